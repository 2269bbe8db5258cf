"""Kernel workspaces the fake trace cannot see, measured with small real calls and fitted.

Some kernels allocate memory that never passes through the dispatcher: oneDNN (mkldnn) convolutions reorder
inputs and weights into blocked layouts, and its RNN layers return a workspace that the meta kernel sizes 0 but
that the real kernel fills (6 MB for one LSTM layer of hidden 128 over 50 x 16 steps) and autograd keeps for
backward; the CPU flash-attention kernel behind SDPA takes per-thread blocks of scores (393 KiB in forward, about
1 MiB in backward at 4 heads over 512 tokens on 2 threads). An attention call whose probes would cost more than
2 GFLOP is not probed and is reported as not measured. A trace on fake tensors therefore under-predicts such models (a BatchNorm conv net by ~10 %, an LSTM
by several times its activations).

For each such op the trace meets (lazily: only ops the traced model calls), :class:`Workspace` runs the op for
real on the trace's device at small sizes of its batch dimension (1, 2, 3, and 5 held out), measures

* ``scratch`` = the allocator's peak during the call minus the bytes of the real outputs, with the method
  :mod:`memwrap.memory.measure` uses for the step's peak (CPU: ``torch.profiler`` allocator events via
  :func:`~memwrap.memory.measure.allocator_growth`; CUDA: ``torch.cuda.max_memory_allocated``), and
* the real size of each output the fake kernel returns empty (a placeholder workspace),

fits each linearly in the batch size and checks the fit on the held-out size. A fit that misses the held-out
size by more than 10 % (and 16 KiB) is replaced by an upper bound (the largest probe plus the steepest measured
slope) and reported as a bound. The trace adds ``scratch`` as a transient at the op (a spike in the op's snapshot,
gone after it) and gives a placeholder output its measured size, so autograd keeps what the real kernel keeps.

Fits are cached as JSON per (torch version, device type) in ``$MEMWRAP_CACHE_DIR`` (default
``$XDG_CACHE_HOME/memwrap`` or ``~/.cache/memwrap``), keyed by the op, the backend flags (mkldnn, threads; cuDNN) and the call's dtypes and
shapes apart from the batch size. ``MEMWRAP_WORKSPACE=0`` (or ``estimate(..., workspace=False)``) turns it off.

Example:
    >>> ws = Workspace(torch.device("cpu"))  # doctest: +SKIP
    >>> est = memwrap.estimate(convnet, batch)  # doctest: +SKIP
    >>> est.workspace  # doctest: +SKIP
    {'aten.convolution.default': {'bytes': 1572864, 'calls': 3, 'kind': 'fit'}, ...}
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import _disable_current_modes

__all__ = ["Workspace", "ThreadsPinned", "pin_threads", "probes_refused", "training_threads", "cache_dir", "check_option", "enabled", "installed_digest", "modelled_ops", "probe_device", "switch", "probe_count", "FIT_SIZES", "HELD_OUT", "STEP_SIZES"]

aten = torch.ops.aten
# oneDNN picks other algorithms for a batch of one (a 64-channel 3x3 convolution: 576 KiB of scratch at batch 1,
# 272 KiB at 2, then +64 KiB per sample, exactly): the line is fitted from 2 up, checked at 6, and a call of a batch
# size below the fit sizes is measured at that size itself (added to the cached entry).
FIT_SIZES = (2, 4)
HELD_OUT = 6
# Flat parameters an optimizer step is probed on (fit, fit, held out): above bitsandbytes' min_8bit_size (4096),
# below which it keeps 32-bit state.
STEP_SIZES = (1 << 16, 1 << 17, 3 << 16)
_REL_TOL, _ABS_TOL = 0.10, 16 << 10
_FORMAT = 1
_probes = {"count": 0}


def probe_count() -> int:
    """How many op signatures have been probed with real calls in this process (a cache hit probes none).

    Example:
        >>> isinstance(probe_count(), int)
        True
    """
    return _probes["count"]


def enabled(option: bool | None = None) -> bool:
    """Whether the trace adds measured workspaces: ``option`` if given, else not ``MEMWRAP_WORKSPACE=0``.

    Example:
        >>> enabled(False)
        False
    """
    return switch("MEMWRAP_WORKSPACE", option)


def check_option(option: bool | str | torch.device | None) -> bool | str | None:
    """``estimate(workspace=...)`` checked, in the form a trace carries (a device by name: the trace cache's key and
    the report read it as text); a CUDA device on a machine without one is refused before anything is traced.

    Example:
        >>> check_option(torch.device("cpu")), check_option(None)
        ('cpu', None)
    """
    if option is None or isinstance(option, bool):
        return option
    if isinstance(option, torch.device):
        option = str(option)
    if isinstance(option, str):
        try:
            kind = torch.device(option).type
        except RuntimeError:  # not a device name ("yes")
            kind = None
        if kind in ("cpu", "cuda"):
            probe_device(option, "meta", torch.device("cpu"))  # the refusal without CUDA, naming the fix
            return option
    raise TypeError(f"estimate(workspace={option!r}) must be True, False, None (None: on unless the environment sets "
                    "MEMWRAP_WORKSPACE=0) or the device to measure on, 'cpu' or 'cuda'.")


def probe_device(option: bool | str | None, home: str, traced: torch.device) -> torch.device | None:
    """Where a trace measures its kernels' workspaces, or None (not modelled).

    ``option`` is ``estimate(workspace=...)``: False turns it off, True / None (the ``MEMWRAP_WORKSPACE`` default) probe
    on the device the model will train on (``home``: its parameters' device, "meta" for a factory: then the traced
    one), a device name (``"cuda"``) probes there: a model built on the CPU or the meta device, planned for a GPU.

    Example:
        >>> probe_device(None, "meta", torch.device("cpu"))
        device(type='cpu')
        >>> probe_device(False, "cpu", torch.device("cpu")) is None
        True
    """
    if isinstance(option, (str, torch.device)):
        device = torch.device(option)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"workspace={str(option)!r}: the kernel workspaces are measured with small real calls on "
                             "that device, and this machine has no CUDA device. Fix: plan on the GPU machine, or "
                             "workspace=True (this machine's kernels) / False (not modelled).")
        return device
    if not enabled(option):
        return None
    if home in (traced.type, "meta"):
        return traced
    if home == "cuda" and torch.cuda.is_available():
        # A model on the GPU runs cuDNN's convolutions there: their workspaces are measured on it.
        return torch.device("cuda", torch.cuda.current_device())
    return None


def switch(variable: str, option: bool | None = None) -> bool:
    """``option`` if given, else whether the environment leaves ``variable`` on (unset, or anything but 0, false, no,
    off): how memwrap's caches and helpers are turned off (``MEMWRAP_WORKSPACE``, ``MEMWRAP_TRACE_CACHE``, ...).

    Example:
        >>> switch("MEMWRAP_SOMETHING_UNSET"), switch("MEMWRAP_SOMETHING_UNSET", False)
        (True, False)
    """
    if option is not None:
        return bool(option)
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def installed_digest() -> str:
    """A digest of every installed distribution and its version: what a measured failure (an optimizer that cannot
    step on this machine) and a stored trace were measured with.

    Example:
        >>> len(installed_digest())
        64
    """
    names = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions())
    return hashlib.sha256(";".join(names).encode()).hexdigest()


def cache_dir() -> Path:
    """The folder of the fit caches: ``$MEMWRAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/memwrap``, else ``~/.cache/memwrap``.

    Example:
        >>> cache_dir().name in ("memwrap",) or "MEMWRAP_CACHE_DIR" in os.environ
        True
    """
    if os.environ.get("MEMWRAP_CACHE_DIR"):
        return Path(os.environ["MEMWRAP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "memwrap"


# ----------------------------------------------------------------------------- the ops and their batch dimension

def _conv_dims(args: tuple) -> dict[int, int]:
    return {0: 0}


def _conv_bw_dims(args: tuple) -> dict[int, int]:
    return {0: 0, 1: 0}


# The layer op always receives time-major (T, B, F) sequences (torch's mkldnn_rnn transposes a batch_first input
# before it, and passes the flag on unused): the batch is dimension 1 of the sequences, 0 of the states. The kernel
# does not check shapes, so a call whose sequence and state batch sizes disagree is not probed (None).
def _rnn_dims(args: tuple) -> dict[int, int] | None:
    if args[0].dim() != 3 or args[0].shape[1] != args[5].shape[0]:
        return None
    return {0: 1, 5: 0, 6: 0}


def _rnn_bw_dims(args: tuple) -> dict[int, int] | None:
    if args[0].dim() != 3 or args[0].shape[1] != args[5].shape[0]:
        return None
    return {0: 1, 5: 0, 6: 0, 7: 1, 8: 0, 9: 0, 10: 1, 11: 0, 12: 0}


def _rnn_bw_prepare(args: list) -> list:
    # The backward reads the forward's output, states and workspace: a real forward at the probe size makes them.
    out, hy, cy, ws = aten.mkldnn_rnn_layer.default(*args[0:7], args[13], args[20], args[14], args[15], args[16],
                                                    args[17], args[19], args[21], args[18])
    args[7], args[8], args[9], args[22] = out, hy, cy, ws
    return args


# The CPU flash-attention kernel (what SDPA runs on CPU without dropout) takes per-thread buffers from the CPU
# allocator inside the kernel: measured at 4 heads of 16 over 512 tokens, 2 threads, bf16: 393 KiB in forward (one
# block of scores per thread, the same at every batch size) and 902 KiB + 64 KiB per sample in backward. The trace
# under-predicted a checkpointed bf16 Llama (2 layers, d 64, 1 x 512 tokens) by 2.1% there. Query, key, value (and
# in backward the output gradient, output and logsumexp) have the batch in dimension 0; a mask keyword too when it
# is per sample (a broadcast mask of batch 1 stays as it is).
def _sdpa_dims(args: tuple) -> dict[int, int] | None:
    if args[0].dim() != 4:
        return None
    return {0: 0, 1: 0, 2: 0}


def _sdpa_bw_dims(args: tuple) -> dict[int, int] | None:
    if args[0].dim() != 4:
        return None
    return {i: 0 for i in range(6)}


# oneDNN's 16-bit matmuls (what a bf16 or fp16 nn.Linear runs on a CPU with AVX512-BF16 / AMX) take a scratchpad
# from the CPU allocator inside the kernel: 84-125 KiB for (260 x 64) @ (64 x 128)-sized bf16 products on a 2-core
# EPYC, 0 for fp32 (MKL allocates nothing through it) and for tiny products. Measured in the zoo: a bf16 ViT was
# 107 KiB (-3.8%) under without it. The scratch depends on the whole shape, not linearly on a batch dimension, so
# each distinct call is measured once at its own shape (kind "measured"), under a cost cap.
_EXACT: dict[int, int] = {}


def _matmul_dims(args: tuple) -> dict[int, int] | None:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not tensors or any(t.dtype not in (torch.bfloat16, torch.float16) for t in tensors):
        return None
    return _EXACT


# op -> (batch dimension of each scaled tensor argument, preparation of the real arguments or None)
_OPS: dict[Any, tuple[Callable, Callable | None]] = {
    aten.convolution.default: (_conv_dims, None),
    aten.convolution_backward.default: (_conv_bw_dims, None),
    aten.mkldnn_rnn_layer.default: (_rnn_dims, None),
    aten.mkldnn_rnn_layer_backward.default: (_rnn_bw_dims, _rnn_bw_prepare),
    aten._scaled_dot_product_flash_attention_for_cpu.default: (_sdpa_dims, None),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (_sdpa_bw_dims, None),
    aten.mm.default: (_matmul_dims, None),
    aten.addmm.default: (_matmul_dims, None),
    aten.bmm.default: (_matmul_dims, None),
    aten.baddbmm.default: (_matmul_dims, None),
}
_MATMULS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# The probes of an attention call cost 4 * batch * heads * queries * keys * head size FLOPs each: above this (at the
# held-out batch), the call is not probed but reported as not measured. Its scratch is per-thread blocks of scores
# (about a MiB per thread at 2048 tokens), small beside the activations of a model that large.
_PROBE_FLOPS = 2e9


def _probe_too_costly(func, args: tuple) -> str:
    """Why a call's probes would cost too much to run while planning, or ''."""
    if func in _MATMULS:
        a, b = (args[1], args[2]) if func in (aten.addmm.default, aten.baddbmm.default) else (args[0], args[1])
        flops = 2 * a.numel() * b.shape[-1]
        if flops <= _PROBE_FLOPS or _matmul_dims(args) is None:
            return ""
        return (f"not measured: its probe would run {flops / 1e9:.0f} GFLOP of real matmul; oneDNN's 16-bit "
                "scratchpad (about 100 KiB at small sizes) is left out")
    if func not in _KWARGS_OK:
        return ""
    q, k = args[0], args[1] if func is aten._scaled_dot_product_flash_attention_for_cpu.default else args[2]
    flops = 4 * HELD_OUT * q.shape[1] * q.shape[2] * k.shape[2] * q.shape[3]
    if flops <= _PROBE_FLOPS:
        return ""
    return (f"not measured: its probes would run {flops / 1e9:.0f} GFLOP of real attention; the kernel's per-thread "
            "score blocks (about a MiB per thread) are left out")


