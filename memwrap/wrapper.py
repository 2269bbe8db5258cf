"""``wrap()``: compose the gate, precision, checkpointing, optimizer plugin and wrappers.

Each concern lives in its own module; this one only decides which pieces a call needs and
hands them the one shared :class:`~memwrap.accumulation.AccumulationGate`.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from memwrap.accumulation import AccumulationGate, WrappedLoader
from memwrap.config import Options, parse_options
from memwrap.distributed import item_reducer, sync_control
from memwrap.loss_scale import configure_scaler
from memwrap.module import WrappedModule
from memwrap.optimizer import WrappedOptimizer, WrappedScheduler, check_params_in_model
from memwrap.precision import TF32, get_precision

__all__ = ["wrap", "unwrap", "backward"]

_WRAPPERS = (WrappedModule, WrappedOptimizer, WrappedScheduler, WrappedLoader)


def wrap(*objects: Any, **options: Any) -> Any:
    """Wrap a model, optimizer, LR scheduler and data loader (any subset, any order).

    Returns the wrapped objects in the order given (the object itself if only one was given).
    The training loop stays as it was.

    Options (keyword-only): ``precision`` ("fp32", "tf32", "bf16", "fp16"), ``accumulate``,
    ``max_grad_norm``, ``count_items``, ``checkpoint``, ``optim``, ``on_nonfinite`` ("skip" or
    "raise"), ``monitor``; Hugging Face ``TrainingArguments`` names are accepted as aliases.

    Example:
        >>> import memwrap, torch
        >>> model = torch.nn.Linear(4, 1)
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> model, optimizer = memwrap.wrap(model, optimizer, precision="bf16", accumulate=4)
        >>> for x in torch.randn(8, 2, 4):
        ...     loss = model(x).pow(2).mean()
        ...     loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> optimizer.updates
        2
    """
    opts = parse_options(**options)
    kinds = _classify(objects)
    models, optimizers = kinds["model"], kinds["optimizer"]
    if len(models) > 1 or len(optimizers) > 1:
        raise TypeError("wrap() takes at most one model and one optimizer per call; wrap each training setup separately.")
    model = models[0] if models else None
    optimizer = optimizers[0] if optimizers else None
    _check_pairing(opts, model, optimizer, kinds)

    gate = AccumulationGate(opts.accumulate)
    precision = get_precision(opts.precision)
    device_type = _device_type(model, optimizer)
    precision.check(device_type)
    scaler = precision.make_scaler(device_type)
    configure_scaler(scaler, opts.scaler)  # validated in parse_options; cannot fail here
    if isinstance(precision, TF32):
        precision.enable()

    results: dict[int, Any] = {}
    wrapped_model = wrapped_opt = None
    if model is not None:
        wrapped_model = _wrap_model(model, opts, gate, precision, scaler, device_type)
        results[id(model)] = wrapped_model
    if optimizer is not None:
        wrapped_opt = _wrap_optimizer(optimizer, model, opts, gate, scaler, kinds["scheduler"])
        results[id(optimizer)] = wrapped_opt
        if wrapped_model is not None:  # the model's forward records a loss it returns, for optimizer.window_loss
            object.__setattr__(wrapped_model, "_loss_log", wrapped_opt.loss_log)
    for scheduler in kinds["scheduler"]:
        results[id(scheduler)] = _wrap_scheduler(scheduler, wrapped_opt)
    for loader in kinds["loader"]:
        if wrapped_opt is None:
            raise TypeError(
                "a data loader needs the optimizer in the same wrap() call: both share the accumulation window. "
                "Fix: memwrap.wrap(model, optimizer, loader, ...)."
            )
        # Under DDP/FSDP2 the window's item total is summed over the data-parallel ranks (memwrap.distributed).
        reduce_items = item_reducer(model) if model is not None and opts.count_items is not None else None
        results[id(loader)] = WrappedLoader(loader, gate, opts.count_items, reduce_items)
    ordered = tuple(results[id(obj)] for obj in objects)
    return ordered[0] if len(ordered) == 1 else ordered


def unwrap(obj: Any) -> Any:
    """Return the original object behind a memwrap wrapper (and undo checkpointing and TF32 on a model).

    Example:
        >>> import memwrap, torch
        >>> net = torch.nn.Linear(2, 2)
        >>> memwrap.unwrap(memwrap.wrap(net)) is net
        True
    """
    if isinstance(obj, WrappedModule):
        if obj.checkpoint_report is not None:
            from memwrap.checkpointing import remove_checkpointing

            remove_checkpointing(_checkpoint_target(obj.module))
        if isinstance(obj._precision, TF32):
            obj._precision.restore()
        return obj.module
    if isinstance(obj, WrappedOptimizer):
        return obj.optimizer
    if isinstance(obj, WrappedScheduler):
        return obj.scheduler
    if isinstance(obj, WrappedLoader):
        return obj.loader
    return obj


def backward(loss: torch.Tensor, model: WrappedModule, **kwargs: Any) -> None:
    """Backward for a loss with terms that do not flow through the wrapped model's outputs.

    Use it instead of ``loss.backward()`` when the loss adds something computed directly from
    parameters (e.g. an L2 penalty over ``model.parameters()``): those terms bypass the output
    hooks that apply the micro-batch weight and the fp16 loss scale. Here the whole loss is
    weighted and scaled once, and the output hooks stand aside.

    Example:
        >>> loss = loss_fn(model(x), y) + 1e-4 * sum(p.square().sum() for p in model.parameters())  # doctest: +SKIP
        >>> memwrap.backward(loss, model)  # doctest: +SKIP
    """
    if not isinstance(model, WrappedModule):
        raise TypeError(f"memwrap.backward needs the model returned by memwrap.wrap, got {type(model).__name__}.")
    model.backward(loss, **kwargs)


# --- pieces ---------------------------------------------------------------------------

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
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            kinds["scheduler"].append(obj)
        elif isinstance(obj, Iterable) and not isinstance(obj, (torch.Tensor, str, bytes, dict)):
            kinds["loader"].append(obj)
        else:
            raise TypeError(
                f"wrap() does not know what to do with a {type(obj).__name__}; it takes an nn.Module, a "
                "torch.optim.Optimizer, an LR scheduler and a data loader (any re-iterable). Options are keyword-only."
            )
    return kinds


def _check_pairing(opts: Options, model: Any, optimizer: Any, kinds: dict[str, list[Any]]) -> None:
    if (optimizer is None) != (model is None) and (opts.accumulate > 1 or opts.precision == "fp16"):
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
    if len(kinds["loader"]) > 1:
        raise TypeError(
            f"wrap() got {len(kinds['loader'])} data loaders; only the training loader may be wrapped: it plans the "
            "accumulation windows, so a second one (an evaluation loader) would plan windows no step follows. "
            "Fix: wrap only the training loader and iterate evaluation loaders unwrapped."
        )
    if opts.count_items is not None and not kinds["loader"]:
        raise TypeError(
            "count_items weights micro-batches by their item counts, which the wrapped loader reads one window ahead; "
            "no loader was given. Fix: memwrap.wrap(model, optimizer, loader, count_items=...)."
        )
    for loader in kinds["loader"]:
        if iter(loader) is loader:
            warnings.warn(
                f"the data loader is a one-shot iterator ({type(loader).__name__}): it is exhausted after one pass, so "
                "a second epoch over the wrapped loader yields nothing. Fix: pass a re-iterable (a DataLoader, a "
                "list, or an object whose __iter__ starts over).",
                stacklevel=3,
            )
    if model is not None and opts.precision == "fp16":
        half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
        if half:
            raise ValueError(
                f"precision='fp16' keeps fp32 master weights and scales the loss, but parameter {half[0]!r} is already "
                "fp16 (model.half()?), and fp16 gradients cannot be unscaled. Fix: keep the parameters in fp32 (autocast "
                "runs the maths in fp16), or use precision='bf16'."
            )
    if model is not None and opts.checkpoint not in (None, False) and hasattr(model, "_orig_mod"):
        raise ValueError(
            "checkpoint= on a torch.compile'd model: torch's non-reentrant checkpoint fails under torch.compile "
            "(recomputed values get different metadata). Fix: drop checkpoint= or compile after training setup "
            "without checkpointing; see docs/checkpointing.md."
        )
    if opts.optim is not None and optimizer is None:
        raise TypeError(
            f"optim={opts.optim!r} converts the optimizer you pass to wrap(); none was given. Fix: pass your "
            f"optimizer, or build one with memwrap.create_optimizer({opts.optim!r}, model.parameters())."
        )
    if model is not None and optimizer is not None:
        check_params_in_model(model, [p for g in optimizer.param_groups for p in g["params"]])
    if model is not None and opts.accumulate > 1 and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        warnings.warn(
            f"the model has BatchNorm layers and accumulate={opts.accumulate}: their statistics are computed per "
            "micro-batch, not over the whole window, so training differs from one big batch. Fix: use GroupNorm or "
            "LayerNorm, SyncBatchNorm under DDP, or freeze BatchNorm statistics (module.eval()).",
            stacklevel=3,
        )


def _device_type(model: Any, optimizer: Any) -> str:
    if model is not None:
        param = next(model.parameters(), None)
    elif optimizer is not None:
        param = next((p for g in optimizer.param_groups for p in g["params"]), None)
    else:
        param = None
    return param.device.type if param is not None else "cpu"


def _checkpoint_target(model: nn.Module) -> nn.Module:
    # Under DDP the blocks live in .module; FSDP2 shards in place, so the model itself is the target.
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def _wrap_model(model: nn.Module, opts: Options, gate: AccumulationGate, precision: Any, scaler: Any, device_type: str) -> WrappedModule:
    report = None
    if opts.checkpoint is not None and opts.checkpoint is not False:
        from memwrap.checkpointing import apply_checkpointing, parse_checkpoint_option

        how = parse_checkpoint_option(opts.checkpoint)
        if how is not None:
            report = apply_checkpointing(_checkpoint_target(model), **how)
    wrapped = WrappedModule(model, gate, precision, scaler, device_type, sync_control(model))
    object.__setattr__(wrapped, "checkpoint_report", report)  # plain attribute: not part of state_dict
    return wrapped


def _wrap_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None, opts: Options, gate: AccumulationGate,
                    scaler: Any, schedulers: list[Any]) -> WrappedOptimizer:
    inner = optimizer
    if opts.optim is not None:
        from memwrap.registry import convert_optimizer

        for scheduler in schedulers:
            if getattr(scheduler, "optimizer", None) is optimizer:
                raise ValueError(
                    f"optim={opts.optim!r} replaces the optimizer, but the scheduler passed along still drives the old "
                    "one. Fix: wrap the model and optimizer first, then build the scheduler on the returned optimizer "
                    "and wrap it: scheduler = memwrap.wrap(LambdaLR(optimizer, ...))."
                )
        inner = convert_optimizer(optimizer, opts.optim, model=model)
    from memwrap.distributed import check_sharded_optimizer

    check_sharded_optimizer(inner)  # e.g. 8-bit bitsandbytes on FSDP2 shards: fail now, with the fix, not at step 1
    monitor = None
    if opts.monitor is not None:
        from memwrap.memory.monitor import MemoryMonitor

        monitor = MemoryMonitor(every=opts.monitor)
    return WrappedOptimizer(inner, gate, scaler, opts.max_grad_norm, opts.on_nonfinite, monitor, model=model)


def _wrap_scheduler(scheduler: Any, wrapped_opt: WrappedOptimizer | None) -> WrappedScheduler:
    target = getattr(scheduler, "optimizer", None)
    if wrapped_opt is None and isinstance(target, WrappedOptimizer):
        wrapped_opt = target
    if wrapped_opt is None:
        raise TypeError(
            "an LR scheduler needs its optimizer in the same wrap() call (or must be built on a wrapped optimizer), "
            "so it can step once per real update. Fix: memwrap.wrap(model, optimizer, scheduler, ...)."
        )
    if target is not wrapped_opt and target is not wrapped_opt.optimizer:
        raise ValueError("the scheduler drives a different optimizer than the one wrapped with it; pass the matching pair.")
    return WrappedScheduler(scheduler, wrapped_opt)
