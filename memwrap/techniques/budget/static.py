"""A ``budget=`` plan made once, ahead of a framework's own loop (Hugging Face Trainer, Lightning).

Those frameworks batch and accumulate themselves, with one fixed batch size: the plan of
:mod:`memwrap.techniques.budget.plan` is made once from a sample global batch, and its micro-batch is the
largest divisor of the global batch that fits (a fixed-size loader cannot cut unevenly). The caller
then sets the framework's batch size and accumulation steps from it; the global batch is kept.

Example:
    >>> choice = plan_split(model, sample_batch, "22GiB")  # doctest: +SKIP
    >>> choice.micro_batch, choice.accumulate  # doctest: +SKIP
    (4, 8)
"""
from __future__ import annotations

import types
from typing import Any

from torch import nn

from memwrap.runtime.batch_split import batch_size, describe_shapes
from memwrap.config.options import parse_options
from memwrap.precision.base import get_precision
from memwrap.techniques.budget.checks import check_budget_options, user_set

__all__ = ["plan_split", "UNSET"]

UNSET = object()  # checkpoint= not given: the plan chooses the policy


def plan_split(model: nn.Module, batch: Any, budget: Any, *, margin: Any = None, checkpoint: Any = UNSET,
               precision: str = "fp32", optim: str = "adamw", device_type: str | None = None,
               log: Any = print, keep_outputs: bool = True) -> Any:
    """The :class:`~memwrap.techniques.budget.plan.BudgetChoice` for ``batch`` (one global batch) under ``budget``, with a
    micro-batch that divides the batch; nothing is changed (the caller applies it). ``keep_outputs``: whether the
    framework's loop holds the model's outputs through backward (see :func:`memwrap.estimate`).

    Example:
        >>> plan_split(model, (x, y), "8GiB", checkpoint=None).micro_batch  # doctest: +SKIP
        16
    """
    # import cost: it loads the planner.
    from memwrap.techniques.budget.plan import BudgetPlanner

    raw: dict[str, Any] = {"budget": budget, "precision": precision, "optim": optim}
    if margin is not None:
        raw["margin"] = margin
    if checkpoint is not UNSET:
        raw["checkpoint"] = checkpoint
    opts = parse_options(**raw)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if params >= opts.budget:
        check_budget_options(opts, user_set(raw), model, object(), [batch])  # raises: smaller than the parameters
    if device_type is None:
        device_type = next(model.parameters()).device.type
    # What the planner reads of a wrapped model and optimizer: nothing is wrapped here.
    shim = types.SimpleNamespace(module=model, _precision=get_precision(opts.precision), _owns_checkpointing=False)
    planner = BudgetPlanner(shim, types.SimpleNamespace(updates=0, monitor=None), opts, raw, device_type, log=None)
    planner.keep_outputs = keep_outputs
    n, shapes = batch_size(batch), describe_shapes(batch)
    choice = planner._search(batch, n, shapes)
    divisor = max(d for d in range(1, choice.micro_batch + 1) if n % d == 0)
    if divisor != choice.micro_batch:  # the framework's loader has one batch size: plan that one
        choice = planner._search(batch, n, shapes, only=divisor)
    if log is not None:
        log(choice.line())
    return choice
