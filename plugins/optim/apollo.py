"""Built-in plugin: apollo-torch's APOLLO AdamW, ``apollo_adamw`` and ``apollo_adamw_layerwise`` (Trainer's names).

APOLLO keeps AdamW's moments of a random projection (``rank`` directions, reseeded every
``update_proj_gap`` steps) of each target ``nn.Linear`` weight's gradient and uses them only to scale
the full gradient channel-wise (``scale_type="channel"``) or tensor-wise. Hyperparameters (Trainer's
defaults): ``target_modules`` (Trainer's ``optim_target_modules``; required), ``rank=128``,
``proj="random"``, ``scale_type="channel"``, ``update_proj_gap=200``, ``scale=1.0``, ``proj_type="std"``,
and ``target_group``: hyperparameters for the projected group only (Trainer puts its Adam ``betas`` and
``eps`` there, leaving APOLLO's defaults on the other parameters). The layer-wise variant steps each
parameter inside ``backward()`` (see ``plugins/optim/galore.py``).

State size: exact when every ``nn.Linear`` is a target (``"all-linear"``); with a list of names the
planner assumes every ``nn.Linear`` weight is projected.

Example:
    >>> opt = memwrap.create_optimizer("apollo_adamw", model, lr=1e-3, target_modules="all-linear", rank=16)  # doctest: +SKIP
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import adam_kwargs, import_backend, module_available, typed_optim_args
from ._lowrank import (LayerwiseOptimizer, check_keywords, check_projection, low_rank_groups, projected_bytes,
                       with_projector_state)

_AVAILABLE = module_available("apollo_torch", "apollo-torch", "apollo")
_PROJECTION = {"rank": int, "proj": str, "scale_type": str, "update_proj_gap": int, "scale": float, "proj_type": str}
_PROJECTION_DEFAULTS = {"rank": 128, "proj": "random", "scale_type": "channel", "update_proj_gap": 200, "scale": 1.0,
                        "proj_type": "std"}


@functools.cache
def _apollo_class() -> type:
    return with_projector_state(import_backend("apollo_torch", "apollo-torch", "apollo").APOLLOAdamW)


PROJ_TYPES = ("std", "reverse_std", "right", "left")  # apollo_torch's random projector ("full" is not implemented)


def check_apollo(hp: dict, name: str = "apollo_adamw") -> None:
    """rank, update_proj_gap, scale, proj_type, proj and scale_type as APOLLO can use them."""
    from ._common import check_choice

    check_projection(name, hp, PROJ_TYPES)
    if "proj" in hp:
        check_choice(name, "proj", hp["proj"], ("random", "svd"))
    if "scale_type" in hp:
        check_choice(name, "scale_type", hp["scale_type"], ("channel", "tensor"))


def _factory(layerwise: bool, optimizer_name: str):
    def factory(params, *, model: nn.Module, target_modules=None, target_group=None, **hp) -> torch.optim.Optimizer:
        projection = {k: hp.pop(k, v) for k, v in _PROJECTION_DEFAULTS.items()}
        check_apollo(projection, optimizer_name)
        check_keywords(optimizer_name, hp, _apollo_class(), ("target_modules", "target_group", *projection))
        groups = low_rank_groups(optimizer_name, params, model, target_modules, {**projection, **(target_group or {})})
        cls = _apollo_class()
        if layerwise:
            return LayerwiseOptimizer(groups, lambda group: cls(group, **hp))
        return cls(groups, **hp)

    factory.__name__ = f"make_{optimizer_name}"
    factory.__doc__ = "apollo_torch.APOLLOAdamW over Trainer's target/non-target groups" + (
        ", one per parameter, stepped in backward." if layerwise else ".")
    return factory


def apollo_state_bytes(param: torch.Tensor, module=None, *, rank: int = 128, **hp) -> int:
    """Projected weights: two rank-r moments, the random projection and a norm scalar; others: two moments."""
    # Every nn.Linear weight counts as a target (exact for "all-linear"); a bare matrix (no owner known) too.
    if param.dim() == 2 and (module is None or isinstance(module, nn.Linear) and module.weight is param):
        return projected_bytes(param, rank, 2, cap_rank=False) + param.element_size()
    return 2 * param.numel() * param.element_size()


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_apollo_optimizer``: lr, projection from ``optim_args``, Adam's betas/eps on targets."""
    given = typed_optim_args(args, name, _PROJECTION)
    if name.endswith("layerwise") and getattr(args, "gradient_accumulation_steps", 1) != 1:
        raise ValueError(f"{name} updates each parameter inside backward and cannot accumulate gradients "
                         f"(gradient_accumulation_steps={args.gradient_accumulation_steps}). Fix: set it to 1, or use "
                         "apollo_adamw.")
    return {"lr": args.learning_rate, "target_modules": getattr(args, "optim_target_modules", None),
            **_PROJECTION_DEFAULTS, **given, "target_group": adam_kwargs(args)}


def _spec(name: str, layerwise: bool) -> OptimizerSpec:
    return OptimizerSpec(
        name=name, factory=_factory(layerwise, name), state_bytes=apollo_state_bytes, available=_AVAILABLE,
        needs_model=True, updates_in_backward=layerwise, trainer_kwargs=_trainer_kwargs, scaler_ok=not layerwise,
        carries=frozenset({"lr", "weight_decay", "betas", "eps"}), optim_args=_PROJECTION, takes_target_modules=True,
        check_hyperparameters=lambda hp: check_apollo(hp, name), runs_on_fake=False, devices=("cpu", "cuda"),
        description="apollo-torch APOLLOAdamW: AdamW moments of a random low-rank projection scale the gradient"
                    + ("; one optimizer per parameter, stepped inside backward." if layerwise else "."))


APOLLO = [_spec("apollo_adamw", False), _spec("apollo_adamw_layerwise", True)]


@hookimpl
def memwrap_optimizers():
    return list(APOLLO)
