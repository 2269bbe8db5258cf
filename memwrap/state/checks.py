"""Checks that a saved optimizer or scheduler state fits this run, made before any of it is loaded.

A refused ``load_state_dict`` must change nothing, so every check that can fail runs first; the
wrappers then load their pieces in an order where nothing left can fail. Each message names what
differs and the fix.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

from memwrap.runtime.gate import AccumulationGate

__all__ = ["class_name", "check_optimizer_state", "check_plain_optimizer_state", "check_scheduler_state"]

# Scheduler attributes that come and go between torch releases without changing the schedule.
_VOLATILE_SCHEDULER_KEYS = {"verbose"}


def class_name(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s class, as recorded in memwrap's checkpoints.

    Example:
        >>> class_name(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
        'torch.optim.sgd.SGD'
    """
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _refuse(what: str) -> None:
    raise ValueError(f"cannot load this optimizer checkpoint: {what}. Nothing was loaded.")


def check_optimizer_state(wrapped: Any, state: Any) -> None:
    """Raise ``ValueError`` if ``state`` (a ``WrappedOptimizer.state_dict()``) does not fit ``wrapped``.

    Example:
        >>> import memwrap
        >>> net = torch.nn.Linear(2, 1)
        >>> _, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> check_optimizer_state(opt, opt.state_dict())  # fits: no error
    """
    if not isinstance(state, dict) or "gate" not in state:
        raise ValueError(
            "this is not a memwrap optimizer checkpoint (no 'gate' entry). To load a plain optimizer "
            "state_dict, call memwrap.unwrap(optimizer).load_state_dict(...)."
        )
    for key in ("optimizer", "counters"):
        if key not in state:
            _refuse(f"its {key!r} entry is missing (a truncated or hand-edited checkpoint?)")
    # The gate's own load is the check (same accumulate, well-formed); a throwaway gate takes it.
    try:
        probe = AccumulationGate(wrapped.gate.accumulate)
        probe.varies = wrapped.gate.varies  # budget=: any saved accumulate is accepted (memwrap.techniques.budget.plan)
        probe.load_state_dict(state["gate"])
    except (KeyError, TypeError) as err:
        _refuse(f"its 'gate' entry is malformed ({err!r})")
    if wrapped.gate.varies and state["gate"].get("micro_step"):
        _refuse(f"it was saved in the middle of a budget= window (after micro-batch {state['gate']['micro_step']} of "
                f"{state['gate']['accumulate']}), and under budget= a window is one of your batches cut by the plan, "
                "which the loader cannot re-enter halfway. Fix: save between updates (when optimizer.did_update or "
                "loader.sync_gradients is True); memwrap.save_checkpoint refuses the other moments")
    saved_class, this_class = state.get("optimizer_class"), class_name(wrapped.optimizer)
    if saved_class is not None and saved_class != this_class:
        _refuse(
            f"it was saved from a {saved_class} but this run's optimizer is a {this_class}, whose state holds "
            "different entries. Fix: resume with the optimizer (and optim= option) the checkpoint was saved with; to "
            "start another optimizer from the saved weights, load only the model's state_dict"
        )
    _check_inner(wrapped.optimizer, state["optimizer"])
    _check_scaler(wrapped.scaler, state.get("scaler"))
    counters = state["counters"]
    if not isinstance(counters, dict) or not all(isinstance(counters.get(k), numbers.Integral) for k in ("updates", "skipped")):
        _refuse(f"its counters {counters!r} are not {{'updates': int, 'skipped': int}}")
    _check_grads(wrapped, state.get("accumulated_grads"))
    window_loss = state.get("window_loss")
    if window_loss is not None and not (isinstance(window_loss, dict) and {"open", "closed"} <= window_loss.keys()):
        _refuse("its 'window_loss' entry is malformed")
    monitor = state.get("monitor")
    if monitor is not None and wrapped.monitor is not None and not (isinstance(monitor, dict) and "records" in monitor):
        _refuse("its memory monitor entry has no 'records'")


def check_plain_optimizer_state(optimizer: torch.optim.Optimizer, state: Any, saved_class: str | None) -> None:
    """Raise ``ValueError`` if a plain ``torch.optim`` state (not memwrap-wrapped) does not fit ``optimizer``.

    torch's own ``load_state_dict`` checks the group sizes but loads another optimizer's per-parameter entries.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> check_plain_optimizer_state(opt, opt.state_dict(), class_name(opt))  # fits: no error
    """
    if saved_class is not None and saved_class != class_name(optimizer):
        _refuse(f"it was saved from a {saved_class} but this optimizer is a {class_name(optimizer)}. Fix: resume with "
                "the optimizer the checkpoint was saved with; to start another optimizer, load only the model")
    _check_inner(optimizer, state)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _check_inner(optimizer: torch.optim.Optimizer, inner: Any) -> None:
    if not isinstance(inner, dict) or "param_groups" not in inner or "state" not in inner:
        _refuse("its 'optimizer' entry is not an optimizer state_dict")
    saved_sizes = [len(g["params"]) for g in inner["param_groups"]]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        _refuse(f"it holds {len(saved_sizes)} parameter group(s) of sizes {saved_sizes}; this optimizer has "
                f"{len(sizes)} of sizes {sizes}. Fix: build the optimizer with the same parameter groups as the saved run")
    # Per-parameter state is compared where this optimizer already holds state for the same parameter: its
    # entries must be the saved ones, with the same shapes (a fresh optimizer has nothing to compare with).
    params = _params(optimizer)
    saved_ids = [i for g in inner["param_groups"] for i in g["params"]]
    for index, param in zip(saved_ids, params):
        saved, current = inner["state"].get(index), optimizer.state.get(param)
        if not saved or not current:
            continue
        if set(saved) != set(current):
            _refuse(f"the saved state of parameter {index} has entries {sorted(saved)} but this "
                    f"{type(optimizer).__name__} keeps {sorted(current)}. Fix: resume with the optimizer the "
                    "checkpoint was saved with")
        for key, value in saved.items():
            now = current[key]
            if isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and value.shape != now.shape:
                _refuse(f"the saved {key!r} of parameter {index} has shape {tuple(value.shape)}, this run's has "
                        f"shape {tuple(now.shape)}: the model differs from the saved one")


