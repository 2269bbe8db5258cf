"""The repeated block stack of a model, found and truncated without copying.

A model whose blocks repeat (a transformer's layers) is traced at two small depths of its stack and
extrapolated (:mod:`memwrap.memory.tracing.estimator`); this module finds the stack and cuts it to a depth.
It sits below the tracer so that the depth rules (:mod:`memwrap.memory.tracing.depth`) need not load the tracer.

Example:
    >>> from memwrap.models import build_preset
    >>> m = build_preset("gpt2-tiny")
    >>> with truncated(m, find_stack(m, 2), 1):
    ...     len(m.transformer.h)
    1
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch  # noqa: F401  (the doctests build on the meta device)
from torch import nn

__all__ = ["Stack", "find_stack", "truncated"]


@dataclasses.dataclass(frozen=True)
class Stack:
    """The homogeneous block stack of a model: ``parent.<attr>`` holds ``length`` identical blocks."""

    name: str
    length: int


def _signature(module: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    kinds = tuple(type(m).__name__ for m in module.modules())
    return params, buffers, kinds


def find_stack(model: nn.Module, min_length: int = 4) -> Stack | None:
    """The largest ``ModuleList``/``Sequential`` of identical blocks (same class, shapes, structure).

    Example:
        >>> from memwrap.models import build_preset
        >>> with torch.device("meta"):
        ...     find_stack(build_preset("llama-7b"))
        Stack(name='model.layers', length=32)
    """
    best, best_size = None, -1
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < min_length or not name:
            continue
        kids = list(mod.children())
        if len(kids) != len(mod):
            continue
        sig = _signature(kids[0])
        if not sig[0] or any(type(k) is not type(kids[0]) or _signature(k) != sig for k in kids[1:]):
            continue
        size = sum(p.numel() for p in mod.parameters())
        if size > best_size:
            best, best_size = Stack(name, len(kids)), size
    return best


@contextlib.contextmanager
def truncated(model: nn.Module, stack: Stack | None, depth: int | None):
    """Within the block, ``model``'s stack holds only its first ``depth`` blocks (nothing is copied).

    Example:
        >>> from memwrap.models import build_preset
        >>> m = build_preset("gpt2-tiny")
        >>> with truncated(m, find_stack(m, 2), 1):
        ...     len(m.transformer.h)
        1
    """
    if stack is None or depth is None or depth == stack.length:
        yield model
        return
    prefix, _, attr = stack.name.rpartition(".")
    parent = model.get_submodule(prefix) if prefix else model
    original = getattr(parent, attr)
    kids = list(original.children())[:depth]
    parent._modules[attr] = nn.Sequential(*kids) if isinstance(original, nn.Sequential) else nn.ModuleList(kids)
    try:
        yield model
    finally:
        parent._modules[attr] = original
