"""Which truncated depths of a block stack may stand for the whole model, given its checkpointing.

Extrapolating from traces with ``a`` and ``a + p`` blocks to the full depth ``L`` is exact only
when the model at depth ``a + m*p`` is the full model's pattern cut there, for every ``m``: the
checkpointed blocks must repeat with period ``p`` along the stack, ``L - a`` must be a multiple of
``p`` (so the last block is checkpointed in the traces as in the full model), and the policy must
select the same modules outside the stack at every depth. :func:`extrapolation_depths` checks this
by running the checkpoint policy's selection (``select_modules`` then ``[::every]``, as
``apply_checkpointing`` does) on the model itself with its stack cut: nothing is allocated or traced.

Example:
    >>> from memwrap.models import GPT, GPTConfig
    >>> with torch.device("meta"):
    ...     m = GPT(GPTConfig(n_layer=9, n_head=2, n_embd=8, vocab_size=16, block_size=8))
    >>> extrapolation_depths(m, Stack("transformer.h", 9), {"checkpoint": "every-2"})
    (3, 5)
"""
from __future__ import annotations

from typing import Any

import torch  # noqa: F401  (the doctest builds on the meta device)
from torch import nn

from memwrap.memory.tracing.stack import Stack, truncated
from memwrap.checkpointing.apply import resolve_policy
from memwrap.checkpointing.policies import parse_checkpoint_option, select_modules

__all__ = ["checkpoint_layout", "extrapolation_depths"]


def _selection(options: dict[str, Any]) -> tuple[Any, int] | None:
    ckpt = options.get("checkpoint")
    if ckpt is None or ckpt is False:
        return None

    how = parse_checkpoint_option(ckpt)
    policy, every, _, _ = resolve_policy(how["policy"], how.get("every", 1), how.get("mode", "full"),
                                   how.get("offload", False))
    return policy, every


def checkpoint_layout(model: nn.Module, stack: Stack, options: dict[str, Any],
                      depth: int | None = None) -> tuple[frozenset, tuple[frozenset, ...]]:
    """``(outside, blocks)``: the checkpointed module names outside the stack, and per stack block
    the names (relative to the block, ``""`` = the block itself) checkpointed inside it, with the
    stack cut to ``depth`` blocks. Raises ``ValueError`` when the policy selects nothing there.
    """
    sel = _selection(options)
    n = stack.length if depth is None else depth
    if sel is None:
        return frozenset(), (frozenset(),) * n

    policy, every = sel
    with truncated(model, stack, depth):
        names = [name for name, _ in select_modules(model, policy)[::every]]
    prefix = stack.name + "."
    outside: set[str] = set()
    blocks: list[set[str]] = [set() for _ in range(n)]
    for name in names:
        if name.startswith(prefix):
            index, _, sub = name[len(prefix):].partition(".")
            blocks[int(index)].add(sub)
        else:
            outside.add(name)
    return frozenset(outside), tuple(frozenset(b) for b in blocks)


def _period(blocks: tuple) -> int:
    n = len(blocks)
    return next(p for p in range(1, n + 1) if all(blocks[i] == blocks[i % p] for i in range(n)))


def extrapolation_depths(model: nn.Module, stack: Stack, options: dict[str, Any],
                         min_depth: int = 1, min_periods: int = 1) -> tuple[int, int] | None:
    """Depths ``(a, b)`` whose traces extrapolate exactly to the full stack, or None (trace it whole).

    ``b - a`` is the period ``p`` of the checkpointed pattern along the stack; ``a >= 2`` when
    checkpointing (``checkpoint="auto"`` needs two blocks to recognise a stack) and
    ``(L - a) % p == 0``; ``b < L``; ``a >= min_depth`` and ``a >= min_periods * p`` (FSDP2 needs
    blocks away from both ends of the stack, where its prefetching differs). The selection on the cut models must equal the full pattern cut.
    """
    L = stack.length
    checkpointing = _selection(options) is not None
    try:
        outside, full = checkpoint_layout(model, stack, options)
        period = _period(full)
        base = max(2 if checkpointing else 1, period * min_periods, min_depth)
        a = base + (L - base) % period
        b = a + period
        if b >= L:
            return None
        if checkpointing:
            for depth in (a, b):
                if checkpoint_layout(model, stack, options, depth) != (outside, full[:depth]):
                    return None
    except (ValueError, TypeError, IndexError, KeyError, AttributeError):
        return None  # the policy cannot be evaluated on a cut model: trace it whole
    return a, b
