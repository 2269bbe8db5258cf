"""``plan()``: search micro-batch x accumulation, precision, checkpointing and optimizer under a
memory budget, and rank the configurations that fit: those that keep the user's optimizer (the same
training maths) first, each group by predicted step time.

Traces are shared: candidates with the same shapes (micro-batch, precision, checkpoint policy,
accumulation on/off) share one trace, and optimizers that cannot run on fake tensors are derived
from it exactly through their plugin's ``state_bytes`` (:func:`memwrap.memory.tracing.estimator.derive`).

Example:
    >>> from memwrap.models import build_preset, preset_batch
    >>> p = plan(build_preset("gpt2-tiny"), lambda mb: preset_batch("gpt2-tiny", mb, 64),
    ...          budget="2GiB", global_batch=8, precisions=("bf16",), checkpoints=(None,))  # doctest: +SKIP
    >>> p.best.options  # doctest: +SKIP
    {'precision': 'bf16', 'accumulate': 1, 'optim': 'adamw'}
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

from memwrap.memory.budget import format_bytes, parse_budget, unit_for
from memwrap.memory.search.cost import DeviceProfile, cost_terms, device_profile
from memwrap.memory.search.step_timing import optimizer_seconds
from memwrap.memory.tracing.estimator import Estimate, derive, finish, resolve_model, trace_config
from memwrap.memory.tracing.unread_inputs import planned_adjustments
from memwrap.memory.tracing.trace import TRACE_ONLY_OPTIONS
from memwrap.memory.tracing import disk_cache
from memwrap.memory.margin import Margin
# How fitting candidates are ordered (memwrap.memory.search.ranking); rank stays importable from here.
from memwrap.memory.search.ranking import _approximates, rank
# The search space (defaults learned from the registries, micro-batch sizes, the candidate grid); its names stay
# importable from here.
from memwrap.memory.search.space import (DEFAULT_CHECKPOINTS, DEFAULT_PRECISIONS, AsBuilt, _checkpoint_spec,
                                         _expand, _smaller_state, _updates_in_backward_refusals, _validate,
                                         default_checkpoints, default_optimizers, plan_values)

from memwrap.plugin.registry import _registry, get_optimizer_spec
from memwrap.plugin.state_size import predict_state_bytes
from memwrap.precision.base import get_precision_class
from memwrap.memory.search.report import plan_table
from memwrap.memory.search.techniques import (default_precisions, expand_techniques, family, prune_by_weights, state_floor,
                                              technique_tags, technique_values, trace_options, traced_as)

__all__ = ["Candidate", "Margin", "Plan", "plan", "rank", "DEFAULT_PRECISIONS", "DEFAULT_CHECKPOINTS",
           "default_optimizers", "default_checkpoints"]


@dataclasses.dataclass
class Candidate:
    """One configuration: its options, estimate, fit and predicted cost."""

    micro_batch: int
    accumulate: int
    precision: str
    checkpoint: Any
    optim: str
    estimate: Estimate
    margin: int
    fits: bool
    seconds: float
    terms: dict[str, float]
    cost: float = 1.0  # seconds relative to the cheapest candidate
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)  # other wrap options traced, e.g. max_grad_norm
    # What this candidate changes in the training maths relative to the user's setup (set by rank()), e.g.
    # ("optimizer adamw -> adafactor",); empty when only memory-neutral settings change (micro-batch x
    # accumulation and checkpointing are exact: the same updates, bit for bit up to summation order).
    changes: tuple[str, ...] = ()

    @property
    def options(self) -> dict[str, Any]:
        """Keyword arguments for ``memwrap.wrap(model, optimizer, **options)``: all the options traced."""
        out: dict[str, Any] = {"precision": self.precision, "accumulate": self.accumulate}
        if self.checkpoint is not None:
            out["checkpoint"] = self.checkpoint
        out.update(self.extra)
        if not isinstance(self.optim, AsBuilt):  # your own optimizer is passed to wrap() as it is: no optim= to convert
            out["optim"] = self.optim
        return out

    @property
    def required(self) -> int:
        """Predicted peak plus the margin: what must fit in the budget."""
        return self.estimate.peak + self.margin

    @property
    def label(self) -> str:
        layout = f"{self.estimate.strategy}x{self.estimate.world_size} " if self.estimate.strategy else ""

        return (f"{layout}{self.micro_batch}x{self.accumulate} {self.precision} {self.checkpoint or 'no-ckpt'} "
                f"{self.optim}{technique_tags(self.extra)}")

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "micro_batch": self.micro_batch, "accumulate": self.accumulate,
                "precision": self.precision, "checkpoint": self.checkpoint, "optim": self.optim,
                "options": self.options, "peak": self.estimate.peak, "margin": self.margin,
                "required": self.required, "fits": self.fits, "seconds": self.seconds, "cost": self.cost,
                "changes": list(self.changes), "cost_terms": self.terms, "estimate": self.estimate.to_dict(),
                "world_size": self.estimate.world_size, "strategy": self.estimate.strategy}


@dataclasses.dataclass
class Plan:
    """Ranked candidates: those that fit (the ones keeping ``keep_optim`` first, then those that change the
    optimizer; each group by predicted step time), then the others by memory needed."""

    candidates: list[Candidate]
    budget: int
    global_batch: int
    margin: Margin
    seconds: float
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (label, why) not traceable
    keep_optim: str | None = None  # the user's optimizer; None: ranked by speed alone
    keep_note: str = ""  # why no candidate keeping keep_optim was traced, when it was searched but left out
    keep_precision: str | None = None  # the user's precision; None: any precision is the user's maths
    # {"read": traces read from the disk cache, "traced": traced now}; empty with the cache off
    trace_cache: dict[str, int] = dataclasses.field(default_factory=dict)
    # Fitting candidates without checkpointing for which the checkpointed ones of the same settings were not traced
    # (the default search; see plan(exhaustive=)): with_budget() refuses a budget under which one no longer fits.
    dominators: list = dataclasses.field(default_factory=list)
    device: DeviceProfile | None = None  # the cost model's device (memwrap.memory.search.cost); None: the A100

    @property
    def unit(self) -> tuple[str, int]:
        """The one memory unit of this plan's report (table, header, verdict): the largest unit in which the
        biggest predicted peak is at least 1, so a small model does not read 0.00 everywhere."""

        return unit_for(max((c.estimate.peak for c in self.candidates), default=0))

    def fmt(self, n: int | float) -> str:
        """``n`` bytes in :attr:`unit`, e.g. ``'405.12 MiB'``."""
        return format_bytes(n, unit=self.unit[0])

    @property
    def best(self) -> Candidate | None:
        """The first-ranked candidate that fits (it keeps ``keep_optim`` whenever any such candidate fits),
        or None."""
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None

    @property
    def fits(self) -> bool:
        return self.best is not None

    @property
    def smallest(self) -> Candidate:
        """The candidate with the smallest predicted peak."""
        return min(self.candidates, key=lambda c: c.required)

    @property
    def verdict(self) -> str:
        """One paragraph: the choice (and whether it changes the training maths), or why nothing fits and what
        dominates the smallest peak."""
        fmt = self.fmt
        if self.best is not None:
            b = self.best
            return (f"best: {b.label}: peak {fmt(b.estimate.peak)} + margin {fmt(b.margin)} "
                    f"= {fmt(b.required)} of {fmt(self.budget)}; predicted "
                    f"{b.seconds:.3g} s/update on {(self.device or device_profile(None)).label} "
                    f"({sum(c.fits for c in self.candidates)} of {len(self.candidates)} candidates fit)."
                    f"{self._maths_note()}")
        low = min(self.candidates, key=lambda c: c.estimate.peak)
        if low.estimate.peak <= self.budget:
            return (f"nothing fits in {fmt(self.budget)} once the margin is added: {low.label} has a peak of "
                    f"{fmt(low.estimate.peak)}, which fits, but the margin ({self.margin.fraction:.0%} of the "
                    f"peak + {fmt(self.margin.fixed)} = {fmt(low.margin)}) brings it to "
                    f"{fmt(low.required)}. The margin is what does not fit: lower it (--margin / "
                    f"--margin-bytes, or plan(margin=...)) if you know the CUDA context and allocator overheads of "
                    f"your setup, or free memory.")
        s = self.smallest
        cat = s.estimate.dominant
        w = s.estimate.state["parameters"]
        if w + self.margin.of(w) > self.budget:  # the weights alone: the advice is about them, whatever dominates
            cat = "parameters"
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.plan import sharded_advice

        advice = sharded_advice(s, cat) or {
            "parameters": "the weights alone are too large: shard them (FSDP) or use a smaller model.",
            "gradients": "gradients are the largest part: shard them (FSDP/ZeRO-2) or freeze part of the model.",
            "optimizer_state": "optimizer state dominates: shard it (ZeRO-1/FSDP) or pick an optimizer with less state.",
            "activations": "activations dominate: shorten the sequence, or lower the micro-batch below the candidates'.",
            "temporaries": "backward temporaries dominate: shorten the sequence or lower the micro-batch.",
        }.get(cat, "")
        if self.keep_precision is not None and all(c.precision == self.keep_precision for c in self.candidates):
            advice += (f" Your precision ({self.keep_precision}) was kept: list others (plan(precisions=('bf16', "
                       f"'bf16-true')), --precisions bf16,bf16-true) or pass keep_precision=None (--keep-precision any) "
                       f"to let the plan change it.")
        top = s.estimate.dominant
        weights = f"; its weights alone take {fmt(w)}" if cat != top else ""
        return (f"nothing fits in {fmt(self.budget)}: the smallest peak is {fmt(s.estimate.peak)} "
                f"(+ margin {fmt(s.margin)} = {fmt(s.required)}) with {s.label}, dominated by "
                f"{top} ({fmt(s.estimate.breakdown[top])}){weights}; {advice}")

    def _maths_note(self) -> str:
        """Says what the best candidate changes in the training maths (optimizer, precision, compensation), and
        when one that changes it would be faster; an unchanged best says what it keeps."""
        b, keep, prec = self.best, self.keep_optim, self.keep_precision
        if keep is None and prec is None:
            return ""
        yours = ", ".join(x for x in (keep and f"optimizer {keep}", prec and f"precision {prec}") if x)
        kept = [c for c in self.candidates if not c.changes]
        if b.changes:
            if kept:
                low = min(kept, key=lambda c: c.required)
                why = f"no candidate keeping your {yours} fits (the smallest, {low.label}, needs {self.fmt(low.required)})"
            elif self.keep_note:
                why = self.keep_note
            else:
                why = f"no candidate keeping your {yours} was among those searched"
            if len(b.changes) == 1 and keep is not None and _approximates(b.optim) == keep:
                return (f" NOTE: this changes the training maths ({'; '.join(b.changes)}): {why}. Its hyperparameters "
                        f"are {keep}'s; the quantized or paged state can still shift convergence slightly.")
            return (f" NOTE: this changes the training maths ({'; '.join(b.changes)}): {why}. Check what it changes "
                    f"(a new optimizer has other hyperparameters; a lower precision other rounding) before a long run.")
        faster = [c for c in self.candidates if c.fits and c.changes and c.seconds < b.seconds]
        if faster:
            f = min(faster, key=lambda c: c.seconds)
            return (f" It keeps your training maths ({yours}); {f.label} would be {b.seconds / f.seconds:.2f}x faster "
                    f"but changes it ({'; '.join(f.changes)}).")
        return f" It keeps your training maths ({yours})."

    @property
    def layouts(self) -> list[dict[str, Any]]:
        """Per (world_size, strategy) planned: whether a candidate fits, and which (see memwrap.memory.sharded.plan)."""
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.plan import layout_summary

        return layout_summary(self)

    @property
    def sharding(self) -> str:
        """Which world sizes and strategies fit, e.g. 'fits on 4 GPUs with FSDP2; not on 4 GPUs with DDP (...)'
        ('' for a single-process plan)."""
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.plan import sharding_verdict

        return sharding_verdict(self)

    def with_budget(self, budget: int | str, margin: Any = None) -> Plan:
        """The same candidates judged against another budget (and margin), without tracing again.

        Example:
            >>> p.with_budget("80GiB").best  # doctest: +SKIP
        """
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.plan import fewest_gpus_first

        margin_ = Margin.parse(margin) if margin is not None else self.margin
        new_budget = parse_budget(budget)
        lost = [d for d in self.dominators if d.estimate.peak + margin_.of(d.estimate.peak) > new_budget]
        if lost:
            raise ValueError(
                f"this plan did not trace the checkpointed variants of {len(self.dominators)} candidate(s) because "
                f"each fit in {format_bytes(self.budget)} and checkpointing can only be slower; under "
                f"{format_bytes(new_budget)} {lost[0].label} no longer fits, so those variants may be the answer. "
                "Fix: plan again with the new budget, or plan once with exhaustive=True (--exhaustive), or with "
                "checkpoints=... listed, and re-judge that plan.")
        cands = [dataclasses.replace(c) for c in self.candidates]
        ranked = fewest_gpus_first(rank(cands, parse_budget(budget), margin_, keep_optim=self.keep_optim,
                                        keep_precision=self.keep_precision))
        return Plan(ranked, new_budget, self.global_batch, margin_, self.seconds, list(self.skipped),
                    self.keep_optim, self.keep_note, self.keep_precision, dominators=list(self.dominators))

    def code(self, model: str = "model", optimizer: str = "optimizer") -> str:
        """The two lines to paste for the best candidate (or the smallest, when nothing fits)."""
        c = self.best or self.smallest
        note = "" if self.best is not None else " (does NOT fit: the smallest peak found)"
        if c.estimate.strategy:  # the launcher and fully_shard/DDP lines too (memwrap.memory.sharded.plan)
            # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
            from memwrap.memory.sharded.plan import sharded_code

            return sharded_code(c, self.global_batch, model, optimizer) + note
        opts = ", ".join(f"{k}={v!r}" for k, v in c.options.items())
        return (f"import memwrap\n{model}, {optimizer} = memwrap.wrap({model}, {optimizer}, {opts})"
                f"  # micro-batch {c.micro_batch}{note}")

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "global_batch": self.global_batch, "seconds": self.seconds,
                "margin": dataclasses.asdict(self.margin), "fits": self.fits, "keep_optim": self.keep_optim,
                "sharding": self.sharding, "layouts": self.layouts,
                "changes_maths": bool(self.best and self.best.changes), "verdict": self.verdict,
                "device": (self.device or device_profile(None)).name,
                "best": self.best.to_dict() if self.best else None, "code": self.code(),
                "skipped": [{"label": lab, "reason": why} for lab, why in self.skipped], "trace_cache": self.trace_cache,
                "candidates": [c.to_dict() for c in self.candidates]}

    def __str__(self) -> str:
        return plan_table(self)


def _over_budget(base: Any, optim: str, module: nn.Module, options: dict, budget: int, margin: Any) -> Any:
    """The group's trace shifted to ``optim``'s state (a lower bound of its peak: its step's temporaries missing)
    when even that exceeds the budget, else None (then the optimizer is traced). Its ``method`` says so.

    Example:
        >>> _over_budget(trace, "adagrad", model, options, 24 * 2**30, Margin())  # doctest: +SKIP
    """
    low = derive(base, optim, module, force=True)
    if low is None:
        return None
    est = finish(low, {**options, "optim": optim}, optim)
    if est.peak + margin.of(est.peak) <= budget:
        return None
    return dataclasses.replace(low, method=low.method + "; not traced: over the budget by its optimizer state alone "
                                                        "(a lower bound: its step's temporaries are not counted)")


def _with_trace_cache(fn: Callable) -> Callable:
    """``plan`` run in one trace-cache session (the model described once for every key), its result saying how many
    traces were read from the disk cache and how many were traced (:mod:`memwrap.memory.tracing.disk_cache`)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Plan:
        before = disk_cache.stats()
        with disk_cache.session():
            result = fn(*args, **kwargs)
        after = disk_cache.stats()
        if disk_cache.enabled():
            result.trace_cache = {"read": after["hits"] - before["hits"],
                                  "traced": sum(after[k] - before[k] for k in ("misses", "uncacheable"))}
        return result

    return run


@_with_trace_cache
def plan(model: nn.Module | Callable[[], nn.Module], make_batch: Callable[[int], Any], *, budget: int | str,
         global_batch: int, candidates: list[dict] | None = None, loss_fn: Callable | None = None,
         precisions: Iterable[str] | None = None, checkpoints: Iterable[Any] | None = None,
         optimizers: Iterable[str] | None = None, micro_batches: Iterable[int] | None = None,
         margin: Any = None, max_grad_norm: float | None = None, keep_optim: Any = "adamw",
         keep_precision: str | None = "fp32",
         progress: Callable[[int, int, str], Any] | None = None, world_size: Any = 1, strategy: Any = None,
         step_in_backward: Iterable[bool] | None = None, chunked_loss: Iterable[Any] | None = None,
         keep_outputs: bool = True, device: Any = None, exhaustive: bool | None = None,
         _cache: dict | None = None) -> Plan:
    """Find the fastest configuration whose predicted peak (plus margin) fits in ``budget``.

    ``make_batch(micro_batch_size)`` returns one micro-batch (see :func:`memwrap.estimate` for the
    batch conventions); ``global_batch`` is kept fixed: each micro-batch size ``m`` runs with
    ``accumulate = global_batch // m``. Without ``candidates`` (a list of dicts with keys
    ``micro_batch``, ``precision``, ``checkpoint``, ``optim``) the search is the product of the
    micro-batch sizes (powers of two dividing ``global_batch``, and ``global_batch``),
    ``precisions``, ``checkpoints`` (default: :func:`default_checkpoints`, plugin policies included) and
    ``optimizers`` (default: :func:`default_optimizers`, every installed registry optimizer).
    ``keep_optim`` is the optimizer you train with (default ``"adamw"``; a registry name, or your optimizer itself,
    planned as built: its class, param groups and hyperparameters, e.g. ``SGD(momentum=0.9)``'s momentum buffers,
    which the registry's ``"sgd"`` does not hold; ``model`` must then be the module it optimizes): fitting
    candidates that keep it
    rank before those that change the optimizer (the training maths), whatever their speed, and the
    verdict says when the best one changes it; None ranks every fitting candidate by speed alone. With the
    default ``optimizers`` and a ``keep_optim``, the search is staged: ``keep_optim`` alone first, and only
    when nothing keeping it fits, the installed optimizers with less (or paged) state per parameter.
    ``margin`` is kept free beyond each predicted peak (see :class:`Margin`): None for the default
    (8% of the peak + 1 GiB), a fraction such as 0.1 (the 1 GiB fixed part is kept), a
    ``(fraction, size)`` pair such as ``(0.1, "512MiB")`` or ``(0, 0)``, or a :class:`Margin`.
    ``progress(done, total, label)`` is called as traces finish.
    ``keep_precision`` is the precision you train with (default ``"fp32"``): it is kept unless you let it change,
    by listing the precisions to search (``precisions=('bf16', 'bf16-true', 'fp32')``) or with
    ``keep_precision=None`` (every registered precision plugin, ranked by speed alone); a candidate with another
    precision names the change in ``changes`` and the verdict and ranks after those keeping yours, as an optimizer
    change does. ``step_in_backward``
    and ``chunked_loss`` (lists of values, default: both where they apply) and paged optimizer state are plan
    dimensions too (see :mod:`memwrap.memory.search.techniques`).
    ``exhaustive`` (default: True when you list ``checkpoints``, else False): with False, a checkpointed candidate
    is not traced when the same settings without checkpointing (micro-batch, precision, optimizer without paged
    state, techniques) fit: checkpointing only adds recompute (and offloading, transfers) to that step, so it cannot
    rank before it; the skipped rows say so, and :meth:`Plan.with_budget` refuses a budget under which such a
    candidate no longer fits. True traces every candidate.
    ``keep_outputs`` is your loop's shape (see :func:`memwrap.estimate`): True (default) when it holds the model's
    outputs through backward, False when it drops them once the loss is computed (Trainer).
    ``device`` is the device the cost model ranks for (:func:`memwrap.memory.search.cost.device_profile`): None or
    ``"cuda"`` for the A100 reference GPU (default), ``"cpu"`` for this CPU (its matmul rates, per-op overhead and
    memory bandwidth measured once per process), or a :class:`~memwrap.memory.search.cost.DeviceProfile`.
    ``world_size`` (an int or a list) and ``strategy`` (``"fsdp2"``, ``"ddp"``, a list, or None for both
    when ``world_size > 1``) make sharding a plan dimension: ``budget`` is per GPU, each rank runs
    ``micro_batch x accumulate`` of the fixed ``global_batch`` (so ``global_batch`` must be divisible by
    ``world_size``), and :attr:`Plan.sharding` says which layouts fit (see :mod:`memwrap.memory.sharded.plan`).

    Example:
        >>> p = plan(lambda: MyNet(), lambda mb: torch.randn(mb, 3, 224, 224), budget="24GiB",
        ...          global_batch=64)  # doctest: +SKIP
        >>> print(p.code())  # doctest: +SKIP
    """
    start = time.perf_counter()
    budget_bytes = parse_budget(budget)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch must be an int >= 1 (samples per optimizer update), got {global_batch!r}.")
    if not callable(make_batch):
        raise TypeError("make_batch must be a callable taking the micro-batch size and returning one micro-batch, "
                        "e.g. lambda mb: preset_batch('gpt2', mb, 1024).")
    margin_ = Margin.parse(margin)
    profile = device_profile(device)  # an unknown device: its message, before any tracing
    keep = _keep_optim(keep_optim, model)
    if keep_precision is not None:
        if not isinstance(keep_precision, str):
            raise TypeError(f"plan(keep_precision={keep_precision!r}) must be a precision name such as 'fp32', or "
                            "None (any precision).")
        keep_precision = get_precision_class(keep_precision).name  # an unknown name: wrap()'s own message
    step_in_backward = plan_values("step_in_backward", step_in_backward, single=(bool,), element=(bool,),
                                   example=", e.g. step_in_backward=False or (False, True)")
    chunked_loss = plan_values("chunked_loss", chunked_loss, single=(bool, int), element=(bool, int),
                               example=", e.g. chunked_loss=False, (False, True) or a chunk size such as 1024")
    precisions = plan_values("precisions", precisions, element=(str,), example=", e.g. precisions=('bf16', 'fp32')")
    optimizers = plan_values("optimizers", optimizers, element=(str,), example=", e.g. optimizers=('adamw',)")
    checkpoints = plan_values("checkpoints", checkpoints, example=", e.g. checkpoints=(None, 'full')")
    if exhaustive is not None and not isinstance(exhaustive, bool):
        raise TypeError(f"plan(exhaustive={exhaustive!r}) must be True (trace every candidate), False (leave out the "
                        "checkpointed candidates a fitting one without checkpointing outruns) or None (True when "
                        "checkpoints= is listed).")
    if exhaustive is None:
        exhaustive = checkpoints is not None
    micro_batches = plan_values("micro_batches", micro_batches, single=(int,), element=(int,),
                                example=", e.g. micro_batches=(8, 4)")
    for what, fn in (("loss_fn", loss_fn), ("progress", progress)):
        if fn is not None and not callable(fn):
            raise TypeError(f"plan({what}={fn!r}) must be a callable or None.")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float))):
        raise TypeError(f"plan(max_grad_norm={max_grad_norm!r}) must be a number (the clipping norm) or None.")
    if not isinstance(keep_outputs, bool):
        raise TypeError(f"plan(keep_outputs={keep_outputs!r}) must be True (the loop holds the model's outputs through "
                        "backward: outputs = model(**batch); outputs.loss.backward()) or False (loss = "
                        "model(**batch).loss, Trainer's compute_loss).")
    # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
    from memwrap.memory.sharded.plan import layouts, plan_layouts, refused_specs

    shardings = layouts(world_size, strategy, global_batch, micro_batches)
    if len(shardings) > 1:
        merged = plan_layouts(plan, shardings, model, make_batch, budget=budget, global_batch=global_batch,
                              candidates=candidates, loss_fn=loss_fn, precisions=precisions, checkpoints=checkpoints,
                              optimizers=optimizers, micro_batches=micro_batches, margin=margin,
                              max_grad_norm=max_grad_norm, keep_optim=keep_optim, keep_precision=keep_precision,
                              progress=progress, step_in_backward=step_in_backward, chunked_loss=chunked_loss,
                              keep_outputs=keep_outputs, device=profile, exhaustive=exhaustive)
        merged.device = profile
        return merged
    # Traces and state floors shared by the stages of one search (same model, batch and layout).
    cache = _cache if _cache is not None else {"traces": {}, "floors": {}}
    if optimizers is None and candidates is None and keep is not None:
        # Candidates keeping the user's optimizer rank first whenever one fits, so the other optimizers can only
        # matter when none does: search them only then (38 installed optimizers would multiply the traces).
        kept = plan(model, make_batch, budget=budget, global_batch=global_batch, loss_fn=loss_fn, precisions=precisions,
                    checkpoints=checkpoints, optimizers=(keep,), micro_batches=micro_batches, margin=margin,
                    max_grad_norm=max_grad_norm, keep_optim=keep, keep_precision=keep_precision, progress=_stage(progress, f"stage 1 ({keep} only)"),
                    world_size=world_size,
                    strategy=strategy, step_in_backward=step_in_backward, chunked_loss=chunked_loss,
                    keep_outputs=keep_outputs, device=profile, exhaustive=exhaustive, _cache=cache)
        if kept.best is not None and kept.best.fits and not kept.best.changes:
            kept.skipped.append(("(search space)", f"other optimizers not searched: a configuration keeping {keep} "
                                                   "fits (pass optimizers=... / --optimizers to compare others)"))
            kept.seconds = time.perf_counter() - start
            return kept
        weights = _weights_never_fit(kept)
        if weights:  # no optimizer changes the weights: the second stage could not fit either
            kept.skipped.append(("(search space)", f"other optimizers not searched: {weights}"))
            kept.seconds = time.perf_counter() - start
            return kept
        optimizers = _smaller_state(keep)
        # The counter restarts for this second search: the label says so (and why it runs).
        progress = _stage(progress, f"stage 2 (nothing keeping {keep} fits: optimizers with less state)")
    (ranks, strategy_), = shardings
    per_rank = global_batch // ranks  # the global batch is fixed: micro-batch x accumulate x world_size
    module = resolve_model(model)

    if precisions is None:  # your precision is kept unless you list others (or keep_precision=None: any)
        precisions = (keep_precision,) if keep_precision is not None else default_precisions()
    specs = _expand(per_rank, candidates, micro_batches, tuple(precisions),
                    tuple(checkpoints) if checkpoints is not None else default_checkpoints(),
                    tuple(optimizers) if optimizers is not None else default_optimizers())
    if not specs:
        raise ValueError("no candidate to evaluate: precisions, checkpoints and optimizers must not be empty.")
    for s in specs:
        s["optim"] = get_optimizer_spec(s["optim"]).name
        if keep is not None and s["optim"] == keep:
            s["optim"] = keep  # your optimizer as you built it (AsBuilt), not the registry's defaults
        s["checkpoint"] = _checkpoint_spec(s["checkpoint"])
    sibs, chunks, notes = technique_values(module, make_batch, min(s["micro_batch"] for s in specs), step_in_backward,
                                           chunked_loss, ranks)
    specs, not_planned = expand_techniques(specs, sibs, chunks, max_grad_norm=max_grad_norm, ranks=ranks)
    _validate(specs, max_grad_norm)
    specs, refused = refused_specs(specs, ranks, strategy_)  # 8-bit / Adafactor on FSDP2 shards: skipped, with why
    specs, in_backward = _updates_in_backward_refusals(specs, per_rank, max_grad_norm, ranks)  # wrap() refuses them
    refused = list(refused) + in_backward
    refused = list(refused) + not_planned  # notes (a dimension that does not apply) are not candidates left out

    # One trace per group of candidates with the same memory: precisions whose plugin declares the memory of another
    # (tf32 = fp32, fp16 = bf16) share its trace (memwrap.memory.search.techniques.traced_as).
    groups: dict[tuple, list[dict]] = {}
    for s in specs:
        # An optimizer that updates inside backward (LOMO) is traced as a stand-in stepping there (in_backward_options).
        in_backward = s["step_in_backward"] or get_optimizer_spec(s["optim"]).updates_in_backward
        key = (s["micro_batch"], traced_as(s["precision"]), repr(s["checkpoint"]), in_backward,
               repr(s["chunked_loss"]), s["compensation"])
        groups.setdefault(key, []).append(s)
    traces: dict[tuple, Any] = cache["traces"]
    state_sizes: dict[str, float] = cache.setdefault("state_sizes", {})
    adjusted: dict[int, tuple[str, ...]] = {}  # micro-batch -> the fake copy's adjustments (decided once each)
    skipped: list[tuple[str, str]] = list(refused)
    groups, pruned = prune_by_weights(groups, module, budget_bytes, margin_, ranks)  # memwrap.memory.search.techniques
    skipped += pruned
    done, total = 0, len(groups)
    results: list[Candidate] = []
    # Smallest micro-batch first: the first traced group of a family gives the state floor (weights, gradients,
    # optimizer state) that every other group of the family must exceed; over the budget, they are not traced.
    floors: dict[tuple, dict[str, tuple[int, str]]] = cache["floors"]
    # Within a micro-batch, the groups without checkpointing first: a fitting one outruns its checkpointed variants.
    dominators: dict[tuple, Candidate] = {}
    used: dict[int, Candidate] = {}  # the dominators some candidate was left out for (with_budget() checks them)
    for key, members in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2] != "None")):
        fam, mb = family(key, per_rank), key[0]
        known = floors.setdefault(fam, {})
        over = [m for m in members if m["optim"] in known and
                known[m["optim"]][0] + margin_.of(known[m["optim"]][0]) > budget_bytes]
        skipped += [(f"{m['micro_batch']}x{per_rank // mb} {m['precision']} {m['checkpoint'] or 'no-ckpt'} {m['optim']}",
                     f"not traced: the weights, gradients and optimizer state alone ({format_bytes(known[m['optim']][0])}"
                     f", traced with {known[m['optim']][1]}; the same whatever the micro-batch and checkpoint policy) "
                     f"+ margin exceed the budget") for m in over]
        members = [m for m in members if m not in over]
        if not exhaustive and members and members[0]["checkpoint"] is not None:
            slower = [(m, dominators[_settings(m)]) for m in members if _settings(m) in dominators]
            skipped += [(f"{m['micro_batch']}x{per_rank // mb} {m['precision']} {m['checkpoint']} {m['optim']}",
                         f"not traced: it cannot outrun {d.label}, which fits (the same step with checkpointing only "
                         f"adds recompute and transfers; plan(exhaustive=True) / --exhaustive traces it)")
                        for m, d in slower]
            used.update((id(d), d) for _, d in slower)
            members = [m for m in members if _settings(m) not in dominators]
        if not members:
            done += 1
            continue
        first = members[0]
        options = {"precision": key[1], "accumulate": per_rank // mb}
        if first["checkpoint"] is not None:
            options["checkpoint"] = first["checkpoint"]
        if max_grad_norm is not None:
            options["max_grad_norm"] = max_grad_norm
        options.update(trace_options(first))
        if key[3]:
            options["step_in_backward"] = True
        options["keep_outputs"] = keep_outputs  # the loop's shape (not a wrap() option; finish() sets it apart)
        if mb not in adjusted:  # the trace's fake copy runs as the real step would (memory.tracing.unread_inputs)
            adjusted[mb] = planned_adjustments(module, lambda mb_=mb: make_batch(mb_))
        if adjusted[mb]:
            options["fake_adjust"] = adjusted[mb]
        # The user's optimizer (a built-in, usually) is traced first: a plugin's failure then only skips its own rows.
        # Then the one with the least state: the others are bounded from its trace (one whose bound exceeds the budget
        # is not traced), and the least state is the likeliest to fit, so its trace is a candidate's, not only a bound.
        fake_runnable = sorted((m["optim"] for m in members if get_optimizer_spec(m["optim"]).runs_on_fake),
                               key=lambda o: (o != keep, _state_size(state_sizes, o, module)))
        reference = fake_runnable[0] if fake_runnable else None
        batch_fn = (lambda mb_=mb: make_batch(mb_))
        if progress is not None:
            progress(done, total, _tracing_label(mb, key[1], first, [m["optim"] for m in members], ranks, strategy_))
        try:
            base = traces.get((key, reference))
            if base is None:
                # The same group traced for another optimizer (the first stage's adamw, say): its forward and backward
                # are this group's, so each member is derived or bounded from it and traced only if it may fit.
                base = _same_group(traces, key)
            if base is None:
                try:
                    base = trace_config(module, batch_fn, loss_fn, options, reference, world_size=ranks,
                                        strategy=strategy_)
                except ValueError:
                    raise
                except Exception:  # noqa: BLE001 - the reference optimizer's plugin failed, not the configuration
                    if reference is None:
                        raise
                    # e.g. schedulefree refuses the steady-state priming step (its optimizers start in eval mode):
                    # trace the group with the stateless stand-in; each optimizer is then traced (and may fail,
                    # skipping only its own rows) below.
                    reference = None
                    base = traces.get((key, None)) or trace_config(module, batch_fn, loss_fn, options, None,
                                                                   world_size=ranks, strategy=strategy_)
        except ValueError as exc:
            if first["checkpoint"] is None:
                raise
            # The options are valid (checked above), so this is about the model: e.g. checkpoint="full" on a
            # model without repeated blocks. Skip the policy, keep planning.
            skipped += [(f"{m['micro_batch']}x{options['accumulate']} {m['precision']} {m['checkpoint']} {m['optim']}",
                         str(exc)) for m in members]
            done += 1
            continue
        traces.setdefault((key, base.optimizer), base)  # a reused base is stored under its own optimizer already
        for m in members:
            try:
                tr = derive(base, m["optim"], module)
                if tr is None:
                    tr = traces.get((key, m["optim"]))
                    low = None if tr is not None else _over_budget(base, m["optim"], module, options, budget_bytes, margin_)
                    if low is not None:  # cannot fit whatever its step needs: not traced (memwrap.memory.search.techniques)
                        tr = low
                    elif tr is None:
                        tr = trace_config(module, batch_fn, loss_fn, options, m["optim"], world_size=ranks,
                                          strategy=strategy_)
                        traces[(key, m["optim"])] = tr
                est = finish(tr, _wrap_options(m, {**options, "precision": m["precision"], "optim": m["optim"]}),
                             m["optim"])
                if m["precision"] != key[1]:
                    est.method += f"; memory traced as {key[1]} (the {m['precision']} plugin's memory_like)"
                known.setdefault(m["optim"], (state_floor(est), f"{mb}x{per_rank // mb} {m['precision']} "
                                                                f"{m['checkpoint'] or 'no-ckpt'}"))
            except Exception as exc:  # noqa: BLE001 - one optimizer plugin's failure must not end the plan
                skipped.append((f"{m['micro_batch']}x{options['accumulate']} {m['precision']} "
                                f"{m['checkpoint'] or 'no-ckpt'} {m['optim']}",
                                f"optimizer {m['optim']!r} ({_origin(m['optim'])}) failed: {type(exc).__name__}: "
                                f"{exc}"))
                continue
            results.append(_candidate(m, options, est, margin_, budget_bytes, profile, module, ranks))
            c = results[-1]
            # Paged state spills less under a smaller peak (its cost term falls with checkpointing): no bound there.
            if m["checkpoint"] is None and c.fits and not est.paged_state and not est.offloaded:
                dominators.setdefault(_settings(m), c)
        done += 1
        if progress is not None:
            progress(done, total, f"traced {done}/{total}")
    if not results:
        raise ValueError(f"no candidate could be traced: {skipped[0][1] if skipped else 'empty grid'}")
    return Plan(rank(results, budget_bytes, margin_, keep_optim=keep, keep_precision=keep_precision), budget_bytes,
                global_batch, margin_, time.perf_counter() - start, skipped, keep,
                _keep_note(keep, specs, results, floors), keep_precision, device=profile,
                dominators=list(used.values()))


def _state_size(sizes: dict[str, float], optim: str, module: nn.Module) -> float:
    """``optim``'s state bytes for ``module`` (its plugin's prediction, memoized in ``sizes``), infinite when the plugin
    cannot predict it: an order for choosing which optimizer of a group to trace first, nothing more."""
    if optim not in sizes:
        try:
            sizes[optim] = predict_state_bytes(optim, module)
        except Exception:  # noqa: BLE001 - a plugin that cannot predict is traced last, and reports its own error there
            sizes[optim] = float("inf")
    return sizes[optim]


def _same_group(traces: dict[tuple, Any], key: tuple) -> Any:
    """A trace of the group ``key`` made for any optimizer, or None: what a later search stage derives its members
    from (exactly, or as the lower bound that skips tracing one that cannot fit) before tracing any."""
    return next((tr for (k, _), tr in traces.items() if k == key), None)


def _wrap_options(spec: dict, options: dict) -> dict:
    """``options`` as wrap() takes them for ``spec``: without the ``step_in_backward=True`` an optimizer that updates
    inside backward was traced with (memwrap.memory.tracing.estimator.in_backward_options; wrap() refuses it)."""
    if not spec.get("step_in_backward") and options.get("step_in_backward"):
        return {k: v for k, v in options.items() if k != "step_in_backward"}
    return options


def _settings(spec: dict) -> tuple:
    """A candidate's settings but its checkpoint policy: what a candidate without checkpointing shares with the
    checkpointed variants it outruns."""
    return (spec["micro_batch"], spec["precision"], str(spec["optim"]), spec.get("step_in_backward"),
            repr(spec.get("chunked_loss")), spec.get("compensation"))


def _weights_never_fit(p: Plan) -> str:
    """Why no optimizer can make ``p`` fit, or '': every candidate's weights alone (this rank's, in its precision)
    plus their margin exceed the budget, and an optimizer changes neither."""
    if not p.candidates or any(c.fits for c in p.candidates):
        return ""
    low = min(p.candidates, key=lambda c: c.estimate.state["parameters"])
    w = low.estimate.state["parameters"]
    if w + p.margin.of(w) <= p.budget:
        return ""
    return (f"the weights alone take at least {format_bytes(w)} per GPU ({low.precision}; + margin "
            f"{format_bytes(p.margin.of(w))}) > budget {format_bytes(p.budget)} in every precision searched, and no "
            "optimizer changes them")


def _stage(progress: Callable[[int, int, str], Any] | None, stage: str) -> Callable[[int, int, str], Any] | None:
    """``progress`` with each label prefixed by the search stage it belongs to (each stage counts from 0)."""
    if progress is None:
        return None
    return lambda done, total, label: progress(done, total, f"{stage}: {label}")


def _tracing_label(mb: int, precision: str, spec: dict, optims: list[str], ranks: int, strategy: str | None) -> str:
    """What one trace differs in: layout, micro-batch, precision, checkpointing, techniques, its optimizers."""
    words = [f"micro-batch {mb}", precision, f"checkpoint {spec['checkpoint']}" if spec["checkpoint"] else
             "no checkpointing"]
    words += [w for w, on in (("step in backward", spec.get("step_in_backward")),
                              ("chunked loss", spec.get("chunked_loss")),
                              ("uncompensated", spec.get("compensation") == "none")) if on]
    names = ", ".join(str(o) for o in optims[:3]) + (f" and {len(optims) - 3} more" if len(optims) > 3 else "")
    layout = f"{strategy} x{ranks}, " if strategy else ""
    return f"tracing {layout}{', '.join(words)} ({names})"


def _keep_optim(keep_optim: Any, model: Any) -> str | None:
    """The optimizer the plan keeps: None, a registry name (an alias names the same maths), or your optimizer itself,
    planned as built (:class:`memwrap.memory.search.space.AsBuilt`: class, param groups, hyperparameters)."""

    if keep_optim is None or isinstance(keep_optim, AsBuilt):
        return keep_optim
    if isinstance(keep_optim, str):
        return get_optimizer_spec(keep_optim).name
    if not isinstance(model, nn.Module):
        raise TypeError("keep_optim=<your optimizer> needs model= to be the module it optimizes (its parameters are "
                        "matched by name), not a factory. Fix: pass the module, or keep_optim='<registry name>'.")
    return AsBuilt(keep_optim, model)


def _keep_note(keep: str | None, specs: list[dict], results: list[Candidate], floors: dict) -> str:
    """Why no candidate keeping ``keep`` is in the plan although it was searched: its state floor was over the
    budget in every family (see :func:`memwrap.memory.search.techniques.state_floor`), or '' when that is not the case."""
    if keep is None or any(c.optim == keep for c in results) or not any(s["optim"] == keep for s in specs):
        return ""
    low = [known[keep] for known in floors.values() if keep in known]
    if not low:
        return ""
    floor, where = min(low)
    return (f"every candidate with {keep} was left out: its weights, gradients and optimizer state alone take at least "
            f"{format_bytes(floor)} per GPU ({where}) before activations and the margin")


def _origin(optim: str) -> str:
    """Which plugin registered ``optim``, for messages."""

    try:
        return next(origin for spec, origin in _registry().entries if spec.name == optim)
    except Exception:  # noqa: BLE001 - only for a message
        return "plugin unknown"


def _candidate(spec: dict, options: dict, est: Estimate, margin: Margin, budget: int,
               profile: DeviceProfile | None = None, module: nn.Module | None = None, ranks: int = 1) -> Candidate:
    terms = cost_terms(flops=est.flops, ops=est.ops_per_micro_batch, micro_batches=options["accumulate"],
                       precision=spec["precision"], param_bytes=est.state["parameters"],
                       grad_bytes=est.state["gradients"], state_bytes=est.state["optimizer_state"],
                       offloaded=est.offloaded,
                       # paged state spills what the budget leaves free beyond peak + margin (memwrap.memory.search.cost)
                       paged_spill=max(0, est.paged_state - max(0, budget - est.peak - margin.of(est.peak))),
                       host_state=est.host_state, device=profile, flop_classes=est.flop_classes,
                       op_stats=est.op_stats)
    if profile is not None and profile.time_steps and module is not None:
        # The step timed on this machine (memwrap.memory.search.step_timing); the bandwidth form where it cannot run.
        timed = optimizer_seconds(_wrap_options(spec, {**options, "precision": spec["precision"],
                                                       "optim": spec["optim"]}),
                                  module, ranks, sharded=est.strategy == "fsdp2")
        if timed is not None:
            terms["optimizer"] = timed
    extra = margin.of(est.peak)
    others = {k: v for k, v in _wrap_options(spec, options).items()
              if k not in ("precision", "accumulate", "checkpoint", "optim", *TRACE_ONLY_OPTIONS)}
    return Candidate(spec["micro_batch"], options["accumulate"], spec["precision"], spec["checkpoint"],
                     spec["optim"], est, extra, est.peak + extra <= budget, sum(terms.values()), terms,
                     extra=others)
