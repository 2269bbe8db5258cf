"""Built-in plugin: torch's own optimizers under their Hugging Face names.

* ``adamw`` (``adamw_torch``, ``adamw_torch_fused``): AdamW with the fused kernel wherever the device has one;
* ``sgd``, ``adagrad``, ``rmsprop``: ``torch.optim.SGD/Adagrad/RMSprop`` with Trainer's ``optim_args``;
* ``adamw_torch_xla``, ``adamw_torch_npu_fused``: torch_xla's syncfree AdamW and torch_npu's fused AdamW,
  usable only where that hardware and its torch extension are installed (otherwise unavailable,
  with the reason).

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

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec, OptimizerUnavailableError
from memwrap.plugin.state_size import scalar_step_bytes

from ._common import adam_kwargs, module_available, strtobool, typed_optim_args


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


def _adamw_trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_adamw_torch``: lr, betas, eps (and fused=True for adamw_torch_fused)."""
    typed_optim_args(args, name, {})
    found = {"lr": args.learning_rate, **adam_kwargs(args)}
    if name == "adamw_torch_fused":
        found["fused"] = True
    return found


ADAMW = OptimizerSpec(
    name="adamw",
    aliases=("adamw_torch", "adamw_torch_fused", "adamw_hf", "torch_adamw"),
    factory=make_adamw,
    state_bytes=adamw_state_bytes,
    carries=frozenset({"lr", "weight_decay", "betas", "eps", "amsgrad", "maximize", "fused", "foreach"}),
    fused=True,
    devices=tuple(_get_fused_kernels_supported_devices()),
    runs_on_fake=True,
    trainer_kwargs=_adamw_trainer_kwargs,
    description="torch.optim.AdamW, fused kernel where the device supports it (8 bytes/param in fp32).",
)


# -- SGD, Adagrad, RMSprop: lr plus the optim_args keys transformers reads for each ---------------------------

def _trainer_kwargs(accepted: dict):
    def trainer_kwargs(name: str, args) -> dict:
        return {"lr": args.learning_rate, **typed_optim_args(args, name, accepted)}

    return trainer_kwargs


def _adagrad_state_bytes(param: torch.Tensor, module=None, **hp) -> int:
    """The ``sum`` accumulator in the parameter's dtype plus ``step``."""
    return param.numel() * param.element_size() + scalar_step_bytes()


def _sgd_state_bytes(param: torch.Tensor, module=None, *, momentum: float = 0, **hp) -> int:
    """A momentum buffer in the parameter's dtype when momentum != 0, else nothing."""
    return param.numel() * param.element_size() if momentum else 0


_FLOAT = float
_SGD_ARGS = {"momentum": _FLOAT, "dampening": _FLOAT, "weight_decay": _FLOAT, "nesterov": strtobool}
_ADAGRAD_ARGS = {"lr_decay": _FLOAT, "weight_decay": _FLOAT, "eps": _FLOAT}
_RMSPROP_ARGS = {"momentum": _FLOAT, "alpha": _FLOAT, "eps": _FLOAT, "weight_decay": _FLOAT, "centered": strtobool}
SGD = OptimizerSpec(
    name="sgd", factory=torch.optim.SGD, state_bytes=_sgd_state_bytes,
    carries=frozenset({"lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize", "foreach"}),
    trainer_kwargs=_trainer_kwargs(_SGD_ARGS), optim_args=_SGD_ARGS,
    description="torch.optim.SGD (momentum buffer only with momentum > 0).")

def make_adagrad(params, **hp) -> torch.optim.Adagrad:
    """``torch.optim.Adagrad``; a converted group's ``initial_accumulator_value`` becomes the constructor's.

    torch's Adagrad fills each parameter's ``sum`` in its constructor from the constructor's value, never from the
    group's, so a value carried in the param groups would be ignored.
    """
    params = list(params)
    values = {g["initial_accumulator_value"] for g in params if isinstance(g, Mapping) and "initial_accumulator_value" in g}
    if len(values) > 1:
        raise ValueError(f"adagrad: torch's Adagrad has one initial_accumulator_value for all param groups; these have "
                         f"{sorted(values)}. Fix: give every group the same value.")
    if values and "initial_accumulator_value" not in hp:
        hp["initial_accumulator_value"] = values.pop()
    return torch.optim.Adagrad(params, **hp)


ADAGRAD = OptimizerSpec(
    name="adagrad", factory=make_adagrad, state_bytes=_adagrad_state_bytes,
    carries=frozenset({"lr", "weight_decay", "eps", "lr_decay", "initial_accumulator_value", "maximize"}),
    trainer_kwargs=_trainer_kwargs(_ADAGRAD_ARGS), optim_args=_ADAGRAD_ARGS,
    description="torch.optim.Adagrad: one accumulator (4 bytes/param in fp32).")


def _rmsprop_state_bytes(param: torch.Tensor, module=None, *, momentum: float = 0, centered: bool = False,
                         **hp) -> int:
    """square_avg, plus momentum_buffer (momentum > 0) and grad_avg (centered), plus ``step``."""
    values = 1 + (1 if momentum else 0) + (1 if centered else 0)
    return values * param.numel() * param.element_size() + scalar_step_bytes()


RMSPROP = OptimizerSpec(
    name="rmsprop", factory=torch.optim.RMSprop, state_bytes=_rmsprop_state_bytes,
    carries=frozenset({"lr", "weight_decay", "eps", "alpha", "momentum", "centered", "maximize", "foreach"}),
    trainer_kwargs=_trainer_kwargs(_RMSPROP_ARGS), optim_args=_RMSPROP_ARGS,
    description="torch.optim.RMSprop: square average (+ momentum, + centered average).")


# -- accelerator-specific AdamW kernels: real where their hardware is --------------------------------------

def _hardware_optimizer(name: str, module: str, attr: str, package: str, device: str):
    probe = module_available(package, package, "")
    hint = (f"optimizer {name!r} runs only on {device} hardware with {package} installed, and this machine has "
            f"neither; Trainer itself fails the same way. Fix: optim='adamw_torch' (or 'adamw_torch_fused') here, "
            f"or run on a {device} host with {package}.")

    def available() -> tuple[bool, str]:
        return probe()[0], hint

    def factory(params, **hp) -> torch.optim.Optimizer:
        import importlib

        try:
            cls = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise OptimizerUnavailableError(f"{hint} ({exc})") from exc
        return cls(params, **hp)

    def state_bytes(param: torch.Tensor, module=None, **hp) -> int:
        """exp_avg and exp_avg_sq in the parameter's dtype plus a step counter (as torch's AdamW)."""
        return 2 * param.numel() * param.element_size() + scalar_step_bytes()

    return OptimizerSpec(name=name, factory=factory, state_bytes=state_bytes, available=available,
                         devices=(device,), runs_on_fake=False, trainer_kwargs=_adamw_trainer_kwargs,
                         carries=frozenset({"lr", "weight_decay", "betas", "eps"}),
                         description=f"{package}'s {attr} (needs {device} hardware).")


ADAMW_XLA = _hardware_optimizer("adamw_torch_xla", "torch_xla.amp.syncfree", "AdamW", "torch_xla", "xla")
ADAMW_NPU = _hardware_optimizer("adamw_torch_npu_fused", "torch_npu.optim", "NpuFusedAdamW", "torch_npu", "npu")


@hookimpl
def memwrap_optimizers():
    return [ADAMW, SGD, ADAGRAD, RMSPROP, ADAMW_XLA, ADAMW_NPU]
