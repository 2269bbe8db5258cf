"""GPU check: memwrap's CUDA paths, planner vs ``torch.cuda.max_memory_allocated``, step-time ratios.

Run on one Hopper-class GPU (H100/H200; any recent NVIDIA GPU works), in about 9 minutes (the zoo row's 24 traces
run on the CPU)::

    python benchmarks/gpu_check.py                 # writes docs/benchmarks/gpu_check.json
    python benchmarks/gpu_check.py --dry-run       # same code paths on CPU at tiny sizes (no GPU needed)
    PYTHONUNBUFFERED=1 timeout 500 python3 benchmarks/gpu_check.py --out $OUT 2>&1 | tee $OUT/log  # lent device

Needs only torch (and memwrap from this checkout). bitsandbytes is optional: without it the 8-bit
check is recorded as skipped, with the reason (see docs/gpu.md to carry a wheel). Every check is
independent: a failure is recorded and the others still run. The exit status is 1 if a
correctness check failed, else 0. The JSON is rewritten after every check (``complete``/``pending`` say
how far it got), so a run cut off by a timeout keeps its results. ``--dry-run`` writes ``gpu_check_dry_run.json`` so that it never
replaces real GPU results (``benchmarks/seed_claims.py`` reads ``gpu_check.json``).
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import sys
import time
import traceback
import warnings
from typing import Any, Callable

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
try:  # a broken checkout must still leave a JSON that says why (main() records it)
    import memwrap  # noqa: E402
    from memwrap.models import lm_loss, preset_batch  # noqa: E402
    from gpu_common import (Setup, compare, environment, expect, grads_of, loss_of, outside_allocator,  # noqa: E402
                            peak_of, split, suggest_margin, train, update, wrapped, write)
    from gpu_budget import check_budget  # noqa: E402
    from gpu_ladder import check_ladder  # noqa: E402
    IMPORT_ERROR = None
except Exception as _exc:  # noqa: BLE001
    IMPORT_ERROR = f"{type(_exc).__name__}: {_exc}\n{traceback.format_exc(limit=6)}"

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
TOLERANCE = 0.05  # planner prediction vs measured peak: the target
# The dry run's 2-layer gpt2-tiny holds ~1 MB of state: fixed costs (autocast weight copies, bitsandbytes'
# blockwise buffers) are a larger share there, as in the CPU benchmarks' smallest rows.
DRY_RUN_TOLERANCE = 0.10


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
    from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes

    model, opt = wrapped(s, optim="adamw_8bit", lr=1e-3)
    losses, step_s = train(model, opt, [s.batches(1, s.batch)[0]], s.updates, s)
    expect(losses[-1] < losses[0], f"8-bit AdamW did not lower the loss: {losses}")
    measured, predicted = measure_state_bytes(opt.optimizer), predict_state_bytes("adamw_8bit", model.module)
    expect(measured == predicted, f"8-bit state {measured} B, plugin predicts {predicted} B")
    return {"losses": losses, "state_bytes": measured, "predicted_state_bytes": predicted,
            "bnb_version": bitsandbytes.__version__, "step_s": step_s}


def check_hf_optimizers_cuda(s: Setup) -> dict:
    """The Hugging Face optimizers whose kernels need CUDA (AdaLomo, GaLore 8-bit, bitsandbytes' 32-bit AdEMAMix)
    and the paged ones with real paging: tests/test_hf_optimizers.py against Trainer's own, on the GPU."""
    import importlib.util

    missing = [m for m in ("pytest", "transformers", "bitsandbytes", "galore_torch", "lomo_optim")
               if importlib.util.find_spec(m) is None]
    if missing or s.dry:
        return {"status": "skipped", "reason": f"not installed: {missing}" if missing else "needs CUDA (dry run)"}
    import pytest

    root = pathlib.Path(__file__).resolve().parents[1]
    names = ["adalomo", "galore_adamw_8bit", "galore_adamw_8bit_layerwise", "ademamix", "paged_ademamix_32bit",
             "paged_adamw_8bit", "paged_adamw_32bit", "paged_lion_8bit"]
    expr = " or ".join(f"[{n}]" for n in names)
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(root / "tests" / "test_hf_optimizers.py"), "-k",
                        f"(same_maths or conformance_kit) and ({expr})"])
    expect(code == 0, f"tests/test_hf_optimizers.py on CUDA exited {code}")
    return {"names": names, "pytest_exit": int(code)}