# Ops whose keyword arguments (SDPA's scale and mask) are part of the call the probes repeat.
_KWARGS_OK = frozenset({aten._scaled_dot_product_flash_attention_for_cpu.default,
                        aten._scaled_dot_product_flash_attention_for_cpu_backward.default})
# CPU-only kernels (forward and backward) -> what runs on another device instead, for the "not modelled" row.
_RNN_ELSEWHERE = ("oneDNN's RNN layer; there the layer runs cuDNN's RNN for an LSTM or GRU, whose workspace and "
                  "reserve kept for backward")
_SDPA_ELSEWHERE = ("the CPU flash-attention kernel; there SDPA runs FlashAttention or memory-efficient kernels, whose "
                   "scratch")
_CPU_KERNEL = {aten.mkldnn_rnn_layer.default: _RNN_ELSEWHERE, aten.mkldnn_rnn_layer_backward.default: _RNN_ELSEWHERE,
               aten._scaled_dot_product_flash_attention_for_cpu.default: _SDPA_ELSEWHERE,
               aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _SDPA_ELSEWHERE}


# What a CUDA model's probes can measure: the fake trace runs on the CPU, so it records the device-neutral convolution
# ops (on CUDA, cuDNN picks the kernel and its workspace), oneDNN's RNN layers and the CPU flash-attention kernel,
# which are CPU kernels: a CUDA LSTM runs cuDNN's RNN instead, and CUDA SDPA its own kernels, which the CPU trace
# never records (not modelled; benchmarks/gpu_check.py's zoo_cuda row).
_DEVICE_NEUTRAL = (aten.convolution.default, aten.convolution_backward.default)


