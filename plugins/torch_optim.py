"""Built-in plugin: ``adamw``, torch's AdamW with the fused kernel wherever the device has one.

On CPU in torch 2.13 the fused kernel is several times faster than the default ``foreach`` one
(see ``docs/benchmarks/optimizers.json``), and it needs no extra memory.

Example:
    >>> import torch, memwrap
    >>> opt = memwrap.create_optimizer("adamw", torch.nn.Linear(4, 4).parameters())
    >>> opt.defaults["fused"]
    True
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from memwrap.plugins import hookimpl
from memwrap.registry import OptimizerSpec, scalar_step_bytes


def _tensors(params: list) -> list[torch.Tensor]:
    out = []
    for item in params:
        group = item["params"] if isinstance(item, Mapping) else item
        out.extend([group] if isinstance(group, torch.Tensor) else group)
    return out


def fused_supported(tensors) -> bool:
    """True when torch has a fused AdamW kernel for every tensor (floating point, supported device)."""
    devices = set(_get_fused_kernels_supported_devices())
    return all(t.is_floating_point() and t.device.type in devices for t in tensors)


def _use_fused(tensors, hp: Mapping) -> bool:
    if hp.get("fused") is not None:
        return bool(hp["fused"])
    # fused cannot be combined with an explicit foreach=True or with differentiable=True.
    return not hp.get("foreach") and not hp.get("differentiable") and fused_supported(tensors)


def make_adamw(params, **hp) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with ``fused=True`` unless a parameter's device has no fused kernel."""
    params = list(params)
    fused = _use_fused(_tensors(params), hp)
    return torch.optim.AdamW(params, **{**hp, "fused": fused or None})


def adamw_state_bytes(param: torch.Tensor, module=None, *, amsgrad: bool = False, **hp) -> int:
    """exp_avg and exp_avg_sq (and max_exp_avg_sq with amsgrad) in the parameter's dtype, plus ``step``."""
    moments = 3 if amsgrad else 2
    fused = _use_fused([param], hp) or bool(hp.get("capturable"))
    return moments * param.numel() * param.element_size() + scalar_step_bytes(fused)


ADAMW = OptimizerSpec(
    name="adamw",
    aliases=("adamw_torch", "adamw_torch_fused", "adamw_hf", "torch_adamw"),
    factory=make_adamw,
    state_bytes=adamw_state_bytes,
    carries=frozenset({"lr", "weight_decay", "betas", "eps", "amsgrad", "maximize", "fused", "foreach"}),
    fused=True,
    devices=tuple(_get_fused_kernels_supported_devices()),
    runs_on_fake=True,
    description="torch.optim.AdamW, fused kernel where the device supports it (8 bytes/param in fp32).",
)


@hookimpl
def memwrap_optimizers():
    return [ADAMW]
