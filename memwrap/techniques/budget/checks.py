"""What ``wrap()`` checks of ``budget=``, ``margin=`` and ``budget_may_change=`` before it changes anything,
and which options the user set (those a budget plan leaves as they are). See :mod:`memwrap.techniques.budget.plan`.

Example:
    >>> sorted(user_set({"gradient_accumulation_steps": 4, "bf16": True, "budget": "8GiB"}))
    ['accumulate', 'budget', 'precision']
"""
from __future__ import annotations

from typing import Any

import torch

from memwrap.config.options import given_names
from memwrap.plugin.registry import get_optimizer_spec

__all__ = ["check_wrap", "check_budget_options", "user_set", "optimizer_name"]


def check_wrap(call) -> None:
    """``wrap()``'s checks of ``budget=``, ``margin=``, ``budget_may_change=`` (run by :mod:`memwrap.validation`;
    read only): :func:`check_budget_options`.

    Example:
        >>> from memwrap.validation import check_wrap as check_call
        >>> check_call((torch.nn.Linear(2, 2),), {"margin": 0.1})
        Traceback (most recent call last):
        ...
        ValueError: margin= applies to budget=, which was not given. ...
    """
    check_budget_options(call.opts, call.given, call.model, call.optimizer, list(call.loaders))


def check_budget_options(opts: Any, given: set[str], model: Any, optimizer: Any, loaders: list) -> None:
    """The checks of ``budget=``, ``margin=``, ``budget_may_change=``; ``given`` are the options the user set
    (:func:`memwrap.config.options.given_names`). Read only; raise naming the fix."""
    if opts.budget is None:
        for name in ("margin", "budget_may_change"):
            if getattr(opts, name) not in (None, ()):
                raise ValueError(f"{name}= applies to budget=, which was not given. Fix: add budget='22GiB' (the "
                                 f"memory one device may use) or drop {name}=.")
        return
    if model is None or optimizer is None or not loaders:
        missing = [n for n, o in (("model", model), ("optimizer", optimizer), ("loader", loaders or None)) if o is None]
        raise ValueError(f"budget= plans the micro-batch from the loader's batches and cuts them for the model and "
                         f"the optimizer, but no {' or '.join(missing)} was given. Fix: memwrap.wrap(model, optimizer, "
                         f"loader, budget=...).")
    for name in opts.budget_may_change:
        if name in given:
            raise ValueError(f"budget_may_change includes {name!r} but {name}={getattr(opts, name)!r} was given: an "
                             f"option you set stays as set. Fix: drop {name}= to let the budget choose it, or drop "
                             f"{name!r} from budget_may_change.")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    if params >= opts.budget:
        # Import cost: memwrap.memory's package loads the planner, which a wrap() that passes needs only with budget=.
        from memwrap.memory.budget import format_bytes

        raise ValueError(f"budget={format_bytes(opts.budget)} is smaller than the model's parameters alone "
                         f"({format_bytes(params)}); no micro-batch can fit. Fix: a budget above "
                         f"{format_bytes(params)} plus gradients and optimizer state (typically 4x the parameters for "
                         f"AdamW in fp32), or shard the model (FSDP2; see `memwrap plan --world-size`).")


def user_set(raw: dict[str, Any]) -> set[str]:
    """The wrap() options the user gave (memwrap names; Hugging Face aliases mapped to them by the options' own table)."""
    return given_names(raw)


def optimizer_name(optimizer: torch.optim.Optimizer, opts: Any) -> str:
    """The registry name that describes the user's optimizer (``opts.optim`` when set, else its class)."""

    if opts.optim is not None:
        return get_optimizer_spec(opts.optim).name
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.search.space import registry_name

    # The name labels the plan; the plan traces the optimizer itself as built (memwrap.memory.search.space.AsBuilt).
    return registry_name(getattr(optimizer, "optimizer", optimizer))
