"""Losses and initialisation shared by every model family of the zoo."""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy for ``[B, T, V]`` logits and ``[B, T]`` targets (mean over tokens)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class LMOutput(dict):
    """A causal LM's output with labels: ``{"loss": ..., "logits": ...}`` with attribute access (``out.loss``),
    like Hugging Face's ``ModelOutput`` (a dict, so memwrap's planner and window loss read ``loss`` from it)."""

    def __getattr__(self, name: str):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_items_in_batch: int | torch.Tensor | None = None,
                   ignore_index: int = -100) -> torch.Tensor:
    """Hugging Face's causal-LM loss, the plain way: ``labels`` are aligned with the inputs and shifted here
    (position ``t`` predicts ``labels[:, t + 1]``), ``ignore_index`` labels add nothing, the result is the
    mean over the others, or their sum divided by ``num_items_in_batch`` when given.

    Example:
        >>> y = torch.tensor([[1, 2, -100]])
        >>> round(float(causal_lm_loss(torch.zeros(1, 3, 4), y)), 4)  # log(4), over the one valid label
        1.3863
    """
    shifted = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.flatten(0, -2).float(), shifted.flatten().to(logits.device),
                           ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


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
