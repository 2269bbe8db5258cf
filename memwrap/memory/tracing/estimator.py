"""``estimate()``: the memory of one training step under memwrap options, measured on fake tensors.

Big models are not traced whole. A model whose bulk is a stack of ``L`` identical blocks is
traced with the stack truncated to ``a`` and ``b = a + p`` blocks, and every segment maximum is
extrapolated linearly to ``L`` blocks, per category (FLOPs and ops too). ``p`` is the period of
the checkpointed pattern along the stack (1 without checkpointing or when every block is treated
alike, ``k`` for ``every-k``), ``a`` the smallest depth >= ``max(1 or 2, p)`` with
``(L - a) % p == 0`` (see :mod:`memwrap.memory.tracing.depth`). The two traces run at once where a second core
allows (:mod:`memwrap.memory.tracing.parallel`). With ``extrapolate="auto"`` a stack so short that they cost no
less than one trace of all ``L`` blocks (``b >= L`` traced at once, ``a + b >= L`` one after the other) is traced
whole instead.

This is exact, not a fit, under one condition: the model at each depth ``a + m*p`` is the full
model's checkpointing pattern cut there (the checkpointed blocks repeat with period ``p``, the
same modules outside the stack are checkpointed, and ``L - a`` is a multiple of ``p``). Then
inside a segment the memory at block ``j`` of ``L`` is ``a + b*j + c*L`` and its maximum sits at the
first or the last block for every ``L`` (the sign of ``b`` does not depend on ``L``), so each
segment maximum is affine in ``L``; the step's peak is the largest of the extrapolated segment
maxima. The condition is checked on the model itself (the policy's selection with the stack cut,
nothing traced); when it fails (e.g. a policy checkpointing "the first 3 blocks") the model is
traced whole. ``tests/test_estimate.py`` checks extrapolations against full traces.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memwrap.memory.budget import format_bytes
from memwrap.memory.tracing.depth import extrapolation_depths
from memwrap.memory.tracing.trace import TRACE_ONLY_OPTIONS, Segment, Stack, TraceResult, find_stack, run_trace
from memwrap.memory.tracing import parallel
from memwrap.memory.tracing.disk_cache import cached
from memwrap.memory.tracing.flop_classes import merge
from memwrap.memory.tracing.unread_inputs import adapt_batch
from memwrap.memory.tracing.workspace import (Workspace, check_option as check_workspace_option,
                                              enabled as workspace_enabled)
from memwrap.config.options import parse_options
from memwrap.plugin.registry import create_optimizer, get_optimizer_spec, optimizer_on
from memwrap.plugin.state_size import predict_state_bytes
from memwrap.precision.base import get_precision

__all__ = ["Estimate", "estimate", "Trace", "trace_config", "derive", "resolve_model", "resolve_batch",
           "in_backward_options"]

PHASES = ("forward", "backward", "optimizer")
# FSDP2 prefetches the next block's all-gather in forward and backward, except at the ends of the stack:
# its traces must hold interior blocks (>= 3, and >= 2 periods of the checkpoint pattern) for the per-block memory to
# repeat; exact against full traces in tests/test_sharded_plan.py. Traces of 2 and 3 blocks without checkpointing
# (tried, and exact on a narrow model) over-predicted the 384-wide GPT of benchmarks/distributed_planner.py by 19.7 MB
# (+8.9%): with 2 blocks the backward peak of the last block also holds the first block's edge.
FSDP2_MIN_DEPTH = 3
_TRACE_PREFIX = "WrappedModule.module."


# ----------------------------------------------------------------------------- inputs

def resolve_model(model: nn.Module | Callable[[], nn.Module]) -> nn.Module:
    """A module to trace: ``model`` itself, or ``model()`` built on the meta device (nothing allocated).

    Example:
        >>> resolve_model(lambda: torch.nn.Linear(2, 2)).weight.device.type
        'meta'
    """
    if isinstance(model, nn.Module):
        return model
    if not callable(model):
        raise TypeError(f"model must be an nn.Module or a zero-argument factory returning one, got "
                        f"{type(model).__name__}.")
    with torch.device("meta"):
        built = model()
    if not isinstance(built, nn.Module):
        raise TypeError(f"the model factory returned a {type(built).__name__}, not an nn.Module.")
    return built


def resolve_batch(batch: Any) -> Callable[[], Any]:
    """A zero-argument callable producing the micro-batch (called under the fake mode)."""
    if callable(batch) and not isinstance(batch, (torch.Tensor, nn.Module)):
        return batch
    return lambda: batch


# ----------------------------------------------------------------------------- traces

@dataclasses.dataclass
class Trace:
    """Segment maxima of a step at the model's full depth (traced whole or extrapolated).

    ``optimizer`` names the optimizer whose state and step are in the segments (None: a stateless
    stand-in, to which :func:`derive` adds a plugin's ``state_bytes``).
    """

    segments: dict[tuple, Segment]
    state: dict[str, int]
    flops: int
    ops: int
    top_modules: list[tuple[str, int]]
    micro_batches: int
    optimizer: str | None
    method: str
    seconds: float
    world_size: int = 1
    strategy: str | None = None
    stack: str | None = None  # the repeated block stack (FSDP2 shards each of its blocks)
    param_dtype: torch.dtype | None = None  # the precision's storage dtype (bf16-true: bf16), None: the model's
    workspace: dict[str, dict] = dataclasses.field(default_factory=dict)  # measured kernel workspaces (TraceResult's)
    flop_classes: dict[str, int] = dataclasses.field(default_factory=dict)  # per micro-batch (TraceResult's)
    op_stats: dict[str, int] = dataclasses.field(default_factory=dict)  # per micro-batch (TraceResult's)


def _optimizer_factory(name: str | None):
    if name is None:
        return None
    if callable(getattr(name, "build", None)):  # the user's own optimizer as built (memwrap.memory.search.space.AsBuilt)
        return name.build

    return lambda fm: create_optimizer(name, fm.parameters(), model=fm)


def _lin(va: int, vb: int, a: int, b: int, n: int) -> int:
    # extrapolation_depths makes (n - a) a multiple of (b - a): integer arithmetic, no rounding.
    assert (n - a) % (b - a) == 0, (a, b, n)
    return va + (vb - va) * ((n - a) // (b - a))


def _rename(name: str, stack: Stack | None, traced: int | None, target: int | None) -> str:
    name = name[len(_TRACE_PREFIX):] if name.startswith(_TRACE_PREFIX) else name
    if stack is None or traced is None or target is None or traced == target:
        return name
    pattern = re.compile(rf"^({re.escape(stack.name)})\.(\d+)")

    def sub(m):
        i = int(m.group(2))
        return f"{m.group(1)}.{target - traced + i if i > 0 else 0}"

    return pattern.sub(sub, name)


def _collapse(rows: list[tuple[str, int]], stack: Stack | None, limit: int = 8) -> list[tuple[str, int]]:
    """Modules by forward activation bytes; the stack's blocks appear once, as ``name.*``."""
    if stack is None:
        return rows[:limit]
    pattern = re.compile(rf"^{re.escape(stack.name)}\.\d+")
    out: dict[str, int] = {}
    for name, value in rows:
        key = pattern.sub(f"{stack.name}.*", name)
        out[key] = max(out.get(key, 0), value)
    return sorted(out.items(), key=lambda kv: -kv[1])[:limit]


def _extrapolate(ta: TraceResult, tb: TraceResult, a: int, b: int, n: int, stack: Stack) -> tuple:
    segments = {}
    for key in tb.segments.keys() | ta.segments.keys():
        sa, sb = ta.segments.get(key), tb.segments.get(key)
        if sa is None or sb is None:  # a segment seen at one depth only: keep the deeper one's value
            segments[key] = sb or sa
            continue
        cats = {c: _lin(sa.bytes[c], sb.bytes[c], a, b, n) for c in sb.bytes}
        segments[key] = Segment(sum(cats.values()), cats, _lin(sa.host, sb.host, a, b, n),
                                _rename(sb.where, stack, b, n))
    state = {k: _lin(ta.state_bytes[k], tb.state_bytes[k], a, b, n) for k in tb.state_bytes}
    flops = _lin(ta.flops, tb.flops, a, b, n)
    ops = _lin(ta.ops, tb.ops, a, b, n)
    # Each class is affine in the depth as the total is (a class met at one depth only is 0 at the other).
    classes = merge(ta.flop_classes, tb.flop_classes, lambda va, vb: max(0, _lin(va, vb, a, b, n)))
    stats = merge(ta.op_stats, tb.op_stats, lambda va, vb: max(0, _lin(va, vb, a, b, n)))
    return segments, state, flops, ops, classes, stats


def trace_config(model: nn.Module, make_batch: Callable[[], Any], loss_fn: Callable | None,
                 options: dict[str, Any], optimizer: str | None, *, extrapolate: bool | str = "auto",
                 stack: Stack | None | str = "auto", world_size: int = 1, strategy: str | None = None,
                 cache: bool | None = None) -> Trace:
    """Trace (or trace truncated copies and extrapolate) one configuration; see the module docstring.

    With ``strategy="fsdp2"`` the step traced is rank 0's of ``world_size`` FSDP2 ranks; with
    ``"ddp"`` the single-process step plus DDP's gradient buckets (see :mod:`memwrap.memory.sharded.trace`).
    A trace of the same inputs made before is read from the disk cache instead
    (:mod:`memwrap.memory.tracing.disk_cache`; ``cache=False`` or ``MEMWRAP_TRACE_CACHE=0`` turns it off).
    """
    return cached(lambda: _traced(model, make_batch, loss_fn, options, optimizer, extrapolate, stack, world_size,
                                  strategy), model, make_batch, loss_fn, options, optimizer, kinds=(Trace, Segment),
                  use=cache, extrapolate=extrapolate, stack=stack, world_size=world_size, strategy=strategy)


def _traced(model, make_batch, loss_fn, options, optimizer, extrapolate, stack, world_size, strategy) -> Trace:

    # Optimizer state a plugin predicts (derive) is sized on the parameters as the precision stores them.
    dtype = get_precision(options.get("precision", "fp32")).param_dtype
    if strategy == "fsdp2":
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.trace import fake_process_group, run_fsdp2_trace

        with fake_process_group(world_size) as mesh:
            runner = functools.partial(run_fsdp2_trace, mesh=mesh)
            trace = _trace_config(model, make_batch, loss_fn, options, optimizer, extrapolate, stack, runner,
                                  min_depth=FSDP2_MIN_DEPTH, min_periods=2)
        return dataclasses.replace(trace, world_size=world_size, strategy=strategy, param_dtype=dtype)
    trace = dataclasses.replace(_trace_config(model, make_batch, loss_fn, options, optimizer, extrapolate, stack,
                                              run_trace), param_dtype=dtype)
    if strategy == "ddp":
        # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
        from memwrap.memory.sharded.trace import ddp_bucket_bytes, with_gradient_buckets

        buckets, count = ddp_bucket_bytes(model)
        trace = dataclasses.replace(trace, segments=with_gradient_buckets(trace.segments, buckets),
                                    state={**trace.state, "gradient_buckets": buckets}, world_size=world_size,
                                    strategy=strategy, method=f"{trace.method}; + {count} DDP gradient buckets")
    return trace


def _trace_config(model, make_batch, loss_fn, options, optimizer, extrapolate, stack, runner, min_depth=1,
                  min_periods=1) -> Trace:
    start = time.perf_counter()
    if stack == "auto":
        stack = find_stack(model)
    factory = _optimizer_factory(optimizer)
    depths = None
    if extrapolate in (True, "auto") and stack is not None:
        depths = extrapolation_depths(model, stack, options, min_depth, min_periods)
        # Traced at once (memwrap.memory.tracing.parallel), the two depths cost the deeper one's time, else their sum:
        # where that is not less than one trace of the whole stack (exact by definition), trace it whole.
        if depths is not None and extrapolate == "auto" and \
                (depths[1] if parallel.enabled() else sum(depths)) >= stack.length:
            depths = None
    if depths is not None:
        a, b = depths
        try:
            ta, tb = parallel.both(
                lambda: runner(model, make_batch, loss_fn, options, factory, stack=stack, depth=a),
                lambda: runner(model, make_batch, loss_fn, options, factory, stack=stack, depth=b))
        except (IndexError, KeyError, AttributeError, RuntimeError, ValueError):
            ta = tb = None  # the model's forward depends on its depth: trace it whole
        if tb is not None:
            n = stack.length
            segments, state, flops, ops, classes, stats = _extrapolate(ta, tb, a, b, n, stack)
            top = _collapse(tb.top_modules, stack)
            method = f"extrapolated from traces with {a} and {b} of {n} blocks ({stack.name})"
            return Trace(segments, state, flops, ops, top, tb.micro_batches, optimizer, method,
                         time.perf_counter() - start, stack=stack.name, workspace=tb.workspace,
                         flop_classes=classes, op_stats=stats)
    tr = runner(model, make_batch, loss_fn, options, factory, stack=stack)
    segments = {k_: dataclasses.replace(s, where=_rename(s.where, None, None, None)) for k_, s in tr.segments.items()}
    return Trace(segments, tr.state_bytes, tr.flops, tr.ops, _collapse(tr.top_modules, stack), tr.micro_batches,
                 optimizer, "full trace", time.perf_counter() - start, stack=stack.name if stack else None,
                 workspace=tr.workspace, flop_classes=dict(tr.flop_classes), op_stats=dict(tr.op_stats))


def in_backward_options(options: dict[str, Any], optimizer: Any) -> dict[str, Any]:
    """The options to trace ``optimizer`` with: for one that updates each parameter inside backward (LOMO, AdaLomo,
    layer-wise GaLore/APOLLO; their spec's ``updates_in_backward``), ``step_in_backward=True``, so that the stand-in
    optimizer traced for it steps each parameter as its gradient completes and frees the gradient, as they do (and,
    with ``max_grad_norm`` or fp16, runs the norm pass their ``wrap()`` runs); ``options`` otherwise. Only the trace
    sees it: wrap() refuses ``step_in_backward=True`` with them.

    Example:
        >>> in_backward_options({"precision": "fp32"}, "lomo")["step_in_backward"], in_backward_options({}, "adamw")
        (True, {})
    """
    if optimizer is None or not get_optimizer_spec(str(optimizer)).updates_in_backward:
        return options
    return {**options, "step_in_backward": True}


def _shift(seg: Segment, delta: int) -> Segment:
    cats = dict(seg.bytes)
    cats["optimizer_state"] += delta
    return Segment(seg.total + delta, cats, seg.host, seg.where)


def derive(trace: Trace, optimizer: str, model: nn.Module, *, force: bool = False,
           workspace: bool | None = None) -> Trace | None:
    """The trace for ``optimizer`` from one traced with another optimizer (or the stand-in).

    Optimizer state is alive through the whole step, so a different optimizer shifts every
    segment by the difference in state bytes (plugin ``state_bytes``, exact), keeping what the configuration adds to
    every optimizer's state (bf16-true's Kahan buffer; :func:`_group_state`). The optimizer-step
    segment of an optimizer that cannot run on fake tensors is the step's entry snapshot plus its
    state, plus (unless ``workspace`` is False, or None with ``MEMWRAP_WORKSPACE=0``) the step's temporaries for
    the largest trainable parameter, measured with real steps on the device
    (:meth:`memwrap.memory.tracing.workspace.Workspace.step_temporary`). Returns None when
    ``optimizer`` runs on fake tensors and differs from the traced one (trace it instead), unless ``force``:
    then the shifted trace is a lower bound for it (its step's temporaries are missing), which the planner uses
    to skip tracing an optimizer that cannot fit whatever its step needs.
    """
    if trace.optimizer == optimizer:
        return trace

    spec = get_optimizer_spec(optimizer)
    if spec.runs_on_fake and not force:
        return None
    # An FSDP2 rank's optimizer holds its shards only (the traced state is the rank's too).
    held = {"world_size": trace.world_size if trace.strategy == "fsdp2" else 1, "dtype": trace.param_dtype}
    new_state = predict_state_bytes(optimizer, model, **held) + _group_state(trace, model, held)
    delta = new_state - trace.state["optimizer_state"]
    segments = {}
    for key, seg in trace.segments.items():
        if key[1:] == ("optimizer", "step"):
            continue
        segments[key] = _shift(seg, delta)
    # An optimizer that runs on fake tensors is derived only as a lower bound (force): its step is traced, not probed.
    step, used = (0, {}) if spec.runs_on_fake else _step_temporary(trace, spec.name, model, workspace)
    for key, seg in list(segments.items()):
        if key[1:] == ("optimizer", "prepare"):
            segments[(key[0], "optimizer", "step")] = Segment(
                seg.total + step, {**seg.bytes, "temporaries": seg.bytes["temporaries"] + step}, seg.host, seg.where)
    state = {**trace.state, "optimizer_state": new_state}
    return dataclasses.replace(trace, segments=segments, state=state, optimizer=spec.name,
                               workspace={**trace.workspace, **used})


def _group_state(trace: Trace, model: nn.Module, held: dict[str, Any]) -> int:
    """State bytes the traced step held beyond its optimizer plugin's own (``state_bytes``): what the configuration,
    not the optimizer, adds, and every optimizer of the group therefore holds too. bf16-true's Kahan summation is
    one: wrap() converts AdamW or SGD to torch-optimi's equivalent, which keeps a bf16 compensation buffer per
    parameter (without this, an SGD derived from a compensated AdamW's trace lost 2 bytes per parameter). 0 for the
    stateless stand-in, which is never converted, for an optimizer whose plugin cannot predict its state, and for
    your optimizer as built (memwrap.memory.search.space.AsBuilt, a name with ``groups``): its hyperparameters make
    state its registry name's plugin does not count (SGD's momentum), which is its own, not the group's."""
    if trace.optimizer is None or hasattr(trace.optimizer, "groups"):
        return 0
    try:
        own = predict_state_bytes(trace.optimizer, model, **held)
    except Exception:  # noqa: BLE001 - no prediction for the traced optimizer: nothing known beyond its plugin's
        return 0
    return max(0, trace.state["optimizer_state"] - own)


def _step_temporary(trace: Trace, name: str, model: nn.Module, workspace: bool | None) -> tuple[int, dict]:
    """Measured step temporaries of optimizer ``name`` for the model's largest trainable parameter of each role (an
    ``nn.Embedding``'s weight, which bitsandbytes steps with 32-bit state, or any other), the largest of them, and the
    report rows; (0, {}) when turned off, for a sharded trace, or for a model that lives on another device than the
    fake CPU trace (its kernels would differ)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not workspace_enabled(workspace) or not params or trace.strategy is not None \
            or params[0].device.type not in ("cpu", "meta"):
        return 0, {}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    largest: dict[str, int] = {}
    for p in params:
        role = "embedding" if id(p) in embeddings else "plain"
        largest[role] = max(largest.get(role, 0), p.numel())

    step, rows = 0, {}
    for role, numel in sorted(largest.items()):
        try:
            got = Workspace(torch.device("cpu")).step_temporary(name, lambda m: optimizer_on(name, m), numel,
                                                                trace.param_dtype or params[0].dtype, role)
        except Exception as exc:  # noqa: BLE001 the optimizer cannot step a lone CPU tensor: no term, the report says so
            rows[f"optimizer step ({name})"] = {"bytes": 0, "calls": 0, "kept": 0,
                                               "kind": f"not measured ({type(exc).__name__}: {str(exc)[:120]})"}
            continue
        if got is not None:
            n, fit = got
            step = max(step, n)  # one tensor at a time: the step's peak is its largest tensor's temporaries
            rows[fit["op"]] = {"bytes": n, "calls": 1, "kept": 0, "kind": fit["kind"]}
    return step, rows


# ----------------------------------------------------------------------------- the result

@dataclasses.dataclass
class Estimate:
    """Predicted memory of one steady-state training step (bytes), and its FLOPs.

    Attributes:
        peak: the largest device total over the step.
        breakdown: bytes per category at the peak (parameters, buffers, gradients,
            optimizer_state, activations, temporaries, other = the batch).
        peak_phase / peak_module / peak_micro_batch: when the peak occurs.
        phases: the peak of each phase (forward, backward, optimizer).
        state: persistent bytes (parameters, buffers, gradients, optimizer_state).
        top_modules: ``(module, bytes)`` of forward activations, largest first (stack blocks once, ``.*``).
        flops: per optimizer update (all micro-batches), recompute included.
        flop_classes: the same FLOPs by matmul dtype and size class (``{"bf16@181": ...}``; see
            :mod:`memwrap.memory.tracing.flop_classes`), which the cost model rates per class.
        offloaded: most host bytes holding offloaded activations at any time of the step.
        paged_state: optimizer state in CUDA unified memory (an optimizer whose spec says
            ``state_location="paged"``, e.g. bitsandbytes' paged AdamW): not in ``peak``/``breakdown``. It uses
            device memory left free beyond the peak and spills to host RAM under pressure, so it needs
            neither; the assumption is that the host has room for all of it (the worst case) and that what
            spills is paged in and out once per step (see :mod:`memwrap.memory.search.cost`).
        host_state: optimizer state held in host RAM (``state_location="host"``, e.g. a CPU-offloaded
            optimizer): not in ``peak``/``breakdown`` either.
        world_size / strategy: the data-parallel run this is one rank of (1 / None: one process).
            Sharded estimates add categories: ``unsharded_parameters`` and ``unsharded_gradients``
            (FSDP2's all-gathered blocks in flight), ``all_gather`` and ``reduce_scatter`` (their
            communication buffers), ``gradient_buckets`` (DDP); ``parameters``, ``gradients`` and
            ``optimizer_state`` are then this rank's shards.
    """

    options: dict[str, Any]
    optimizer: str
    peak: int
    breakdown: dict[str, int]
    peak_phase: str
    peak_module: str
    peak_micro_batch: int
    phases: dict[str, int]
    state: dict[str, int]
    top_modules: list[tuple[str, int]]
    flops: int
    flops_per_micro_batch: int
    ops_per_micro_batch: int
    offloaded: int
    method: str
    seconds: float
    world_size: int = 1
    strategy: str | None = None
    stack: str | None = None
    paged_state: int = 0
    host_state: int = 0
    # The loop's shape: True, the loop holds the model's outputs through backward and the step (``outputs =
    # model(**batch); outputs.loss.backward()``); False, they are dropped once the loss is computed (``loss =
    # model(**batch).loss``, Trainer). Not a wrap() option, so not in ``options``.
    keep_outputs: bool = True
    # Kernel workspaces measured on the device and added to the trace (memwrap.memory.tracing.workspace): op ->
    # {"bytes": largest transient at the op, "kept": largest workspace output kept for backward, "calls", "kind":
    # "fit" (checked on a held-out size) or "bound" (no fit held: an upper bound)}. Empty when turned off.
    workspace: dict[str, dict] = dataclasses.field(default_factory=dict)
    # ``flops`` by matmul dtype and size, "<dtype>@<size>" (memwrap.memory.tracing.flop_classes): what the cost
    # model rates at the device's speed for that size. Empty for a trace stored before the classes existed.
    flop_classes: dict[str, int] = dataclasses.field(default_factory=dict)
    # The ops without FLOPs, per micro-batch (memwrap.memory.tracing.op_stats): {"views": how many are views,
    # "bytes": what the others read and write}; the cost model charges views at their own cost, bytes at bandwidth.
    op_stats: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def host(self) -> int:
        """Host RAM the step may need: offloaded activations, host optimizer state, and all paged state (worst case)."""
        return self.offloaded + self.host_state + self.paged_state

    @property
    def dominant(self) -> str:
        """The category holding the most bytes at the peak."""
        return max(self.breakdown, key=self.breakdown.get)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dictionary (options shown with ``repr`` for non-JSON values)."""
        d = dataclasses.asdict(self)
        d["options"] = {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)
                        for k, v in self.options.items()}
        d["top_modules"] = [list(r) for r in self.top_modules]
        d["dominant"] = self.dominant
        return d

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items()) or "defaults"
        where = f"; rank 0 of {self.world_size}, {self.strategy}" if self.strategy else ""
        lines = [f"memwrap estimate ({opts}; optimizer {self.optimizer}{where})",
                 f"  peak {format_bytes(self.peak)} in {self.peak_phase} (micro-batch {self.peak_micro_batch}, "
                 f"at {self.peak_module})"]
        for cat, value in self.breakdown.items():
            if value:
                lines.append(f"    {cat:<21}{format_bytes(value):>12}")
        if self.offloaded:
            lines.append(f"    {'(host, offloaded)':<16}{format_bytes(self.offloaded):>12}")
        if self.paged_state:
            lines.append(f"    {'(paged optimizer state)':<21}{format_bytes(self.paged_state):>12}  not in the peak: CUDA "
                         f"unified memory, uses free device memory, spills to host RAM (assumed available)")
        if self.host_state:
            lines.append(f"    {'(host optimizer state)':<21}{format_bytes(self.host_state):>12}  in host RAM, not in the peak")
        lines.append("  loop: " + ("the model's outputs kept through backward and the step (outputs = model(...); "
                                   "outputs.loss.backward()); keep_outputs=False if your loop drops them"
                                   if self.keep_outputs else "the model's outputs dropped once the loss is computed "
                                   "(loss = model(...).loss, as Trainer does)"))
        for op, row in self.workspace.items():
            unmeasured = (f"; {row['not_measured']} more call(s) {row['why_not']}" if row.get("not_measured") and
                          row["kind"] in ("fit", "bound", "measured") else "")
            if row["kind"] not in ("fit", "bound", "measured"):  # no term: the probe could not run (its reason)
                lines.append(f"  kernel workspace {op}: {row['kind']}, no term added")
                continue
            lines.append(f"  kernel workspace {op}: {format_bytes(row['bytes'])} transient"
                         + (f", {format_bytes(row['kept'])} kept for backward" if row.get("kept") else "")
                         + f" ({row['calls']} calls; measured on the device, "
                         + {"fit": "fitted, checked on a held-out size)",
                            "measured": "at each call's own shape)"}.get(
                             row["kind"], "no fit held on the held-out size: an upper bound)") + unmeasured)
        lines.append("  phase peaks: " + ", ".join(f"{p} {format_bytes(v)}" for p, v in self.phases.items()))
        if self.top_modules:
            lines.append("  largest forward activations: " + ", ".join(
                f"{n} {format_bytes(v)}" for n, v in self.top_modules[:5]))
        lines.append(f"  {self.flops / 1e12:.3f} TFLOP per update (recompute included); {self.method}; "
                     f"{self.seconds:.1f} s")
        return "\n".join(lines)