def modelled_ops(device: torch.device) -> frozenset:
    """The ops whose workspace :class:`Workspace` measures on ``device``.

    Example:
        >>> sorted(str(op) for op in modelled_ops(torch.device("cuda")))
        ['aten.convolution.default', 'aten.convolution_backward.default']
    """
    return frozenset(_OPS) if torch.device(device).type == "cpu" else frozenset(_DEVICE_NEUTRAL)


_threads = {"training": None, "pinned": False, "refused": 0}


def training_threads(count: int | None = None) -> int:
    """The thread count the real step runs with, which probes measure at (set by a trace's forked child, which
    itself runs on one thread); the current count when none was set.

    Example:
        >>> training_threads() == torch.get_num_threads()
        True
    """
    if count is not None:
        _threads["training"] = int(count)
    return _threads["training"] or torch.get_num_threads()


class ThreadsPinned(Exception):
    """A probe needs another thread count than this process may use: it is a forked trace child (see
    :func:`pin_threads`). The child's trace is then given up and the parent runs it (memwrap.memory.tracing.parallel)."""


def pin_threads() -> None:
    """Forbid this process to change its thread count, and so to probe at the step's: called in a trace's forked
    child. OpenMP's thread pool does not survive fork: a parallel region at more threads than the child started
    with hangs it (a bf16 matmul probe at 2 threads never returned, and the parent waited 30 s for each such
    trace before running it itself: a 12-trace plan of a 2-layer GPT took 97 s instead of 8).

    Example:
        >>> probes_refused()
        0
    """
    _threads["pinned"] = True


