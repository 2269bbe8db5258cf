"""Benchmark of the memory planner.

1. Planning time for the LLaMA-7B preset (batch 1, sequence 2048) over the default grid
   (2 precisions x 5 checkpoint policies x installed optimizers), on fake tensors.
2. Extrapolation check at 7B scale: one configuration traced whole vs extrapolated (skip: --no-full).
3. Predicted vs measured peak on CPU for several models and configurations: the measurement is
   the CPU allocator's peak of live bytes (torch.profiler memory events), see memwrap/memory/measure.py.
   Also process memory growth (RSS) vs the tensor peak: the non-tensor overhead on CPU.

Writes docs/benchmarks/planner.json and docs/benchmarks/planner.png.

    python benchmarks/planner.py            # about 5 minutes on 2 cores
    python benchmarks/planner.py --quick    # skip the 7B full trace and the largest real runs
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from memwrap.memory import estimate, measure_peak, plan  # noqa: E402
from memwrap.memory.tracing.estimator import trace_config  # noqa: E402
from memwrap.models import (GPT, Bert, BertConfig, GPTConfig, Llama, LlamaConfig, ResNet, ResNetConfig,  # noqa: E402
                            build_preset, preset_batch)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks")


def lm(vocab, b, t):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def cases(quick: bool):
    gpt = lambda: GPT(GPTConfig(n_layer=6, n_head=8, n_embd=512, vocab_size=8192, block_size=128))  # noqa: E731
    llama = lambda: Llama(LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376,  # noqa: E731
                                      num_hidden_layers=6, num_attention_heads=8, max_position_embeddings=128))
    bert = lambda: Bert(BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4,  # noqa: E731
                                   num_attention_heads=4, intermediate_size=1024, max_position_embeddings=128,
                                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    resnet = lambda: ResNet(ResNetConfig(layers=(1, 1, 1, 1), width=32, num_classes=100))  # noqa: E731
    g = torch.Generator().manual_seed(0)
    img = (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 100, (8,), generator=g))
    cls = (torch.randint(0, 8192, (8, 128), generator=g), torch.randint(0, 2, (8,), generator=g))
    rows = [
        ("gpt 6x512 (23M)", gpt, lm(8192, 4, 128), {}),
        ("gpt 6x512 (23M)", gpt, lm(8192, 4, 128), {"precision": "bf16", "checkpoint": "full"}),
        ("gpt 6x512 (23M)", gpt, lm(8192, 4, 128), {"accumulate": 2, "checkpoint": "selective", "max_grad_norm": 1.0}),
        ("gpt 6x512 (23M)", gpt, lm(8192, 4, 128), {"optim": "adafactor"}),
        ("llama 6x512 (27M)", llama, lm(8192, 4, 128), {}),
        ("llama 6x512 (27M)", llama, lm(8192, 4, 128), {"precision": "bf16", "checkpoint": "every-2"}),
        ("llama 6x512 (27M)", llama, lm(8192, 4, 128), {"precision": "fp16", "accumulate": 2}),
        ("bert 4x256 (6M)", bert, cls, {}),
        ("bert 4x256 (6M)", bert, cls, {"checkpoint": "full", "precision": "bf16"}),
        ("resnet (1,1,1,1)x32", resnet, img, {}),
        ("resnet (1,1,1,1)x32", resnet, img, {"precision": "bf16", "checkpoint": "full"}),
    ]
    return rows


def one_case(index: int) -> dict:
    """Estimate and measure case ``index`` in this (fresh) process, so that RSS growth means something."""
    name, factory, batch, options = cases(False)[index]
    # First, in the fresh process, the real steps without the profiler: process memory growth.
    plain = measure_peak(factory, batch, profile=False, **options)
    growth = plain["rss_peak"] - plain["rss_start"]
    t1 = time.perf_counter()
    measured = measure_peak(factory, batch, **options)
    t2 = time.perf_counter()
    est = estimate(factory, batch, **options)
    t0 = t1 - (time.perf_counter() - t2)  # so that t1 - t0 is the estimate's duration
    err = (est.peak - measured["peak"]) / measured["peak"]
    state = est.state["parameters"] + est.state["gradients"] + est.state["optimizer_state"]
    return {"model": name, "options": {k: str(v) for k, v in options.items()}, "predicted": est.peak,
            "measured": measured["peak"], "error": err, "training_state": state, "phase": est.peak_phase,
            "rss_growth": growth, "rss_overhead": growth - measured["peak"],
            "estimate_s": t1 - t0, "measure_s": t2 - t1, "method": est.method}


def accuracy(quick: bool):
    import subprocess

    out = []
    indices = [0, 1, 2, 3, 7] if quick else range(len(cases(False)))
    for i in indices:
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", str(i)], capture_output=True,
                              text=True, check=True)
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        out.append(row)
        print(f"{row['model']:<20} {str(row['options']):<70} predicted {row['predicted'] / 2**20:8.2f} MiB  "
              f"measured {row['measured'] / 2**20:8.2f} MiB  error {row['error']:+6.2%}  RSS growth "
              f"{row['rss_growth'] / 2**20:7.1f} MiB ({row['rss_growth'] / row['measured'] - 1:+.0%} vs tensors)  "
              f"[{row['estimate_s']:.1f} s / {row['measure_s']:.1f} s]", flush=True)
    return out


def planning(full_check: bool):
    t0 = time.perf_counter()
    p = plan(lambda: build_preset("llama-7b"), lambda mb: preset_batch("llama-7b", mb, 2048), budget="24GiB",
             global_batch=1)
    seconds = time.perf_counter() - t0
    print(f"\nllama-7b, batch 1, seq 2048: {len(p.candidates)} candidates planned in {seconds:.1f} s")
    print(p.verdict)
    big = p.with_budget("80GiB")
    print("80 GiB:", big.verdict)
    print(big.code())
    result = {"candidates": len(p.candidates), "seconds": seconds, "verdict_24GiB": p.verdict,
              "verdict_80GiB": big.verdict, "best_80GiB": big.best.to_dict() if big.best else None,
              "table": [{"label": c.label, "peak": c.estimate.peak, "breakdown": c.estimate.breakdown,
                         "phase": c.estimate.peak_phase, "cost": c.cost} for c in p.candidates]}
    if full_check:
        with torch.device("meta"):
            model = build_preset("llama-7b")
        batch = lambda: preset_batch("llama-7b", 1, 2048)  # noqa: E731
        options = {"precision": "bf16", "checkpoint": "full"}
        fast = trace_config(model, batch, None, options, "adamw", extrapolate=True)
        full = trace_config(model, batch, None, options, "adamw", extrapolate=False)
        pf = max(s.total for s in full.segments.values())
        pe = max(s.total for s in fast.segments.values())
        print(f"7B extrapolation check ({options}): extrapolated {pe} B in {fast.seconds:.1f} s, full trace {pf} B "
              f"in {full.seconds:.1f} s, difference {pe - pf} B")
        result["full_check"] = {"options": options, "extrapolated": pe, "full": pf, "extrapolated_s": fast.seconds,
                                "full_s": full.seconds}
    return result, p


def plot(acc, plan_result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [2, 1]})
    labels = [f"{r['model']}\n{','.join(f'{k}={v}' for k, v in r['options'].items()) or 'fp32'}" for r in acc]
    x = range(len(acc))
    ax1.bar([i - 0.2 for i in x], [r["predicted"] / 2**20 for r in acc], 0.4, label="predicted (fake trace)")
    ax1.bar([i + 0.2 for i in x], [r["measured"] / 2**20 for r in acc], 0.4, label="measured (CPU allocator)")
    for i, r in enumerate(acc):
        ax1.text(i, max(r["predicted"], r["measured"]) / 2**20, f"{r['error']:+.1%}", ha="center", va="bottom",
                 fontsize=7)
    ax1.set_xticks(list(x))
    ax1.set_xticklabels(labels, rotation=70, ha="right", fontsize=6)
    ax1.set_ylabel("peak MiB")
    ax1.set_title("predicted vs measured peak, CPU (one steady-state update)")
    ax1.legend(fontsize=8)
    tab = plan_result["table"]
    cats = ["parameters", "gradients", "optimizer_state", "activations", "temporaries"]
    bottom = [0.0] * len(tab)
    for c in cats:
        vals = [t["breakdown"][c] / 2**30 for t in tab]
        ax2.bar(range(len(tab)), vals, bottom=bottom, label=c)
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax2.axhline(24, color="red", linestyle="--", label="24 GiB")
    ax2.axhline(80, color="purple", linestyle=":", label="80 GiB")
    ax2.set_xticks(range(len(tab)))
    ax2.set_xticklabels([t["label"] for t in tab], rotation=80, fontsize=5)
    ax2.set_ylabel("GiB at the peak")
    ax2.set_title(f"llama-7b seq 2048: {plan_result['candidates']} candidates in {plan_result['seconds']:.0f} s")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-full", action="store_true", help="skip the 7B full-trace extrapolation check")
    parser.add_argument("--case", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(2)
    if args.case is not None:
        print(json.dumps(one_case(args.case)))
        return
    torch.manual_seed(0)
    plan_result, _ = planning(full_check=not (args.quick or args.no_full))
    print("\npredicted vs measured peak on CPU")
    acc = accuracy(args.quick)
    worst = max(abs(r["error"]) for r in acc)
    over = [r["rss_growth"] / r["measured"] - 1 for r in acc]
    print(f"worst error {worst:.2%}; RSS growth vs tensor peak: {min(over):+.0%} .. {max(over):+.0%}")
    os.makedirs(OUT, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with open(os.path.join(OUT, "planner.json"), "w") as fh:
        json.dump({"meta": meta, "planning_llama7b": plan_result, "accuracy_cpu": acc,
                   "worst_abs_error": worst, "rss_overhead_fraction": {"min": min(over), "max": max(over)}},
                  fh, indent=1)
    plot(acc, plan_result, os.path.join(OUT, "planner.png"))
    print(f"wrote {os.path.join(OUT, 'planner.json')} and planner.png")


if __name__ == "__main__":
    main()
