"""Everything ``wrap()`` checks before it changes anything: one read-only pass, run once per call.

A refused ``wrap()`` call must leave the model (its hooks, its checkpointing, its parameters),
the optimizer and torch's global settings exactly as they were, and a retry must behave like a
first call. So every option and every object is checked here, by code that only reads, and the
result is a frozen :class:`WrapPlan` that :mod:`memwrap.wrapper` acts on. What can still fail once
``wrap()`` acts is undone there.

The pass has two parts. This module checks what every call shares: the options (parsed once, by
:func:`memwrap.config.options.parse_options`), which object is which, what each option needs, the model,
the loaders and schedulers, the precision. Each technique then checks its own option through one
interface: a module in :data:`TECHNIQUES` defines ``check_wrap(call: WrapCall)``, which reads the parsed
options and the objects (never the raw options again), raises naming the fix, and may return fields of
the plan (``{"checkpoint": ...}``, ``{"loss_head": ...}``); a module may also define
``check_stepping(call, optimizer)``, run by :func:`check_stepping` on the optimizer that will step (after an
``optim=`` conversion, which only builds new objects). A new technique adds its module to the list.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from types import MappingProxyType, ModuleType
from typing import Any

import torch
from torch import nn

from memwrap.checkpointing import apply as checkpointing
from memwrap.config.options import Options, given_names, parse_options
from memwrap.integrations import accelerate
from memwrap.plugin.registry import OptimizerSpec, get_optimizer_spec, option_hyperparameters
from memwrap.precision.base import Precision, get_precision
from memwrap.runtime import distributed
from memwrap.runtime import optimizer as clipping
from memwrap.runtime.loader import WrappedLoader
from memwrap.runtime.module import WrappedModule
from memwrap.runtime.optimizer import WrappedOptimizer, check_params_in_model
from memwrap.runtime.scheduler import WrappedScheduler
from memwrap.techniques import loss_head, step_in_backward
from memwrap.techniques.budget import checks as budget

__all__ = ["WrapCall", "WrapPlan", "TECHNIQUES", "check_wrap", "check_stepping", "checkpoint_target"]

checkpoint_target = checkpointing.checkpoint_target  # re-exported: wrap() and unwrap() find the blocks with it

# The techniques' checks, in the order they run: the optimizer first (what it updates, how it is wrapped), then
# the model's forward (checkpointing, chunked loss), then clipping, then budget= (which reads the others' results).
TECHNIQUES: tuple[ModuleType, ...] = (accelerate, distributed, step_in_backward, checkpointing, loss_head, clipping,
                                      budget)

_WRAPPERS = (WrappedModule, WrappedOptimizer, WrappedScheduler, WrappedLoader)
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
# Warnings below point at the user's wrap(...) line: warn <- helper <- check_wrap <- wrap <- user.
_USER = 4


@dataclasses.dataclass(frozen=True)
class WrapCall:
    """One ``wrap()`` call as the techniques' checks read it: the options parsed once, the objects by kind.

    ``given`` holds the names of the options the user set (Hugging Face aliases mapped to memwrap's names);
    ``optim_spec`` is the registry's spec of ``optim=`` (None without it, and until :func:`check_wrap` has checked
    that ``optim=`` has an optimizer to convert).

    Example:
        >>> call = WrapCall.of((torch.nn.Linear(2, 2),), {"bf16": True})
        >>> call.precision.name, sorted(call.given), call.optimizer
        ('bf16', ['precision'], None)
    """

    opts: Options
    given: frozenset[str]
    precision: Precision
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    schedulers: tuple[Any, ...]
    loaders: tuple[Any, ...]
    device_type: str
    optim_spec: OptimizerSpec | None

    @classmethod
    def of(cls, objects: tuple[Any, ...], options: dict[str, Any]) -> "WrapCall":
        """Parse the options and sort the objects; raises for what no technique could use."""
        opts = parse_options(**options)
        precision = get_precision(opts.precision, compensation=opts.compensation)
        kinds = _classify(objects)
        model, optimizer = _one_model_and_optimizer(kinds)
        return cls(opts, frozenset(given_names(options)), precision, model, optimizer, tuple(kinds["scheduler"]),
                   tuple(kinds["loader"]), _device_type(model, optimizer), None)


@dataclasses.dataclass(frozen=True)
class WrapPlan:
    """A checked ``wrap()`` call: what to wrap and how, frozen. Building it changed nothing.

    ``checkpoint`` holds :func:`~memwrap.checkpointing.apply.apply_checkpointing` arguments, or None
    when ``wrap()`` leaves the model's checkpointing as it is.
    """

    opts: Options
    objects: tuple[Any, ...]
    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    schedulers: tuple[Any, ...]
    loaders: tuple[Any, ...]
    precision: Precision
    device_type: str
    checkpoint: dict[str, Any] | None
    loss_head: Any = None  # the model's chunked-loss adapter (memwrap.techniques.loss_head.BoundLossHead) or None
    call: WrapCall | None = None  # what the checks read; check_stepping() reads it again


def check_wrap(objects: tuple[Any, ...], options: dict[str, Any]) -> WrapPlan:
    """Check a ``wrap(*objects, **options)`` call; raise naming the fix, or return its plan.

    Example:
        >>> plan = check_wrap((torch.nn.Linear(2, 2),), {"precision": "bf16"})
        >>> plan.precision.name, plan.optimizer
        ('bf16', None)
    """
    if not objects:
        raise TypeError(
            "wrap() was given nothing to wrap. Fix: pass the objects of your training setup, e.g. "
            "model, optimizer = memwrap.wrap(model, optimizer, accumulate=4); options alone wrap nothing."
        )
    call = WrapCall.of(tuple(objects), options)
    opts, precision, model, optimizer = call.opts, call.precision, call.model, call.optimizer
    _check_option_targets(opts, precision, model, optimizer, list(call.loaders))
    _check_loaders(list(call.loaders))
    _check_schedulers(list(call.schedulers), optimizer, opts)
    if model is not None:
        _check_model(model, optimizer, opts, precision)
    if opts.optim is not None:
        call = dataclasses.replace(call, optim_spec=get_optimizer_spec(opts.optim))  # unknown: its did-you-mean
        option_hyperparameters(opts)  # optim_args / optim_target_modules checked against it, before anything changes
    precision.check(call.device_type)  # called from here: its warnings use stacklevel=4, the user's wrap() line
    found: dict[str, Any] = {"checkpoint": None, "loss_head": None}
    for technique in TECHNIQUES:
        fields = technique.check_wrap(call) or {}
        unknown = set(fields) - set(found)
        if unknown:  # a plan field no one would read: a technique's result silently dropped
            raise TypeError(f"{technique.__name__}.check_wrap returned {sorted(unknown)}, which are not fields of the "
                            f"wrap() plan ({sorted(found)}). Fix: return only those, or add the field to WrapPlan.")
        found.update(fields)
    return WrapPlan(opts, tuple(objects), model, optimizer, call.schedulers, call.loaders, precision,
                    call.device_type, found["checkpoint"], found["loss_head"], call)


def check_stepping(plan: WrapPlan, optimizer: torch.optim.Optimizer) -> bool:
    """The checks of the optimizer that will step (the user's, or the one ``optim=`` built from it; building it
    changed nothing of the user's): each technique's ``check_stepping``, then the precision's. Returns whether the
    precision will replace it with a compensated equivalent.

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> sgd = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> check_stepping(check_wrap((net, sgd), {}), sgd)
        False
    """
    call = plan.call if plan.call is not None else WrapCall.of(plan.objects, {})
    for technique in TECHNIQUES:
        check = getattr(technique, "check_stepping", None)
        if check is not None:
            check(call, optimizer)
    replaces = bool(plan.precision.check_optimizer(optimizer))
    if replaces and plan.schedulers:
        raise ValueError(
            f"precision={plan.opts.precision!r} replaces {type(optimizer).__name__} with a compensated equivalent, but "
            "the scheduler passed along still drives the old one. Fix: wrap the model and optimizer first, then build "
            "the scheduler on the returned optimizer and wrap it: scheduler = memwrap.wrap(LambdaLR(optimizer, ...))."
        )
    return replaces


# --- the objects --------------------------------------------------------------------------

def _classify(objects: Iterable[Any]) -> dict[str, list[Any]]:
    kinds: dict[str, list[Any]] = {"model": [], "optimizer": [], "scheduler": [], "loader": []}
    for obj in objects:
        if isinstance(obj, _WRAPPERS):
            raise ValueError(
                f"{type(obj).__name__} is already wrapped by memwrap. Wrapping twice would weight gradients twice. "
                "Fix: wrap the original object once with all options (memwrap.unwrap(obj) returns it)."
            )
        if isinstance(obj, nn.Module):
            kinds["model"].append(obj)
        elif isinstance(obj, torch.optim.Optimizer):
            kinds["optimizer"].append(obj)
        elif isinstance(obj, _SCHEDULERS):
            kinds["scheduler"].append(obj)
        elif isinstance(obj, Iterable) and not isinstance(obj, (torch.Tensor, str, bytes, dict)):
            kinds["loader"].append(obj)
        else:
            raise TypeError(
                f"wrap() does not know what to do with a {type(obj).__name__}; it takes an nn.Module, a "
                "torch.optim.Optimizer, an LR scheduler and a data loader (any re-iterable). Options are keyword-only."
            )
    return kinds


def _one_model_and_optimizer(kinds: dict[str, list[Any]]) -> tuple[Any, Any]:
    models, optimizers = kinds["model"], kinds["optimizer"]
    if len(models) > 1 or len(optimizers) > 1:
        raise TypeError("wrap() takes at most one model and one optimizer per call; wrap each training setup separately.")
    return (models[0] if models else None), (optimizers[0] if optimizers else None)


def _check_option_targets(opts: Options, precision: Precision, model: Any, optimizer: Any, loaders: list[Any]) -> None:
    """Each option acts on some of the objects; without them it would be silently ignored."""
    if (opts.accumulate > 1 or precision.uses_scaler) and (model is None or optimizer is None):
        raise TypeError(
            f"accumulate={opts.accumulate} / precision={opts.precision!r} needs the model and the optimizer in the "
            "same wrap() call: the model weights gradients and the optimizer steps once per window. "
            "Fix: model, optimizer = memwrap.wrap(model, optimizer, ...)."
        )
    if opts.monitor is not None and optimizer is None:
        raise TypeError(
            f"monitor={opts.monitor} logs peak memory every {opts.monitor} optimizer updates; no optimizer was given. "
            "Fix: memwrap.wrap(model, optimizer, monitor=...), or use memwrap.MemoryMonitor yourself."
        )
    if opts.optim is not None and optimizer is None:
        raise TypeError(
            f"optim={opts.optim!r} converts the optimizer you pass to wrap(); none was given. Fix: pass your "
            f"optimizer, or build one with memwrap.create_optimizer({opts.optim!r}, model.parameters())."
        )
    stepping = {"max_grad_norm": opts.max_grad_norm is not None, "on_nonfinite": opts.on_nonfinite != "skip",
                "step_in_backward": opts.step_in_backward}
    for name in (n for n, given in stepping.items() if given):
        if optimizer is None:
            raise TypeError(
                f"{name}={getattr(opts, name)!r} acts in optimizer.step(), but no optimizer was given, so it would be "
                f"ignored. Fix: memwrap.wrap(model, optimizer, {name}=...)."
            )
    forward = {"precision": precision.name != "fp32", "checkpoint": opts.checkpoint not in (None, False),
               "chunked_loss": opts.chunked_loss is not False}
    for name in (n for n, given in forward.items() if given):
        if model is None:
            raise TypeError(
                f"{name}={getattr(opts, name)!r} acts in the model's forward, but no model was given, so it would be "
                f"ignored. Fix: memwrap.wrap(model, ..., {name}=...)."
            )
    if opts.count_items is not None and not loaders:
        raise TypeError(
            "count_items weights micro-batches by their item counts, which the wrapped loader reads one window ahead; "
            "no loader was given. Fix: memwrap.wrap(model, optimizer, loader, count_items=...)."
        )
    if loaders and optimizer is None:
        raise TypeError(
            "a data loader needs the optimizer in the same wrap() call: both share the accumulation window. "
            "Fix: memwrap.wrap(model, optimizer, loader, ...)."
        )


def _check_loaders(loaders: list[Any]) -> None:
    if len(loaders) > 1:
        raise TypeError(
            f"wrap() got {len(loaders)} data loaders; only the training loader may be wrapped: it plans the "
            "accumulation windows, so a second one (an evaluation loader) would plan windows no step follows. "
            "Fix: wrap only the training loader and iterate evaluation loaders unwrapped."
        )
    for loader in loaders:
        if iter(loader) is loader:
            warnings.warn(
                f"the data loader is a one-shot iterator ({type(loader).__name__}): it is exhausted after one pass, so "
                "a second epoch over the wrapped loader yields nothing. Fix: pass a re-iterable (a DataLoader, a "
                "list, or an object whose __iter__ starts over).",
                stacklevel=_USER,
            )


def _check_schedulers(schedulers: list[Any], optimizer: Any, opts: Options) -> None:
    for scheduler in schedulers:
        target = getattr(scheduler, "optimizer", None)
        if optimizer is None:
            if not isinstance(target, WrappedOptimizer):
                raise TypeError(
                    "an LR scheduler needs its optimizer in the same wrap() call (or must be built on a wrapped "
                    "optimizer), so it can step once per real update. Fix: memwrap.wrap(model, optimizer, scheduler, ...)."
                )
        elif target is not optimizer:
            raise ValueError(
                f"the scheduler drives a different optimizer ({type(target).__name__}) than the one wrapped with it; "
                "pass the matching pair. Fix: build the scheduler on the optimizer you pass to wrap()."
            )
        elif opts.optim is not None:
            raise ValueError(
                f"optim={opts.optim!r} replaces the optimizer, but the scheduler passed along still drives the old "
                "one. Fix: wrap the model and optimizer first, then build the scheduler on the returned optimizer "
                "and wrap it: scheduler = memwrap.wrap(LambdaLR(optimizer, ...))."
            )


# --- the model ----------------------------------------------------------------------------

def _check_model(model: nn.Module, optimizer: Any, opts: Options, precision: Precision) -> None:
    _refuse_nested_wrappers(model)
    if precision.uses_scaler:
        half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
        if half:
            raise ValueError(
                f"precision='fp16' keeps fp32 master weights and scales the loss, but parameter {half[0]!r} is already "
                "fp16 (model.half()?), and fp16 gradients cannot be unscaled. Fix: keep the parameters in fp32 (autocast "
                "runs the maths in fp16), or use precision='bf16'."
            )
    if optimizer is not None:
        check_params_in_model(model, [p for g in optimizer.param_groups for p in g["params"]])
    if opts.accumulate > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        warnings.warn(
            f"the model has BatchNorm layers and accumulate={opts.accumulate}: their statistics are computed per "
            "micro-batch, not over the whole window, so training differs from one big batch. Fix: use GroupNorm or "
            "LayerNorm, SyncBatchNorm under DDP, or freeze BatchNorm statistics (module.eval()).",
            stacklevel=_USER,
        )


def _refuse_nested_wrappers(model: nn.Module) -> None:
    # A wrapped model inside the model (a wrapped encoder in a bigger net, DDP or torch.compile around a
    # wrapped model): both wrappers would weight the same gradients, e.g. x0.5 twice with accumulate=2.
    for name, module in model.named_modules():
        if name and isinstance(module, WrappedModule):
            raise ValueError(
                f"{type(model).__name__} holds a model already wrapped by memwrap at {name!r}; wrapping the outer model "
                "as well would weight (and loss-scale) the same gradients twice. Fix: put the original module there "
                f"(memwrap.unwrap(...) returns it) and wrap only the outer model, once, with all options."
            )


def _device_type(model: Any, optimizer: Any) -> str:
    if model is not None:
        param = next(model.parameters(), None)
    elif optimizer is not None:
        param = next((p for g in optimizer.param_groups for p in g["params"]), None)
    else:
        param = None
    return param.device.type if param is not None else "cpu"
