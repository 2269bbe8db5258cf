"""Built-in plugin: torch-optimi's ``stable_adamw`` and ``adamw_anyprecision`` (Trainer's names).

* ``stable_adamw``: ``optimi.StableAdamW`` with Trainer's hyperparameters (``decouple_lr``, ``max_lr``,
  ``kahan_sum`` from ``optim_args``). State: two moments and a scalar epsilon in the parameter's dtype,
  plus a Kahan compensation buffer for 16-bit parameters.
* ``adamw_anyprecision``: Trainer builds torchdistx's ``AnyPrecisionAdamW``, which has no release on
  PyPI and cannot be installed with current torch, so Trainer itself fails on it. memwrap builds the
  maintained equivalent, ``optimi.AdamW`` with Kahan summation (``use_kahan_summation``); its moments
  are kept in the parameter's dtype, so a ``momentum_dtype``/``variance_dtype`` other than that is
  refused rather than silently changed.

optimi picks its Triton kernel by default even for CPU tensors when Triton is installed (it then
fails); memwrap passes ``triton=False`` unless every parameter is on a GPU (same maths).

Example:
    >>> opt = memwrap.create_optimizer("stable_adamw", model, lr=1e-3)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import adam_kwargs, import_backend, module_available, strtobool, tensors_of, typed_optim_args

_AVAILABLE = module_available("optimi", "torch-optimi", "optimi")
_LOW = (torch.float16, torch.bfloat16)


def _optimi(class_name: str, params, hp: dict) -> torch.optim.Optimizer:
    params = list(params)
    if "lr" not in hp:  # optimi requires lr; converted groups carry their own, the first stands as the default
        first = next((g["lr"] for g in params if isinstance(g, dict) and "lr" in g), None)
        if first is not None:
            hp["lr"] = first
    if hp.get("triton") is None and hp.get("foreach") is None:
        hp["triton"] = False if any(not t.is_cuda for t in tensors_of(params)) else None
    return getattr(import_backend("optimi", "torch-optimi", "optimi"), class_name)(params, **hp)


def make_stable_adamw(params, **hp) -> torch.optim.Optimizer:
    """``optimi.StableAdamW(params, **hp)`` (Triton only on GPUs)."""
    return _optimi("StableAdamW", params, hp)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def make_anyprecision_adamw(params, *, use_kahan_summation: bool = False, momentum_dtype=None, variance_dtype=None,
                            compensation_buffer_dtype=None, **hp) -> torch.optim.Optimizer:
    """``optimi.AdamW`` for AnyPrecisionAdamW's options; state dtypes must be the parameters' own."""
    params = list(params)
    dtypes = {t.dtype for t in tensors_of(params)}
    for key, wanted in (("momentum_dtype", momentum_dtype), ("variance_dtype", variance_dtype)):
        wanted = _DTYPES.get(wanted, wanted) if isinstance(wanted, str) else wanted
        if wanted is not None and dtypes and dtypes != {wanted}:
            raise ValueError(
                f"adamw_anyprecision: {key}={wanted} differs from the parameters' dtype {sorted(map(str, dtypes))}; "
                "optimi keeps optimizer state in the parameter's dtype. Fix: drop it from optim_args (for bf16 "
                "parameters use_kahan_summation=True recovers the precision), or keep fp32 parameters.")
    if compensation_buffer_dtype not in (None, torch.bfloat16, "bfloat16") and use_kahan_summation:
        raise ValueError("adamw_anyprecision: optimi's Kahan buffer has the parameter's dtype; "
                         f"compensation_buffer_dtype={compensation_buffer_dtype} cannot be honoured. Fix: drop it.")
    # AnyPrecisionAdamW applies no Kahan summation unless asked; optimi's default (None) would turn it on for
    # 16-bit parameters, so the choice is passed explicitly.
    return _optimi("AdamW", params, {**hp, "kahan_sum": bool(use_kahan_summation)})


def _moments_bytes(param: torch.Tensor, kahan) -> int:
    n, size = param.numel(), param.element_size()
    kahan_buffer = n * size if (kahan is None or kahan) and param.dtype in _LOW else 0
    return 2 * n * size + kahan_buffer


def stable_adamw_state_bytes(param: torch.Tensor, module=None, *, kahan_sum=None, **hp) -> int:
    """exp_avg, exp_avg_sq and a 0-dim eps_sq in the parameter's dtype; Kahan buffer for 16-bit parameters."""
    return _moments_bytes(param, kahan_sum) + param.element_size()


def anyprecision_state_bytes(param: torch.Tensor, module=None, *, use_kahan_summation: bool = False, **hp) -> int:
    """exp_avg and exp_avg_sq in the parameter's dtype; a Kahan buffer for 16-bit parameters when asked."""
    return _moments_bytes(param, bool(use_kahan_summation))


def optimi_group_keys(carried: dict) -> dict:
    """optimi's param groups read ``beta1``/``beta2`` (its constructor splits ``betas``): a converted group's
    ``betas`` would otherwise sit unread while optimi steps with its defaults (0.9, 0.99)."""
    betas = carried.pop("betas", None)
    if betas is not None:
        carried["beta1"], carried["beta2"] = betas
    return carried


_STABLE_ARGS = {"decouple_lr": strtobool, "max_lr": float, "kahan_sum": strtobool}
_ANYPRECISION_ARGS = {"use_kahan_summation": strtobool, "momentum_dtype": str, "variance_dtype": str,
                      "compensation_buffer_dtype": str}


def _stable_trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_stable_adamw`` (its ``bool("False")`` reads as True; memwrap reads the word)."""
    given = typed_optim_args(args, name, _STABLE_ARGS)
    return {"lr": args.learning_rate, **adam_kwargs(args), "weight_decay": args.weight_decay,
            "decouple_lr": given.get("decouple_lr", False), "max_lr": given.get("max_lr"),
            "kahan_sum": given.get("kahan_sum")}


def _anyprecision_trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_adamw_anyprecision``: lr, betas, eps and the four AnyPrecision options."""
    given = typed_optim_args(args, name, _ANYPRECISION_ARGS)
    return {"lr": args.learning_rate, **adam_kwargs(args), **given}


STABLE_ADAMW = OptimizerSpec(
    name="stable_adamw", factory=make_stable_adamw, state_bytes=stable_adamw_state_bytes, available=_AVAILABLE,
    carries=frozenset({"lr", "weight_decay", "betas", "eps"}), group_keys=optimi_group_keys, optim_args=_STABLE_ARGS,
    runs_on_fake=False, trainer_kwargs=_stable_trainer_kwargs, devices=("cpu", "cuda", "xpu"),
    description="torch-optimi StableAdamW (AdamW with update clipping; Kahan summation for 16-bit parameters).")

ADAMW_ANYPRECISION = OptimizerSpec(
    name="adamw_anyprecision", factory=make_anyprecision_adamw, state_bytes=anyprecision_state_bytes,
    available=_AVAILABLE, carries=frozenset({"lr", "weight_decay", "betas", "eps"}), group_keys=optimi_group_keys,
    optim_args=_ANYPRECISION_ARGS, runs_on_fake=False, trainer_kwargs=_anyprecision_trainer_kwargs, devices=("cpu", "cuda", "xpu"),
    description="torch-optimi AdamW with optional Kahan summation, standing in for torchdistx's AnyPrecisionAdamW "
                "(not installable).")


@hookimpl
def memwrap_optimizers():
    return [STABLE_ADAMW, ADAMW_ANYPRECISION]
