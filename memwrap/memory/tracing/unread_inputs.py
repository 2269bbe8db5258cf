"""Inputs the real step gives the model differently than the fake trace would: the values fake tensors cannot show.

Some models decide on the *values* of an input, and on fake tensors they cannot read them. A Hugging Face model with
SDPA attention checks whether its ``attention_mask`` is all ones and then gives SDPA no mask at all
(``is_causal=True``); on a fake tensor transformers treats the mask as traced and builds the 4-D mask, which SDPA
turns into a float mask and keeps for backward, one per layer: the estimate of an unpadded batch that carries its
all-ones mask (what a tokenizer returns) was over by that (4 GiB, +3.2%, on a 7B Llama at batch 4 x 4096 with 8-bit
AdamW in bf16-true; +4.3% on the zoo's small Llama).

Where the batch is real (``memwrap.estimate(model, batch)`` with tensors), memwrap reads those values before
tracing and asks the ``memwrap_trace_inputs`` plugins (:class:`TraceInputSpec`; built-in: Hugging Face's SDPA
mask, ``plugins/trace_inputs/hf.py``) which keyword inputs the real step would not pass on. Those are left out of the
traced call and kept in the batch (so their bytes are still counted, for as long as the batch lives), and the
estimate's report says so. A batch built under the fake mode (a ``plan()`` batch function) has no values: nothing is
left out there, and the estimate stays on the safe side.

Only dict batches (``model(**batch)``, as Hugging Face loops and Trainer call the model) are adapted.

Example:
    >>> import torch
    >>> call, notes, adjust = adapt_batch(torch.nn.Linear(2, 2), {"x": torch.ones(1, 2)})
    >>> isinstance(call, dict), notes, adjust  # not a model any adapter knows: unchanged
    (True, [], ())
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memwrap.memory.tracing.batch import Call
from memwrap.plugin.calls import FieldRule, call_hook, guard_fields
from memwrap.plugin.manager import PluginContractError

__all__ = ["TraceInputSpec", "trace_input_adapters", "adapt_batch", "planned_adjustments", "adjust_fake_model", "is_real"]


@dataclasses.dataclass(frozen=True)
class TraceInputSpec:
    """A ``memwrap_trace_inputs`` adapter. ``unused(model, kwargs) -> dict[str, str]`` gets the model (a fake copy
    or the user's module: types and config only, it must not run it) and the call's keyword arguments with their
    real values (:func:`is_real`; others are fake), and returns the names the real step would not pass on to the
    model's kernels, each with why (``{}``: none). It must not change anything.

    Example:
        >>> spec = TraceInputSpec("none", lambda model, kwargs: {})
        >>> spec.name
        'none'
    """

    name: str
    unused: Callable[[nn.Module, dict], dict]
    # Optional: ``decide(model, kwargs) -> str`` says, from the real batch, whether the trace's fake copy of the model
    # (never the user's) must be run differently to take the real step's path (a note saying why, or ""); ``adjust(
    # fake_model)`` then does it inside the trace.
    decide: Callable[[nn.Module, dict], str] | None = None
    adjust: Callable[[nn.Module], None] | None = None


def is_real(t: Any) -> bool:
    """Whether ``t`` is a tensor with values (not fake, not meta).

    Example:
        >>> is_real(torch.ones(2)), is_real(torch.ones(2, device="meta"))
        (True, False)
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"


def _check_decide(result: Any) -> str | None:
    return None if isinstance(result, str) else f"decide() must return a note (str, '' for none), got {result!r}"


def _validate(result: Any) -> list[TraceInputSpec]:
    if not isinstance(result, (list, tuple)) or not all(isinstance(s, TraceInputSpec) for s in result):
        raise PluginContractError("memwrap_trace_inputs must return a list of "
                                  f"memwrap.memory.tracing.unread_inputs.TraceInputSpec, got {result!r}")
    return list(result)


def _check(result: Any) -> str | None:
    if isinstance(result, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in result.items()):
        return None
    return f"unused() must return a dict of input name -> reason, got {result!r}"


def trace_input_adapters() -> list[TraceInputSpec]:
    """Every registered adapter, guarded (one that fails counts as leaving nothing out, warned once).

    Example:
        >>> [s.name for s in trace_input_adapters()]  # doctest: +SKIP
        ['hf-sdpa-mask']
    """
    rules = {"unused": FieldRule(check=_check, fallback=lambda failure: {}),
             "decide": FieldRule(check=_check_decide, fallback=lambda failure: "")}
    return [guard_fields(spec, r.plugin, spec.name, rules)
            for r in call_hook("memwrap_trace_inputs", validate=_validate,
                               consequence="Its trace-input adapters are unavailable.")
            for spec in r.result]


def adapt_batch(model: nn.Module, batch: Any) -> tuple[Any, list[str], tuple[str, ...]]:
    """``(batch to trace, notes, adjustments)``: a dict ``batch`` whose inputs an adapter says the real step leaves
    out becomes ``Call((), kwargs without them, batch)`` (the targets keep the whole batch, so every tensor stays
    alive and counted as the loop's batch variable holds it); ``adjustments`` names the adapters whose ``adjust``
    the trace applies to its fake copy of the model (:func:`adjust_fake_model`). Anything else comes back unchanged,
    with no notes and no adjustments.

    Example:
        >>> adapt_batch(torch.nn.Linear(2, 2), torch.ones(1, 2))[1:]
        ([], ())
    """
    if not isinstance(batch, dict) or not any(is_real(v) for v in batch.values()):
        return batch, [], ()
    specs = trace_input_adapters()
    unused: dict[str, str] = {}
    for spec in specs:
        for name, why in spec.unused(model, dict(batch)).items():
            if name in batch:
                unused.setdefault(name, f"{why} ({spec.name})")
    adjust, decided = _decisions(specs, model, batch)
    notes = [f"{name} not passed to the traced model: {why}" for name, why in unused.items()] + decided
    if unused:
        batch = Call((), {k: v for k, v in batch.items() if k not in unused}, batch)
    return batch, notes, adjust


def _decisions(specs: list[TraceInputSpec], model: nn.Module, batch: dict) -> tuple[tuple[str, ...], list[str]]:
    """The adapters whose ``decide`` says the fake copy must be adjusted for ``batch``, and their notes."""
    names, notes = [], []
    for spec in specs:
        if spec.decide is not None and spec.adjust is not None:
            note = spec.decide(model, dict(batch))
            if note:
                names.append(spec.name)
                notes.append(f"{note} ({spec.name})")
    return tuple(names), notes


def planned_adjustments(model: nn.Module, make_batch: Callable[[], Any]) -> tuple[str, ...]:
    """The adjustments (:func:`adjust_fake_model`) for a batch the planner makes under the fake mode (``plan()``'s
    ``make_batch(mb)``): the adapters decide on its shapes alone (a mask input without values makes them decide
    nothing). The batch is made under a fake mode of its own: nothing is allocated.

    Example:
        >>> planned_adjustments(torch.nn.Linear(2, 2), lambda: {"x": torch.ones(1, 2)})
        ()
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        batch = make_batch()
    if not isinstance(batch, dict):
        return ()
    return _decisions(trace_input_adapters(), model, batch)[0]


def adjust_fake_model(fake: nn.Module, names: tuple[str, ...] | list[str]) -> None:
    """Apply the ``adjust`` of the adapters ``names`` (from :func:`adapt_batch`) to the trace's fake copy ``fake``.

    Example:
        >>> adjust_fake_model(torch.nn.Linear(2, 2), ())  # nothing named: nothing done
    """
    if not names:
        return
    by_name = {s.name: s for s in trace_input_adapters()}
    for name in names:
        spec = by_name.get(name)
        if spec is None or spec.adjust is None:
            raise RuntimeError(f"the trace-input adapter {name!r} that decided to adjust the fake model is gone. "
                               "Fix: trace again in the same process.")
        spec.adjust(fake)