def _off_device(trace: Trace, optimizer: str) -> tuple[Trace, int, int]:
    """``trace`` with the optimizer state taken out of device memory when the optimizer's spec keeps it paged or
    on the host (``OptimizerSpec.state_location``), and those bytes: ``(trace, paged, host)``."""

    location = get_optimizer_spec(optimizer).state_location
    if location == "device":
        return trace, 0, 0
    segments = {}
    for key, seg in trace.segments.items():
        cats = {**seg.bytes, "optimizer_state": 0}
        segments[key] = Segment(seg.total - seg.bytes["optimizer_state"], cats, seg.host, seg.where)
    moved = trace.state["optimizer_state"]
    trace = dataclasses.replace(trace, segments=segments)
    return (trace, moved, 0) if location == "paged" else (trace, 0, moved)


def finish(trace: Trace, options: dict[str, Any], optimizer: str) -> Estimate:
    """Turn a full-depth :class:`Trace` into an :class:`Estimate`."""
    trace, paged, host = _off_device(trace, optimizer)
    key, seg = max(trace.segments.items(), key=lambda kv: kv[1].total)
    phases = {p: max((s.total for k, s in trace.segments.items() if k[1] == p), default=0) for p in PHASES}
    accumulate = int(options.get("accumulate", 1))
    grads = max((s.bytes["gradients"] for s in trace.segments.values()), default=0)
    state = {**trace.state, "gradients": grads}
    keep = bool(options.get("keep_outputs", True))
    options = {k: v for k, v in options.items() if k not in TRACE_ONLY_OPTIONS}
    return Estimate(options=dict(options), optimizer=optimizer, keep_outputs=keep, peak=seg.total, breakdown=dict(seg.bytes),
                    peak_phase=key[1], peak_module=seg.where, peak_micro_batch=key[0] + 1, phases=phases,
                    state=state, top_modules=list(trace.top_modules), flops=trace.flops * accumulate,
                    flops_per_micro_batch=trace.flops, ops_per_micro_batch=trace.ops,
                    offloaded=max((s.host for s in trace.segments.values()), default=0),
                    method=trace.method, seconds=trace.seconds, world_size=trace.world_size,
                    strategy=trace.strategy, stack=trace.stack, paged_state=paged, host_state=host,
                    workspace=dict(trace.workspace),
                    flop_classes={c: v * accumulate for c, v in trace.flop_classes.items()},
                    op_stats=dict(trace.op_stats))


