"""Per-rank memory of data-parallel training (FSDP2, DDP), traced on one fake rank.

FSDP2 is traced, not modelled: the process joins torch's ``fake`` process group as rank 0 of
``world_size`` (no communication happens, collectives only produce their output shapes), builds
a device mesh, copies the model onto the meta device, ``fully_shard``s every block of its stack
and then the root (the layout of ``examples/fsdp2_torchrun.py`` and torchtitan), materialises it
with ``to_empty`` under ``FakeTensorMode`` and runs one steady-state step of
``memwrap.wrap(sharded_model, optimizer, **options)`` under torch's ``FSDPMemTracker``. What the
trace sees is what FSDP2 allocates on a rank: the padded local shards of parameters, gradients
and optimizer state, the unsharded parameters of the blocks in flight (FSDP2's default prefetch
of one block ahead, in forward and backward), the all-gather and reduce-scatter buffers, and
activations. The device mesh is created before the fake mode is entered, as torch's own
FSDPMemTracker tests do.

DDP is traced and completed by one modelled term. A DDP rank runs the single-process step
(traced as for ``world_size=1``) and, in addition, DDP's ``Reducer`` holds flat gradient buckets
for the whole run: with DDP's default ``gradient_as_bucket_view=False`` each bucket is a separate
flat copy of its parameters' gradients, so the buckets together hold one more copy of the
trainable parameters' gradients, in their dtype. The Reducer allocates them in C++ when DDP is
constructed, before any step, which a trace of the step cannot attribute, so their size is taken
from the bucket assignment torch itself computes (``dist._compute_bucket_assignment_by_size``)
and added to every segment as ``gradient_buckets``. The real 2- and 4-rank runs in
``benchmarks/distributed_planner.py`` measure how close both are.

Example:
    >>> import memwrap
    >>> from memwrap.models import build_preset, preset_batch
    >>> est = memwrap.estimate(lambda: build_preset("gpt2-tiny"), preset_batch("gpt2-tiny", 2, 64),
    ...                        world_size=4, strategy="fsdp2")  # doctest: +SKIP
    >>> est.breakdown["parameters"] < 17094656 / 2  # doctest: +SKIP
    True
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import itertools
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memwrap.memory.tracing.disk_cache import remember
from memwrap.memory.tracing.unread_inputs import adjust_fake_model
from memwrap.memory.tracing.trace import (
    NOT_WRAP_OPTIONS, SegmentMixin, Stack, TraceResult, _offload_to_host, _precision, _state, _to_fake, default_loss, drive_step,
    per_micro_batch, truncated,
)
from memwrap.errors import closest_hint
from memwrap.plugin.registry import create_optimizer
from memwrap.runtime.distributed import check_sharded_optimizer

__all__ = ["STRATEGIES", "SHARDED_CATEGORIES", "check_sharding", "fake_process_group", "run_fsdp2_trace",
           "ddp_bucket_bytes", "with_gradient_buckets", "sharding_refusal", "fsdp2_refusals"]

STRATEGIES = ("ddp", "fsdp2")
SHARDED_CATEGORIES = ("parameters", "buffers", "gradients", "optimizer_state", "unsharded_parameters",
                      "unsharded_gradients", "all_gather", "reduce_scatter", "gradient_buckets", "activations",
                      "temporaries", "other")


# ----------------------------------------------------------------------------- validation

def _fsdp2_missing() -> str | None:
    """Why the installed torch cannot trace (or run) FSDP2 on this machine, or None."""
    try:
        import torch.distributed as dist
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: F401
        from torch.distributed.device_mesh import init_device_mesh  # noqa: F401
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401
    except ImportError as exc:
        return f"it lacks {exc.name or exc} (FSDP2's fully_shard, FSDPMemTracker and the fake process group)"
    if not dist.is_available():
        return "it was built without torch.distributed"
    if not hasattr(torch.cpu.Stream, "record_event"):
        # FSDP2 records events on the device's streams; torch 2.6's CPU stream cannot (2.11 can).
        return "FSDP2 cannot run on a CPU device there (torch.cpu.Stream.record_event is missing)"
    return None


def check_sharding(world_size: Any, strategy: Any) -> tuple[int, str | None]:
    """Validate ``world_size`` and ``strategy``; returns ``(world_size, strategy)`` (strategy lower-cased).

    ``world_size=1`` without a strategy is a single-process run. Raises ``ValueError`` naming the fix:
    ``world_size`` < 1, a strategy that does not exist (with the closest name), several ranks without
    a strategy, or a strategy this torch cannot trace.

    Example:
        >>> check_sharding(4, "FSDP2")
        (4, 'fsdp2')
        >>> check_sharding(1, None)
        (1, None)
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} is not valid; give the number of data-parallel ranks (GPUs), "
                         f"an int >= 1 (--world-size on the command line).")
    if strategy is None:
        if world_size > 1:
            raise ValueError(f"world_size={world_size} needs a strategy: say how the ranks share the model, "
                             f"strategy='fsdp2' (shard parameters, gradients, optimizer state) or 'ddp' (replicate).")
        return world_size, None
    if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
        hint = closest_hint(strategy.lower() if isinstance(strategy, str) else strategy, STRATEGIES)
        raise ValueError(f"unknown strategy {strategy!r}.{hint} Valid strategies: {', '.join(STRATEGIES)}.")
    strategy = strategy.lower()
    if strategy == "fsdp2":
        missing = _fsdp2_missing()
        if missing is not None:
            raise ValueError(f"strategy 'fsdp2' cannot be planned with torch {torch.__version__}: {missing}. "
                             f"Fix: upgrade torch (2.11 or later), or plan strategy='ddp'.")
    elif not torch.distributed.is_available():
        raise ValueError(f"strategy 'ddp' needs torch.distributed, which torch {torch.__version__} was built "
                         f"without. Fix: install a torch build with distributed support.")
    return world_size, strategy