def probes_refused() -> int:
    """How many probes this process refused because its thread count is pinned (:func:`pin_threads`): a trace that
    refused one is incomplete, whatever the code around the probe did with the :class:`ThreadsPinned` it raised.

    Example:
        >>> probes_refused() >= 0
        True
    """
    return _threads["refused"]


@contextlib.contextmanager
def _at_training_threads():
    now, want = torch.get_num_threads(), training_threads()
    if now != want and _threads["pinned"]:
        _threads["refused"] += 1
        raise ThreadsPinned(f"kernel workspace probes run at the training step's {want} threads; this forked trace "
                            f"process runs on {now} and cannot switch (OpenMP does not survive fork)")
    if now != want:
        torch.set_num_threads(want)
    try:
        yield
    finally:
        if now != want:
            torch.set_num_threads(now)


def _flags(device: torch.device) -> dict[str, Any]:
    if device.type == "cpu":
        # oneDNN sizes some scratchpads per thread: the thread count is part of the key.
        return {"mkldnn": bool(torch.backends.mkldnn.enabled), "threads": training_threads()}
    if device.type == "cuda":
        return {"cudnn": bool(torch.backends.cudnn.enabled), "benchmark": bool(torch.backends.cudnn.benchmark)}
    return {}


def _kwarg_dims(kwargs: dict, n: int) -> dict[str, int]:
    """The keyword tensors with the call's batch (size ``n`` > 1) in dimension 0: scaled with it in the probes."""
    return {k: 0 for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.dim() and n > 1 and v.shape[0] == n}