# GradScaler.load_state_dict's entries and the kinds torch's loader needs (fill_ takes a number, not a string).
_SCALER_KINDS = {"scale": numbers.Real, "growth_factor": numbers.Real, "backoff_factor": numbers.Real,
                 "growth_interval": numbers.Integral, "_growth_tracker": numbers.Integral}


def _check_scaler(scaler: torch.amp.GradScaler, saved: Any) -> None:
    if not saved:
        return  # saved from a run without loss scaling: a scaler here starts fresh, as in a new fp16 run
    if not scaler.is_enabled():
        # torch's disabled GradScaler ignores any state: the saved loss scale would be dropped without a word.
        _refuse("it holds a GradScaler (scaler) state, saved from a run with precision='fp16', but this run's "
                "precision has no loss scaling, so that state would be dropped. Fix: resume with precision='fp16'; "
                "to change precision on purpose, empty the saved entry first (state['scaler'] = {} in the "
                "optimizer's state, state['optimizer']['scaler'] = {} in a memwrap.save_checkpoint file)")
    if not isinstance(saved, dict):
        _refuse(f"its GradScaler (scaler) state is a {type(saved).__name__}, not a dict")
    missing = [k for k in scaler.state_dict() if k not in saved]
    if missing:
        _refuse(f"its GradScaler (scaler) state lacks {missing}")
    wrong = [k for k, kind in _SCALER_KINDS.items()
             if k in saved and (not isinstance(saved[k], kind) or isinstance(saved[k], bool))]
    if wrong:
        _refuse(f"its GradScaler (scaler) entries {wrong} are not numbers ({ {k: saved[k] for k in wrong} }): "
                "a damaged or hand-edited checkpoint. Fix: load the state as memwrap saved it")


def _check_grads(wrapped: Any, grads: Any) -> None:
    if grads is None:
        return
    params = _params(wrapped.optimizer)
    if not isinstance(grads, (list, tuple)) or len(grads) != len(params):
        count = len(grads) if isinstance(grads, (list, tuple)) else grads
        _refuse(f"it holds partial gradients for {count} parameters; this optimizer has {len(params)}")
    for i, (param, grad) in enumerate(zip(params, grads)):
        if grad is not None and (not isinstance(grad, torch.Tensor) or grad.shape != param.shape):
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            _refuse(f"its partial gradient {i} has shape {shape}, parameter {i} has shape {tuple(param.shape)}: "
                    "the model differs from the saved one")


def check_scheduler_state(scheduler: Any, optimizer: torch.optim.Optimizer, state: Any, saved_class: str | None) -> None:
    """Raise ``ValueError`` if a scheduler state (plain or memwrap's) was saved from another kind of scheduler.

    torch's schedulers load any dict into their attributes, so a StepLR state loaded into a
    CosineAnnealingLR would be accepted and mix the two schedules.

    Example:
        >>> opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        >>> s = torch.optim.lr_scheduler.StepLR(opt, 2)
        >>> check_scheduler_state(s, opt, s.state_dict(), None)  # fits: no error
    """
    this_class = class_name(scheduler)
    if saved_class is not None and saved_class != this_class:
        raise ValueError(
            f"cannot load this scheduler state: it was saved from a {saved_class}, this scheduler is a {this_class}. "
            "Nothing was loaded. Fix: build the same scheduler as the saved run before loading its state."
        )
    if not isinstance(state, dict):
        raise ValueError(f"cannot load this scheduler state: expected a dict, got {type(state).__name__}.")

    def public(keys: Any) -> set[str]:
        return {k for k in keys if not str(k).startswith("_") and k not in _VOLATILE_SCHEDULER_KEYS}

    # A recorded class that matches is trusted (torch releases add and drop attributes); a plain state has only
    # its keys to tell which scheduler saved it.
    current = public(scheduler.state_dict())
    extra, missing = sorted(public(state) - current), sorted(current - public(state))
    if saved_class is None and (extra or missing):
        raise ValueError(
            f"cannot load this scheduler state into a {type(scheduler).__name__}: the saved state has {extra} which it "
            f"does not keep, and lacks {missing}; it was saved from another kind of scheduler. Nothing was loaded. "
            "Fix: build the same scheduler as the saved run before loading its state."
        )
    base_lrs = state.get("base_lrs")
    groups = len(optimizer.param_groups)
    if isinstance(base_lrs, (list, tuple)) and len(base_lrs) != groups:
        raise ValueError(
            f"cannot load this scheduler state: it drives {len(base_lrs)} parameter groups, this optimizer has "
            f"{groups}. Nothing was loaded. Fix: build the optimizer with the same parameter groups as the saved run."
        )
