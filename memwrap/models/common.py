"""Losses and initialisation shared by every model family of the zoo."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy for ``[B, T, V]`` logits and ``[B, T]`` targets (mean over tokens)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy for ``[B, C]`` logits and ``[B]`` integer labels."""
    return F.cross_entropy(logits.float(), targets)


def _normal_init(module: nn.Module, std: float) -> None:
    # One init rule for every family keeps the zoo simple; the exact scheme is irrelevant for
    # memory/gradient experiments, but small std keeps tiny models numerically tame.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