def _describe(x: Any, dim: int | None) -> Any:
    if isinstance(x, torch.Tensor):
        shape = list(x.shape)
        if dim is not None:
            shape[dim] = "N"
        order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
        return ["T", str(x.dtype), shape, order]
    if isinstance(x, (list, tuple)):
        return [_describe(v, None) for v in x]
    return x if isinstance(x, (bool, int, float, str, type(None))) else repr(x)


def _real_like(t: torch.Tensor, dim: int | None, n: int, device: torch.device) -> torch.Tensor:
    """A real tensor with ``t``'s dtype and dimension order (strides' order), dimension ``dim`` set to ``n``; the
    dimensions ``t`` broadcasts (stride 0, e.g. the gradient of a sum) broadcast in it too."""
    shape = list(t.shape)
    if dim is not None:
        shape[dim] = n
    wide = [d for d in range(t.dim()) if t.stride(d) == 0 and t.shape[d] > 1]
    if wide:
        small = _real_like(t.as_strided([1 if d in wide else s for d, s in enumerate(t.shape)], t.stride()),
                           dim if dim not in wide else None, n, device)
        return small.expand(shape)
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))  # outermost first, as the traced layout
    base_shape = [shape[d] for d in order]
    if t.dtype.is_floating_point or t.dtype.is_complex:
        base = torch.randn(base_shape, dtype=t.dtype, device=device)
    else:
        base = torch.zeros(base_shape, dtype=t.dtype, device=device)
    inverse = [order.index(d) for d in range(t.dim())]
    return base.permute(inverse)