def estimate(model: nn.Module | Callable[[], nn.Module], batch: Any, *, loss_fn: Callable | None = None,
             optimizer: str = "adamw", extrapolate: bool | str = "auto", world_size: int = 1,
             strategy: str | None = None, keep_outputs: bool = True, workspace: bool | None = None,
             **wrap_options: Any) -> Estimate:
    """Predict the memory of one steady-state training step under ``memwrap.wrap(**wrap_options)``.

    Runs the step (forward, loss, backward, optimizer update, with the optimizer state already
    present) on a fake copy of ``model`` under torch's ``MemTracker``: nothing is allocated and
    the model's storage is never touched. ``model`` is a module or a zero-argument factory (built
    on the meta device); ``batch`` a micro-batch or a callable returning one (tuple
    ``(inputs, targets)``, dict of keyword arguments, or tensor; see :func:`~memwrap.memory.tracing.batch.split_batch`).
    ``loss_fn(outputs, targets)`` defaults to :func:`~memwrap.memory.tracing.batch.default_loss`.
    The optimizer is ``wrap_options["optim"]`` or ``optimizer`` (a registry name); optimizers that
    cannot run on fake tensors (bitsandbytes, Adafactor) contribute their plugin's ``state_bytes``.

    ``keep_outputs`` is the shape of your loop: True (the default, as in a hand-written Hugging Face loop) when it
    holds the model's outputs through backward (``outputs = model(**batch); outputs.loss.backward()``: the logits
    live through backward and the step, and the previous update's through the next forward); False when they are
    dropped once the loss is computed (``loss = model(**batch).loss``; Trainer's ``compute_loss``). The report says
    which was planned.

    ``workspace``: add kernel workspaces the fake trace cannot see (oneDNN convolution and RNN buffers), measured
    with small real calls on the device and cached on disk (:mod:`memwrap.memory.tracing.workspace`); None (the
    default) follows ``MEMWRAP_WORKSPACE`` (on unless ``0``). The device is the model's (for a factory, the CPU);
    a device name (``workspace="cuda"``) measures there instead, for a model built on the CPU and trained on a GPU
    (cuDNN's convolution workspaces; a CUDA RNN's are not modelled, and the report says so). The report lists
    each op that got a term.

    ``world_size=N, strategy="fsdp2" | "ddp"``: the peak of one of ``N`` data-parallel ranks, each
    running ``batch`` as its micro-batch (the global batch is ``micro-batch x accumulate x N``).
    FSDP2 is traced on a fake rank (``fully_shard`` on each block of the stack, then the root);
    DDP is the single-process step plus its gradient buckets. See :mod:`memwrap.memory.sharded.trace`
    and docs/distributed.md.

    Example:
        >>> from memwrap.models import build_preset, preset_batch
        >>> est = estimate(build_preset("gpt2-tiny"), preset_batch("gpt2-tiny", 2, 64), precision="bf16")
        >>> est.breakdown["parameters"]
        17094656
    """

    # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
    from memwrap.memory.sharded.trace import check_sharding, fsdp2_refusals

    world_size, strategy = check_sharding(world_size, strategy)
    if not isinstance(keep_outputs, bool):
        raise TypeError(f"estimate(keep_outputs={keep_outputs!r}) must be True (the loop holds the model's outputs "
                        "through backward: outputs = model(**batch); outputs.loss.backward()) or False (loss = "
                        "model(**batch).loss, Trainer's compute_loss).")
    workspace = check_workspace_option(workspace)
    wrap_options = parse_options(**wrap_options).to_kwargs()  # wrap()'s validation, canonical names
    opt_name = get_optimizer_spec(wrap_options.get("optim") or optimizer).name
    if strategy == "fsdp2":
        refused = fsdp2_refusals([opt_name], world_size)
        if refused:
            raise ValueError(refused[opt_name])
    module = resolve_model(model)
    # Inputs the real step does not pass on because of their values (an all-ones attention_mask under SDPA), which
    # the fake trace cannot read: left out of the traced call (memwrap.memory.tracing.unread_inputs).
    batch, notes, adjust = adapt_batch(module, batch)  # a batch factory or a non-dict batch: unchanged
    make_batch = resolve_batch(batch)
    traced = opt_name if get_optimizer_spec(opt_name).runs_on_fake else None
    # The loop's shape and the workspace switch travel with the traced options (not wrap() options).
    options = {**wrap_options, "keep_outputs": keep_outputs, "workspace": workspace}
    if adjust:  # the fake copy runs as the real step would for this batch's values (unread_inputs.adjust_fake_model)
        options["fake_adjust"] = adjust
    trace = trace_config(module, make_batch, loss_fn, in_backward_options(options, opt_name), traced,
                         extrapolate=extrapolate, world_size=world_size, strategy=strategy)
    trace = derive(trace, opt_name, module, workspace=workspace)
    est = finish(trace, options, opt_name)
    return dataclasses.replace(est, method="; ".join([est.method, *notes])) if notes else est
