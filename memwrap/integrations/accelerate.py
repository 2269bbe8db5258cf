"""Accumulation counted outside memwrap: accelerate's ``AcceleratedOptimizer`` and Hugging Face ``Trainer``.

An ``AcceleratedOptimizer`` steps and clears its optimizer only when accelerate's gradient state closes a window
(``Accelerator(gradient_accumulation_steps=N)``), and ``accelerator.backward`` divides each loss by ``N``; Trainer
calls ``optimizer.step()`` once per ``gradient_accumulation_steps`` micro-batches and divides the loss itself. memwrap's
``accumulate=`` on top weights every micro-batch a second time (``accumulate=2`` under ``N=2``: an update of 0.5x the
big batch's), and memwrap's window-end work (clipping, fp16 unscaling, a wrapped scheduler) would run on windows the
outer loop does not close. Each such combination is refused, naming both settings and the fix.

Detection reads the objects, never stack frames (walking callers' frames missed memwrap wrapping the
``AcceleratedOptimizer``, and reading their locals kept deleted models alive):

* at ``wrap()``: the optimizer passed is an ``AcceleratedOptimizer`` (``accelerator.prepare`` came first); its
  ``gradient_state.num_steps`` is accelerate's accumulation;
* at the first ``step()`` (``wrap()`` came first, then ``accelerator.prepare`` or ``Trainer``): the objects that hold
  memwrap's optimizer are looked up once among its referrers (``gc.get_referrers``): an ``AcceleratedOptimizer``
  whose ``optimizer`` it is, and a ``Trainer`` holding that (``args.gradient_accumulation_steps``; Trainer sets
  accelerate's own ``num_steps`` to 1 and accumulates itself).

accelerate's state is process-wide and outlives a run, so it is read only through an object that wraps this very
optimizer: a plain loop after a Trainer or accelerate run is never refused. Neither library is imported here: their
objects can exist only once they are.

Example:
    >>> outer_accumulation(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
    (1, '')
"""
from __future__ import annotations

import gc
import sys
from typing import Any

import torch

__all__ = ["accelerated_optimizer", "check_prepared_optimizer", "check_outer_accumulation", "outer_accumulation"]


def _accelerated_type() -> type | None:
    module = sys.modules.get("accelerate.optimizer")
    return getattr(module, "AcceleratedOptimizer", None)


def _steps(accelerated: Any) -> int:
    """accelerate's gradient_accumulation_steps as ``accelerated`` reads it (its shared gradient state)."""
    return _num_steps(getattr(accelerated, "gradient_state", None))


def _num_steps(gradient_state: Any) -> int:
    try:
        return max(1, int(gradient_state.num_steps))
    except (AttributeError, TypeError, ValueError):  # another accelerate layout: nothing accumulates there
        return 1


def accelerated_optimizer(optimizer: Any) -> Any:
    """The ``AcceleratedOptimizer`` that ``optimizer`` is, or None.

    Example:
        >>> accelerated_optimizer(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)) is None
        True
    """
    cls = _accelerated_type()
    return optimizer if cls is not None and isinstance(optimizer, cls) else None


def _holders(obj: Any, refs: list[Any], kind: type, marks: tuple[str, ...]) -> list[Any]:
    """Attribute tables (``vars()``) of the instances of ``kind`` among ``refs`` (``obj``'s referrers) whose
    ``optimizer`` is ``obj``.

    An instance whose attributes live in a materialized ``__dict__`` is referred to through that dict; such a dict is
    recognized by ``marks``, attribute names every instance of ``kind`` sets (no owner lookup is needed).
    """
    found = []
    for ref in refs:
        if isinstance(ref, kind):
            table = getattr(ref, "__dict__", {})
        elif type(ref) is dict and all(m in ref for m in marks):
            table = ref
        else:
            continue
        if table.get("optimizer") is obj:
            found.append(table)
    return found


def _owner(table: dict, kind: type) -> Any:
    """The instance of ``kind`` whose attribute table ``table`` is (one more scan: only for a wrapper found)."""
    return next((o for o in gc.get_referrers(table) if isinstance(o, kind) and getattr(o, "__dict__", None) is table),
                None)


def _trainer_steps(tables: list[dict]) -> int:
    steps = [getattr(t.get("args"), "gradient_accumulation_steps", 1) for t in tables]
    return max([n for n in steps if isinstance(n, int)] or [1])


def outer_accumulation(optimizer: torch.optim.Optimizer) -> tuple[int, str]:
    """``(steps, who)``: the accumulation an outer accelerate or Trainer loop applies around ``optimizer``.

    ``steps`` is 1 when nothing accumulates outside memwrap. Looked up once, at the first ``step()``: one scan of
    ``optimizer``'s referrers, one more when an accelerate wrapper holds it (to find a Trainer holding that).

    Example:
        >>> outer_accumulation(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))
        (1, '')
    """
    accelerated_cls = _accelerated_type()
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if accelerated_cls is None and trainer_cls is None:
        return 1, ""
    refs = gc.get_referrers(optimizer)
    steps, who = 1, ""
    trainers = _holders(optimizer, refs, trainer_cls, ("args", "accelerator")) if trainer_cls is not None else []
    if accelerated_cls is not None:
        for table in _holders(optimizer, refs, accelerated_cls, ("gradient_state", "accelerator_state")):
            n = _num_steps(table.get("gradient_state"))
            if n > steps:
                steps, who = n, f"accelerate's gradient_accumulation_steps={n}"
            outer = _owner(table, accelerated_cls) if trainer_cls is not None else None
            if outer is not None:  # Trainer holds accelerate's wrapper after accelerator.prepare
                trainers += _holders(outer, gc.get_referrers(outer), trainer_cls, ("args", "accelerator"))
    del refs
    n = _trainer_steps(trainers)  # Trainer sets accelerate's num_steps to 1 and calls step() once per window itself
    if n > steps:
        steps, who = n, f"the Trainer's gradient_accumulation_steps={n}"
    return steps, who


