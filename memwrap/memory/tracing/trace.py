"""One training step traced on fake tensors: torch's MemTracker plus FlopCounterMode.

The step is the one ``memwrap.wrap`` runs: the fake model is wrapped with the real ``wrap``
(autocast, checkpointing, output casts and gradient hooks), the optimizer already holds its
state (steady state), and with ``accumulate > 1`` two micro-batches are traced, because from the
second one on the gradients of the earlier ones are alive while activations are built.

Memory is recorded per *segment*: (micro-batch, phase, position relative to the repeated block
stack). Each segment keeps the snapshot (bytes per category) at its own maximum. For a stack of
identical blocks every segment maximum is an affine function of the stack depth, which is what
makes extrapolation from two truncated depths exact when the checkpointed blocks repeat along
the stack (see :mod:`memwrap.memory.tracing.estimator` and :mod:`memwrap.memory.tracing.depth`).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.utils._pytree import tree_flatten, tree_map_only

from memwrap.memory.tracing import rng_states
from memwrap.memory.tracing.batch import default_loss, split_batch
from memwrap.memory.tracing.stack import Stack, find_stack, truncated
from memwrap.precision.base import get_precision
import memwrap.memory.tracing.fake_kernels  # noqa: F401  fake kernels the trace needs (MoE grouped_mm in fp32)
from memwrap.memory.tracing.flop_classes import flop_class, flop_formulas
from memwrap.memory.tracing.op_stats import OpStats
from memwrap.memory.tracing.grad_accumulation import InPlaceAccumulation
from memwrap.memory.tracing.unread_inputs import adjust_fake_model
from memwrap.memory.tracing.workspace import Workspace, probe_device

__all__ = ["CATEGORIES", "NOT_WRAP_OPTIONS", "TRACE_ONLY_OPTIONS", "Stack", "TraceResult", "find_stack", "fake_model", "output_bytes", "truncated", "run_trace", "split_batch", "default_loss"]  # noqa: the last two re-exported from batch.py

# Keys of a traced configuration that are not wrap() options: the optimizer's registry name, wrap-time objects, and
# the loop's shape (whether it keeps the model's outputs through backward; see drive_step).
# The trace-only keys (the loop's shape, the workspace switch) are left out of an Estimate's options too.
TRACE_ONLY_OPTIONS = ("keep_outputs", "workspace", "fake_adjust")
NOT_WRAP_OPTIONS = ("optim", "monitor", "count_items", *TRACE_ONLY_OPTIONS)
CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries", "other")
_CAT = {_MemRefType.PARAM: "parameters", _MemRefType.BUFFER: "buffers", _MemRefType.GRAD: "gradients",
        _MemRefType.OPT: "optimizer_state", _MemRefType.ACT: "activations", _MemRefType.TEMP: "temporaries",
        _MemRefType.OTH: "other"}
# Offloaded activations are parked on this fake device during the trace, so that MemTracker keeps
# them apart from device memory (see _fake_offload).
HOST = torch.device("meta")


# ----------------------------------------------------------------------------- the model

def fake_model(model: nn.Module, mode, device: torch.device, stack: Stack | None = None,
               depth: int | None = None) -> nn.Module:
    """A structural copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    The real storage is never read or copied (the fakes only share shapes, strides and dtypes).
    With ``stack`` and ``depth`` the copy keeps only the first ``depth`` blocks of the stack.
    """
    with truncated(model, stack, depth):
        memo: dict[int, Any] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) in memo:
                continue
            with mode:
                ft = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
            memo[id(t)] = nn.Parameter(ft, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else ft
        return copy.deepcopy(model, memo)


# ----------------------------------------------------------------------------- the tracker

@dataclasses.dataclass
class Segment:
    """The snapshot at one segment's maximum: device bytes per category, host (offloaded) bytes."""

    total: int
    bytes: dict[str, int]
    host: int
    where: str


