"""What the GPU check's checks share: sizes, the training update, timing, peaks, overhead and the JSON.

``benchmarks/gpu_check.py`` holds the checks and the runner; this module holds the pieces they all
use, so that each check reads as what it verifies.
"""
from __future__ import annotations

import json
import math
import pathlib
import platform
import statistics
import time
from typing import Any, Callable

import torch

import memwrap
from memwrap.models import build_preset, lm_loss, preset_batch

WARMUP = 2  # untimed updates per configuration: allocator, cuBLAS/cuDNN autotuning, lazy optimizer state
MARGIN_ROUND = 64 << 20  # the suggested fixed margin is rounded up to this


class Setup:
    """Sizes and device: real (GPU) or dry run (CPU, tiny)."""

    def __init__(self, dry_run: bool):
        self.dry = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.gpt = "gpt2-tiny" if dry_run else "gpt2"
        self.batch, self.seq = (4, 32) if dry_run else (8, 512)
        self.image = 32 if dry_run else 224
        self.img_batch = 8 if dry_run else 32
        self.reps = 2 if dry_run else 10
        self.updates = 4 if dry_run else 8
        self.overrides = {"n_layer": 2} if dry_run else {}  # dry run: a 2-layer gpt2-tiny

    def build(self, name: str | None = None):
        name = name or self.gpt
        return build_preset(name, **(self.overrides if name == self.gpt else {}))

    def model(self, name: str | None = None):
        torch.manual_seed(0)
        return self.build(name).to(self.device)

    def batches(self, n: int, micro: int, name: str | None = None, seq: int | None = None) -> list:
        gen = torch.Generator().manual_seed(1)
        name = name or self.gpt
        seq = seq or (self.image if name == "resnet50" else self.seq)
        return [tuple(t.to(self.device) for t in preset_batch(name, micro, seq, generator=gen)) for _ in range(n)]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def loss_of(outputs, targets):
    return lm_loss(outputs, targets) if outputs.dim() == 3 else torch.nn.functional.cross_entropy(outputs.float(), targets)


def update(model, optimizer, micro_batches: list) -> torch.Tensor:
    """One update over the micro-batches (one window = all of them); the mean loss, left on the device.

    The loss is summed on the device so that the loop never waits for the GPU inside an update; the caller
    syncs once per update, as the hand-written loop it is compared with does.
    """
    total = torch.zeros((), device=micro_batches[0][0].device)
    for x, y in micro_batches:
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total += loss.detach().float()
    return total / len(micro_batches)


def train(model, optimizer, micro_batches: list, updates: int, setup: Setup) -> tuple[list[float], float]:
    """``updates`` updates; their losses and the median s/update (first one left out)."""
    losses, times = [], []
    for _ in range(updates):
        setup.sync()
        t0 = time.perf_counter()
        losses.append(float(update(model, optimizer, micro_batches)))  # the one host sync per update
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[1:] or times)


def peak_of(s: Setup, fn: Callable[[], Any]) -> tuple[Any, int | None]:
    """``fn()`` and its own CUDA peak: max_memory_allocated above what was alive before it (None on CPU).

    Subtracting the baseline keeps memory left by earlier configurations (their weights, optimizer state)
    out of this one's figure.
    """
    if s.device.type != "cuda":
        return fn(), None
    s.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    s.sync()
    return out, torch.cuda.max_memory_allocated() - base


def compare(s: Setup, runners: dict[str, Callable[[], Any]]) -> dict:
    """Seconds per update of each runner (one call = one update): ``WARMUP`` untimed updates each, then
    ``s.reps`` rounds that time every runner once in turn (interleaved, so drift in clocks or temperature
    hits all alike); the median per runner, and ``<name>_peak`` from the last warm-up update (state exists).
    """
    out: dict[str, Any] = {}
    for name, run in runners.items():
        for _ in range(WARMUP):
            _, peak = peak_of(s, lambda: float(run()))
        if peak is not None:
            out[f"{name}_peak"] = peak
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(s.reps):
        for name, run in runners.items():
            s.sync()
            t0 = time.perf_counter()
            float(run())  # the one host sync per update
            times[name].append(time.perf_counter() - t0)
    out.update({f"{name}_s": statistics.median(t) for name, t in times.items()})
    out["reps"], out["warmup"] = s.reps, WARMUP
    return out


def wrapped(setup: Setup, name: str | None = None, lr: float = 1e-4, **options):
    model = setup.model(name)
    opt = memwrap.create_optimizer("adamw", model, lr=lr)
    return memwrap.wrap(model, opt, **options)


def split(batch: tuple, n: int) -> list:
    x, y = batch
    m = x.shape[0] // n
    return [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(n)]


def grads_of(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def environment(s: Setup) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "dry_run": s.dry,
           "device": "cpu (dry run)" if s.dry else torch.cuda.get_device_name(0)}
    if not s.dry:
        torch.cuda.init()
        env.update(capability=".".join(map(str, torch.cuda.get_device_capability(0))), cuda=torch.version.cuda,
                   memory=torch.cuda.get_device_properties(0).total_memory, bf16=torch.cuda.is_bf16_supported(),
                   outside_allocator_at_start=(outside_allocator(s.device) or {}).get("outside_allocator"))
    return env


def write(doc: dict, out: pathlib.Path, dry: bool) -> pathlib.Path:
    """Write the JSON atomically (a run killed by a timeout keeps the last complete file)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / ("gpu_check_dry_run.json" if dry else "gpu_check.json")
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=repr))
    tmp.replace(path)
    return path


def outside_allocator(device: torch.device) -> dict | None:
    """Device memory that PyTorch's caching allocator does not hold: the CUDA context, loaded kernel
    modules, library handles (cuBLAS, cuDNN) and anything else in the process. None on CPU.

    ``mem_get_info`` counts every process on the device; on a lent single-user GPU that is this one.
    """
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"device_used": total - free, "torch_reserved": reserved, "outside_allocator": total - free - reserved}


def suggest_margin(doc: dict) -> dict | None:
    """The planner margin (``fraction * predicted peak + fixed``) that the measurements in ``doc`` call for.

    ``fraction``: the largest ``max_memory_reserved / predicted peak - 1`` over the planner rows, so it
    covers both the prediction error and the allocator's cached and fragmented blocks; ``fixed``: the
    largest memory seen outside the allocator (context, kernels, library handles), rounded up to 64 MiB.
    None until the planner rows (with reserved bytes, i.e. on CUDA) exist.
    """
    planner = doc.get("checks", {}).get("planner_vs_cuda", {})
    rows = [r for r in planner.get("rows", []) if r.get("reserved")]
    if not rows:
        return None
    outside = [v for v in (doc.get("outside_allocator_at_start"), planner.get("outside_allocator")) if v is not None]
    worst = max(rows, key=lambda r: r["reserved"] / r["predicted"])
    fraction = max(0.0, math.ceil(round((worst["reserved"] / worst["predicted"] - 1) * 100, 6)) / 100)  # 1.1 - 1 is 0.100...09
    fixed = math.ceil(max(outside, default=0) / MARGIN_ROUND) * MARGIN_ROUND
    return {"fraction": fraction, "fixed": fixed, "fixed_gib": round(fixed / 2**30, 3),
            "from_row": worst["options"], "reserved_over_allocated": [round(r["reserved"] / r["measured"], 4) for r in rows],
            "rule": "fraction = max(reserved / predicted) - 1 over planner rows, rounded up to 1%; "
                    "fixed = max memory outside the allocator, rounded up to 64 MiB"}
