"""Apply a precision or optimizer chosen by ``budget=`` (only with ``budget_may_change=``), before the first update.

``wrap()`` built the wrapped model and optimizer with the user's precision and optimizer; the plan is
made at the first batch, when no update has happened yet, so switching is the same work ``wrap()``
does (:mod:`memwrap.wrapper`): a new precision object and loss scaler, the precision's process-wide
settings and parameter conversion, and the optimizer converted through the registry. Nothing is
lost: there is no optimizer state and no gradient yet.

Example:
    >>> wrap(model, optimizer, loader, budget="8GiB", budget_may_change=("precision",))  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

from memwrap.plugin.registry import convert_optimizer
from memwrap.precision.base import get_precision
from memwrap.precision.loss_scale import configure_scaler

__all__ = ["change_option"]


def change_option(planner: Any, name: str, value: str) -> None:
    """Switch the wrapped model/optimizer of ``planner`` to precision or optimizer ``value``."""
    model, opt = planner.model, planner.optimizer
    if getattr(opt, "updates", 0) or opt.gate.micro_step:
        raise RuntimeError(f"budget= chose {name}={value!r} after training started; memwrap changes the {name} only "
                           "before the first update. Please report this.")
    if name == "optim":
        inner = convert_optimizer(opt.optimizer, value, model=model.module)
        opt.optimizer = model._precision.convert_optimizer(inner, model.module)
        return

    new = get_precision(value, compensation=planner.opts.compensation)
    new.check(planner.device_type)
    scaler = new.make_scaler(planner.device_type)
    configure_scaler(scaler, planner.opts.scaler)
    new.check_optimizer(opt.optimizer)
    inner = new.convert_optimizer(opt.optimizer, model.module)
    old = model._precision
    old.restore()
    new.enable()
    new.convert_module(model.module)
    object.__setattr__(model, "_precision", new)
    object.__setattr__(model, "_scaler", scaler)
    opt.scaler = scaler
    opt.optimizer = inner