@dataclasses.dataclass
class TraceResult:
    """What one traced step measured (at the traced depth)."""

    segments: dict[tuple, Segment]
    state_bytes: dict[str, int]  # persistent totals at the start: parameters, buffers, optimizer_state
    flops: int  # per micro-batch, including recompute
    ops: int  # dispatched ops per micro-batch (forward + backward)
    top_modules: list[tuple[str, int]]  # forward activation bytes per module
    micro_batches: int
    depth: int | None
    seconds: float
    # ops given a measured kernel workspace: name -> {"bytes": largest transient, "kept": largest placeholder output
    # resized, "calls", "kind": "fit" | "bound"} (see memwrap.memory.tracing.workspace)
    workspace: dict[str, dict] = dataclasses.field(default_factory=dict)
    # ``flops`` by matmul dtype and size, "<dtype>@<size>" (memwrap.memory.tracing.flop_classes), per micro-batch
    flop_classes: dict[str, int] = dataclasses.field(default_factory=dict)
    # the ops without FLOPs, per micro-batch of forward + backward (memwrap.memory.tracing.op_stats): {"views": how
    # many are views, "bytes": what the others read and write}
    op_stats: dict[str, int] = dataclasses.field(default_factory=dict)


def _is_bw() -> bool:
    return torch._C._current_graph_task_id() != -1


class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOKS = (_NoHook(), _NoHook())


class SegmentMixin:
    """Keeps the maximum of every (micro-batch, phase, position) segment of a MemTracker subclass.

    Mixed into torch's ``MemTracker`` here and into its ``FSDPMemTracker`` in
    :mod:`memwrap.memory.sharded.trace`; ``category_of`` maps the tracker's reference types to memwrap's
    category names (``categories``, in report order). Call :meth:`init_segments` from ``__init__``.
    """

    categories: tuple[str, ...] = CATEGORIES
    category_of: dict = _CAT

    def init_segments(self, device: torch.device) -> None:
        self.device = device
        self.segments: dict[tuple, Segment] = {}
        self.mb = 0
        self.fw_pos = self.bw_pos = "pre"
        self.stage = "forward"  # set by the driver: "forward", "backward", "optimizer"
        self.ops = {"forward": 0, "backward": 0, "optimizer": 0}
        self.flops = 0
        self.flop_classes: dict[str, int] = {}  # the same FLOPs by matmul dtype and size (flop_classes.py)
        self._flop_registry = flop_formulas()  # torch's formulas and the CPU flash attention kernel's
        self.op_stats = OpStats()  # views and bytes moved by the ops without FLOPs (forward + backward)
        # Whether the op being dispatched runs a kernel in a real step, and the phase MemTracker tracked it in (None:
        # not tracked, e.g. DTensor's sharding propagation): only those are counted as ops.
        self._counted_op, self._tracked = True, None
        # The engine's in-place gradient accumulation, which the dispatch mode itself turns off (observer effect).
        self.accumulation = InPlaceAccumulation()
        # Kernel workspaces the dispatcher never sees, measured on the device (run_trace sets it; None: not modelled).
        self.workspace: Workspace | None = None

    def key(self) -> tuple:
        if self._in_opt:
            return (self.mb, "optimizer", "step")
        if self.stage == "optimizer":
            return (self.mb, "optimizer", "prepare")
        if self._mod_tracker.is_bw or self.stage == "backward":
            return (self.mb, "backward", self.bw_pos)
        return (self.mb, "forward", self.fw_pos)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        func = self.accumulation.rewrite(func, args, kwargs)
        call = func if self.workspace is None else self.workspace.wrap(func, args, kwargs)
        # prim.device / prim.layout: metadata queries that reach a dispatch mode only because the tensors are fake (a
        # real tensor answers them in C++). Counted, they were 912 of 1314 "ops" per micro-batch of a small GPT-2
        # (402 in the eager step) and tripled the cost model's launches term.
        self._counted_op, self._tracked = func.namespace != "prim", None
        res = super().__torch_dispatch__(call, types, args, kwargs)
        self.accumulation.made(res)
        # torch's own FLOP formulas (FlopCounterMode's registry, plus the CPU flash attention kernel's); FlopCounterMode
        # itself is not used because its module tracking keeps checkpoint-recomputed tensors alive.
        count = self._flop_registry.get(func._overloadpacket)
        if count is not None and res is not NotImplemented:
            n = int(count(*args, **(kwargs or {}), out_val=res))
            self.flops += n
            cls = flop_class(func, args, res)
            self.flop_classes[cls] = self.flop_classes.get(cls, 0) + n
        elif self._tracked not in (None, "optimizer") and self._counted_op and self._flop_registry:
            self.op_stats.add(func, args, kwargs, res)
        return res

    def current(self) -> tuple[int, dict[str, int], int]:
        dev = dict.fromkeys(self.categories, 0)
        host = 0
        for device, snap in self._curr_mem_snap.items():
            if device.type == HOST.type:
                host += snap["Total"]
            elif device.type == self.device.type:
                for ref, value in snap.items():
                    if ref in self.category_of:
                        dev[self.category_of[ref]] += value
        return sum(dev.values()), dev, host

    def _update_peak_stats(self, peak_state) -> None:
        # Replaces MemTracker's version, which walks every module on every op to keep per-module
        # peaks that the planner does not use; segment maxima are kept instead.
        key = self.key()
        self._tracked = key[1]
        if self._counted_op:
            self.ops[key[1]] += 1
        total, dev, host = self.current()
        scratch = self.workspace.take() if self.workspace is not None else 0
        if scratch:  # the kernel's workspace is alive during the op only: in this op's snapshot, freed after it
            dev["temporaries"] += scratch
            total += scratch
        seg = self.segments.get(key)
        if seg is None or total > seg.total:
            parents = self._mod_tracker.parents
            where = max(parents, key=lambda s: (s.count("."), len(s))) if parents else "Global"
            self.segments[key] = Segment(total, dev, host, where)


