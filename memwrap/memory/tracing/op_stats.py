"""What the trace's ops cost beyond their matmul FLOPs: how many are views, and the bytes the others move.

The cost model used to charge every dispatched op one launch cost and every op's work only through its matmul
FLOPs. On a CPU that mis-ranks micro-batch splits both ways (rank_check, a 2-layer GPT-2 at 8 x 1 against 2 x 4:
predicted 2x apart, measured equal): a view (``view``, ``transpose``, ``expand``, ``detach``: metadata only) costs
a fraction of a kernel, and an elementwise kernel's time grows with the bytes it reads and writes, so a few large
ops are not cheaper than many small ones by their count. The trace therefore also records, per micro-batch of
forward + backward (the optimizer step has its own term):

* ``views``: ops whose schema returns an alias of an input (``OpOverload.is_view``, plus ``detach``/``alias``),
  charged at the profile's ``view_s``;
* ``bytes``: for the other ops without a FLOP formula (elementwise, reductions, copies, norms, softmax, embedding
  lookups, losses), the bytes of their tensor inputs and outputs (a broadcast input counted once per element it
  holds), charged at the profile's memory bandwidth (see :mod:`memwrap.memory.search.cost`).

Example:
    >>> import torch
    >>> stats = OpStats()
    >>> x = torch.ones(4, 4)
    >>> stats.add(torch.ops.aten.add.Tensor, (x, x), {}, x + x)
    >>> stats.add(torch.ops.aten.t.default, (x,), {}, x.t())
    >>> stats.as_dict()
    {'bytes': 192, 'views': 1}
"""
from __future__ import annotations

import itertools
from typing import Any

import torch

__all__ = ["OpStats", "is_view", "moved_bytes"]

aten = torch.ops.aten
# Alias-returning ops whose schema does not mark them as views.
_ALIASES = frozenset({aten.detach.default, aten.alias.default, aten.lift_fresh.default, aten._unsafe_view.default})


def is_view(func: Any) -> bool:
    """Whether ``func`` only makes another view of its input (no kernel runs).

    Example:
        >>> is_view(torch.ops.aten.view.default), is_view(torch.ops.aten.add.Tensor)
        (True, False)
    """
    return bool(getattr(func, "is_view", False)) or func in _ALIASES


def _held_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements ``t`` addresses (a broadcast dimension, stride 0, holds one)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size() if t.numel() else 0


def moved_bytes(args: tuple, kwargs: dict | None, out: Any) -> int:
    """Bytes an op reads (its tensor arguments, and tensors in list arguments) and writes (its tensor outputs).

    Example:
        >>> x = torch.ones(8)
        >>> moved_bytes((x, x.expand(8)), {}, x)
        96
    """
    # Called for every op of a trace: a flat walk, not tree_flatten (ops take tensors, lists of them, and scalars).
    total = 0
    outs = out if isinstance(out, (tuple, list)) else (out,)
    for x in itertools.chain(args, kwargs.values() if kwargs else (), outs):
        if isinstance(x, torch.Tensor):
            total += _held_bytes(x)
        elif isinstance(x, (tuple, list)):
            total += sum(_held_bytes(y) for y in x if isinstance(y, torch.Tensor))
    return total


class OpStats:
    """The counters of one trace (see the module docstring)."""

    def __init__(self) -> None:
        self.views = 0
        self.bytes = 0

    def add(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        """Count one op that has no FLOP formula."""
        if is_view(func):
            self.views += 1
        else:
            self.bytes += moved_bytes(args, kwargs, out)

    def as_dict(self, micro_batches: int = 1) -> dict[str, int]:
        """The counters per micro-batch (``micro_batches`` traced)."""
        return {"bytes": self.bytes // micro_batches, "views": self.views // micro_batches}
