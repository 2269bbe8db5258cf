"""Built-in plugin: galore-torch's GaLore optimizers under Trainer's six names.

``galore_adamw``, ``galore_adamw_8bit``, ``galore_adafactor`` and their ``*_layerwise`` variants. GaLore
projects the gradient of each target ``nn.Linear`` weight onto ``rank`` directions (refreshed by an SVD
every ``update_proj_gap`` steps) and keeps the optimizer's moments in that small space; every other
parameter gets the ordinary optimizer. Hyperparameters (Trainer's defaults): ``target_modules``
(Trainer's ``optim_target_modules``: names, a regex or ``"all-linear"``; required), ``rank=128``,
``update_proj_gap=200``, ``scale=0.25``, ``proj_type="std"``.

Layer-wise variants give each parameter its own optimizer, stepped inside ``backward()`` as soon as its
gradient is complete (no full set of gradients is ever held); ``wrap()`` refuses accumulation with them, and
clips them (``max_grad_norm``, Trainer's default 1.0 included) and loss-scales them (fp16) with the norm pass
(:mod:`memwrap.techniques.updates_in_backward`). ``galore_adamw_8bit`` uses bitsandbytes kernels that galore-torch runs on CUDA only.

State size: exact for projected weights when every ``nn.Linear`` is a target (``"all-linear"``); with a
list of names the planner assumes every ``nn.Linear`` weight is projected (so it under-counts the state
of the non-target linears by at most their AdamW moments).

Example:
    >>> opt = memwrap.create_optimizer("galore_adamw", model, lr=1e-3, target_modules=["attn", "mlp"], rank=64)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import import_backend, module_available, typed_optim_args
from ._lowrank import LayerwiseOptimizer, check_keywords, check_projection, low_rank_groups, with_projector_state

_AVAILABLE = module_available("galore_torch", "galore-torch", "galore")
_ADAFACTOR_DEFAULTS = {"scale_parameter": False, "relative_step": False}  # as Trainer builds galore_adafactor
_PROJECTION_DEFAULTS = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}


@functools.cache
def _galore_class(name: str) -> type:
    galore = import_backend("galore_torch", "galore-torch", "galore")
    return with_projector_state(getattr(galore, name))


PROJ_TYPES = ("std", "reverse_std", "right", "left", "full")  # galore_torch.GaLoreProjector's


def _checker(name: str):
    def check_galore(hp: dict) -> None:
        """rank, update_proj_gap, scale and proj_type as GaLore can use them."""
        check_projection(name, hp, PROJ_TYPES)

    return check_galore


def _factory(class_name: str, layerwise: bool, optimizer_name: str):
    def factory(params, *, model: nn.Module, target_modules=None, rank: int = 128, update_proj_gap: int = 200,
                scale: float = 0.25, proj_type: str = "std", **hp) -> torch.optim.Optimizer:
        projection = {"rank": rank, "update_proj_gap": update_proj_gap, "scale": scale, "proj_type": proj_type}
        check_projection(optimizer_name, projection, PROJ_TYPES)
        check_keywords(optimizer_name, hp, _galore_class(class_name), ("target_modules", *projection))
        groups = low_rank_groups(optimizer_name, params, model, target_modules, projection)
        if class_name == "GaLoreAdamW8bit" and any(p.device.type != "cuda" for g in groups for p in g["params"]):
            raise ValueError(f"{optimizer_name} runs galore-torch's 8-bit kernels, which need CUDA tensors; this model "
                             "is not on a GPU. Fix: model.cuda() on a GPU machine, or galore_adamw on CPU.")
        cls = _galore_class(class_name)
        if layerwise:
            return LayerwiseOptimizer(groups, lambda group: cls(group, **hp))
        return cls(groups, **hp)

    factory.__name__ = f"make_{optimizer_name}"
    factory.__doc__ = f"galore_torch.{class_name} over Trainer's target/non-target groups" + (
        ", one per parameter, stepped in backward." if layerwise else ".")
    return factory


def _is_projected(param: torch.Tensor, module) -> bool:
    # The owner's name is not known here, so every nn.Linear weight counts as a target (exact for
    # "all-linear"); with no owner at all (a bare weight, e.g. memwrap.optimizers()' probe) a matrix does.
    if module is None:
        return param.dim() == 2
    return isinstance(module, nn.Linear) and module.weight is param and param.dim() == 2


def _projection_bytes(param: torch.Tensor, rank: int) -> int:
    """galore-torch keeps the first ``rank`` singular vectors as a *view* of the SVD factor for float32 weights, so the
    whole ``smaller side x smaller side`` factor stays allocated; other dtypes get a converted ``rank x side`` copy."""
    small = min(param.shape[0], param.shape[1])
    if param.dtype == torch.float32:
        return small * small * 4
    return min(rank, small) * small * param.element_size()


def adamw_state_bytes(param: torch.Tensor, module=None, *, rank: int = 128, **hp) -> int:
    """Projected weights: two rank-r moments and the projection; others: AdamW's two moments (step is an int)."""
    if _is_projected(param, module):
        r = min(rank, *param.shape)
        return 2 * r * max(param.shape) * param.element_size() + _projection_bytes(param, rank)
    return 2 * param.numel() * param.element_size()