def check_norm_pass_cuda(s: Setup) -> dict:
    """The norm pass's CUDA-only tests (issue 21): AdaLomo clipped inside backward against lomo-optim's own two-pass
    clipping (in a plain loop, and inside transformers.Trainer), the step in backward's CUDA rows, and a penalty refused
    where the hooks run on autograd's device thread (the caller's roots read from another thread), on the GPU."""
    import importlib.util

    missing = [m for m in ("pytest", "lomo_optim") if importlib.util.find_spec(m) is None]
    if missing or s.dry:
        return {"status": "skipped", "reason": f"not installed: {missing}" if missing else "needs CUDA (dry run)"}
    import pytest

    root = pathlib.Path(__file__).resolve().parents[1] / "tests"
    code = pytest.main(["-q", "-p", "no:cacheprovider", str(root / "test_norm_pass_in_backward.py"),
                        str(root / "test_step_in_backward.py"), str(root / "test_trainer_norm_pass.py"),
                        str(root / "test_loss_paths.py"), "-k", "cuda"])
    expect(code == 0, f"the norm pass's CUDA tests exited {code}")
    return {"pytest_exit": int(code)}


def check_offload(s: Setup) -> dict:
    x, y = s.batches(1, s.batch)[0]
    res, grads = {}, {}
    for policy in (None, "full", "offload"):
        key = policy or "none"
        model = s.model()
        wm = memwrap.wrap(model, checkpoint=policy) if policy else model
        _, res[f"peak_{key}"] = peak_of(s, lambda wm=wm: loss_of(wm(x), y).backward())
        grads[key] = grads_of(model).cpu()  # kept off the GPU so the next pass's peak does not carry it
        del model, wm  # nor this pass's weights and gradients
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    for k in ("full", "offload"):
        err = float((grads[k] - grads["none"]).norm() / grads["none"].norm())
        res[f"grad_rel_err_{k}"] = err
        expect(err < 1e-5, f"checkpoint={k} changed the gradients (relative error {err})")
    if s.device.type == "cuda":
        expect(res["peak_offload"] <= res["peak_full"], f"offloading did not lower the peak below full checkpointing "
               f"({res['peak_offload']} B vs {res['peak_full']} B above the weights)")
    return res


# The zoo families and configurations measured on CUDA (issue 20): convolutions and an RNN (cuDNN workspaces, which
# the CPU-side workspace probes do not model), attention models, an encoder-decoder, 8-bit AdamW's CUDA kernel.
ZOO_FAMILIES = ("resnet", "lstm", "vit", "whisper", "bart", "t5", "gpt2", "llama")
ZOO_CONFIGS = ("fp32", "bf16+ckpt", "adamw_8bit")
ZOO_DRY = (("resnet", "fp32"), ("lstm", "fp32"))  # the code path on CPU, in seconds


def check_zoo_cuda(s: Setup) -> dict:
    """benchmarks/zoo.py's cells measured on the GPU: predicted (fake trace on the CPU) vs the CUDA allocator's peak.

    The rows are kept when one misses the 5% target, so the JSON shows by how much (cuDNN workspaces are expected to
    be the largest gap); the check then fails.
    """
    import zoo

    found = zoo.families()
    cells = ZOO_DRY if s.dry else [(f, c) for f in ZOO_FAMILIES for c in ZOO_CONFIGS]
    rows, bad = [], []
    for family, config in cells:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            row = zoo.cell(family, found[family], config, device=s.device)
        rows.append(row)
        if row["status"] == "ok" and abs(row["error"]) > TOLERANCE:
            bad.append((family, config, round(row["error"], 3)))
    out: dict[str, Any] = {"rows": rows, "target": TOLERANCE,
                           "measured": sum(r["status"] == "ok" for r in rows), "cells": len(rows)}
    if bad:
        out.update(status="failed", error=f"(predicted - measured) / measured outside {TOLERANCE:.0%}: {bad}")
    return out


