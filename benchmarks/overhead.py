"""Step time of memwrap's unchanged loop vs the hand-written loop using the same torch primitives.

The hand-written loop is the seeds' loop: divide the loss by N, autocast around the forward,
GradScaler for fp16, step every N micro-batches. Both run side by side in one process,
interleaved, several repetitions; the median ratio is reported.

    python benchmarks/overhead.py [--reps 7] [--windows 3]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import time
from pathlib import Path

import torch

import memwrap
from memwrap.models import build_preset, lm_loss, preset_batch

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def hand_written(model, opt, batches, precision, accumulate):
    """The seed's loop, written out by hand."""
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    ctx = (lambda: torch.autocast("cpu", dtype=DTYPES[precision])) if precision in DTYPES else contextlib.nullcontext
    for i, (x, y) in enumerate(batches):
        with ctx():
            logits = model(x)
        loss = lm_loss(logits.float(), y) / accumulate
        scaler.scale(loss).backward()
        if (i + 1) % accumulate == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()


def with_memwrap(model, opt, batches, precision, accumulate):
    """The user's loop unchanged; memwrap does the rest."""
    for x, y in batches:
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def run(precision, accumulate, reps, windows, micro_batch=4, seq=128):
    torch.manual_seed(0)
    base = build_preset("gpt2-tiny")
    batches = [preset_batch("gpt2-tiny", micro_batch, seq) for _ in range(accumulate * windows)]
    plain = copy.deepcopy(base)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    mw = copy.deepcopy(base)
    mw_model, mw_opt = memwrap.wrap(mw, torch.optim.AdamW(mw.parameters(), lr=1e-4), precision=precision,
                                   accumulate=accumulate)
    hand_written(plain, plain_opt, batches[:accumulate], precision, accumulate)  # warm-up both
    with_memwrap(mw_model, mw_opt, batches[:accumulate], precision, accumulate)
    hand, wrapped = [], []
    for rep in range(reps):
        # Alternate which goes first, so drifts in machine load hit both sides alike.
        order = [(hand, hand_written, plain, plain_opt), (wrapped, with_memwrap, mw_model, mw_opt)]
        for times, fn, model, opt in order if rep % 2 == 0 else order[::-1]:
            times.append(timed(fn, model, opt, batches, precision, accumulate) / len(batches))
    ratios = [w / h for w, h in zip(wrapped, hand)]
    return {"precision": precision, "accumulate": accumulate, "micro_batch": micro_batch, "seq": seq,
            "hand_ms": 1e3 * statistics.median(hand), "memwrap_ms": 1e3 * statistics.median(wrapped),
            "ratio_median": statistics.median(ratios), "ratios": ratios}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    rows = [run(p, 4, args.reps, args.windows) for p in ("fp32", "bf16", "fp16")]
    print(f"{'precision':>9} {'accum':>5} {'hand ms/micro':>14} {'memwrap ms/micro':>17} {'median ratio':>13}")
    for r in rows:
        print(f"{r['precision']:>9} {r['accumulate']:>5} {r['hand_ms']:>14.1f} {r['memwrap_ms']:>17.1f} {r['ratio_median']:>13.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "model": "gpt2-tiny", "reps": args.reps}
    (args.out / "overhead.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, args.out / "overhead.png")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, r in enumerate(rows):
        ax.scatter([i] * len(r["ratios"]), r["ratios"], color="tab:blue", alpha=0.5)
        ax.hlines(r["ratio_median"], i - 0.25, i + 0.25, color="tab:red")
    ax.axhline(1.01, color="gray", ls="--", label="target 1.01")
    ax.set_xticks(range(len(rows)), [f"{r['precision']}, accumulate={r['accumulate']}" for r in rows])
    ax.set_ylabel("memwrap / hand-written step time")
    ax.set_title("memwrap overhead on an unchanged loop (gpt2-tiny, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
