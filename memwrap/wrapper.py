"""``wrap()``: compose the gate, precision, checkpointing, optimizer plugin and wrappers.

Each concern lives in its own module; this one only decides which pieces a call needs and
hands them the one shared :class:`~memwrap.runtime.gate.AccumulationGate`.

A call runs in three steps. :func:`memwrap.validation.check_wrap` checks every option and every
object and changes nothing. Then the new objects are built (the converted optimizer, the
wrappers; :func:`memwrap.validation.check_stepping` checks the optimizer that will step), which
changes nothing of the user's either. Last come the changes to the user's model and to torch's
global settings (checkpointing, TF32, parameter dtype), undone if one of them
fails, so that a refused call leaves nothing behind and a retry behaves like a first call.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch

from memwrap.runtime.gate import AccumulationGate
from memwrap.runtime.loader import WrappedLoader
from memwrap.runtime.distributed import item_reducer, sync_control
from memwrap.precision.loss_scale import configure_scaler
from memwrap.runtime.module import WrappedModule
from memwrap.runtime.optimizer import WrappedOptimizer
from memwrap.runtime.scheduler import WrappedScheduler
from memwrap.precision.base import convert_model, Precision
from memwrap.errors import refuse_unwrapped  # re-exported: it was defined here
from memwrap.validation import WrapPlan, check_stepping, check_wrap, checkpoint_target
from memwrap.checkpointing.apply import apply_checkpointing, current_report, remove_checkpointing
from memwrap.plugin.registry import convert_optimizer, option_hyperparameters
from memwrap.techniques.step_in_backward import StepInBackward
from memwrap.techniques.updates_in_backward import UpdatesInBackward, uses_norm_pass

__all__ = ["wrap", "unwrap", "backward", "refuse_unwrapped"]


def wrap(*objects: Any, **options: Any) -> Any:
    """Wrap a model, optimizer, LR scheduler and data loader (any subset, any order).

    Returns the wrapped objects in the order given (the object itself if only one was given).
    The training loop stays as it was. A refused call (bad option, mismatched objects, unknown
    optimizer name, ...) raises before it changes anything.

    Options (keyword-only): ``precision`` ("fp32", "tf32", "bf16", "fp16"), ``accumulate``,
    ``max_grad_norm``, ``count_items``, ``checkpoint``, ``optim``, ``on_nonfinite`` ("skip" or
    "raise"), ``monitor``, ``scaler`` (fp16 GradScaler settings); Hugging Face ``TrainingArguments`` names are accepted as aliases.
    ``budget`` (with the loader: its batches are the global batch, cut into micro-batches planned to fit; see
    :mod:`memwrap.techniques.budget.plan`), ``margin`` and ``budget_may_change`` go with it.

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
    plan = check_wrap(objects, options)  # every check of the options and objects; it changes nothing
    gate = AccumulationGate(plan.opts.accumulate)
    scaler = plan.precision.make_scaler(plan.device_type)
    configure_scaler(scaler, plan.opts.scaler)  # validated in parse_options; cannot fail here

    # New objects only: nothing of the user's changes until _change_model() below.
    results: dict[int, Any] = {}
    wrapped_model = wrapped_opt = None
    if plan.model is not None:
        wrapped_model = WrappedModule(plan.model, gate, plan.precision, scaler, plan.device_type,
                                      sync_control(plan.model), loss_head=plan.loss_head)
        results[id(plan.model)] = wrapped_model
    if plan.optimizer is not None:
        wrapped_opt = WrappedOptimizer(_optimizer_to_step(plan), gate, scaler, plan.opts.max_grad_norm,
                                       plan.opts.on_nonfinite, _monitor(plan), model=plan.model)
        results[id(plan.optimizer)] = wrapped_opt
        if wrapped_model is not None:  # the model's forward records a loss it returns, for optimizer.window_loss
            object.__setattr__(wrapped_model, "_loss_log", wrapped_opt.loss_log)
    for scheduler in plan.schedulers:
        results[id(scheduler)] = WrappedScheduler(scheduler, wrapped_opt or scheduler.optimizer)
    for loader in plan.loaders:
        results[id(loader)] = _wrap_loader(loader, plan, gate)
        results[id(loader)].optimizer = wrapped_opt  # loader.end_epoch() steps the open window through it
    if plan.opts.budget is not None:  # each batch is one window, cut at the first batch's plan (memwrap.techniques.budget.plan)
        # import cost: it loads the planner.
        from memwrap.techniques.budget.plan import BudgetPlanner

        planner = BudgetPlanner(wrapped_model, wrapped_opt, plan.opts, options, plan.device_type)
        gate.varies = True
        wrapped_opt.budget_plan = results[id(plan.loaders[0])].budget_plan = planner
    # The changes to the user's objects come last; if one fails, those before it are undone (newest first).
    with contextlib.ExitStack() as undo:
        if wrapped_model is not None:
            _change_model(plan, wrapped_model, undo, wrapped_opt.optimizer if wrapped_opt is not None else None)
        if wrapped_opt is not None and plan.opts.step_in_backward:  # hooks on the parameters: a change, made last

            wrapped_opt.step_in_backward = StepInBackward(wrapped_opt, plan.model)
        elif wrapped_opt is not None and plan.model is not None and uses_norm_pass(wrapped_opt):
            # LOMO / layer-wise GaLore with max_grad_norm or fp16: the norm pass drives their updates (hooks, made last)
            wrapped_opt.norm_in_backward = UpdatesInBackward(wrapped_opt, plan.model)
        undo.pop_all()  # all done: keep every change
    ordered = tuple(results[id(obj)] for obj in objects)
    return ordered[0] if len(ordered) == 1 else ordered


