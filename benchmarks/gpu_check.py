"""GPU check: memwrap's CUDA paths, planner vs ``torch.cuda.max_memory_allocated``, step-time ratios.

Run on one Hopper-class GPU (H100/H200; any recent NVIDIA GPU works), in under 8 minutes::

    python benchmarks/gpu_check.py                 # writes docs/benchmarks/gpu_check.json
    python benchmarks/gpu_check.py --dry-run       # same code paths on CPU at tiny sizes (no GPU needed)

Needs only torch (and memwrap from this checkout). bitsandbytes is optional: without it the 8-bit
check is recorded as skipped, with the reason (see docs/gpu.md to carry a wheel). Every check is
independent: a failure is recorded and the others still run. The exit status is 1 if a
correctness check failed, else 0. ``--dry-run`` writes ``gpu_check_dry_run.json`` so that it never
replaces real GPU results (``benchmarks/seed_claims.py`` reads ``gpu_check.json``).
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import platform
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import memwrap  # noqa: E402
from memwrap.models import build_preset, lm_loss, preset_batch  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
TOLERANCE = 0.10  # planner prediction vs measured peak


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


def train(model, optimizer, micro_batches: list, updates: int, setup: Setup) -> tuple[list[float], float]:
    """``updates`` updates over the micro-batches (one window = all of them); losses and median s/update."""
    losses, times = [], []
    for _ in range(updates):
        setup.sync()
        t0 = time.perf_counter()
        total = 0.0
        for x, y in micro_batches:
            loss = loss_of(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += float(loss.detach())
        setup.sync()
        times.append(time.perf_counter() - t0)
        losses.append(total / len(micro_batches))
    return losses, statistics.median(times[1:] or times)


def wrapped(setup: Setup, name: str | None = None, lr: float = 1e-4, **options):
    model = setup.model(name)
    opt = memwrap.create_optimizer("adamw", model, lr=lr)
    return memwrap.wrap(model, opt, **options)


def split(batch: tuple, n: int) -> list:
    x, y = batch
    m = x.shape[0] // n
    return [(x[i * m:(i + 1) * m], y[i * m:(i + 1) * m]) for i in range(n)]


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


# ----------------------------------------------------------------------------- correctness checks

def check_fp16_gradscaler(s: Setup) -> dict:
    model, opt = wrapped(s, precision="fp16", accumulate=2, lr=1e-3)
    data = s.batches(1, s.batch)[0]
    losses, _ = train(model, opt, split(data, 2), s.updates, s)
    expect(all(map(lambda v: v == v and abs(v) != float("inf"), losses)), f"non-finite losses {losses}")
    expect(losses[-1] < losses[0], f"fp16 training did not lower the loss: {losses}")
    before = [p.detach().clone() for p in model.parameters()]
    skipped = opt.skipped
    for x, y in split(data, 2):  # an overflowing window: its update must be skipped, not applied
        (loss_of(model(x), y) * float("inf")).backward()
        opt.step()
        opt.zero_grad()
    expect(opt.skipped == skipped + 1, "the overflowing window was not reported as skipped")
    expect(all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a skipped update changed weights")
    return {"losses": losses, "scale": float(opt.scaler.get_scale()), "skipped": opt.skipped}


def check_bf16(s: Setup) -> dict:
    ref, ref_opt = wrapped(s)
    model, opt = wrapped(s, precision="bf16")
    x, y = s.batches(1, s.batch)[0]
    out = model(x)
    expect(out.dtype == torch.float32, f"bf16 outputs should be cast to fp32, got {out.dtype}")
    l32, l16 = float(loss_of(ref(x), y).detach()), float(loss_of(out, y).detach())
    expect(abs(l16 - l32) / abs(l32) < 2e-2, f"bf16 loss {l16} too far from fp32 loss {l32}")
    return {"loss_fp32": l32, "loss_bf16": l16, "rel_diff": abs(l16 - l32) / abs(l32)}


def check_tf32(s: Setup) -> dict:
    before = torch.get_float32_matmul_precision()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on CPU, tf32 warns that it trains in plain fp32
        model = memwrap.wrap(s.model(), precision="tf32")
    during = torch.get_float32_matmul_precision()
    memwrap.unwrap(model)
    after = torch.get_float32_matmul_precision()
    expect(during == "high" and after == before, f"matmul precision {before} -> {during} -> {after}")
    return {"before": before, "during": during, "after": after}


def check_bnb_8bit(s: Setup) -> dict:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        return {"status": "skipped", "reason": f"bitsandbytes is not installed ({exc}); carry a wheel, see docs/gpu.md"}
    from memwrap.registry import measure_state_bytes, predict_state_bytes

    model, opt = wrapped(s, optim="adamw_8bit", lr=1e-3)
    losses, step_s = train(model, opt, [s.batches(1, s.batch)[0]], s.updates, s)
    expect(losses[-1] < losses[0], f"8-bit AdamW did not lower the loss: {losses}")
    measured, predicted = measure_state_bytes(opt.optimizer), predict_state_bytes("adamw_8bit", model.module)
    expect(measured == predicted, f"8-bit state {measured} B, plugin predicts {predicted} B")
    return {"losses": losses, "state_bytes": measured, "predicted_state_bytes": predicted,
            "bnb_version": bitsandbytes.__version__, "step_s": step_s}


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def check_offload(s: Setup) -> dict:
    data = s.batches(1, s.batch)[0]
    res = {}
    grads = {}
    for policy in (None, "full", "offload"):
        model = s.model()
        wm = memwrap.wrap(model, checkpoint=policy) if policy else model
        if s.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss_of(wm(data[0]), data[1]).backward()
        s.sync()
        grads[policy or "none"] = _grads(model)
        res[f"peak_{policy or 'none'}"] = torch.cuda.max_memory_allocated() if s.device.type == "cuda" else None
    for k in ("full", "offload"):
        err = float((grads[k] - grads["none"]).norm() / grads["none"].norm())
        res[f"grad_rel_err_{k}"] = err
        expect(err < 1e-5, f"checkpoint={k} changed the gradients (relative error {err})")
    if s.device.type == "cuda":
        expect(res["peak_offload"] <= res["peak_full"], "offloading did not lower the peak below full checkpointing")
    return res


def check_planner_vs_cuda(s: Setup) -> dict:
    from memwrap.memory import measure_peak

    configs = [{}, {"precision": "bf16"}, {"accumulate": 4}, {"checkpoint": "full"},
               {"precision": "bf16", "accumulate": 4, "checkpoint": "full"}, {"checkpoint": "selective"}]
    try:
        import bitsandbytes  # noqa: F401

        configs.append({"precision": "bf16", "optim": "adamw_8bit"})
    except ImportError:
        pass
    rows, bad = [], []
    for opts in configs:
        micro = s.batch // opts.get("accumulate", 1)
        batch = preset_batch(s.gpt, micro, s.seq)
        est = memwrap.estimate(s.build, batch, loss_fn=lm_loss, **opts)
        got = measure_peak(s.build, batch, lm_loss, steps=1, device=s.device, **opts)
        ratio = got["peak"] / est.peak
        rows.append({"options": opts, "predicted": est.peak, "measured": got["peak"], "ratio": ratio,
                     "reserved": got.get("reserved"), "method": got["method"]})
        if abs(ratio - 1) > TOLERANCE:
            bad.append((opts, round(ratio, 3)))
    expect(not bad, f"measured/predicted outside {TOLERANCE:.0%}: {bad}")
    return {"rows": rows}


# ----------------------------------------------------------------------------- timing (not correctness)

def check_precision_step_time(s: Setup) -> dict:
    data = s.batches(1, s.batch)
    out = {}
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        torch.set_float32_matmul_precision("highest")  # fp32 means fp32, not TF32
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt = wrapped(s, precision=mode)
        _, out[f"{mode}_s"] = train(model, opt, data, s.reps, s)
        memwrap.unwrap(model)
    torch.set_float32_matmul_precision("highest")
    out.update(speedup_bf16_vs_fp32=out["fp32_s"] / out["bf16_s"], speedup_bf16_vs_tf32=out["tf32_s"] / out["bf16_s"],
               speedup_fp16_vs_fp32=out["fp32_s"] / out["fp16_s"], setting=f"{s.gpt}, {s.batch} x {s.seq}, AdamW")
    return out


def check_checkpoint_overhead(s: Setup) -> dict:
    data = s.batches(1, s.batch)
    out = {}
    for policy in (None, "full", "selective"):
        model, opt = wrapped(s, precision="bf16", **({"checkpoint": policy} if policy else {}))
        if s.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        _, out[f"{policy or 'none'}_s"] = train(model, opt, data, s.reps, s)
        if s.device.type == "cuda":
            out[f"{policy or 'none'}_peak"] = torch.cuda.max_memory_allocated()
    out.update(overhead_full_pct=100 * (out["full_s"] / out["none_s"] - 1),
               overhead_selective_pct=100 * (out["selective_s"] / out["none_s"] - 1),
               setting=f"{s.gpt}, {s.batch} x {s.seq}, bf16, AdamW")
    return out


def check_accumulation_overhead(s: Setup) -> dict:
    out = {}
    for name, batch, n in (("resnet50", s.img_batch, 4), (s.gpt, s.batch, 4)):
        key = "resnet50" if name == "resnet50" else "gpt2"
        data = s.batches(1, batch, name=name)[0]
        for acc in (1, n):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ResNet's BatchNorm under accumulation: known, timing only
                model, opt = wrapped(s, name=name, accumulate=acc)
            if s.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            _, out[f"{key}_x{acc}_s"] = train(model, opt, split(data, acc), s.reps, s)
            if s.device.type == "cuda":
                out[f"{key}_x{acc}_peak"] = torch.cuda.max_memory_allocated()
        out[f"overhead_{key}_pct"] = 100 * (out[f"{key}_x{n}_s"] / out[f"{key}_x1_s"] - 1)
    out["setting"] = f"resnet50 batch {s.img_batch} at {s.image}px and {s.gpt} {s.batch} x {s.seq}, fp32, 4 micro-batches"
    return out


def check_wrapped_vs_handwritten(s: Setup) -> dict:
    data = split(s.batches(1, s.batch)[0], 4)
    autocast = torch.autocast(s.device.type, dtype=torch.bfloat16)
    hand = s.model()
    hand_opt = memwrap.create_optimizer("adamw", hand, lr=1e-4)
    ref_state = copy.deepcopy(hand.state_dict())

    def hand_update():
        for x, y in data:  # nanoGPT-style: autocast forward, loss / N, step at the window's end
            with autocast:
                logits = hand(x)
            (lm_loss(logits, y) / len(data)).backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)

    times = []
    for _ in range(s.reps):
        s.sync()
        t0 = time.perf_counter()
        hand_update()
        s.sync()
        times.append(time.perf_counter() - t0)
    hand_s = statistics.median(times[1:])
    model, opt = wrapped(s, precision="bf16", accumulate=4)
    model.module.load_state_dict(ref_state)
    _, wrapped_s = train(model, opt, data, s.reps, s)
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(hand.parameters(), model.parameters()))
    expect(diff < 1e-3, f"wrapped and hand-written loops diverged (max weight difference {diff})")
    return {"hand_s": hand_s, "wrapped_s": wrapped_s, "ratio": wrapped_s / hand_s, "max_weight_diff": diff}


CHECKS: dict[str, tuple[Callable[[Setup], dict], bool]] = {  # name -> (function, is a correctness check)
    "fp16_gradscaler": (check_fp16_gradscaler, True),
    "bf16": (check_bf16, True),
    "tf32": (check_tf32, True),
    "bnb_8bit": (check_bnb_8bit, True),
    "offload_checkpointing": (check_offload, True),
    "planner_vs_cuda": (check_planner_vs_cuda, True),
    "wrapped_vs_handwritten": (check_wrapped_vs_handwritten, True),
    "precision_step_time": (check_precision_step_time, False),
    "checkpoint_overhead": (check_checkpoint_overhead, False),
    "accumulation_overhead": (check_accumulation_overhead, False),
}


def environment(s: Setup) -> dict:
    env = {"torch": torch.__version__, "python": platform.python_version(), "dry_run": s.dry,
           "device": "cpu (dry run)" if s.dry else torch.cuda.get_device_name(0)}
    if not s.dry:
        env.update(capability=".".join(map(str, torch.cuda.get_device_capability(0))), cuda=torch.version.cuda,
                   memory=torch.cuda.get_device_properties(0).total_memory, bf16=torch.cuda.is_bf16_supported())
    return env


def main(argv: list[str] | None = None) -> int:
    """Run every check; write the JSON; return 1 if a correctness check failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="output folder (default docs/benchmarks)")
    ap.add_argument("--dry-run", action="store_true", help="run the same code paths on CPU at tiny sizes")
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run with --dry-run to exercise the code on CPU.", file=sys.stderr)
        return 2
    s = Setup(args.dry_run)
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown checks {unknown}; valid: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"benchmark": "gpu_check", **environment(s), "checks": {}}
    t_all = time.perf_counter()
    for name in names:
        fn, correctness = CHECKS[name]
        t0 = time.perf_counter()
        try:
            result = fn(s)
            status = result.pop("status", "ok")
        except Exception as exc:  # recorded; the other checks still run
            result, status = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}, \
                "failed"
        finally:
            if s.device.type == "cuda":
                torch.cuda.empty_cache()
        result.update(status=status, correctness=correctness, seconds=round(time.perf_counter() - t0, 2))
        doc["checks"][name] = result
        print(f"[{time.perf_counter() - t_all:6.1f}s] {name:<24} {status:<8} "
              f"{result.get('error') or result.get('reason') or ''}", flush=True)
    doc["seconds"] = round(time.perf_counter() - t_all, 1)
    failed = [n for n, r in doc["checks"].items() if r["correctness"] and r["status"] == "failed"]
    doc["failed"] = failed
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gpu_check_dry_run.json" if s.dry else "gpu_check.json")
    path.write_text(json.dumps(doc, indent=1, default=repr))
    print(f"wrote {path}; {len(failed)} correctness check(s) failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
