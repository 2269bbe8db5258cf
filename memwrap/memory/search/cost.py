"""The planner's cost model: predicted seconds per optimizer update on a reference device.

Only the ranking matters (the plan reports costs relative to the cheapest candidate), so the
model keeps the terms that differ between candidates and one reference device, a :class:`DeviceProfile`
(the A100 reference GPU, :data:`A100`, unless the plan targets another device, e.g. ``plan(device="cpu")``)::

    compute   = sum over the trace's FLOP classes c (matmul dtype and size, recompute included) of
                FLOPs[c] / (peak_flops * mfu * speed[dtype of c, size of c])
    launches  = micro-batches per update * (kernels * launch_s + views * view_s)   (per micro-batch, from the trace:
                dispatched ops that are views, memwrap.memory.tracing.op_stats, and the others)
    traffic   = micro-batches per update * bytes the ops without FLOPs read and write per micro-batch / hbm_bytes_s
    optimizer = (2 * parameter bytes + gradient bytes + 2 * optimizer-state bytes) / hbm_bytes_s
                (on the calibrated CPU profile: the candidate's step timed there, memwrap.memory.search.step_timing)
    offload   = 2 * offloaded bytes / pcie_bytes_s      (out in forward, back in backward; no overlap assumed)
    paging    = 2 * spilled paged-state bytes / pcie_bytes_s  (paged optimizer state that does not fit in the
                device memory left free is paged in for the step and out again; all of it when nothing is free)
    host_state= 2 * host optimizer-state bytes / pcie_bytes_s  (state on the host: gradients out, updates back,
                about one state-sized transfer each way per step)

A class's dtype picks the speed (bf16, fp16; fp32, or tf32 when the precision is tf32; any other dtype the
precision's speed), its size the entry of ``size_speed`` (log-linear between the sizes measured, clamped at the
ends) where the profile has a table for that dtype, else ``speed`` alone (the A100 profile: datasheet ratios, one
number per precision). A step traced before the classes existed is rated by its precision alone.

``launches`` is the micro-batch efficiency term: a small micro-batch pays the same per-kernel
overhead for less work, so splitting a global batch into more micro-batches costs time. A view (metadata only) pays
``view_s`` (``launch_s`` where the profile has no ``view_s``: the A100's). ``traffic`` is the work of the ops the
compute term does not rate (elementwise ops, norms, softmax, copies, losses): bandwidth-bound, so it grows with the
bytes, not with the count of ops; a step traced before the trace counted them has no traffic term.
``speed`` is the matmul throughput of a precision relative to the profile's ``peak_flops``. On the A100
(``peak_flops`` its dense bf16 rate): fp16 1, tf32 1/2, fp32 1/16 (A100/H100 dense ratios; fp32 without TF32 runs
on CUDA cores). A precision plugin not named there is rated by its autocast (or storage) dtype: bf16 and fp16 at
the profile's bf16 / fp16 speed, anything else at fp32's.

The ``"cpu"`` profile (:func:`cpu_profile`) is measured on the machine that plans, not guessed: ``peak_flops`` is
the fp32 rate achieved by a 256^3 matmul (so ``mfu`` is 1), ``speed`` the measured bf16 and fp16 rates relative
to it (bf16 is fast with AMX tiles and can be slower than fp32 without native bf16 arithmetic), ``size_speed``
each precision's rate at square matmuls of 32^3 to 512^3, relative to ``peak_flops`` and with the time of a 4x4
matmul taken off each call (that per-call cost is the ``launches`` term's; on a 2-core AMX Xeon bf16 runs at
0.08x fp32 at 32^3 and 7.3x at 512^3, so one calibration size mis-rates a small model's matmuls), ``launch_s`` the
measured time per dispatched op of a tiny MLP stack's forward + backward (the op mix of a training step on tensors too
small for the work to count), ``hbm_bytes_s`` the measured bandwidth of a large
elementwise add (the optimizer term is not rated by it there: each candidate's step is timed, because a CPU's bf16
step converts every element and runs slower than fp32's although it touches fewer bytes), and ``pcie_bytes_s`` the same bandwidth (host and "device" memory are one on a CPU: an offload
is a copy). It is measured once per process and thread count (about 0.1 s); with ``MEMWRAP_CALIBRATE=0`` in the
environment, or ``cpu_profile(calibrate=False)``, the fixed :data:`CPU_FIXED` is used instead. How well it orders
real CPU steps: ``docs/benchmarks/rank_check.md`` (``benchmarks/rank_check.py``).

Example:
    >>> step_seconds(flops=1e15, ops=1000, micro_batches=1, precision="bf16", param_bytes=0,
    ...              grad_bytes=0, state_bytes=0) > 0
    True
    >>> device_profile("cuda") is A100 and device_profile(None) is A100
    True
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from memwrap.memory.tracing.flop_classes import flop_formulas
from memwrap.memory.tracing.op_stats import OpStats

__all__ = ["PEAK_FLOPS", "MFU", "SPEED", "LAUNCH_S", "HBM_BYTES_S", "PCIE_BYTES_S", "DeviceProfile", "A100",
           "CPU_FIXED", "SIZE_SPEED_SIDES", "cpu_profile", "calibrate_cpu", "device_profile", "class_speed",
           "step_seconds", "cost_terms"]

PEAK_FLOPS = 312e12  # dense bf16 of the reference GPU (A100)
MFU = 0.5  # fraction of peak a well-fed training step reaches
SPEED = {"bf16": 1.0, "fp16": 1.0, "tf32": 0.5, "fp32": 1 / 16}
LAUNCH_S = 8e-6  # per dispatched op: kernel launch + framework overhead
HBM_BYTES_S = 1.5e12
PCIE_BYTES_S = 20e9


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """The constants of the cost model for one device (see the module docstring for the terms).

    ``speed`` maps a precision name (``"fp32"``, ``"bf16"``, ``"fp16"``, ``"tf32"``) to its matmul throughput
    relative to ``peak_flops``; ``size_speed`` (optional) the same by matmul size, ``{"bf16": {32: 0.02, ...,
    512: 6.9}}`` (the side of a square matmul; a name without a table is rated by ``speed``); ``source`` says where
    the numbers come from (datasheet ratios, a calibration).

    Example:
        >>> p = DeviceProfile("toy", peak_flops=1e12, mfu=1.0, speed={"fp32": 1.0, "bf16": 0.5}, launch_s=1e-6,
        ...                   hbm_bytes_s=1e10, pcie_bytes_s=1e10)
        >>> cost_terms(flops=1e12, ops=0, micro_batches=1, precision="bf16", param_bytes=0, grad_bytes=0,
        ...            state_bytes=0, device=p)["compute"]
        2.0
    """

    name: str
    peak_flops: float
    mfu: float
    speed: Mapping[str, float]
    launch_s: float
    hbm_bytes_s: float
    pcie_bytes_s: float
    source: str = ""
    size_speed: Mapping[str, Mapping[int, float]] = dataclasses.field(default_factory=dict)
    # The optimizer term timed on this machine (memwrap.memory.search.step_timing) instead of its bandwidth form:
    # the calibrated CPU profile, where the step runs in this process.
    time_steps: bool = False
    # Seconds per view op (no kernel: metadata only); None: ``launch_s``, as for every other op.
    view_s: float | None = None

    def __post_init__(self) -> None:
        for field in ("peak_flops", "mfu", "launch_s", "hbm_bytes_s", "pcie_bytes_s"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 or value == float("inf"):
                raise ValueError(f"DeviceProfile({self.name!r}).{field} must be a finite number > 0, got {value!r}.")
        if self.view_s is not None and (isinstance(self.view_s, bool) or not isinstance(self.view_s, (int, float))
                                        or not 0 < self.view_s < float("inf")):
            raise ValueError(f"DeviceProfile({self.name!r}).view_s must be None (launch_s) or a finite number > 0, "
                             f"got {self.view_s!r}.")
        if "fp32" not in self.speed or any(not v > 0 for v in self.speed.values()):
            raise ValueError(f"DeviceProfile({self.name!r}).speed must rate 'fp32' (the fallback) and every speed "
                             f"must be > 0, got {dict(self.speed)!r}.")
        for name, table in self.size_speed.items():
            if not table or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 or not v > 0
                                for k, v in table.items()):
                raise ValueError(f"DeviceProfile({self.name!r}).size_speed[{name!r}] must map matmul sides (ints >= 1) "
                                 f"to speeds > 0, e.g. {{64: 0.5, 256: 1.0}}; got {dict(table)!r}.")

    @property
    def label(self) -> str:
        """How reports name the device: ``'the reference GPU (A100)'``, ``'this CPU'``."""
        return "the reference GPU (A100)" if self.name == "a100" else ("this CPU" if self.name == "cpu"
                                                                      else f"device {self.name!r}")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "speed": dict(self.speed),
                "size_speed": {k: dict(v) for k, v in self.size_speed.items()}}


A100 = DeviceProfile("a100", PEAK_FLOPS, MFU, dict(SPEED), LAUNCH_S, HBM_BYTES_S, PCIE_BYTES_S,
                     source="A100 datasheet ratios (dense bf16 312 TFLOP/s at 50% MFU, HBM 1.5 TB/s, PCIe 20 GB/s)")

# The fallback when calibration is not wanted: calibrate_cpu() on the development machine (a 2-core Xeon with AMX,
# torch 2.13.0, 1 thread, 2026-12-03), rounded. bf16 256^3 matmuls are ~3.7x fp32's there (AMX tiles); a CPU
# without AMX/AVX512-BF16 rates bf16 very differently: calibrate there.
# By size: calibrate_cpu() there on 2026-12-04 (two runs, rounded). launch_s and view_s, per kernel op and per view
# since the trace stopped counting fake tensors' metadata queries as ops (2026-12-06): calibrate_cpu() on a 2-core
# AMD EPYC, three runs (8.7-11.5 us and 1.0-1.7 us), rounded; the Xeon's were not measured that way.
_CPU_FP32_BY_SIZE = {32: 1.0, 64: 0.9, 128: 0.85, 256: 0.95, 512: 0.95}
CPU_FIXED = DeviceProfile("cpu", peak_flops=165e9, mfu=1.0, speed={"fp32": 1.0, "tf32": 1.0, "bf16": 3.7,
                                                                   "fp16": 0.9},
                          launch_s=9e-6, view_s=1.3e-6, hbm_bytes_s=25e9, pcie_bytes_s=25e9,
                          source="fixed defaults (calibrate_cpu() on a 2-core AMX Xeon, 1 thread, rounded; the "
                                 "per-kernel and per-view costs on a 2-core EPYC)",
                          size_speed={"fp32": _CPU_FP32_BY_SIZE, "tf32": _CPU_FP32_BY_SIZE,
                                      "bf16": {32: 0.025, 64: 0.16, 128: 0.94, 256: 4.0, 512: 6.2},
                                      "fp16": {32: 0.025, 64: 0.15, 128: 0.5, 256: 0.92, 512: 0.96}})


def _best(fn, reps: int) -> float:
    """The fastest of ``reps`` timed calls after one warm-up: the machine's rate, not its load."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _op_mix(fn) -> tuple[int, int, int]:
    """(ops, views, bytes the ops without FLOPs move) that ``fn`` dispatches, counted as the trace counts them
    (memwrap.memory.tracing.op_stats; under a dispatch mode, metadata queries left out)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    formulas = flop_formulas()
    stats = OpStats()
    ops = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            res = func(*args, **(kwargs or {}))
            if func.namespace != "prim":
                ops[0] += 1
                if func._overloadpacket not in formulas:
                    stats.add(func, args, kwargs, res)
            return res

    with Count():
        fn()
    return ops[0], stats.views, stats.bytes


def _ops_of(fn) -> int:
    """The ops ``fn`` dispatches, counted as the trace counts them.

    Example:
        >>> _ops_of(lambda: torch.ones(2) + 1)
        2
    """
    return _op_mix(fn)[0]


def _view_seconds(reps: int) -> float:
    """Seconds per view op: a chain of views of a small tensor, half with autograd recording them (a forward's
    views) and half without (a backward's), averaged."""
    x = torch.ones(16, 32, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(40):
            y = y.view(32, 16).t().unsqueeze(0).squeeze(0).transpose(0, 1)

    recorded = _best(chain, reps)
    with torch.no_grad():
        plain = _best(chain, reps)
    return (recorded + plain) / 2 / 200


def _tiny_step(g: torch.Generator):
    """One forward + backward of a tiny 4-block pre-norm MLP with a cross-entropy loss (16 tokens, width 32)."""
    from torch import nn

    dim, tokens, classes = 32, 16, 64
    with torch.random.fork_rng():
        torch.manual_seed(0)
        blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(),
                                             nn.Linear(2 * dim, dim)) for _ in range(4))
        head = nn.Linear(dim, classes)
    x = torch.randn(tokens, dim, generator=g)
    y = torch.randint(0, classes, (tokens,), generator=g)

    def step() -> None:
        h = x
        for block in blocks:
            h = h + block(h)
        torch.nn.functional.cross_entropy(head(h), y).backward()

    return step