def check_outer_accumulation(optimizer: torch.optim.Optimizer, accumulate: int, step_in_backward: bool = False,
                             wrapper: Any = None) -> None:
    """Refuse, at the first ``step()``, memwrap's accumulation (or step in backward) inside an accumulating loop.

    ``optimizer`` is the one memwrap wraps; ``wrapper`` memwrap's ``WrappedOptimizer`` (what ``accelerator.prepare``
    or Trainer wrap after ``wrap()``).

    Example:
        >>> check_outer_accumulation(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), 2)
    """
    if accumulate == 1 and not step_in_backward:
        return
    inner = accelerated_optimizer(optimizer)
    steps, who = (_steps(inner), f"accelerate's gradient_accumulation_steps={_steps(inner)}") if inner else (1, "")
    if steps == 1 and wrapper is not None:
        steps, who = outer_accumulation(wrapper)
    if steps == 1:
        return
    if step_in_backward:
        raise ValueError(
            f"step_in_backward=True inside a loop that accumulates ({who}): memwrap updates each parameter in every "
            "backward pass, while the loop means one update per window (the first backward already updated the "
            "parameters). Fix: set the loop's accumulation to 1 and pass memwrap accumulate= instead "
            "(Accelerator(gradient_accumulation_steps=1) / TrainingArguments(gradient_accumulation_steps=1)), or drop "
            "step_in_backward.")
    raise ValueError(
        f"memwrap's accumulate={accumulate} and {who} are both active: every update would cover accumulate x "
        "gradient_accumulation_steps micro-batches, each loss divided by both, while the loop counts only its own "
        "window. This step() was not applied. Fix: keep one of "
        "them: accumulate=1 (the loop accumulates; memwrap still clips and checks at its window's end), or the loop's "
        "gradient_accumulation_steps=1 and memwrap's accumulate=; inside Hugging Face Trainer use "
        "memwrap.integrations.transformers.trainer.memwrap_trainer_kwargs with Trainer's gradient_accumulation_steps and pass "
        "Trainer the unwrapped model.")


def check_prepared_optimizer(optimizer: Any, opts: Any, precision: Any, schedulers: list[Any]) -> None:
    """Refuse, at ``wrap()``, what memwrap would do on windows an ``AcceleratedOptimizer`` does not close.

    After ``accelerator.prepare`` with ``gradient_accumulation_steps=N > 1`` the optimizer passed to ``wrap()`` steps
    only once per ``N`` micro-batches. memwrap's window-end work would then run mid-window: a second accumulation
    (``accumulate=``), clipping or fp16 unscaling of a partial gradient, a wrapped scheduler stepping per micro-batch;
    and ``optim=`` would build a new optimizer from the wrapper's groups, so accelerate's window would be lost.
    With ``accumulate=1`` and none of those, memwrap passes each ``step()`` on and accelerate decides: allowed.

    Example:
        >>> check_prepared_optimizer(None, None, None, [])  # not an AcceleratedOptimizer: nothing to check
    """
    accelerated = accelerated_optimizer(optimizer)
    if accelerated is None:
        return
    steps = _steps(accelerated)
    if steps == 1:
        return
    clashes = [text for text, on in (
        (f"accumulate={opts.accumulate} (a second accumulation: updates of 1/{opts.accumulate} of the big batch's)",
         opts.accumulate > 1),
        (f"max_grad_norm={opts.max_grad_norm} (would clip each partial gradient)", opts.max_grad_norm is not None),
        (f"precision={opts.precision!r} (its loss scale would unscale each partial gradient)",
         getattr(precision, "uses_scaler", False)),
        ("the LR scheduler passed to wrap() (it would step once per micro-batch)", bool(schedulers)),
        (f"optim={opts.optim!r} (the optimizer built from it replaces accelerate's wrapper, whose window is lost)",
         getattr(opts, "optim", None) is not None),
    ) if on]
    if not clashes:
        return
    raise ValueError(
        f"wrap() got accelerate's AcceleratedOptimizer (around {type(accelerated.optimizer).__name__}) of an "
        f"Accelerator(gradient_accumulation_steps={steps}): it updates once per {steps} micro-batches and "
        f"accelerator.backward() divides each loss by {steps}, while memwrap's window ends at every step(): "
        f"{'; '.join(clashes)}. Fix: let one of them accumulate: Accelerator(gradient_accumulation_steps=1) with "
        "memwrap's accumulate=<your window>; or wrap() before "
        "accelerator.prepare() with accumulate=1, so that accelerate calls memwrap's step() only when its window "
        "closes (then memwrap's clipping, loss scale and scheduler act on whole windows).")


def check_wrap(call) -> None:
    """``wrap()``'s check of an optimizer after ``accelerator.prepare`` (run by :mod:`memwrap.validation`):
    :func:`check_prepared_optimizer`, one window."""
    check_prepared_optimizer(call.optimizer, call.opts, call.precision, list(call.schedulers))