class _SegmentTracker(SegmentMixin, MemTracker):
    """MemTracker that also keeps the maximum of every (micro-batch, phase, position) segment."""

    def __init__(self, device: torch.device):
        super().__init__()
        self.init_segments(device)

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True):
        # torch's MemTracker hooks every parameter's gradient, and register_hook refuses a frozen parameter
        # (fine-tuning, LoRA, frozen embeddings). Frozen ones are marked as hooked already: they get no
        # gradient to track anyway.
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param, None) is None:
                self._param_to_grad_hook_handles[param] = _NO_HOOKS
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def _first_grad_tensor(obj: Any) -> torch.Tensor | None:
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return t
    return None


def _stack_hooks(model: nn.Module, stack: Stack | None, tracker: _SegmentTracker) -> list:
    """Move the tracker's position marker across the block stack, in forward and in backward."""
    if stack is None:
        return []
    blocks = list(model.get_submodule(stack.name).children())
    if not blocks:
        return []

    def set_bw(value):
        def hook(grad):
            tracker.bw_pos = value
        return hook

    def enter(mod, args, kwargs):
        if _is_bw():
            return
        tracker.fw_pos = "stack"
        t = _first_grad_tensor((args, kwargs))
        if t is not None:  # its gradient is complete once backward has left the stack
            t.register_hook(set_bw("post"))

    def leave(mod, args, kwargs, out):
        if _is_bw():
            return
        tracker.fw_pos = "post"
        t = _first_grad_tensor(out)
        if t is not None:  # its gradient arrives when backward enters the stack
            t.register_hook(set_bw("stack"))

    return [blocks[0].register_forward_pre_hook(enter, with_kwargs=True),
            blocks[-1].register_forward_hook(leave, with_kwargs=True)]


class _FakeOffload(torch.autograd.graph.saved_tensors_hooks):
    """Stand-in for ``save_on_cpu`` while tracing on a fake CPU device: parks saved tensors on
    :data:`HOST` so they are reported as host memory rather than device memory."""

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        def pack(tensor):
            return tensor.device, tensor.to(HOST)

        def unpack(packed):
            device, tensor = packed
            return tensor.to(device)

        super().__init__(pack, unpack)


