"""Measure the real peak of training steps, to check the planner's predictions.

CPU: the peak of live bytes seen by torch's CPU allocator, from ``torch.profiler`` memory events
(every allocation and free the c10 allocator reports, in order) plus the bytes alive when the
profile starts (parameters, buffers, optimizer state, batch). This is independent of the fake
trace: it counts what the allocator actually handed out, including tensors the dispatcher never
shows (kernel-internal buffers that go through the c10 allocator).

CUDA: ``torch.cuda.max_memory_allocated`` (and ``max_memory_reserved``) over the measured steps,
after ``reset_peak_memory_stats``.

Example:
    >>> from memwrap.models import build_preset, preset_batch
    >>> r = measure_peak(build_preset("gpt2-tiny"), preset_batch("gpt2-tiny", 2, 32))  # doctest: +SKIP
    >>> r["peak"] > r["baseline"]  # doctest: +SKIP
    True
"""
from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memwrap.memory.monitor import process_memory, reset_process_peak
from memwrap.memory.tracing.batch import default_loss, split_batch
from memwrap.plugin.registry import create_optimizer
from memwrap.quiet import quiet_native_stderr

__all__ = ["measure_peak", "live_bytes", "allocator_growth"]


def live_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages reachable from modules, optimizers and tensors (nested).

    Example:
        >>> live_bytes(torch.nn.Linear(10, 10, bias=False))
        400
    """
    seen: set[tuple] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        st = t.untyped_storage()
        key = (t.device, st.data_ptr(), st.nbytes())
        if st.nbytes() and key not in seen:
            seen.add(key)
            total += st.nbytes()

    def visit(obj: Any) -> None:
        if isinstance(obj, nn.Module):
            for p in obj.parameters():
                add(p)
                if p.grad is not None:
                    add(p.grad)
            for b in obj.buffers():
                add(b)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                visit(list(state.values()) if isinstance(state, dict) else state)
        elif isinstance(obj, torch.Tensor):
            add(obj)
        else:
            for leaf in tree_flatten(obj)[0]:
                if isinstance(leaf, (torch.Tensor, nn.Module, torch.optim.Optimizer)):
                    visit(leaf)

    for obj in objects:
        visit(obj)
    return total


def allocator_growth(fn: Callable[[], Any]) -> int:
    """Most bytes the CPU allocator held above its level when ``fn`` started, from the profiler's memory events.

    Add :func:`live_bytes` of what was alive before to get a peak comparable with ``measure_peak``.

    Example:
        >>> allocator_growth(lambda: torch.ones(1024)) >= 4096
        True
    """
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    # kineto prints "USDT ... profiler_start/stop" natively at each start and stop: held back around those two calls
    # only, so whatever fn itself prints still shows.
    with quiet_native_stderr():
        prof.start()
    try:
        fn()
    finally:
        with quiet_native_stderr():
            prof.stop()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak


class _Loop:
    """The measured training loop, in the shape the estimate assumes (``keep_outputs``, see
    :func:`memwrap.memory.tracing.trace.drive_step`): with ``keep_outputs`` the model's outputs are held until
    the next forward has returned, as ``outputs = model(**batch)`` in a loop holds them."""

    def __init__(self, wmodel, wopt, batches, loss_fn, keep_outputs: bool):
        self.wmodel, self.wopt, self.batches, self.loss_fn, self.keep_outputs = wmodel, wopt, batches, loss_fn, keep_outputs
        self.held: Any = None

    def update(self) -> None:
        for batch in self.batches:
            args, kwargs, targets = split_batch(batch)
            outputs = self.wmodel(*args, **kwargs)
            self.held = None  # rebinding the loop's name frees the previous outputs once the forward has returned
            loss = self.loss_fn(outputs, targets)
            if self.keep_outputs:
                self.held = outputs
            del outputs, args, kwargs, targets
            loss.backward()
            del loss
            self.wopt.step()
            self.wopt.zero_grad()


def measure_peak(model: nn.Module | Callable[[], nn.Module], batch: Any, loss_fn: Callable | None = None, *,
                 steps: int = 1, optimizer: str = "adamw", device: str | torch.device | None = None,
                 profile: bool = True, keep_outputs: bool = True, **wrap_options: Any) -> dict[str, Any]:
    """Run ``1 + steps`` real optimizer updates under ``memwrap.wrap(**wrap_options)`` and measure the peak.

    The first update creates the optimizer state (not measured, as in the estimate's steady
    state); the next ``steps`` updates of ``accumulate`` micro-batches each are measured. ``model``
    is a module or a zero-argument factory; ``batch`` a micro-batch (or a callable returning one).
    ``keep_outputs``: the loop holds the model's outputs through backward (True, as the estimate's default) or
    drops them once the loss is computed (False); see :func:`memwrap.estimate`.

    Returns ``peak`` (bytes: CPU allocator peak of live bytes, or ``torch.cuda.max_memory_allocated``),
    ``baseline`` (bytes alive before the measured steps), ``reserved`` (CUDA only), ``rss_peak`` and
    ``rss_start`` (process memory, CPU) and ``method``. ``profile=False`` (CPU) skips the profiler,
    whose own buffers inflate process memory: ``peak`` is then None and only the RSS figures count.

    Example:
        >>> measure_peak(lambda: torch.nn.Linear(64, 64), torch.randn(8, 64), steps=1)["peak"] > 0
        True
    """
    import memwrap

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # blocks cached by earlier work would count in this run's reserved peak
    rss_start = process_memory()["rss"]
    reset_process_peak()
    if not isinstance(model, nn.Module):
        model = model()
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    model = model.to(dev).train()
    make = batch if callable(batch) else (lambda: batch)
    accumulate = int(wrap_options.get("accumulate", 1))
    batches = [_to(make(), dev) for _ in range(accumulate)]
    loss_fn = loss_fn or default_loss
    opt_name = wrap_options.pop("optim", None) or optimizer
    inner = create_optimizer(opt_name, model.parameters(), model=model)
    wmodel, wopt = memwrap.wrap(model, inner, **wrap_options)
    loop = _Loop(wmodel, wopt, batches, loss_fn, keep_outputs)
    loop.update()  # warm-up: optimizer state now exists (and, with keep_outputs, the last outputs are held)
    gc.collect()
    result: dict[str, Any] = {"device": str(dev), "steps": steps, "optimizer": opt_name}
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        result["baseline"] = torch.cuda.memory_allocated(dev)
        for _ in range(steps):
            loop.update()
        torch.cuda.synchronize(dev)
        result.update(peak=torch.cuda.max_memory_allocated(dev), reserved=torch.cuda.max_memory_reserved(dev),
                      method="torch.cuda.max_memory_allocated")
    elif not profile:
        for _ in range(steps):
            loop.update()
        result.update(peak=None, baseline=live_bytes(model, wopt.optimizer, batches, loop.held), method="process RSS only")
    else:
        # The profiler sees no free of a block allocated before it started, so outputs held from the warm-up would
        # stay counted after the next forward frees them: they are dropped here, and one more update runs inside the
        # profile, so that each later update starts with outputs the profile saw made (the steady state).
        extra = 0
        if keep_outputs:
            loop.held = None
            gc.collect()
            extra = 1
        # wopt.optimizer, not inner: a precision may have replaced the optimizer (bf16-true: optimi's Kahan AdamW).
        baseline = live_bytes(model, wopt.optimizer, batches, wopt.scaler.__dict__)

        def updates() -> None:
            for _ in range(steps + extra):
                loop.update()

        peak = allocator_growth(updates)
        result.update(peak=baseline + peak, baseline=baseline, method="torch.profiler CPU allocator events")
    mem = process_memory()
    result.update(rss_start=rss_start, rss_peak=mem["peak"])
    return result


def _to(batch: Any, device: torch.device) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
