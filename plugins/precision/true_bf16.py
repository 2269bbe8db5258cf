"""Built-in precision plugin: ``bf16-true``, parameters, gradients and optimizer state in bf16.

There is no fp32 master copy, so a 7B model's weights take 12.6 GiB instead of 25.1. The cost is
the update: bf16 keeps 8 significant bits, so ``p - lr * update`` rounds small steps away (at
fine-tuning learning rates most of them). The updates are therefore compensated by a maintained
library, never by hand-written kernels:

* ``compensation="kahan"`` (the default): torch-optimi's ``kahan_sum``: a bf16 buffer per parameter
  carries what rounding dropped into the next step (+2 bytes per parameter);
* ``compensation="stochastic"``: torchao's bf16 stochastic rounding (``torchao.optim._AdamW(
  bf16_stochastic_round=True)``): the rounding is unbiased, no extra state (AdamW only);
* ``compensation="none"``: the explicit opt-out: the optimizer steps the bf16 weights as it is.

A torch AdamW, Adam or SGD is converted to its compensated equivalent, keeping each group's
hyperparameters, with a one-line :class:`~memwrap.plugin.registry.ConversionWarning`. An optimizer
already compensated (optimi with ``kahan_sum`` unset or True, torchao with stochastic rounding) is
kept. Any other optimizer is refused unless ``compensation="none"``.

Floating inputs are cast to bf16 before the forward, as Lightning's bf16-true does (a LayerNorm,
BatchNorm or GroupNorm with bf16 weights refuses an fp32 input); integer inputs stay. The forward runs
under bf16 autocast, so the ops autocast keeps in fp32 (softmax, losses) stay there, and floating
outputs come back fp32. ``unwrap`` leaves the weights in bf16 (casting back would not restore what
bf16 storage rounded); call ``model.float()`` for fp32.

Under DDP or FSDP2 the model must be converted before ``DistributedDataParallel(...)`` /
``fully_shard`` (``model.to(torch.bfloat16)``): both are built for the parameters' dtype, and
``wrap()`` refuses to convert behind their back (:func:`memwrap.runtime.distributed.check_dtype_change`).

Example:
    >>> model, optimizer = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=2e-5),
    ...                                 precision="bf16-true")  # doctest: +SKIP
"""
from __future__ import annotations

import importlib.util
import itertools
import warnings
from typing import Any

import torch
from torch import nn

from memwrap.plugin.manager import hookimpl
from memwrap.precision.base import AutocastPrecision, cast_floating
from memwrap.plugin.registry import ConversionWarning

_HINTS = {
    "kahan": "compensation='kahan' needs torch-optimi: pip install 'memwrap[optimi]' (or pip install torch-optimi)",
    "stochastic": "compensation='stochastic' needs torchao: pip install 'memwrap[torchao]' (or pip install torchao)",
}
_MODULES = {"kahan": "optimi", "stochastic": "torchao"}
# Group keys whose value at these settings changes nothing; any other value cannot be carried.
_NEUTRAL = {"amsgrad": False, "maximize": False, "nesterov": False, "differentiable": False}
# Kernel choices, not maths: the compensated equivalent picks its own.
_KERNEL_FLAGS = frozenset({"foreach", "fused", "capturable", "decoupled_weight_decay"})


def _available(compensation: str) -> bool:
    return importlib.util.find_spec(_MODULES[compensation]) is not None