def check_planner_vs_cuda(s: Setup) -> dict:
    """Predicted (fake trace on the CPU) vs measured peak of real steps, and what the device holds beyond it.

    The rows are kept when one misses the target, so the JSON shows by how much; the check then fails.
    """
    from memwrap.memory import measure_peak

    configs = [(s.gpt, o) for o in ({}, {"precision": "bf16"}, {"accumulate": 4}, {"checkpoint": "full"},
                                    {"precision": "bf16", "accumulate": 4, "checkpoint": "full"},
                                    {"checkpoint": "selective"})]
    configs.append(("resnet50", {"precision": "bf16"}))  # convolutions: cuDNN workspaces are not traced
    bnb_missing = None
    try:
        import bitsandbytes  # noqa: F401

        configs.append((s.gpt, {"precision": "bf16", "optim": "adamw_8bit"}))
    except Exception as exc:  # noqa: BLE001  (a broken CUDA library raises more than ImportError)
        bnb_missing = f"adamw_8bit row left out: {type(exc).__name__}: {exc}"
    rows, bad = [], []
    tolerance = DRY_RUN_TOLERANCE if s.dry else TOLERANCE
    for name, opts in configs:
        image = name == "resnet50"
        micro = (s.img_batch if image else s.batch) // opts.get("accumulate", 1)
        batch = preset_batch(name, micro, s.image if image else s.seq)
        loss_fn = None if image else lm_loss
        est = memwrap.estimate(lambda: s.build(name), batch, loss_fn=loss_fn, workspace=s.device.type, **opts)
        got = measure_peak(lambda: s.build(name), batch, loss_fn, steps=1, device=s.device, **opts)
        ratio = got["peak"] / est.peak
        rows.append({"model": name, "options": opts, "predicted": est.peak, "measured": got["peak"], "ratio": ratio,
                     "reserved": got.get("reserved"), "method": got["method"]})
        if abs(ratio - 1) > tolerance:
            bad.append((name, opts, round(ratio, 3)))
    out: dict[str, Any] = {"rows": rows, "target": tolerance,
                           "worst_ratio": max((r["ratio"] for r in rows), key=lambda v: abs(v - 1))}
    if bnb_missing:
        out["bnb_unavailable"] = bnb_missing
    if (outside := outside_allocator(s.device)) is not None:
        out.update(outside)  # after real steps: cuBLAS (and cuDNN) handles and workspaces now exist
    if bad:
        out.update(status="failed", error=f"measured/predicted outside {tolerance:.0%}: {bad}")
    return out