# The matmul sides size_speed is measured at: the small end is where a small model's GEMMs are (d 64 at 512 tokens:
# a mean side of 161), the large end where the bf16/fp32 ratio of an AMX CPU levels off.
SIZE_SPEED_SIDES = (32, 64, 128, 256, 512)


def _mm_seconds(side: int, dtype: torch.dtype, g: torch.Generator, reps: int) -> float:
    """Seconds per ``side`` x ``side`` matmul; small ones are timed in batches, above the timer's resolution."""
    a = torch.randn(side, side, generator=g).to(dtype)
    b = torch.randn(side, side, generator=g).to(dtype)
    calls = min(256, max(1, 2**21 // side**3))

    def run() -> None:
        for _ in range(calls):
            torch.mm(a, b)

    return _best(run, reps) / calls


def _size_speed(g: torch.Generator, reps: int, peak: float) -> dict[str, dict[int, float]]:
    """Each precision's matmul rate at :data:`SIZE_SPEED_SIDES`, relative to ``peak``: FLOPs over the time of a call
    less a 4x4 matmul's (the per-call cost, which the launches term already charges per dispatched op)."""
    tables = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        overhead = _mm_seconds(4, dtype, g, reps)
        tables[name] = {}
        for side in SIZE_SPEED_SIDES:
            t = _mm_seconds(side, dtype, g, reps)
            tables[name][side] = 2 * side**3 / max(t - overhead, 0.1 * t) / peak
    tables["tf32"] = dict(tables["fp32"])  # a CPU has no TF32: fp32 matmuls
    return tables


@functools.lru_cache(maxsize=None)
def _calibrated(threads: int, size: int, reps: int) -> DeviceProfile:
    g = torch.Generator().manual_seed(0)
    rates = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        rates[name] = 2 * size**3 / _mm_seconds(size, dtype, g, reps)
    n = 4 * 2**20  # 16 MiB per fp32 operand: well past the caches
    a, b, out = torch.full((n,), 1.5), torch.full((n,), 0.5), torch.empty(n)  # full(): cheaper than randn
    bandwidth = 3 * 4 * n / _best(lambda: torch.add(a, b, out=out), reps)  # two reads and a write
    # Per kernel op: the forward + backward of a tiny pre-norm MLP stack (layer norm, linear, GELU, residual,
    # cross-entropy), the op mix of a training step through nn.Module calls and autograd, on tensors small enough
    # that the work itself is negligible: what an op costs beyond its FLOPs, less its views (timed apart: a view
    # is metadata only, 1-2 us where a kernel op of this mix costs 10-14 on a 2-core EPYC) and its bytes.
    view = _view_seconds(reps)
    step = _tiny_step(g)
    ops, views, moved = _op_mix(step)
    total = _best(step, reps)
    launch = max(total - views * view - moved / bandwidth, 0.25 * total) / max(ops - views, 1)
    speed = {"fp32": 1.0, "tf32": 1.0, "bf16": rates["bf16"] / rates["fp32"], "fp16": rates["fp16"] / rates["fp32"]}
    return DeviceProfile("cpu", peak_flops=rates["fp32"], mfu=1.0, speed=speed, launch_s=launch, view_s=view,
                         hbm_bytes_s=bandwidth, pcie_bytes_s=bandwidth,
                         source=f"calibrated on this machine ({threads} thread{'s' * (threads > 1)}, {size}^3 matmuls, "
                                f"by size {SIZE_SPEED_SIDES[0]}^3 to {SIZE_SPEED_SIDES[-1]}^3, best of {reps})",
                         size_speed=_size_speed(g, reps, rates["fp32"]), time_steps=True)


def calibrate_cpu(*, size: int = 256, reps: int = 3) -> DeviceProfile:
    """Measure the ``"cpu"`` profile on this machine at the current ``torch.get_num_threads()``: fp32, bf16 and
    fp16 matmul rates (``size`` x ``size`` matmuls, and by size from 32^3 to 512^3: ``size_speed``), the time per
    dispatched op and the memory bandwidth, each the best of ``reps`` runs. Cached per process (per thread count,
    size and reps): the second call returns the same object. About 0.1 s on a 2-core machine with AMX; a CPU with
    slow bf16 takes longer.

    Example:
        >>> p = calibrate_cpu()
        >>> p.name, p is calibrate_cpu(), p.speed["fp32"]
        ('cpu', True, 1.0)
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 16:
        raise ValueError(f"calibrate_cpu(size={size!r}) must be an int >= 16 (the matmul side), e.g. size=256.")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"calibrate_cpu(reps={reps!r}) must be an int >= 1, e.g. reps=3.")
    return _calibrated(torch.get_num_threads(), size, reps)


def cpu_profile(*, calibrate: bool | None = None) -> DeviceProfile:
    """The ``"cpu"`` profile: :func:`calibrate_cpu` by default, :data:`CPU_FIXED` with ``calibrate=False`` or,
    when ``calibrate`` is None, with ``MEMWRAP_CALIBRATE=0`` in the environment (reproducible plans, no timing).

    Example:
        >>> cpu_profile(calibrate=False) is CPU_FIXED
        True
    """
    if calibrate is None:
        calibrate = os.environ.get("MEMWRAP_CALIBRATE", "1").strip().lower() not in ("0", "false", "no", "off")
    return calibrate_cpu() if calibrate else CPU_FIXED


def device_profile(device: Any = None, *, calibrate: bool | None = None) -> DeviceProfile:
    """The cost model's profile for a target device: None, ``"cuda"``/``"gpu"``/``"a100"`` (or a CUDA
    ``torch.device``) -> :data:`A100`; ``"cpu"`` -> :func:`cpu_profile`; a :class:`DeviceProfile` -> itself.

    Example:
        >>> device_profile("cpu", calibrate=False).name, device_profile("cuda:0").name
        ('cpu', 'a100')
    """
    if device is None or isinstance(device, DeviceProfile):
        return device or A100
    if isinstance(device, str) or isinstance(device, torch.device):
        text = str(device).strip().lower()
        kind = text.split(":", 1)[0]
        if kind in ("cuda", "gpu", "a100"):
            return A100
        if kind == "cpu":
            return cpu_profile(calibrate=calibrate)
    raise ValueError(f"device={device!r}: the cost model knows 'cuda' (the A100 reference GPU, the default) and "
                     "'cpu' (measured on this machine). Fix: pass one of them, or a "
                     "memwrap.memory.search.cost.DeviceProfile with your device's constants.")


def _speed_name(precision: str, profile: DeviceProfile = A100) -> str:
    """The key of ``profile.speed`` that rates ``precision``'s matmuls."""
    speed = profile.speed
    if precision in speed:
        return precision
    try:  # learned from the precision plugin: its matmuls run in its autocast (or storage) dtype
        from memwrap.precision.base import get_precision_class

        cls = get_precision_class(precision)
    except ValueError:
        return "fp32"
    dtype = cls.autocast_dtype or cls.param_dtype
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    if name in speed:
        return name
    return "bf16" if name != "fp32" and "bf16" in speed else "fp32"


def _speed(precision: str, profile: DeviceProfile = A100) -> float:
    return profile.speed[_speed_name(precision, profile)]


def _interpolate(table: Mapping[int, float], side: int) -> float:
    """``table`` (side -> speed) at ``side``: log-linear between the two sides around it, clamped at the ends."""
    sides = sorted(table)
    if side <= sides[0]:
        return table[sides[0]]
    if side >= sides[-1]:
        return table[sides[-1]]
    hi = next(i for i, s in enumerate(sides) if s >= side)
    lo_s, hi_s = sides[hi - 1], sides[hi]
    w = (math.log(side) - math.log(lo_s)) / (math.log(hi_s) - math.log(lo_s))
    return math.exp((1 - w) * math.log(table[lo_s]) + w * math.log(table[hi_s]))


def class_speed(flop_class: str, precision: str, device: Any = None) -> float:
    """The speed (relative to the profile's ``peak_flops``) of one FLOP class ``"<dtype>@<size>"`` of a step run
    in ``precision`` (see the module docstring and :mod:`memwrap.memory.tracing.flop_classes`).

    Example:
        >>> p = DeviceProfile("toy", peak_flops=1e12, mfu=1.0, speed={"fp32": 1.0, "bf16": 2.0}, launch_s=1e-6,
        ...                   hbm_bytes_s=1e10, pcie_bytes_s=1e10, size_speed={"bf16": {64: 0.5, 256: 2.0}})
        >>> class_speed("bf16@128", "bf16", p), class_speed("bf16@0", "bf16", p), class_speed("fp32@128", "bf16", p)
        (1.0, 2.0, 1.0)
    """
    p = device_profile(device)
    dtype, _, size = flop_class.partition("@")
    if dtype in ("bf16", "fp16") and dtype in p.speed:
        name = dtype
    elif dtype == "fp32":  # fp32 operands: TF32 where the precision turns it on
        name = "tf32" if _speed_name(precision, p) == "tf32" else "fp32"
    else:
        name = _speed_name(precision, p)
    table = p.size_speed.get(name)
    side = int(size) if size.isdigit() else 0
    if table and side > 0:
        return _interpolate(table, side)
    return p.speed.get(name, p.speed["fp32"])


def cost_terms(*, flops: float, ops: int, micro_batches: int, precision: str, param_bytes: int, grad_bytes: int,
               state_bytes: int, offloaded: int = 0, paged_spill: int = 0, host_state: int = 0,
               device: Any = None, flop_classes: Mapping[str, int] | None = None,
               op_stats: Mapping[str, int] | None = None) -> dict[str, float]:
    """The terms of the model in seconds (see the module docstring), on ``device`` (see :func:`device_profile`;
    default: the A100 reference GPU). ``flop_classes`` (an estimate's, the same FLOPs by matmul dtype and size)
    rates each class at its own speed; without it, ``flops`` is rated at the precision's speed. ``op_stats`` (an
    estimate's, per micro-batch: ``{"views": n, "bytes": n}``) rates views at ``view_s`` and gives the traffic term.

    Example:
        >>> t = cost_terms(flops=0, ops=100, micro_batches=2, precision="fp32", param_bytes=0, grad_bytes=0,
        ...                state_bytes=0)
        >>> round(t["launches"] / LAUNCH_S)
        200
    """
    p = device_profile(device)
    views = min(ops, (op_stats or {}).get("views", 0))
    view_s = p.view_s if p.view_s is not None else p.launch_s
    if flop_classes:
        compute = sum(v / (p.peak_flops * p.mfu * class_speed(c, precision, p)) for c, v in flop_classes.items())
    else:
        compute = flops / (p.peak_flops * p.mfu * _speed(precision, p))
    return {
        "compute": compute,
        "launches": micro_batches * (max(0, ops - views) * p.launch_s + views * view_s),
        "traffic": micro_batches * (op_stats or {}).get("bytes", 0) / p.hbm_bytes_s,
        "optimizer": (2 * param_bytes + grad_bytes + 2 * state_bytes) / p.hbm_bytes_s,
        "offload": 2 * offloaded / p.pcie_bytes_s,
        "paging": 2 * paged_spill / p.pcie_bytes_s,
        "host_state": 2 * host_state / p.pcie_bytes_s,
    }


def step_seconds(**kw: Any) -> float:
    """Predicted seconds per optimizer update: the sum of :func:`cost_terms` (same keywords, ``device`` included).

    Example:
        >>> step_seconds(flops=0, ops=0, micro_batches=1, precision="fp32", param_bytes=0, grad_bytes=0,
        ...              state_bytes=0)
        0.0
    """
    return sum(cost_terms(**kw).values())
