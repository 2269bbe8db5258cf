"""Rank agreement for ``budget=`` (:mod:`memwrap.techniques.budget.plan`): under DDP/FSDP2 every rank plans at the same
batches and adopts the most conservative rank's micro-batch, so that windows and collectives line up.

One process (or no process group): each function returns its local value unchanged.

Example:
    >>> agree_max(3)   # without a process group
    3
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["world", "agree_any", "agree_max", "agree_plan"]


def world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agree_any(flag: bool) -> bool:
    """True on every rank when it is True on any (a rank with a new shape makes all ranks plan together)."""
    if world() == 1:
        return flag
    return agree_max(int(flag)) > 0


def agree_max(value: int) -> int:
    if world() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())


def agree_plan(local: Any, search_at: Callable[[int], Any]) -> Any:
    """Every rank adopts the smallest micro-batch any rank chose (all_reduce MIN), and the setting found for it."""
    if world() == 1:
        return local
    t = torch.tensor([local.micro_batch], dtype=torch.int64, device=_collective_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    agreed = int(t.item())
    return local if agreed == local.micro_batch else search_at(agreed)


def _collective_device() -> torch.device:
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
