"""Everything ``wrap()`` checks before it changes anything.

A refused ``wrap()`` call must leave the model (its hooks, its checkpointing, its parameters),
the optimizer and torch's global settings exactly as they were, and a retry must behave like a
first call. So every option and every object is checked here, by code that only reads, and the
result is a :class:`WrapPlan` that :mod:`memwrap.wrapper` acts on. What can still fail once
``wrap()`` acts is undone there.
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memwrap.runtime.loader import WrappedLoader
from memwrap.config.options import Options, parse_options
from memwrap.runtime.module import WrappedModule
from memwrap.runtime.optimizer import WrappedOptimizer, check_params_in_model, check_sparse_clipping
from memwrap.runtime.scheduler import WrappedScheduler
from memwrap.precision.base import Precision, get_precision

__all__ = ["WrapPlan", "check_wrap", "checkpoint_target"]

_WRAPPERS = (WrappedModule, WrappedOptimizer, WrappedScheduler, WrappedLoader)
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
# Warnings below point at the user's wrap(...) line: warn <- helper <- check_wrap <- wrap <- user.
_USER = 4


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
    opts = parse_options(**options)
    precision = get_precision(opts.precision, compensation=opts.compensation)
    kinds = _classify(objects)
    model, optimizer = _one_model_and_optimizer(kinds)
    _check_option_targets(opts, precision, model, optimizer, kinds["loader"])
    _check_loaders(kinds["loader"])
    _check_schedulers(kinds["scheduler"], optimizer, opts)
    from memwrap.integrations.accelerate import check_prepared_optimizer

    check_prepared_optimizer(optimizer, opts, precision, kinds["scheduler"])  # after accelerator.prepare: one window
    if model is not None:
        _check_model(model, optimizer, opts, precision)
        from memwrap.runtime.distributed import check_dtype_change

        check_dtype_change(model, precision)  # bf16-true after DDP / fully_shard: refused with the order that works
    if opts.optim is not None:
        from memwrap.plugin.registry import get_optimizer_spec

        spec = get_optimizer_spec(opts.optim)  # an unknown name fails here, with its did-you-mean
        from memwrap.plugin.registry import option_hyperparameters
        from memwrap.techniques.step_in_backward import check_updates_in_backward

        option_hyperparameters(opts)  # optim_args / optim_target_modules checked against it, before anything changes
        check_updates_in_backward(spec.name if spec.updates_in_backward else None, opts, precision, model)
    elif optimizer is not None and getattr(optimizer, "updates_in_backward", False):
        from memwrap.techniques.step_in_backward import check_updates_in_backward

        check_updates_in_backward(type(optimizer).__name__, opts, precision, model)
    device_type = _device_type(model, optimizer)
    precision.check(device_type)  # called from here: its warnings use stacklevel=4, the user's wrap() line
    checkpoint = _check_checkpointing(model, opts) if model is not None else None
    loss_head = None
    if model is not None and opts.chunked_loss is not False:
        from memwrap.techniques.loss_head import BoundLossHead, find_loss_head

        loss_head = BoundLossHead(find_loss_head(model), None if opts.chunked_loss is True else opts.chunked_loss)
    check_sparse_clipping(model, opts.max_grad_norm)  # torch's clip_grad_norm_ has no sparse kernel
    if opts.budget is not None or options.get("margin") is not None or options.get("budget_may_change"):
        from memwrap.techniques.budget.checks import check_budget_options  # import cost: it pulls in the planner

        check_budget_options(opts, options, model, optimizer, kinds["loader"])
    return WrapPlan(opts, tuple(objects), model, optimizer, tuple(kinds["scheduler"]), tuple(kinds["loader"]), precision,
                    device_type, checkpoint, loss_head)


def checkpoint_target(model: nn.Module) -> nn.Module:
    """The module whose blocks are checkpointed: under DDP the blocks live in ``.module``.

    FSDP2 shards in place, so there the model itself is the target.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> checkpoint_target(net) is net
        True
    """
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


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


# --- checkpointing ------------------------------------------------------------------------

def _check_checkpointing(model: nn.Module, opts: Options) -> dict[str, Any] | None:
    """The ``apply_checkpointing`` arguments for ``checkpoint=``, resolved against this model without applying them."""
    from memwrap.checkpointing.apply import is_checkpointed, parse_checkpoint_option, resolve_policy
    from memwrap.checkpointing.policies import select_modules
    from torch.distributed._composable.contract import REGISTRY_KEY  # the composable API's per-module registry

    how = parse_checkpoint_option(opts.checkpoint)
    if how is None:
        return None
    _refuse_compiled(model)
    target = checkpoint_target(model)
    already = [name or "(root)" for name, m in target.named_modules() if is_checkpointed(m)]
    if already:
        raise ValueError(
            f"checkpoint={opts.checkpoint!r}, but {len(already)} module(s) of the model are already checkpointed "
            f"({', '.join(already[:3])}{', ...' if len(already) > 3 else ''}) by memwrap.apply_checkpointing or by an "
            "earlier wrap(checkpoint=...) not unwrapped. wrap() would replace that checkpointing and unwrap() would then "
            "remove it. Fix: drop checkpoint= (wrap() keeps and reports the existing checkpointing), unwrap the earlier "
            "wrapped model, or call memwrap.remove_checkpointing(model) first."
        )
    policy, every, _, _ = resolve_policy(how["policy"], how.get("every", 1), how.get("mode", "full"),
                                         how.get("offload", False))
    chosen = select_modules(target, policy)[::every]  # a policy that selects nothing fails here
    foreign = [name for name, m in chosen if "checkpoint" in (m.__dict__.get(REGISTRY_KEY) or {})]
    if foreign:
        raise ValueError(
            f"module {foreign[0]!r} is already checkpointed by torch.distributed._composable.checkpoint outside "
            "memwrap. Fix: remove that call and let wrap(checkpoint=...) do it, or drop checkpoint=."
        )
    return how


def _refuse_compiled(model: nn.Module) -> None:
    compiled = [name or type(model).__name__ for name, m in model.named_modules()
                if hasattr(m, "_orig_mod") or m.__dict__.get("_compiled_call_impl") is not None]
    if compiled:
        raise ValueError(
            f"checkpoint= on a torch.compile'd model ({compiled[0]} is compiled): torch's non-reentrant checkpoint "
            "fails under torch.compile (recomputed values get different metadata). Fix: drop checkpoint= or compile "
            "after training setup without checkpointing; see docs/checkpointing.md."
        )
