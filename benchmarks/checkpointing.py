"""Activation checkpointing: peak memory by category and step-time ratio on a GPT-style model.

Run:  python benchmarks/checkpointing.py [--layers 6 --d 256 --batch 4 --seq 256 --reps 9 --device cpu]

For each configuration (none, full, selective, every-2, offload) one training step (forward,
backward, AdamW step, zero_grad) is traced with torch's ``MemTracker`` to get the memory at the
step's peak split into parameters, gradients, optimizer state, activations and temporaries; the
forward's retained activations and the step FLOPs (``FlopCounterMode``) are recorded as well.
Step time is measured without the tracker, configurations interleaved per repetition, median
(on CPU: CPU time of the one compute thread, so neighbours on a shared machine do not skew it).
Writes docs/benchmarks/checkpointing.{json,png}. On CPU, ``offload`` cannot lower the numbers
(its target memory *is* the CPU); run with ``--device cuda`` to see it.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from memwrap.checkpointing.apply import apply_checkpointing  # noqa: E402
from memwrap.models import GPT, GPTConfig, lm_loss  # noqa: E402

CONFIGS = {"none": None, "full": {}, "selective": {"mode": "selective"}, "every-2": {"every": 2},
           "offload": {"offload": True}}
CATEGORIES = ["Parameter", "Gradient", "Optstate", "Activation", "Temp"]
OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def build(args, kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.d // 64,
                    n_embd=args.d)
    model = GPT(cfg).to(args.device)
    if kw is not None:
        apply_checkpointing(model, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, opt, x, y):
    lm_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def trace(args, kw, x, y):
    model, opt = build(args, kw)
    step(model, opt, x, y)  # create optimizer state so the traced step is a steady-state one
    mt = MemTracker()
    mt.track_external(model, opt, x, y)
    with mt:
        before = sum(s["Total"] for s in mt.get_tracker_snapshot("current").values())
        out = model(x)
        retained = sum(s["Total"] for s in mt.get_tracker_snapshot("current").values()) - before
        lm_loss(out, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dev = torch.device(args.device)
    peak = {getattr(k, "value", k): v for d, snap in mt.get_tracker_snapshot("peak").items() if d.type == dev.type
            for k, v in snap.items()}
    with FlopCounterMode(display=False) as fc:
        step(model, opt, x, y)
    return {"peak": {c: peak.get(c, 0) for c in CATEGORIES + ["Total"]}, "forward_retained": retained,
            "flops": fc.get_total_flops()}


def timings(args, x, y):
    runs = {name: build(args, kw) for name, kw in CONFIGS.items()}
    for model, opt in runs.values():  # warm-up
        step(model, opt, x, y)
    # On CPU, time this thread's CPU time with one intra-op thread: wall time on a shared machine
    # mostly measures the neighbours. On CUDA, wall time between synchronizations.
    clock = time.perf_counter if args.device == "cuda" else time.thread_time
    times = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, (model, opt) in runs.items():  # interleaved: drift hits every config alike
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0 = clock()
            step(model, opt, x, y)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times[name].append(clock() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def plot(results, path, setup):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    bottom = [0.0] * len(names)
    for cat in CATEGORIES:
        vals = [results[n]["peak"][cat] / 2**20 for n in names]
        ax1.bar(names, vals, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("MiB at the step's peak")
    ax1.set_title("Peak memory by category (MemTracker)")
    ax1.legend(fontsize=8)
    ax2.bar(names, [results[n]["time_ratio"] for n in names], color="tab:gray")
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_ylabel("step time / step time without checkpointing")
    ax2.set_title("Step-time ratio (median)")
    fig.suptitle(f"GPT {setup['layers']}x{setup['d']}, batch {setup['batch']}x{setup['seq']}, {setup['device']}"
                 + (" (offload targets CPU memory, so on CPU it equals full)" if setup["device"] == "cpu" else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing JSON")
    args = p.parse_args(argv)
    if args.plot_only:
        saved = json.loads((args.out / "checkpointing.json").read_text())
        plot(saved["results"], args.out / "checkpointing.png", saved["setup"])
        return
    if args.device == "cpu":
        torch.set_num_threads(1)

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(args.device)
    results = {name: trace(args, kw, x, y) for name, kw in CONFIGS.items()}
    med = timings(args, x, y)
    outside = trace(argparse.Namespace(**{**vars(args), "layers": 0}), None, x, y)["forward_retained"]
    base = results["none"]
    for name, r in results.items():
        r["time_s"] = med[name]
        r["time_ratio"] = med[name] / med["none"]
        r["block_activation_kept"] = (r["forward_retained"] - outside) / (base["forward_retained"] - outside)
        r["recompute_flops_ratio"] = r["flops"] / base["flops"]

    mib = 2**20
    header = (f"{'config':<10} {'peak MiB':>9} {'act@peak':>9} {'temp@peak':>9} {'fwd-kept MiB':>12} "
              f"{'blocks kept':>11} {'FLOPs x':>8} {'time x':>7}")
    print(f"GPT {args.layers}x{args.d}, vocab {args.vocab}, batch {args.batch}x{args.seq}, {args.device}, "
          f"torch {torch.__version__}")
    print(header)
    for name, r in results.items():
        pk = r["peak"]
        print(f"{name:<10} {pk['Total'] / mib:>9.1f} {pk['Activation'] / mib:>9.1f} {pk['Temp'] / mib:>9.1f} "
              f"{r['forward_retained'] / mib:>12.1f} {r['block_activation_kept']:>10.1%} "
              f"{r['recompute_flops_ratio']:>8.3f} {r['time_ratio']:>7.2f}")

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()}
    meta["torch"] = torch.__version__
    (args.out / "checkpointing.json").write_text(json.dumps({"setup": meta, "results": results}, indent=2))
    plot(results, args.out / "checkpointing.png", meta)
    print(f"wrote {args.out / 'checkpointing.json'} and .png")


if __name__ == "__main__":
    main()
