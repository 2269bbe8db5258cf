"""The norm pass's cost: clipping (and fp16) with the step inside backward vs the ordinary clipped step.

For each model, three configurations of one update (``accumulate`` micro-batches):

* ``ordinary + clip``: ``wrap(..., max_grad_norm=1.0)``: every gradient alive at the step;
* ``sib``: ``step_in_backward=True`` without clipping (no norm pass): the reference for the pass's extra time;
* ``sib + clip``: ``step_in_backward=True, max_grad_norm=1.0``: the norm pass (a first backward of the last
  micro-batch over its retained graph, then the clipped steps inside the second).

Measured: the peak (:func:`memwrap.measure_peak`, the CPU allocator's live bytes; CUDA: max_memory_allocated), the
estimate of it, and the seconds per update (median of ``--reps`` repetitions, the configurations interleaved in
each repetition so that load changes hit them alike).

Run:  python benchmarks/norm_pass.py [--device cuda] [--reps 7]
Writes docs/benchmarks/norm_pass.json, .md and .png (``--device cuda``: norm_pass_cuda.*).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import memwrap
from memwrap.memory.measure import measure_peak
from memwrap.models import GPT, GPTConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
CONFIGS = {
    "ordinary + clip": {"max_grad_norm": 1.0},
    "sib": {"step_in_backward": True},
    "sib + clip": {"step_in_backward": True, "max_grad_norm": 1.0},
}


def _mlp():
    torch.manual_seed(0)
    widths = [32, 1024, 1024, 1024, 1024, 8]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=128))


def models(device: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 2048, (8, 64), generator=g)
    return {
        "MLP 32-1024x4-8": (_mlp, (torch.randn(64, 32, generator=g), torch.randn(64, 8, generator=g)), F.mse_loss),
        "GPT 4x128 (vocab 2048)": (_gpt, (ids, ids), lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())),
    }


def _loop(factory, batch, loss_fn, options, device):
    model = factory().to(device)
    x, y = (t.to(device) for t in batch)
    wmodel, opt = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **options)
    accumulate = options.get("accumulate", 1)

    def update():
        for _ in range(accumulate):
            loss_fn(wmodel(x), y).backward()
            opt.step()
            opt.zero_grad()
    return update, opt


def run(args) -> dict:
    rows = []
    for name, (factory, batch, loss_fn) in models(args.device).items():
        for accumulate in (1, 4):
            configs = {k: {**v, "accumulate": accumulate} for k, v in CONFIGS.items()}
            loops = {k: _loop(factory, batch, loss_fn, v, args.device) for k, v in configs.items()}
            for update, _ in loops.values():
                update()  # warm-up: optimizer state exists
            times = {k: [] for k in configs}
            for _ in range(args.reps):  # interleaved
                for k, (update, _) in loops.items():
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    update()
                    if args.device.startswith("cuda"):
                        torch.cuda.synchronize()
                    times[k].append(time.perf_counter() - t0)
            first_passes = loops["sib + clip"][1].step_in_backward.norm.first_passes
            for k, options in configs.items():
                measured = measure_peak(factory, batch, loss_fn, device=args.device, **options)
                est = memwrap.estimate(factory, batch, loss_fn=loss_fn, **options)
                rows.append({"model": name, "config": k, "accumulate": accumulate, "options": options,
                             "seconds": statistics.median(times[k]), "times": times[k],
                             "measured_peak": measured["peak"], "estimate": est.peak,
                             "estimate_error": (est.peak - measured["peak"]) / measured["peak"],
                             "method": measured["method"],
                             **({"first_passes": first_passes} if k == "sib + clip" else {})})
            by = {r["config"]: r for r in rows[-3:]}
            by["sib + clip"]["time_vs_sib"] = by["sib + clip"]["seconds"] / by["sib"]["seconds"]
            by["sib + clip"]["time_vs_ordinary"] = by["sib + clip"]["seconds"] / by["ordinary + clip"]["seconds"]
            by["sib + clip"]["peak_vs_ordinary"] = by["sib + clip"]["measured_peak"] / by["ordinary + clip"]["measured_peak"]
    return {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
            "threads": torch.get_num_threads(), "reps": args.reps,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}


def markdown(result: dict) -> str:
    mb = 1e6
    lines = [
        "# The norm pass: clipping with the step inside backward (measured)",
        "",
        f"`python benchmarks/norm_pass.py --device {result['device']} --reps {result['reps']}` (torch "
        f"{result['torch']}, {result['threads']} threads, {result['date']}). AdamW, `max_grad_norm=1.0`. Time: median "
        "seconds per update, the three configurations interleaved in each repetition. Peak: "
        f"{result['rows'][0]['method']}; estimate: `memwrap.estimate` of the same step.",
        "",
        "| model | accumulate | configuration | s / update | vs sib | vs ordinary + clip | measured peak (MB) | "
        "peak vs ordinary + clip | estimate error |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        vs_sib = f"{r['time_vs_sib']:.2f}x" if "time_vs_sib" in r else ""
        vs_ord = f"{r['time_vs_ordinary']:.2f}x" if "time_vs_ordinary" in r else ""
        peak = f"{r['peak_vs_ordinary']:.3f}" if "peak_vs_ordinary" in r else ""
        lines.append(f"| {r['model']} | {r['accumulate']} | {r['config']} | {r['seconds'] * 1e3:.1f} ms | {vs_sib} | "
                     f"{vs_ord} | {r['measured_peak'] / mb:.2f} | {peak} | {r['estimate_error']:+.2%} |")
    lines += [
        "",
        "The pass costs one more backward of the window's last micro-batch per update (with accumulate 4, one of "
        "four micro-batches' backwards), and no full set of gradients: during the first pass the last micro-batch's "
        "saved activations stay alive (as at the start of any backward) with the gradients of the model's outputs "
        "and one parameter's gradient at a time. Where gradients dominate the peak (the MLP, accumulate 1) the norm "
        "pass keeps the step in backward's saving; where activations dominate (the GPT) the peaks are alike. With "
        "accumulation the step in backward saves nothing (the earlier micro-batches' gradients are alive anyway), "
        "and the first pass adds one parameter's fresh gradient beside the accumulated ones (the MLP at accumulate "
        "4: above the ordinary step). On these small CPU models the extra time is 1.2-1.9x the ordinary clipped "
        "step: the second backward is most of a micro-batch's step here. The planner traces "
        "the pass through the real `wrap()`, so its peak and its second backward's FLOPs are in the plan "
        "(tests/test_norm_pass.py::test_the_planner_plans_the_norm_pass_with_its_memory_and_second_backward).",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["accumulate"]) for r in result["rows"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(CONFIGS)
    for j, config in enumerate(CONFIGS):
        rows = [next(r for r in result["rows"] if (r["model"], r["accumulate"]) == g and r["config"] == config)
                for g in groups]
        xs = [i + j * width for i in range(len(groups))]
        axes[0].bar(xs, [r["seconds"] * 1e3 for r in rows], width, label=config)
        axes[1].bar(xs, [r["measured_peak"] / 1e6 for r in rows], width, label=config)
    for ax, label in zip(axes, ("ms per update (median)", "measured peak (MB)")):
        ax.set_xticks([i + 0.4 for i in range(len(groups))], [f"{m}\nacc {a}" for m, a in groups], fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle("norm pass (step in backward + clipping) vs the ordinary clipped step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    result = run(args)
    suffix = "" if args.device == "cpu" else f"_{torch.device(args.device).type}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"norm_pass{suffix}.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / f"norm_pass{suffix}.md").write_text(markdown(result))
    plot(result, OUT / f"norm_pass{suffix}.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