@contextlib.contextmanager
def _offload_to_host():
    original = torch.autograd.graph.save_on_cpu
    torch.autograd.graph.save_on_cpu = _FakeOffload
    try:
        yield
    finally:
        torch.autograd.graph.save_on_cpu = original


def _top_modules(tracker: MemTracker, limit: int = 40) -> list[tuple[str, int]]:
    from torch.distributed._tools.mem_tracker import _ModState

    rows = []
    for stats in tracker.memory_tracking.values():
        pre, post = stats.snapshots.get(_ModState.PRE_FW), stats.snapshots.get(_ModState.POST_FW)
        if not pre or not post:
            continue
        delta = sum(s.get(_MemRefType.ACT, 0) for s in post[0].values()) - \
            sum(s.get(_MemRefType.ACT, 0) for s in pre[0].values())
        prefix = "WrappedModule.module."
        if delta > 0 and stats.mod_fqn.startswith(prefix):
            rows.append((stats.mod_fqn[len(prefix):], delta))
    rows.sort(key=lambda r: -r[1])
    return rows[:limit]


def run_trace(model: nn.Module, make_batch: Callable[[], Any], loss_fn: Callable | None, options: dict[str, Any],
              optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None, *, stack: Stack | None = None,
              depth: int | None = None, device: str = "cpu", count_flops: bool = True) -> TraceResult:
    """Trace one steady-state training step of a fake copy of ``model`` under ``memwrap.wrap(**options)``.

    ``optimizer(fake_model)`` builds the inner optimizer (None: a stateless SGD stand-in, whose
    state the caller adds from the plugin's ``state_bytes``). ``make_batch()`` is called under the
    fake mode. Returns per-segment maxima, persistent state, FLOPs and ops per micro-batch.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memwrap

    start = time.perf_counter()
    dev = torch.device(device)
    loss_fn = loss_fn or default_loss
    accumulate = int(options.get("accumulate", 1))
    n_mb = 2 if accumulate > 1 else 1
    # Micro-batches 2..N of a window are identical in memory, so a window of 2 stands for any N >= 2.
    wrap_opts = {k: v for k, v in options.items() if k not in NOT_WRAP_OPTIONS}
    wrap_opts["accumulate"] = n_mb
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fmodel = fake_model(model, mode, dev, stack, depth)
    fmodel.train()
    adjust_fake_model(fmodel, options.get("fake_adjust", ()))
    # checkpointing's RNG states: device memory where the step runs on the CPU (memwrap.memory.tracing.rng_states)
    states = rng_states.fake_states(rng_states.steps_on_cpu(_home(model), options.get("workspace")))
    with mode, warnings.catch_warnings(), _offload_to_host(), states:
        warnings.simplefilter("ignore")
        precision = _precision(options)
        # The precision's storage dtype (bf16-true: bf16 weights, hence bf16 gradients and state) is applied before
        # the optimizer exists and steps, as it is in training; wrap() below then finds nothing left to convert.
        precision.convert_module(fmodel)
        inner = optimizer(fmodel) if optimizer is not None else torch.optim.SGD(fmodel.parameters(), lr=0.0)
        if optimizer is not None and precision.check_optimizer(inner):
            # wrap() converts a fresh optimizer (e.g. AdamW -> optimi's Kahan-summed AdamW); the steady state is that
            # optimizer's, so convert before its first step. The stand-in (state from a plugin) is never converted.
            inner = precision.convert_optimizer(inner, fmodel, step_in_backward=bool(options.get("step_in_backward")))
        params = [p for p in fmodel.parameters() if p.requires_grad]
        if optimizer is not None:  # steady state: the optimizer's state exists before the step
            for p in params:
                p.grad = torch.zeros_like(p)
            inner.step()
            inner.zero_grad(set_to_none=True)
        wmodel, wopt = memwrap.wrap(fmodel, inner, **wrap_opts)
        tracker = _SegmentTracker(dev)
        # The fake trace stays on the CPU; the workspaces are measured where the model trains (a GPU runs cuDNN's
        # convolutions; oneDNN's RNN ops are CPU kernels, not probed there: workspace.modelled_ops).
        probed = probe_device(options.get("workspace"), _home(model), dev)
        if probed is not None:
            tracker.workspace = Workspace(probed)
        if not count_flops:
            tracker._flop_registry = {}
        batches = [_to_fake(make_batch(), mode, dev) for _ in range(n_mb)]
        tracker.track_external(fmodel, inner, *[t for b in batches for t in tree_flatten(b)[0] if isinstance(t, torch.Tensor)])
        state = _state(tracker)
        top = drive_step(tracker, fmodel, wmodel, wopt, batches, loss_fn, stack, _top_modules,
                         keep_outputs=bool(options.get("keep_outputs", True)))
        total_flops = tracker.flops
    del batches, wmodel, wopt, inner, fmodel
    if tracker.workspace is not None:
        tracker.workspace.emit()  # outside the block above, which silences the traced code's warnings
    ops = (tracker.ops["forward"] + tracker.ops["backward"]) // n_mb
    return TraceResult(tracker.segments, state, total_flops // n_mb, ops, top, n_mb, depth,
                       time.perf_counter() - start, dict(tracker.workspace.used) if tracker.workspace else {},
                       per_micro_batch(tracker.flop_classes, n_mb), tracker.op_stats.as_dict(n_mb))


def per_micro_batch(classes: dict[str, int], n_mb: int) -> dict[str, int]:
    """A tracker's FLOPs by class over ``n_mb`` traced micro-batches, per micro-batch (as ``flops`` is)."""
    return {c: v // n_mb for c, v in sorted(classes.items())}


def _home(model: nn.Module) -> str:
    """The device type the model's first parameter or buffer lives on ("meta" for none or a meta-built model)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        return t.device.type
    return "meta"


def _precision(options: dict[str, Any]):
    """The precision plugin instance ``wrap(**options)`` would use (its storage dtype and optimizer conversion)."""
    comp = options.get("compensation")
    return get_precision(options.get("precision") or "fp32", **({"compensation": comp} if comp is not None else {}))


def drive_step(tracker: SegmentMixin, fmodel: nn.Module, wmodel: nn.Module, wopt: Any, batches: list, loss_fn: Callable,
               stack: Stack | None, top_modules: Callable | None = None, *,
               keep_outputs: bool = True) -> list[tuple[str, int]]:
    """Run the traced micro-batches (forward, loss, backward, step, zero_grad) under ``tracker``.

    ``keep_outputs`` is the loop's shape (:data:`LOOP_SHAPES`): True, the loop holds each micro-batch's outputs
    until the next forward has returned (``outputs = model(**batch); outputs.loss.backward()``), so they live through
    backward and the step, and the previous update's last outputs live through the first forward (added to the first
    micro-batch's forward segments: the same shapes, from before the traced window); False, they are dropped once the
    loss is computed (``loss = model(**batch).loss``, Trainer's ``compute_loss``).
    Returns ``top_modules(tracker)`` read after the first forward (``[]`` without it).
    """
    hooks = _stack_hooks(fmodel, stack, tracker)
    top: list[tuple[str, int]] = []
    held = None
    held_bytes = 0
    try:
        with tracker, _explain_data_dependence():
            for mb in range(len(batches)):
                # The loop's name now holds this micro-batch: the previous one is freed (a loader's loop keeps one
                # micro-batch's inputs, not the window's; an image batch is not negligible next to a small model).
                batch, batches[mb] = batches[mb], None
                if mb:
                    tracker.reset_mod_stats()  # MemTracker refuses a second root call otherwise
                tracker.mb, tracker.fw_pos, tracker.bw_pos, tracker.stage = mb, "pre", "pre", "forward"
                args, kwargs, targets = split_batch(batch)
                outputs = wmodel(*args, **kwargs)
                held = None  # the loop's name now holds this micro-batch's outputs: the previous ones are freed
                if keep_outputs and mb == 0:
                    held_bytes = output_bytes(outputs, fmodel)
                loss = loss_fn(outputs, targets)
                if keep_outputs:
                    held = outputs
                del outputs, args, kwargs, targets
                if mb == 0 and top_modules is not None:
                    top = top_modules(tracker)
                tracker.stage = "backward"
                loss.backward()
                del loss
                tracker.stage = "optimizer"
                wopt.step()
                wopt.zero_grad()
            del held
    finally:
        for h in hooks:
            h.remove()
    if held_bytes:
        for key, seg in list(tracker.segments.items()):
            if key[0] == 0 and key[1] == "forward":
                tracker.segments[key] = Segment(seg.total + held_bytes,
                                                {**seg.bytes, "activations": seg.bytes["activations"] + held_bytes},
                                                seg.host, seg.where)
    return top


def output_bytes(outputs: Any, model: nn.Module) -> int:
    """Device bytes of the tensors in ``outputs`` (each storage once), leaving out the model's own parameters and buffers.

    Example:
        >>> output_bytes({"logits": torch.zeros(2, 8), "loss": torch.zeros(())}, torch.nn.Linear(1, 1))
        68
    """
    # A storage's Python object is preserved while the storage lives, so its id names it (as MemTracker keys them).
    own = {id(t.untyped_storage()) for t in itertools.chain(model.parameters(), model.buffers())}
    seen: dict[int, int] = {}

    for t in reachable_tensors(outputs):
        storage = t.untyped_storage()
        if id(storage) not in own:
            seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def reachable_tensors(obj: Any, limit: int = 100_000) -> list[torch.Tensor]:
    """Every tensor ``obj`` holds: through containers, dataclasses and any object's attributes (``__dict__`` and
    ``__slots__``), each object once. What a loop holding ``obj`` keeps alive, which a pytree walk does not see: a
    Hugging Face output's ``past_key_values`` is a ``DynamicCache`` object whose layers hold every layer's keys and
    values (a 7B Llama at batch 4 x 4096: 8 GiB in bf16). Modules, classes and functions are not entered.

    Example:
        >>> class Box:
        ...     def __init__(self): self.inner = [torch.zeros(3)]
        >>> [t.shape for t in reachable_tensors({"a": torch.ones(2), "b": Box()})]
        [torch.Size([2]), torch.Size([3])]
    """
    found, seen, stack = [], set(), [obj]
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, (str, bytes, int, float, bool, type, nn.Module)) or callable(o):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, dict):
            stack.extend(reversed(list(o.values())))
        elif isinstance(o, (list, tuple, set, frozenset)):
            stack.extend(reversed(list(o)))
        else:
            attrs = list(vars(o).values()) if hasattr(o, "__dict__") else []
            for cls in type(o).__mro__:
                for slot in getattr(cls, "__slots__", ()):
                    if isinstance(slot, str) and hasattr(o, slot):
                        attrs.append(getattr(o, slot))
            stack.extend(reversed(attrs))
    return found


@contextlib.contextmanager
def _explain_data_dependence():
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise RuntimeError(
            f"the training step reads tensor values ({exc}), which a fake-tensor trace cannot do: fake "
            "tensors have shapes but no data. Fix: keep value-dependent Python (.item(), bool(tensor), "
            "nonzero, data-dependent shapes) out of forward and loss_fn, or estimate with a loss_fn that "
            "avoids it.") from exc


def _to_fake(batch: Any, mode, device: torch.device) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}  # a tensor the batch holds twice ({"input_ids": ids, "labels": ids}) is one

    def convert(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.device == device:
            return t
        if id(t) not in made:
            # Only metadata matters; a batch on another device (CUDA) is traced on the fake device.
            with mode:
                made[id(t)] = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
        return made[id(t)]

    return tree_map_only(torch.Tensor, convert, batch)


def _state(tracker: _SegmentTracker) -> dict[str, int]:
    _, dev, _ = tracker.current()
    return {k: dev[k] for k in ("parameters", "buffers", "optimizer_state")}