def adamw_8bit_state_bytes(param: torch.Tensor, module=None, *, rank: int = 128, min_8bit_size: int = 4096,
                           **hp) -> int:
    """bitsandbytes' block-wise 8-bit moments of the (projected) gradient, plus the projection matrix."""
    shape = param.shape
    if _is_projected(param, module):
        moment_values, projection = min(rank, *shape) * max(shape), _projection_bytes(param, rank)
    else:
        moment_values, projection = param.numel(), 0
    if moment_values < min_8bit_size:
        return 2 * 4 * moment_values + projection
    return 2 * (moment_values + 4 * -(-moment_values // 256)) + projection


def adafactor_state_bytes(param: torch.Tensor, module=None, *, rank: int = 128, beta1=None, **hp) -> int:
    """transformers-style Adafactor state of the (projected) gradient: row + column factors, RMS; + projection."""
    size = 4 if param.dtype in (torch.float16, torch.bfloat16) else param.element_size()
    if _is_projected(param, module):
        r = min(rank, *param.shape)
        big = max(param.shape)
        return (big + r + (r * big if beta1 is not None else 0) + 1) * size + _projection_bytes(param, rank)
    shape = tuple(param.shape)
    second = math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:]) if len(shape) >= 2 else param.numel()
    return (second + (param.numel() if beta1 is not None else 0) + 1) * size


_ARGS = {"rank": int, "update_proj_gap": int, "scale": float, "proj_type": str}


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_galore_optimizer``: lr, the projection from ``optim_args``, ``optim_target_modules``."""
    given = typed_optim_args(args, name, _ARGS)
    if name.endswith("layerwise") and getattr(args, "gradient_accumulation_steps", 1) != 1:
        raise ValueError(f"{name} updates each parameter inside backward and cannot accumulate gradients "
                         f"(gradient_accumulation_steps={args.gradient_accumulation_steps}). Fix: set it to 1, or use "
                         f"{name.removesuffix('_layerwise')}.")
    found = {"lr": args.learning_rate, "target_modules": getattr(args, "optim_target_modules", None),
             **_PROJECTION_DEFAULTS, **given}
    if "adafactor" in name:
        found.update(_ADAFACTOR_DEFAULTS)
    return found


def _spec(name: str, class_name: str, state_bytes, *, layerwise: bool, devices=("cpu", "cuda")) -> OptimizerSpec:
    return OptimizerSpec(
        name=name, factory=_factory(class_name, layerwise, name), state_bytes=state_bytes, available=_AVAILABLE,
        needs_model=True, updates_in_backward=layerwise, trainer_kwargs=_trainer_kwargs,
        defaults=dict(_ADAFACTOR_DEFAULTS) if "adafactor" in name else {},
        # GaLore's AdamWs read torch's betas/eps (the 8-bit one bitsandbytes'); its Adafactor is transformers', whose
        # eps is a pair and whose beta1 is not Adam's: those two carry lr and weight_decay only.
        carries=frozenset({"lr", "weight_decay"} if "adafactor" in name else {"lr", "weight_decay", "betas", "eps"}),
        optim_args=_ARGS, takes_target_modules=True, check_hyperparameters=_checker(name),
        runs_on_fake=False, devices=devices,
        # a layer-wise step cannot be skipped after the fact, so an inf gradient from GradScaler would be applied
        scaler_ok=not layerwise,
        description=f"galore-torch {class_name}: low-rank projected moments for target linears"
                    + ("; one optimizer per parameter, stepped inside backward." if layerwise else "."))


GALORE = [
    _spec("galore_adamw", "GaLoreAdamW", adamw_state_bytes, layerwise=False),
    _spec("galore_adamw_8bit", "GaLoreAdamW8bit", adamw_8bit_state_bytes, layerwise=False, devices=("cuda",)),
    _spec("galore_adafactor", "GaLoreAdafactor", adafactor_state_bytes, layerwise=False),
    _spec("galore_adamw_layerwise", "GaLoreAdamW", adamw_state_bytes, layerwise=True),
    _spec("galore_adamw_8bit_layerwise", "GaLoreAdamW8bit", adamw_8bit_state_bytes, layerwise=True, devices=("cuda",)),
    _spec("galore_adafactor_layerwise", "GaLoreAdafactor", adafactor_state_bytes, layerwise=True),
]


@hookimpl
def memwrap_optimizers():
    return list(GALORE)