# ----------------------------------------------------------------------------- the fake rank

@contextlib.contextmanager
def fake_process_group(world_size: int):
    """Be rank 0 of a ``world_size``-rank ``fake`` process group inside the block; yields a 1-D CPU device mesh.

    The group is created here and destroyed on exit, so the caller's process is left as it was.
    A process that already has a default process group (inside torchrun) cannot host the fake one.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("planning FSDP2 needs a process without a default process group (it joins torch's fake "
                           "one for the trace), but this process already has one. Fix: plan before "
                           "init_process_group, or from a separate process (memwrap plan --world-size N ...).")
    # init_process_group wraps sys.excepthook to prefix "[rank0]:" and destroy_process_group does not unwrap it: a
    # planning session that traces FSDP2 fifty times would print an uncaught error's lines with fifty prefixes.
    hook = sys.excepthook
    dist.init_process_group("fake", rank=0, world_size=world_size, store=FakeStore())
    try:
        # The mesh is created before any FakeTensorMode is entered (its init reads real tensors).
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


def _meta_copy(model: nn.Module, stack: Stack | None, depth: int | None) -> nn.Module:
    """A structural copy of ``model`` (cut to ``depth`` stack blocks) with its tensors on the meta device."""
    with truncated(model, stack, depth):
        memo: dict[int, Any] = {}
        for t in itertools.chain(model.parameters(), model.buffers()):
            if id(t) not in memo:
                mt = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
                memo[id(t)] = nn.Parameter(mt, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else mt
        return copy.deepcopy(model, memo)


def _shard(model: nn.Module, stack: Stack | None, mesh) -> nn.Module:
    """``fully_shard`` each block of the stack, then the root: one FSDP unit per block."""
    from torch.distributed.fsdp import fully_shard

    if stack is not None:
        for block in model.get_submodule(stack.name).children():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_categories() -> dict:
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType as R

    return {R.SHARDED_PARAM: "parameters", R.UNSHARDED_PARAM: "unsharded_parameters", R.BUFFER: "buffers",
            R.SHARDED_GRAD: "gradients", R.UNSHARDED_GRAD: "unsharded_gradients", R.ACT: "activations",
            R.TEMP: "temporaries", R.ALL_GATHER: "all_gather", R.REDUCE_SCATTER: "reduce_scatter",
            R.OPT: "optimizer_state", R.INP: "other"}


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    class _FSDPSegmentTracker(SegmentMixin, FSDPMemTracker):
        categories = SHARDED_CATEGORIES
        category_of = _fsdp_categories()

        def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device):
            super().__init__(module, optimizer)
            self.init_segments(device)

    return _FSDPSegmentTracker


@contextlib.contextmanager
def _eager():
    """The probe's step with ``torch.compile`` directives ignored (``torch.compiler.set_stance("force_eager")``).

    Whether an optimizer steps DTensor shards is a question about its update, not about a compiled kernel, and
    compiling made the verdict depend on what had been compiled before: torchao's 8-bit and 4-bit AdamW step one
    compiled function, and on torch 2.13 + torchao 0.18 the FX graph cache (in memory, and on disk under
    ``TORCHINDUCTOR_CACHE_DIR``, shared by the user's processes) handed the second of them the first one's graph,
    which fails its shape assert ("wrong number of dimensions2 for op: input"); the refusal was stored. Eager, the
    37 default optimizers get the same verdicts as compiled afresh with the caches off, in 1.9 s instead of 18.8 s
    on 2 cores (nothing compiled); real FSDP2 training agrees (tests/test_plan_pruning.py). A torch without
    ``set_stance`` steps with its graph caches off instead."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is not None:
        with set_stance("force_eager"):
            yield
        return
    with contextlib.ExitStack() as stack:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        for config, name in ((inductor_config, "fx_graph_cache"), (functorch_config, "enable_autograd_cache")):
            if hasattr(config, name):
                stack.enter_context(config.patch(**{name: False}))
        yield


def sharding_refusal(optimizer: str, mesh) -> str | None:
    """Why memwrap refuses optimizer ``optimizer`` (a registry name) on FSDP2 shards, or None.

    The rule is :func:`memwrap.runtime.distributed.check_sharded_optimizer` itself, applied to the optimizer
    built on a sharded 256x256 layer (so the planner and ``wrap()`` cannot disagree), then one real
    step there (a plugin optimizer that fails on DTensors is refused with its error). An optimizer
    that cannot even be built there (one needing CUDA, or target modules: GaLore, APOLLO) is refused
    too: memwrap plans under FSDP2 only the optimizers it has seen step DTensor shards (measured:
    APOLLO, planned before this rule, fails its first FSDP2 step with "mixed torch.Tensor and DTensor").
    """

    # A real layer (256 KiB): optimizer constructors and steps may read values, which fake tensors cannot. 256 wide,
    # so block-wise quantizers quantize its shards (torchao keeps a 64x64 layer in fp32), and a named child, so
    # optimizers with target modules project it (APOLLO passed as the root, where "all-linear" matched nothing, and
    # fails on FSDP2 shards). Not wider: on the fake process group torchao's 8-bit AdamW fails a 512-wide layer that
    # it steps on real gloo ranks (tests/test_plan_pruning.py runs both).
    probe = _shard(nn.Sequential(nn.Linear(256, 256)), None, mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built, error = None, None
        # What users pass anyway: a learning rate (torch-optimi's optimizers have no default; GaLore's Adafactor steps
        # with lr=None otherwise) and, for GaLore/APOLLO, target modules (Trainer's optim_target_modules). Without a
        # learning rate last: transformers' Adafactor refuses one with its default relative step.
        for extra in ({"lr": 1e-3}, {"lr": 1e-3, "target_modules": "all-linear"}, {}, {"target_modules": "all-linear"}):
            try:
                built = create_optimizer(optimizer, probe.parameters(), model=probe, **extra)
                break
            except Exception as exc:  # noqa: BLE001 - whatever stops the probe is the reason it is not planned
                error = exc  # the last attempt's reason is reported
        if built is None:
            return (f"not verified on FSDP2's DTensor parameters: building it on a sharded probe layer failed "
                    f"({type(error).__name__}: {str(error)[:160]}), so memwrap could not see it step shards. Fix: "
                    f"under FSDP2 use an elementwise torch optimizer (optim='adamw'), or train with DDP.")
        if callable(getattr(built, "train", None)):
            built.train()  # schedule-free optimizers step only in train mode, which training sets
        try:
            check_sharded_optimizer(built)
        except ValueError as exc:
            return str(exc)
        # An optimizer memwrap does not know (a plugin's) may still fail on DTensors: one real step says so.
        for p in probe.parameters():  # not zeros: an update path may be skipped for a zero gradient
            p.grad = torch.full_like(p, 1e-3)
        try:
            with _eager():
                built.step()
        except Exception as exc:  # noqa: BLE001 - whatever the optimizer raises is the reason it is refused
            return (f"{type(built).__name__} ({type(built).__module__.split('.')[0]}) cannot step FSDP2's DTensor "
                    f"parameters: {type(exc).__name__}: {str(exc)[:160]}. Fix: under FSDP2 use an elementwise torch "
                    f"optimizer (optim='adamw'), or train with DDP, where every optimizer sees ordinary tensors.")
    return None


def fsdp2_refusals(optimizers: list[str], world_size: int) -> dict[str, str]:
    """``{name: why}`` for the optimizers memwrap refuses on FSDP2 shards (see :func:`sharding_refusal`).

    The probe always runs on 2 fake ranks: whether an optimizer steps DTensor shards does not depend on how many there
    are, and on the fake process group torchao's 8-bit AdamW failed the probe layer's 8-rank shards (32 rows) while
    it steps real shards (tests/test_plan_pruning.py compares the probe with 2 real gloo ranks)."""
    out = {}
    with contextlib.ExitStack() as stack:
        mesh = None

        def probe(name: str) -> str | None:
            nonlocal mesh
            if mesh is None:  # the fake process group only when a probe runs (not when every answer is stored)
                mesh = stack.enter_context(fake_process_group(min(int(world_size), 2)))
            return sharding_refusal(name, mesh)

        for name in dict.fromkeys(optimizers):
            # The answer depends on the optimizer's code only (memwrap.memory.tracing.disk_cache keys it so).
            # "eager": an answer stored by the compiled probe may be a stale graph's refusal (see _eager).
            why = remember("fsdp2 refusal, eager", [name], functools.partial(probe, name))
            if why is not None:
                out[name] = why
    return out


def run_fsdp2_trace(model: nn.Module, make_batch: Callable[[], Any], loss_fn: Callable | None,
                    options: dict[str, Any], optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None, *,
                    mesh, stack: Stack | None = None, depth: int | None = None) -> TraceResult:
    """Trace one steady-state step of rank 0 of an FSDP2 run (see the module docstring); needs
    :func:`fake_process_group`'s ``mesh``. Same contract as :func:`memwrap.memory.tracing.trace.run_trace`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import memwrap

    start = time.perf_counter()
    dev = torch.device("cpu")
    loss_fn = loss_fn or default_loss
    accumulate = int(options.get("accumulate", 1))
    n_mb = 2 if accumulate > 1 else 1  # as in run_trace: micro-batches 2..N look alike
    wrap_opts = {k: v for k, v in options.items() if k not in NOT_WRAP_OPTIONS}
    wrap_opts["accumulate"] = n_mb
    precision = _precision(options)
    fmodel = _meta_copy(model, stack, depth)
    adjust_fake_model(fmodel, options.get("fake_adjust", ()))  # as the real step would run for the batch's values
    # As run_trace: the precision's storage dtype (bf16-true: bf16 weights) is applied before the optimizer exists,
    # and here before sharding too, so FSDP2 shards (and all-gathers) the dtype training uses.
    precision.convert_module(fmodel)
    fmodel = _shard(fmodel, stack, mesh)
    fmodel.train()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode, warnings.catch_warnings(), _offload_to_host():
        warnings.simplefilter("ignore")
        fmodel.to_empty(device=dev)
        inner = optimizer(fmodel) if optimizer is not None else torch.optim.SGD(fmodel.parameters(), lr=0.0)
        if optimizer is not None and precision.check_optimizer(inner):
            # wrap() would convert a fresh optimizer (AdamW -> optimi's Kahan AdamW): convert before its first step.
            inner = precision.convert_optimizer(inner, fmodel, step_in_backward=bool(options.get("step_in_backward")))
        params = [p for p in fmodel.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        if optimizer is not None:  # steady state: the optimizer's state exists before the step
            inner.step()
        # DTensor computes an op's output sharding once per shape and caches it; on a miss it runs the op on
        # global-shape tensors under the active fake mode, which the tracker would count as memory (a whole
        # unsharded gradient in the clipping norm, on the first trace of a process only). Warm the cache
        # with the norm and clipping the wrapped optimizer runs; the step itself was warmed just above.
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        inner.zero_grad(set_to_none=True)
        wmodel, wopt = memwrap.wrap(fmodel, inner, **wrap_opts)
        tracker = _tracker_class()(fmodel, inner, dev)
        batches = [_to_fake(make_batch(), mode, dev) for _ in range(n_mb)]
        tracker.track_inputs(tuple(t for b in batches for t in tree_flatten(b)[0] if isinstance(t, torch.Tensor)))
        with tracker:  # the tracker registers FSDP2's shards when entered: read the persistent state there
            state = _state(tracker)
        # The cyclic garbage collector runs at moments that depend on the process's allocation history;
        # a collection inside the traced step changed the optimizer-phase segment from run to run (by a
        # full gradient's size, 16 MiB of a 60 MiB step). Paused, the same model always traces the same.
        paused = gc.isenabled()
        gc.disable()  # (no collection first: it cost 0.8 s per trace, and garbage from before is not tracked)
        try:
            drive_step(tracker, fmodel, wmodel, wopt, batches, loss_fn, stack,
                       keep_outputs=bool(options.get("keep_outputs", True)))
        finally:
            if paused:
                gc.enable()
    del batches, wmodel, wopt, inner, fmodel
    ops = (tracker.ops["forward"] + tracker.ops["backward"]) // n_mb
    return TraceResult(tracker.segments, state, tracker.flops // n_mb, ops, [], n_mb, depth,
                       time.perf_counter() - start, flop_classes=per_micro_batch(tracker.flop_classes, n_mb),
                       op_stats=tracker.op_stats.as_dict(n_mb))


# ----------------------------------------------------------------------------- DDP

def ddp_bucket_bytes(model: nn.Module, bucket_cap_mb: float = 25.0) -> tuple[int, int]:
    """``(total, buckets)``: bytes of DDP's flat gradient buckets on each rank, and how many there are.

    The assignment is torch's own (``dist._compute_bucket_assignment_by_size`` with DDP's default
    first bucket of 1 MiB and ``bucket_cap_mb``), as DDP rebuilds its buckets after the first
    iteration (it starts with a single bucket of the same total); each bucket is one flat tensor of
    its parameters' elements, so the total is the trainable parameters' gradient bytes.

    Example:
        >>> ddp_bucket_bytes(nn.Linear(1024, 1024))
        (4198400, 2)
    """
    import torch.distributed as dist

    params = [p for p in model.parameters() if p.requires_grad]
    seen: set[int] = set()
    unique = [p for p in params if not (id(p) in seen or seen.add(id(p)))]
    if not unique:
        return 0, 0
    first = int(getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))
    limits = [first, int(bucket_cap_mb * 1024 * 1024)]
    indices, _ = dist._compute_bucket_assignment_by_size(list(reversed(unique)), limits, [False] * len(unique))
    rev = list(reversed(unique))
    total = sum(sum(rev[i].numel() for i in bucket) * rev[bucket[0]].element_size() for bucket in indices)
    return total, len(indices)


def with_gradient_buckets(segments: dict, nbytes: int) -> dict:
    """Every segment with ``gradient_buckets`` bytes added (alive for the whole run)."""
    out = {}
    for key, seg in segments.items():
        cats = dict(seg.bytes)
        cats["gradient_buckets"] = cats.get("gradient_buckets", 0) + nbytes
        out[key] = dataclasses.replace(seg, total=seg.total + nbytes, bytes=cats)
    return out

