"""Activation checkpointing: applying it with hooks (apply) and which modules a policy selects (policies).

The names below are re-exported from the modules that define them (``memwrap.checkpointing`` was one module before).
"""
from __future__ import annotations

from memwrap.checkpointing.apply import (
    CheckpointReport, apply_checkpointing, remove_checkpointing, find_blocks, parse_checkpoint_option,
    is_checkpointed,
)
from memwrap.checkpointing.policies import (
    select_modules, plugin_policies, check_policy_name, selective_policy, SAVE_OPS, MODES,
)

__all__ = [
    'CheckpointReport', 'apply_checkpointing', 'remove_checkpointing', 'find_blocks',
    'parse_checkpoint_option', 'is_checkpointed', 'select_modules', 'plugin_policies', 'check_policy_name',
    'selective_policy', 'SAVE_OPS', 'MODES',
]
