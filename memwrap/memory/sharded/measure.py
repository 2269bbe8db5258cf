"""Measure one rank's real peak during data-parallel steps (FSDP2 or DDP), to check the sharded estimate.

Called on every rank of a running job (torchrun, an initialized process group). The rank builds
the model, shards it as :mod:`memwrap.memory.sharded.trace` traces it (``fully_shard`` on each block of
the stack, then the root) or wraps it in DDP, wraps it with ``memwrap.wrap``, runs one warm-up
update (the optimizer state appears) and then measures the next update.

CPU: the c10 CPU allocator's own running total of live bytes, read from ``torch.profiler``'s
memory events ("Total Allocated") during the measured update: ``peak`` is its maximum,
``baseline`` its value when the update starts (parameter shards, optimizer state, DDP's buckets,
FSDP2's buffers, the batches). The profiler's per-event byte counts are not summed: gloo drops its
last reference to a communication tensor on its own worker threads, where the profiler records no
event, so a running sum of events drifts upwards on some ranks (measured: +4.5 MB on rank 1 of an
FSDP2 run, +17 MB with DDP). c10's ``FLAGS_caffe2_report_cpu_memory_usage`` makes the allocator
keep its total across every thread; it is switched on (through ``ctypes``, as torch exposes no
setter) before the model is built, so the total counts exactly what this measurement allocated.
Allocations gloo makes with its own allocator are counted by neither the trace nor this
measurement. CUDA: ``torch.cuda.max_memory_allocated``.

Example (under ``torchrun --nproc-per-node 2``)::

    >>> dist.init_process_group("gloo")  # doctest: +SKIP
    >>> r = measure_rank_peak(lambda: build_preset("gpt2-tiny"), lambda: preset_batch("gpt2-tiny", 2, 64),
    ...                       strategy="fsdp2")  # doctest: +SKIP
    >>> r["peak"]  # doctest: +SKIP
"""
from __future__ import annotations

import gc
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memwrap.memory.measure import _Loop, _to
from memwrap.memory.tracing.batch import default_loss
from memwrap.memory.tracing.trace import find_stack
from memwrap.plugin.registry import create_optimizer

__all__ = ["measure_rank_peak"]


def _count_every_thread() -> bool:
    """Switch on c10's cross-thread accounting of CPU allocations; False when this torch has no such flag."""
    import ctypes
    import os

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
        ctypes.c_bool.in_dll(lib, "FLAGS_caffe2_report_cpu_memory_usage").value = True
    except (OSError, ValueError):
        return False
    return True


def _allocator_totals(prof, path: str) -> list[int]:
    """The allocator's total live bytes after each memory event, in order (from the Chrome trace)."""
    import json

    prof.export_chrome_trace(path)
    with open(path) as fh:
        events = json.load(fh)["traceEvents"]
    rows = sorted((e["args"].get("Ev Idx", 0), e["args"]["Total Allocated"], e["args"]["Bytes"]) for e in events
                  if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    return [(total, nbytes) for _, total, nbytes in rows]


def _total_now() -> int:
    """The c10 CPU allocator's total live bytes right now (read from one tiny profiled allocation)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        probe = torch.empty(16, dtype=torch.uint8)
    with tempfile.TemporaryDirectory() as tmp:
        totals = _allocator_totals(prof, os.path.join(tmp, "now.json"))
    del probe
    return totals[0][0] - totals[0][1] if totals else 0


def _build(factory: Callable[[], nn.Module], strategy: str, device: torch.device) -> nn.Module:
    # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
    from memwrap.memory.sharded.trace import _shard

    model = factory().to(device)
    if strategy == "fsdp2":
        return _shard(model, find_stack(model), None)
    if strategy == "ddp":
        ids = [device.index] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    raise ValueError(f"strategy {strategy!r} is not measurable here; use 'fsdp2' or 'ddp'.")


def measure_rank_peak(factory: Callable[[], nn.Module], make_batch: Callable[[], Any], *, strategy: str,
                      loss_fn: Callable | None = None, optimizer: str = "adamw", device: str | None = None,
                      keep_outputs: bool = True, **wrap_options: Any) -> dict[str, Any]:
    """This rank's peak bytes during one steady-state update (see the module docstring).

    ``factory()`` builds the full model (same seed on every rank), ``make_batch()`` this rank's
    micro-batch; ``wrap_options`` go to ``memwrap.wrap`` (``accumulate`` micro-batches per update).
    ``keep_outputs``: the loop's shape, as in :func:`memwrap.memory.measure.measure_peak`.
    Returns ``peak``, ``baseline`` (bytes alive when the measured update starts), ``rank``,
    ``world_size``, ``strategy`` and ``method``.
    """
    import torch.distributed as dist

    import memwrap

    if device is None and torch.cuda.is_available():
        device = f"cuda:{torch.cuda.current_device()}"  # the rank's GPU (torch.cuda.set_device(LOCAL_RANK))
    dev = torch.device(device or "cpu")
    loss_fn = loss_fn or default_loss
    accumulate = int(wrap_options.get("accumulate", 1))
    opt_name = wrap_options.pop("optim", None) or optimizer
    gc.collect()

    def setup():
        model = _build(factory, strategy, dev).train()
        inner = create_optimizer(opt_name, model.parameters(), model=model)
        wmodel, wopt = memwrap.wrap(model, inner, **wrap_options)
        batches = [_to(make_batch(), dev) for _ in range(accumulate)]
        loop = _Loop(wmodel, wopt, batches, loss_fn, keep_outputs)
        loop.update()  # warm-up: the optimizer state now exists
        return loop

    result: dict[str, Any] = {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "strategy": strategy,
                              "optimizer": opt_name, "options": dict(wrap_options)}
    if dev.type == "cuda":
        loop = setup()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result["baseline"] = torch.cuda.memory_allocated(dev)
        loop.update()
        torch.cuda.synchronize(dev)
        result.update(peak=torch.cuda.max_memory_allocated(dev), method="torch.cuda.max_memory_allocated")
        return result
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    if not _count_every_thread():
        raise RuntimeError(f"torch {torch.__version__} has no c10 flag caffe2_report_cpu_memory_usage, which "
                           f"per-rank CPU measurement needs; measure on CUDA instead.")
    # What is alive before this measurement (an earlier measurement's tensors that gloo's threads still hold,
    # measured up to 3 MB on one rank) is not this run's memory: counted from here.
    dist.barrier()
    gc.collect()
    start = _total_now()
    loop = setup()
    gc.collect()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loop.update()
    with tempfile.TemporaryDirectory() as tmp:
        totals = _allocator_totals(prof, os.path.join(tmp, "trace.json"))
    baseline = (totals[0][0] - totals[0][1] if totals else start) - start
    peak = max((t - start for t, _ in totals), default=baseline)
    result.update(peak=peak, baseline=baseline, method="c10 CPU allocator total (torch.profiler memory events)")
    return result
