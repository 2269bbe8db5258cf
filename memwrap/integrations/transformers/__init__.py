"""Hugging Face ``Trainer`` integration: optimizers and checkpoint policies for Trainer (trainer), and the
per-device batch and accumulation from a ``budget=`` plan (budget).

The names below are re-exported from the modules that define them (``memwrap.integrations.transformers`` was one module before).
"""
from __future__ import annotations

from memwrap.integrations.transformers.trainer import (
    memwrap_trainer_kwargs, memwrap_optimizer_class, wrap_options, checkpoint_report, trainer_hyperparameters,
    trainer_param_groups, trainer_optimizer,
)
from memwrap.integrations.transformers.budget import plan_trainer_split

__all__ = [
    'memwrap_trainer_kwargs', 'memwrap_optimizer_class', 'wrap_options', 'checkpoint_report',
    'trainer_hyperparameters', 'trainer_param_groups', 'trainer_optimizer', 'plan_trainer_split',
]