def check_multi_gpu_planner(s: Setup) -> dict:
    """Per-rank peak under FSDP2 and DDP on every GPU of the machine (torchrun, nccl) vs the sharded estimate.

    Optional: skipped on a machine with fewer than 2 GPUs (the CPU/gloo version is benchmarks/distributed_planner.py).
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if s.dry or count < 2:
        return {"status": "skipped", "reason": f"needs 2 or more GPUs, this machine has {count}"}
    import tempfile

    import distributed_planner as dp

    rows, bad = [], []
    with tempfile.TemporaryDirectory() as tmp:
        ranks = dp.measure(count, pathlib.Path(tmp))
    for i, first in enumerate(ranks[0]):
        est = dp.predict(count, first["strategy"], dp.CASES[first["case"]])
        measured = [r[i]["peak"] for r in ranks]
        ratio = max(measured) / est.peak
        rows.append({"strategy": first["strategy"], "case": first["case"], "world_size": count,
                     "predicted": est.peak, "measured": measured, "ratio": ratio})
        if abs(ratio - 1) > TOLERANCE:
            bad.append((first["strategy"], first["case"], round(ratio, 3)))
    out: dict[str, Any] = {"rows": rows, "target": TOLERANCE}
    if bad:
        out.update(status="failed", error=f"measured/predicted outside {TOLERANCE:.0%}: {bad}")
    return out


# ----------------------------------------------------------------------------- timing (not correctness)

def check_precision_step_time(s: Setup) -> dict:
    data = s.batches(1, s.batch)
    before = torch.get_float32_matmul_precision()
    models = {}
    for mode in ("fp32", "tf32", "bf16", "fp16"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            models[mode] = wrapped(s, precision=mode)

    def runner(mode):
        def run():
            # the matmul precision is process-wide and tf32's wrap set it: fp32 means fp32, not TF32
            torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
            return update(*models[mode], data)
        return run

    try:
        out = compare(s, {mode: runner(mode) for mode in models})
    finally:
        memwrap.unwrap(models["tf32"][0])
        torch.set_float32_matmul_precision(before)
    out.update(speedup_bf16_vs_fp32=out["fp32_s"] / out["bf16_s"], speedup_bf16_vs_tf32=out["tf32_s"] / out["bf16_s"],
               speedup_fp16_vs_fp32=out["fp32_s"] / out["fp16_s"], setting=f"{s.gpt}, {s.batch} x {s.seq}, AdamW")
    return out


def check_checkpoint_overhead(s: Setup) -> dict:
    data = s.batches(1, s.batch)
    models = {policy or "none": wrapped(s, precision="bf16", **({"checkpoint": policy} if policy else {}))
              for policy in (None, "full", "selective")}
    out = compare(s, {k: (lambda m=m, o=o: update(m, o, data)) for k, (m, o) in models.items()})
    out.update(overhead_full_pct=100 * (out["full_s"] / out["none_s"] - 1),
               overhead_selective_pct=100 * (out["selective_s"] / out["none_s"] - 1),
               setting=f"{s.gpt}, {s.batch} x {s.seq}, bf16, AdamW")
    return out


def check_accumulation_overhead(s: Setup) -> dict:
    out = {}
    for name, batch, n in (("resnet50", s.img_batch, 4), (s.gpt, s.batch, 4)):
        key = "resnet50" if name == "resnet50" else "gpt2"
        data = s.batches(1, batch, name=name)[0]
        runners = {}
        for acc in (1, n):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # ResNet's BatchNorm under accumulation: known, timing only
                model, opt = wrapped(s, name=name, accumulate=acc)
            runners[f"{key}_x{acc}"] = lambda m=model, o=opt, mb=split(data, acc): update(m, o, mb)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out.update(compare(s, runners))
        out[f"overhead_{key}_pct"] = 100 * (out[f"{key}_x{n}_s"] / out[f"{key}_x1_s"] - 1)
        del runners, model, opt  # free this family before the next one
        if s.device.type == "cuda":
            torch.cuda.empty_cache()
    out["setting"] = f"resnet50 batch {s.img_batch} at {s.image}px and {s.gpt} {s.batch} x {s.seq}, fp32, 4 micro-batches"
    return out


def check_wrapped_vs_handwritten(s: Setup) -> dict:
    data = split(s.batches(1, s.batch)[0], 4)
    autocast = torch.autocast(s.device.type, dtype=torch.bfloat16)
    hand = s.model()
    hand_opt = memwrap.create_optimizer("adamw", hand, lr=1e-4)
    init = [p.detach().clone() for p in hand.parameters()]
    model, opt = wrapped(s, precision="bf16", accumulate=4)
    model.module.load_state_dict(hand.state_dict())

    def hand_update():
        total = torch.zeros((), device=s.device)
        for x, y in data:  # nanoGPT-style: autocast forward, loss / N, step at the window's end
            with autocast:
                logits = hand(x)
            loss = lm_loss(logits, y) / len(data)
            loss.backward()
            total += loss.detach().float()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)
        return total

    # both run WARMUP + reps updates on the same data, so their weights must agree afterwards
    out = compare(s, {"hand": hand_update, "wrapped": lambda: update(model, opt, data)})
    num = den = 0.0
    for w0, h, w in zip(init, hand.parameters(), model.module.parameters()):
        d_hand, d_wrapped = (h.detach() - w0).double(), (w.detach() - w0).double()
        num += float((d_wrapped - d_hand).pow(2).sum())
        den += float(d_hand.pow(2).sum())
    rel = (num / den) ** 0.5 if den else float("inf")
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(hand.parameters(), model.module.parameters()))
    # relative to the update itself: a max |w diff| is small even for a wrong loop when lr is small
    expect(rel < 1e-2, f"wrapped and hand-written updates differ: ||dw_wrapped - dw_hand|| / ||dw_hand|| = {rel:.3g}")
    out.update(ratio=out["wrapped_s"] / out["hand_s"], update_rel_diff=rel, max_weight_diff=diff)
    return out


CHECKS: dict[str, tuple[Callable[[Setup], dict], bool]] = {  # name -> (function, is a correctness check)
    "fp16_gradscaler": (check_fp16_gradscaler, True),
    "bf16": (check_bf16, True),
    "tf32": (check_tf32, True),
    "bnb_8bit": (check_bnb_8bit, True),
    "hf_optimizers_cuda": (check_hf_optimizers_cuda, True),
    "norm_pass_cuda": (check_norm_pass_cuda, True),
    "zoo_cuda": (check_zoo_cuda, True),  # benchmarks/zoo.py's cells on CUDA: the estimate vs cuDNN's workspaces
    "offload_checkpointing": (check_offload, True),
    "planner_vs_cuda": (check_planner_vs_cuda, True),
    "wrapped_vs_handwritten": (check_wrapped_vs_handwritten, True),
    "multi_gpu_planner": (check_multi_gpu_planner, True),  # skipped below 2 GPUs
    "precision_step_time": (check_precision_step_time, False),
    "checkpoint_overhead": (check_checkpoint_overhead, False),
    "accumulation_overhead": (check_accumulation_overhead, False),
    "budget": (check_budget, True),  # benchmarks/gpu_budget.py: wrap(budget=) within the budget on CUDA (issue 13)
    "ladder": (check_ladder, True),  # benchmarks/gpu_ladder.py: issue 12's ladder on ~1B, then 8B under a 24 GiB cap
}


def main(argv: list[str] | None = None) -> int:
    """Run every check; write the JSON after each one; return 1 if a correctness check failed."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=OUT, help="output folder (default docs/benchmarks)")
    ap.add_argument("--dry-run", action="store_true", help="run the same code paths on CPU at tiny sizes")
    ap.add_argument("--only", default=None, help="comma-separated check names (default: all)")
    args = ap.parse_args(argv)
    if IMPORT_ERROR is not None:
        doc = {"benchmark": "gpu_check", "torch": torch.__version__, "python": platform.python_version(),
               "dry_run": args.dry_run, "import_error": IMPORT_ERROR, "checks": {}, "failed": ["import"]}
        path = write(doc, args.out, args.dry_run)
        print(f"gpu_check: importing memwrap failed; recorded in {path}:\n{IMPORT_ERROR}", file=sys.stderr)
        return 1
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; run with --dry-run to exercise the code on CPU.", file=sys.stderr)
        return 2
    s = Setup(args.dry_run)
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"gpu_check: unknown checks {unknown}; valid: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    doc: dict[str, Any] = {"benchmark": "gpu_check", **environment(s), "checks": {}, "complete": False,
                           "pending": list(names), "failed": []}
    path = write(doc, args.out, s.dry)
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
        doc["pending"].remove(name)
        doc["failed"] = [n for n, r in doc["checks"].items() if r["correctness"] and r["status"] == "failed"]
        doc["seconds"] = round(time.perf_counter() - t_all, 1)
        doc["suggested_margin"] = suggest_margin(doc)
        write(doc, args.out, s.dry)  # after every check: a timeout still leaves what ran
        print(f"[{time.perf_counter() - t_all:6.1f}s] {name:<24} {status:<8} "
              f"{result.get('error') or result.get('reason') or ''}", flush=True)
    doc["complete"] = True
    write(doc, args.out, s.dry)
    failed = doc["failed"]
    print(f"wrote {path}; {len(failed)} correctness check(s) failed{': ' + ', '.join(failed) if failed else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
