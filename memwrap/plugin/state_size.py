"""Sizes of optimizer state: predicted from an optimizer's spec without running it, measured on a real optimizer.

``predict_state_bytes`` is what the planner adds for optimizers that cannot run on fake tensors; ``measure_state_bytes``
checks it (tests, benchmarks, :func:`memwrap.testing.check_optimizer`). This module sits above the registry, whose
specs it reads.

Example:
    >>> predict_state_bytes("adamw", torch.nn.Linear(1000, 1000, bias=False))
    8000004
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from memwrap.plugin.registry import get_optimizer_spec

__all__ = ["predict_state_bytes", "measure_state_bytes", "scalar_step_bytes"]


def _param_modules(model_or_params) -> list[tuple[torch.Tensor, nn.Module | None]]:
    if isinstance(model_or_params, nn.Module):
        owners: dict[int, tuple[torch.Tensor, nn.Module]] = {}
        for module in model_or_params.modules():
            for p in module.parameters(recurse=False):
                owners.setdefault(id(p), (p, module))
        return list(owners.values())
    seen, pairs = set(), []
    for item in model_or_params:
        tensors = item["params"] if isinstance(item, Mapping) else [item]
        for p in [tensors] if isinstance(tensors, torch.Tensor) else tensors:
            if id(p) not in seen:
                seen.add(id(p))
                pairs.append((p, None))
    return pairs


def _as_held(p: torch.Tensor, world_size: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``p`` as the optimizer holds it: rank 0's FSDP2 shard (dim 0 split over ``world_size``, rounded up) and, for a
    floating parameter, stored in ``dtype`` (a precision's storage dtype); a meta tensor when either changes it."""
    shape = p.shape
    if world_size > 1 and p.dim() > 0:
        shape = (-(-p.shape[0] // world_size), *p.shape[1:])
    held = dtype if dtype is not None and p.is_floating_point() else p.dtype
    if shape == p.shape and held == p.dtype:
        return p
    return torch.empty(shape, dtype=held, device="meta")


def predict_state_bytes(name: str, model_or_params, *, world_size: int = 1, dtype: torch.dtype | None = None,
                        **hyperparameters) -> int:
    """Bytes of optimizer state after the first step, without running it (meta/fake tensors work).

    ``world_size > 1``: the state of one FSDP2 rank, whose optimizer holds each parameter's dim-0 shard
    (``ceil(rows / world_size)`` rows; the parameter's module is still passed to the plugin). ``dtype``: the
    floating parameters as a precision stores them (``precision="bf16-true"``: ``torch.bfloat16``).

    Example:
        >>> predict_state_bytes("adamw", torch.nn.Linear(1000, 1000, bias=False))
        8000004
        >>> predict_state_bytes("adamw", torch.nn.Linear(1000, 1000, bias=False), world_size=4)
        2000004
    """
    spec = get_optimizer_spec(name)
    pairs = [(_as_held(p, world_size, dtype), m) for p, m in _param_modules(model_or_params) if p.requires_grad]
    hp = {**spec.defaults, **hyperparameters}
    total = sum(int(spec.state_bytes(p, module=m, **hp)) for p, m in pairs)
    if spec.shared_state_bytes is not None:
        total += int(spec.shared_state_bytes(pairs, **hp))
    return total


def measure_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors, each storage counted once.

    Example:
        >>> measure_state_bytes(torch.optim.SGD(torch.nn.Linear(2, 2).parameters()))
        0
    """
    seen, total = set(), 0

    def visit(value):
        nonlocal total
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
            for inner in value.__tensor_flatten__()[0]:  # a wrapper subclass (torchao's 4/8-bit state): its parts
                visit(getattr(value, inner))
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            key = (value.device, storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(value, Mapping):
            for v in value.values():
                visit(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)

    for state in optimizer.state.values():
        visit(state)
    return total


def scalar_step_bytes(fused: bool = False) -> int:
    """Bytes of torch's per-parameter ``step`` tensor (float32, or float64 under a float64 default dtype)."""
    return 4 if fused or torch.get_default_dtype() != torch.float64 else 8