def _compensated(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer already compensates bf16 updates (and is kept as it is)."""
    module = type(optimizer).__module__
    if module.startswith("optimi"):  # kahan_sum=None applies Kahan summation to low-precision parameters
        return all(g.get("kahan_sum") is not False for g in optimizer.param_groups)
    if module.startswith("torchao"):
        return bool(getattr(optimizer, "bf16_stochastic_round", False))
    return False


def _target(optimizer: torch.optim.Optimizer, compensation: str) -> str | None:
    """The compensated equivalent's name for ``optimizer``, or None when there is none."""
    cls = type(optimizer)
    if cls is torch.optim.AdamW or (cls is torch.optim.Adam and optimizer.defaults.get("decoupled_weight_decay")):
        return {"kahan": "optimi.AdamW", "stochastic": "torchao.optim._AdamW"}[compensation]
    if cls is torch.optim.Adam and compensation == "kahan":
        return "optimi.Adam"
    if cls is torch.optim.SGD and compensation == "kahan":
        return "optimi.SGD"
    return None


def _uncarried(optimizer: torch.optim.Optimizer) -> list[str]:
    """Hyperparameters at non-neutral values that the compensated equivalent does not have."""
    bad = []
    for group in optimizer.param_groups:
        bad += [f"{key}={group[key]!r}" for key, neutral in _NEUTRAL.items() if group.get(key, neutral) != neutral]
        if type(optimizer) is torch.optim.SGD and group.get("dampening") not in (0, group.get("momentum")):
            bad.append(f"dampening={group['dampening']!r} (optimi has none or dampening=momentum)")
    return sorted(set(bad))


class BF16True(AutocastPrecision):
    """bf16 storage for weights, gradients and optimizer state; updates compensated (see the module)."""

    name = "bf16-true"
    aliases = ("bf16-pure", "pure-bf16", "true-bf16", "bfloat16-true")
    param_dtype = torch.bfloat16
    autocast_dtype = torch.bfloat16
    optimizer_requirement = ("compensated bf16 updates: Kahan summation (torch-optimi) or stochastic rounding "
                             "(torchao); compensation='none' opts out")
    compensations = ("kahan", "stochastic", "none")
    description = "bf16 weights, gradients and optimizer state, no fp32 master copy; Kahan-compensated updates."

    def _mode(self) -> str:
        return self.compensation or "kahan"

    # -- validation --------------------------------------------------------------------------
    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        mode = self._mode()
        if mode == "none" or _compensated(optimizer):
            return False
        target = _target(optimizer, mode)
        name = type(optimizer).__module__.split(".")[0] + "." + type(optimizer).__qualname__
        if target is None:
            other = "stochastic" if mode == "kahan" else "kahan"
            also = (f" (with compensation={other!r} it has: {_target(optimizer, other)})"
                    if _target(optimizer, other) else "")
            raise ValueError(
                f"precision='bf16-true' with {name}: this optimizer has no {mode!r}-compensated equivalent{also}, and "
                "without compensation bf16 weights round most small updates away. Fix: use torch.optim.AdamW, Adam or "
                "SGD (converted to torch-optimi's Kahan-summed equivalents), or an optimi optimizer; or opt out "
                "explicitly with compensation='none'; or keep fp32 master weights with precision='bf16'.")
        bad = _uncarried(optimizer)
        if bad:
            raise ValueError(
                f"precision='bf16-true' converts {name} to {target}, which cannot carry {', '.join(bad)}. Fix: drop "
                "those settings, or opt out of compensation with compensation='none', or use precision='bf16'.")
        if not _available(mode):
            raise ImportError(f"precision='bf16-true' converts {name} to {target}: {_HINTS[mode]}. Or opt out "
                              "with compensation='none'.")
        return True

    # -- actions -----------------------------------------------------------------------------
    def convert_module(self, module: nn.Module) -> nn.Module:
        # In place, tensor by tensor: the optimizer's parameter objects and the state_dict keys stay, buffers (e.g.
        # BatchNorm statistics) become bf16 too, and it works on the planner's fake parameters, which
        # nn.Module.to cannot swap.
        with torch.no_grad():
            for t in itertools.chain(module.parameters(), module.buffers()):
                if t.is_floating_point() and t.dtype != torch.bfloat16:
                    t.data = t.data.to(torch.bfloat16)
                    if t.grad is not None:
                        t.grad = t.grad.to(torch.bfloat16)
        return module

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *,
                          step_in_backward: bool = False) -> torch.optim.Optimizer:
        mode = self._mode()
        if mode == "none" or _compensated(optimizer):
            return optimizer
        target = _target(optimizer, mode)
        holding = [s for s in optimizer.state.values() if s]
        if holding:
            raise ValueError(f"precision='bf16-true' cannot convert {type(optimizer).__name__} to {target}: it already "
                             "holds state (it has stepped). Fix: wrap right after building the optimizer.")
        new = _build(optimizer, target, step_in_backward)

        warnings.warn(f"precision='bf16-true': {type(optimizer).__name__} converted to {target} "
                      f"({'kahan_sum=True' if mode == 'kahan' else 'bf16_stochastic_round=True'}), each group's "
                      "hyperparameters kept.", ConversionWarning, stacklevel=4)
        return new

    def convert_input(self, data: Any) -> Any:
        # As Lightning's bf16-true: a norm layer with bf16 weights refuses an fp32 input, and autocast leaves it.
        return cast_floating(data, torch.bfloat16)

    # -- memory effect -----------------------------------------------------------------------
    def compensation_bytes(self, param: torch.Tensor) -> int:
        """Extra optimizer state for the compensation: one bf16 Kahan buffer per parameter, none otherwise."""
        return param.numel() * 2 if getattr(self, "compensation", None) in (None, "kahan") else 0


def _build(optimizer: torch.optim.Optimizer, target: str, step_in_backward: bool) -> torch.optim.Optimizer:
    src = type(optimizer)
    known = {"params", "lr", "betas", "eps", "weight_decay", "momentum", "dampening", *_NEUTRAL, *_KERNEL_FLAGS}
    groups = []
    for g in optimizer.param_groups:
        group: dict[str, Any] = {k: v for k, v in g.items() if k not in known}  # user metadata ("name", "initial_lr")
        group.update(params=g["params"], lr=g["lr"], weight_decay=g.get("weight_decay", 0))
        if target.startswith("optimi") and "betas" in g:
            group.update(beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"])
        elif "betas" in g:
            group.update(betas=g["betas"], eps=g["eps"])
        if src is torch.optim.SGD:
            group.update(momentum=g["momentum"], dampening=bool(g["dampening"]) and g["momentum"] != 0)
        groups.append(group)
    lr = optimizer.defaults["lr"]
    if target == "torchao.optim._AdamW":
        from torchao.optim import _AdamW

        return _AdamW(groups, lr=lr, bf16_stochastic_round=True)
    import optimi

    release = {"gradient_release": True} if step_in_backward else {}
    if target == "optimi.SGD":
        # torch SGD's momentum buffer starts at the first gradient; with dampening=momentum that is torch_init.
        return optimi.SGD(groups, lr=lr, torch_init=True, kahan_sum=True, **release)
    cls = optimi.AdamW if target == "optimi.AdamW" else optimi.Adam
    return cls(groups, lr=lr, kahan_sum=True, **release)


@hookimpl
def memwrap_precisions():
    return [BF16True]