def _storages_bytes(obj: Any) -> int:
    seen: dict[int, int] = {}
    for t in tree_flatten(obj)[0]:
        if isinstance(t, torch.Tensor):
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _measure(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """(peak bytes the allocator held above its level at the start, the outputs), as measure_peak measures."""
    held: list = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        held.append(fn())
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base, held[0]
    # The CPU allocator's events, as measure_peak reads them: a name needed on this branch only.
    from memwrap.memory.measure import allocator_growth

    return allocator_growth(lambda: held.append(fn())), held[0]


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares line ``a + b*n`` through ``points``."""
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0
    return my - b * mx, b


def _close(pred: float, got: float) -> bool:
    return abs(pred - got) <= max(_REL_TOL * abs(got), _ABS_TOL)


# ----------------------------------------------------------------------------- the model

class Workspace:
    """Measured kernel workspaces for the ops of one trace on ``device``; see the module docstring.

    :meth:`wrap` returns the op to call in the trace's dispatch (the fake op, with placeholder outputs resized);
    :meth:`take` the transient bytes to add to the snapshot at that op; :attr:`used` what was added, per op.

    Example:
        >>> ws = Workspace(torch.device("cpu"))
        >>> ws.wrap(torch.ops.aten.add.Tensor, (), {}) is torch.ops.aten.add.Tensor
        True
    """

    def __init__(self, device: torch.device, directory: Path | None = None):
        self.device = torch.device(device)
        self.ops = modelled_ops(self.device)
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.path = self.directory / f"workspace-torch{torch.__version__}-{self.device.type}.json"
        self.fits: dict[str, dict] | None = None  # loaded on the first op that needs one
        self.pending = 0
        self.used: dict[str, dict[str, Any]] = {}
        # Cache problems, warned by emit() once the trace (which silences warnings of the traced code) is over.
        self.problems: list[str] = []

    # -- the cache
    def _load(self) -> dict[str, dict]:
        if self.fits is None:
            self.fits = {}
            if self.path.exists():
                try:
                    data = json.loads(self.path.read_text())
                    if not isinstance(data, dict) or data.get("format") != _FORMAT or not isinstance(data.get("fits"), dict):
                        raise ValueError("not a memwrap workspace cache of format %d" % _FORMAT)
                    self.fits = data["fits"]
                except (OSError, ValueError) as exc:
                    self.problems.append(f"memwrap: ignoring the workspace cache {self.path} ({exc}); the ops it "
                                         "held are measured again and the file rewritten. Fix: none needed, or "
                                         "delete the file.")
        return self.fits

    def _save(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            try:  # another process (a parallel trace, a second plan) may have added fits since this one loaded
                data = json.loads(self.path.read_text())
                if isinstance(data, dict) and data.get("format") == _FORMAT and isinstance(data.get("fits"), dict):
                    self.fits = {**data["fits"], **self.fits}
            except (OSError, ValueError):
                pass
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"format": _FORMAT, "torch": torch.__version__, "device": self.device.type,
                                       "fits": self.fits}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)  # atomic: a concurrent reader sees the old file or the new one
        except OSError as exc:
            self.problems.append(f"memwrap: could not write the workspace cache {self.path} ({exc}); fits are kept "
                                 "for this trace only. Fix: set MEMWRAP_CACHE_DIR to a writable folder.")

    # -- probing
    def _key(self, func, args: tuple, dims: dict[int, int], kwargs: dict | None = None) -> str:
        desc = [_describe(a, dims.get(i)) for i, a in enumerate(args)]
        if kwargs:  # (the key of a call without keywords is as it was: cached fits stay valid)
            kdims = _kwarg_dims(kwargs, args[0].shape[dims[0]] if dims else 0)
            desc.append({k: _describe(v, kdims.get(k)) for k, v in sorted(kwargs.items())})
        return json.dumps([str(func), _flags(self.device), desc], separators=(",", ":"))

    def _point(self, func, args: tuple, dims: dict[int, int], prepare: Callable | None, n: int,
               kwargs: dict | None = None) -> tuple[int, list[int]]:
        """One real call at batch size ``n``: (scratch bytes, numel of each output)."""
        real = [_real_like(a, dims.get(i), n, self.device) if isinstance(a, torch.Tensor) else a
                for i, a in enumerate(args)]
        kdims = _kwarg_dims(kwargs or {}, args[0].shape[dims[0]] if dims else 0)
        real_kw = {k: _real_like(v, kdims.get(k), n, self.device) if isinstance(v, torch.Tensor) else v
                   for k, v in (kwargs or {}).items()}
        # Grad mode on, as in a training forward: mkldnn's RNN layer returns its workspace only then (else it frees it
        # inside the call). No probe tensor requires grad, so no graph is recorded.
        with torch.enable_grad(), _at_training_threads():
            if prepare is not None:
                real = prepare(real)
            peak, out = _measure(lambda: func(*real, **real_kw), self.device)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return max(0, peak - _storages_bytes(out)), [o.numel() if isinstance(o, torch.Tensor) else 0 for o in outs]

    def _probe(self, func, args: tuple, dims: dict[int, int], prepare: Callable | None,
               kwargs: dict | None = None) -> dict:
        _probes["count"] += 1
        start = time.perf_counter()
        points = {n: self._point(func, args, dims, prepare, n, kwargs) for n in (*FIT_SIZES, HELD_OUT)}
        a, b = _fit([(n, points[n][0]) for n in FIT_SIZES])
        held = points[HELD_OUT][0]
        predicted = a + b * HELD_OUT
        kind = "fit" if _close(predicted, held) else "bound"
        if kind == "bound":
            # No line through the fit sizes predicts the held-out one: an upper bound instead, the steepest slope
            # measured between probes, through the highest probe, so that it is >= every measured value beyond it.
            sizes = sorted(points)
            b = max(0.0, *((points[q][0] - points[p][0]) / (q - p) for p, q in zip(sizes, sizes[1:])))
            a = max(points[p][0] - b * p for p in sizes)
        # Output sizes are exact functions of the shapes: fitted through every probe.
        outputs = {str(i): list(_fit([(n, points[n][1][i]) for n in points])) for i in range(len(points[HELD_OUT][1]))}
        return {"op": str(func), "scratch": [a, b], "kind": kind, "outputs": outputs,
                "probes": {str(n): points[n][0] for n in points},
                "held_out": {"size": HELD_OUT, "measured": held, "predicted": round(predicted)},
                "seconds": round(time.perf_counter() - start, 4)}

    def fit_for(self, func, args: tuple, kwargs: dict | None = None) -> tuple[dict, int] | None:
        """The cached or freshly measured fit for this call and the call's batch size, or None (op not modelled)."""
        spec = _OPS.get(func) if func in self.ops else None
        if spec is None:
            return None
        dims_of, prepare = spec
        dims = dims_of(args)
        if dims is None:
            return None
        n = args[0].shape[dims[0]] if dims else 0
        key = self._key(func, args, dims, kwargs)
        fits = self._load()
        fit = fits.get(key)
        if dims is _EXACT and not isinstance(fit, dict):
            with unset_fake_temporarily(), _disable_current_modes():
                _probes["count"] += 1
                scratch = self._point(func, args, dims, prepare, 0, kwargs)[0]
            fit = fits[key] = {"op": str(func), "scratch": [scratch, 0], "kind": "measured", "outputs": {},
                               "probes": {}}
            self._save()
        if dims is _EXACT:
            return fit, 0
        if not isinstance(fit, dict) or "scratch" not in fit:
            # The probe runs real kernels on real tensors: the trace's modes (fake, tracker) must not capture them.
            with unset_fake_temporarily(), _disable_current_modes():
                fit = self._probe(func, args, dims, prepare, kwargs)
            fits[key] = fit
            self._save()
        if n < FIT_SIZES[0] and str(n) not in fit["probes"]:
            with unset_fake_temporarily(), _disable_current_modes():
                fit["probes"][str(n)] = self._point(func, args, dims, prepare, n, kwargs)[0]
            self._save()
        return fit, n

    # -- the trace's side
    def wrap(self, func, args: tuple, kwargs: dict | None):
        """``func`` itself for ops without a workspace model; else a callable that runs it and applies the fit.

        A CPU-only kernel met in a trace for another device (oneDNN's RNN layer, for a model trained on CUDA, which
        runs cuDNN's RNN there) gets no term, but a row saying so: the report names what the estimate leaves out.
        """
        keywords_ok = not kwargs or func in _KWARGS_OK
        if func in _CPU_KERNEL and func not in self.ops and keywords_ok:
            return self._unmodelled(func)
        if func not in self.ops or not keywords_ok:
            return func

        def call(*a, **k):
            res = func(*a, **k)
            costly = _probe_too_costly(func, a)
            if costly:  # counted apart: other calls of the op may be measured
                row = self.used.setdefault(str(func), {"bytes": 0, "calls": 0, "kept": 0, "kind": costly})
                row["not_measured"] = row.get("not_measured", 0) + 1
                row["why_not"] = costly
                return res
            got = self.fit_for(func, a, k)
            if got is None:
                return res
            fit, n = got
            sa, sb = fit["scratch"]
            probed = fit["probes"].get(str(n))
            scratch = int(probed) if probed is not None else max(0, int(round(sa + sb * n)))
            outs = list(res) if isinstance(res, (tuple, list)) else [res]
            grown = 0
            for i, o in enumerate(outs):
                oa, ob = fit["outputs"].get(str(i), (0, 0))
                want = int(round(oa + ob * n))
                if isinstance(o, torch.Tensor) and o.dim() == 1 and o.numel() == 0 and want > 0:
                    # A placeholder the fake kernel returns empty (mkldnn RNN workspace): the real size, so the
                    # trace keeps for backward what the real kernel keeps.
                    outs[i] = o.new_empty(want)
                    grown += want * o.element_size()
            self.pending = scratch
            row = self.used.setdefault(str(func), {"bytes": 0, "calls": 0, "kept": 0, "kind": "fit"})
            row["bytes"] = max(row["bytes"], scratch)
            row["kept"] = max(row["kept"], grown)
            row["calls"] += 1
            if fit["kind"] != "fit" or row["kind"].startswith("not measured"):
                row["kind"] = fit["kind"]
            return type(res)(outs) if isinstance(res, (tuple, list)) else outs[0]

        return call

    def _unmodelled(self, func):
        def call(*a, **k):
            row = self.used.setdefault(str(func), {
                "bytes": 0, "calls": 0, "kept": 0,
                "kind": f"not modelled on {self.device.type} (the CPU trace records {_CPU_KERNEL[func]} "
                        f"were not measured)"})
            row["calls"] += 1
            return func(*a, **k)

        return call

    def step_temporary(self, name: str, make: Callable[[torch.nn.Module], Any], numel: int,
                       dtype: torch.dtype, role: str = "plain") -> tuple[int, dict] | None:
        """The transient bytes of an optimizer step (``name``, built by ``make(module)``) over a parameter of ``numel``
        elements, and its fit; None when ``numel`` is 0.

        Optimizers that cannot run on fake tensors (bitsandbytes' 8-bit AdamW: it dequantizes a tensor's state
        into temporaries, ~20 bytes per element on CPU) step one tensor at a time, so the step's peak is the
        temporaries of the largest one. Measured like the kernels: real steps (after a first, state-creating step)
        of one flat parameter of :data:`STEP_SIZES` elements, fitted on the first two, checked on the third.

        Example:
            >>> ws = Workspace(torch.device("cpu"))
            >>> n, fit = ws.step_temporary("sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 10**6, torch.float32)
            >>> fit["kind"], n < 4 * 10**6
            ('fit', True)
        """
        if numel <= 0:
            return None
        # role "embedding": the parameter is an nn.Embedding's weight, which optimizers may step otherwise
        # (bitsandbytes keeps its state in 32 bits); probed as one.
        key = json.dumps(["optimizer step", name, str(dtype), _flags(self.device)] + ([role] if role != "plain" else []),
                         separators=(",", ":"))
        fits = self._load()
        fit = fits.get(key)
        if isinstance(fit, dict) and "error" in fit and fit.get("installed") == installed_digest():
            # It failed with these libraries installed: not probed again (an import alone can take seconds).
            raise RuntimeError(fit["error"])
        if not isinstance(fit, dict) or "scratch" not in fit:
            _probes["count"] += 1
            start = time.perf_counter()
            points = {}
            # The library's own warnings while it steps a probe tensor (torchao's compile notes) are not the user's.
            with unset_fake_temporarily(), _disable_current_modes(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    for n in STEP_SIZES:
                        module = torch.nn.Embedding(n, 1) if role == "embedding" else torch.nn.Module()
                        module.weight = torch.nn.Parameter(torch.randn(n, *((1,) if role == "embedding" else ()),
                                                                       dtype=dtype, device=self.device))
                        opt = make(module)
                        module.weight.grad = torch.randn_like(module.weight)
                        opt.step()  # creates the state: not measured (the estimate's steady state)
                        points[n] = _measure(opt.step, self.device)[0]
                        del opt, module
                except Exception as exc:  # noqa: BLE001 - remembered (with the libraries it failed with), re-raised
                    error = f"{type(exc).__name__}: {str(exc)[:240]}"
                    fits[key] = {"op": f"optimizer step ({name})", "error": error, "installed": installed_digest()}
                    self._save()
                    raise RuntimeError(error) from exc
            (n1, n2, held_n) = STEP_SIZES
            b = (points[n2] - points[n1]) / (n2 - n1)
            a = points[n1] - b * n1
            kind = "fit" if _close(a + b * held_n, points[held_n]) else "bound"
            if kind == "bound":  # the steepest measured slope through the highest point (an upper bound beyond it)
                b = max(b, (points[held_n] - points[n2]) / (held_n - n2), 0.0)
                a = max(points[q] - b * q for q in STEP_SIZES)
            fit = {"op": f"optimizer step ({name}{', embedding' if role == 'embedding' else ''})", "scratch": [a, b],
                   "kind": kind,
                   "probes": {str(n): points[n] for n in points}, "held_out": {"size": held_n, "measured": points[held_n],
                   "predicted": round(a + b * held_n)}, "seconds": round(time.perf_counter() - start, 4)}
            fits[key] = fit
            self._save()
        a, b = fit["scratch"]
        return max(0, int(round(a + b * numel))), fit

    def emit(self) -> None:
        """Warn (RuntimeWarning) about each cache problem met during the trace, once."""
        for message in self.problems:
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        self.problems.clear()

    def take(self) -> int:
        """The transient bytes of the op that just ran (0 after the first read)."""
        pending, self.pending = self.pending, 0
        return pending