def unwrap(obj: Any) -> Any:
    """Return the original object behind a memwrap wrapper, undoing what ``wrap()`` changed on a model.

    For a model: the checkpointing ``wrap(checkpoint=...)`` applied is removed (checkpointing the
    model already had before ``wrap()`` stays) and process-wide precision settings (TF32) are
    restored. For an optimizer: the step-in-backward hooks are removed. A wrapper that lost something
    this way is spent: calling it (forward, ``step()``, ``zero_grad()``, ``memwrap.backward``) raises
    rather than train without it. One that lost nothing (``unwrap`` only handed out the inner object)
    goes on as before. Unwrapping twice is harmless.

    Example:
        >>> import memwrap, torch
        >>> net = torch.nn.Linear(2, 2)
        >>> memwrap.unwrap(memwrap.wrap(net)) is net
        True
    """
    if isinstance(obj, WrappedModule):
        undone = []
        if obj._owns_checkpointing:
            remove_checkpointing(checkpoint_target(obj.module))
            object.__setattr__(obj, "_owns_checkpointing", False)  # a later wrap's checkpointing is not this one's
            undone.append("the checkpointing wrap() applied (checkpoint_report no longer holds)")
        if type(obj._precision).restore is not Precision.restore:  # the mode has process-wide settings
            undone.append(f"precision={obj._precision.name!r}'s process-wide settings")
        obj._precision.restore()
        if undone and not obj.__dict__.get("_unwrapped"):
            object.__setattr__(obj, "_unwrapped", ", ".join(undone))
            # A pre-hook rather than a check in forward(): it runs before anything of the call, autocast included.
            obj.register_forward_pre_hook(lambda module, args: refuse_unwrapped(module, "forward"), prepend=True)
        return obj.module
    if isinstance(obj, WrappedOptimizer):
        if obj.__dict__.get("step_in_backward") is not None:
            obj.step_in_backward.remove()  # its parameters stop stepping inside backward
            obj._unwrapped = "the step-in-backward hooks (its parameters would no longer step)"
        if obj.__dict__.get("norm_in_backward") is not None:
            obj.norm_in_backward.remove()  # the optimizer's own hooks update again, unclipped
            obj._unwrapped = "the norm pass's hooks (its updates inside backward would no longer be clipped)"
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
    hooks that apply the micro-batch weight and the fp16 loss scale (and the norm pass's norm), and
    ``loss.backward()`` refuses such a loss where that matters. Here the whole loss is weighted and
    scaled once, and the output hooks stand aside.

    Example:
        >>> loss = loss_fn(model(x), y) + 1e-4 * sum(p.square().sum() for p in model.parameters())  # doctest: +SKIP
        >>> memwrap.backward(loss, model)  # doctest: +SKIP
    """
    if not isinstance(model, WrappedModule):
        raise TypeError(f"memwrap.backward needs the model returned by memwrap.wrap, got {type(model).__name__}.")
    if model.__dict__.get("_unwrapped"):
        refuse_unwrapped(model, "memwrap.backward")
    model.backward(loss, **kwargs)


# --- pieces ---------------------------------------------------------------------------

def _optimizer_to_step(plan: WrapPlan) -> torch.optim.Optimizer:
    """The optimizer to wrap: the user's, or one built from it (``optim=``, a precision's compensated
    equivalent). Builds new objects only; the user's optimizer is left as it is."""
    inner = plan.optimizer
    if plan.opts.optim is not None:
        inner = convert_optimizer(inner, plan.opts.optim, model=plan.model, **option_hyperparameters(plan.opts))
    check_stepping(plan, inner)  # sharded parameters, the step in backward, the precision: read only
    # Before convert_module(): building the optimizer does not depend on the parameters' dtype (state is made at
    # the first step), and a failure here must find the model unchanged.
    return plan.precision.convert_optimizer(inner, plan.model, step_in_backward=plan.opts.step_in_backward)


def _monitor(plan: WrapPlan) -> Any:
    if plan.opts.monitor is None:
        return None
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.monitor import MemoryMonitor

    return MemoryMonitor(every=plan.opts.monitor)


def _change_model(plan: WrapPlan, wrapped: WrappedModule, undo: contextlib.ExitStack,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
    """Checkpoint the model, switch on the precision's process-wide settings and convert its parameters
    (and the state ``optimizer``, the one that steps, already holds).

    Each change registers its undo on ``undo``, which ``wrap()`` runs if a later step fails. The dtype
    conversion keeps the old storage until ``wrap()`` succeeds, so it is undone bit for bit
    (:func:`memwrap.precision.base.convert_model`).
    """

    target = checkpoint_target(plan.model)
    if plan.checkpoint is not None:
        undo.callback(remove_checkpointing, target)  # also undoes a partial application
        apply_checkpointing(target, **plan.checkpoint)
    undo.callback(plan.precision.restore)
    plan.precision.enable()
    undo.callback(convert_model(plan.precision, plan.model, optimizer))
    # Plain attributes (not part of state_dict). The report also shows checkpointing applied before wrap();
    # unwrap() removes only what this call applied.
    object.__setattr__(wrapped, "checkpoint_report", current_report(target))
    object.__setattr__(wrapped, "_owns_checkpointing", plan.checkpoint is not None)


def _wrap_loader(loader: Any, plan: WrapPlan, gate: AccumulationGate) -> WrappedLoader:
    # Under DDP/FSDP2 the window's item total is summed over the data-parallel ranks (memwrap.runtime.distributed).
    model, count_items = plan.model, plan.opts.count_items
    reduce_items = item_reducer(model) if model is not None and count_items is not None else None
    return WrappedLoader(loader, gate, count_items, reduce_items)
