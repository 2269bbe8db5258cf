"""``wrap(..., budget=)``: time to plan, the split chosen, predicted vs measured peak, for a GPT on CPU.

For each budget (a fraction of the unsplit batch's measured peak) a fresh GPT trains 3 updates of a
16 x 64-token global batch under ``memwrap.wrap(model, optimizer, loader, budget=...)``; the second
update is measured with the CPU allocator's events (as ``memwrap.measure_peak`` does). Writes
docs/benchmarks/budget.{json,png,md}.

    OMP_NUM_THREADS=2 python benchmarks/budget.py
"""
from __future__ import annotations

import copy
import gc
import json
import sys
from pathlib import Path

import torch

import memwrap
from memwrap.memory import format_bytes
from memwrap.memory.measure import allocator_growth, live_bytes
from memwrap.models import build_preset, lm_loss

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
GPT = dict(n_layer=2, vocab_size=512, n_embd=64, n_head=2, dropout=0.0)
FRACTIONS = (1.2, 0.7, 0.45, 0.3)


def allocator_peak(fn, *alive) -> int:
    gc.collect()
    return live_bytes(*alive) + allocator_growth(fn)


def run(fraction: float, plain: int, start, batches) -> dict:
    budget = int(plain * fraction)
    model = copy.deepcopy(start)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wmodel, opt, loader = memwrap.wrap(model, inner, batches, budget=f"{budget}B")
    opt.budget_plan.log = None
    it = iter(loader)

    def update():
        while True:
            x, y = next(it)
            lm_loss(wmodel(x), y).backward()
            opt.step()
            opt.zero_grad()
            if opt.did_update:
                return

    update()
    measured = allocator_peak(update, model, inner, batches[1])
    c = opt.budget_plan.current
    return {"fraction": fraction, "budget": budget, "plan_seconds": round(opt.budget_plan.plan_seconds, 2),
            "micro_batch": c.micro_batch, "accumulate": c.accumulate, "checkpoint": c.checkpoint or "none",
            "predicted": c.peak + c.batch_rest, "required": c.required, "measured": measured,
            "ratio": round(measured / (c.peak + c.batch_rest), 4), "within_budget": measured <= budget}


def main() -> int:
    torch.manual_seed(0)
    start = build_preset("gpt2-tiny", **GPT)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (16, 64), generator=g), torch.randint(0, 512, (16, 64), generator=g))
               for _ in range(2)]
    plain = memwrap.measure_peak(copy.deepcopy(start), batches[0], lm_loss, steps=1)["peak"]
    rows = [run(f, plain, start, batches) for f in FRACTIONS]
    head = "| budget (x plain peak) | plan time | split | checkpoint | predicted | measured | measured/predicted | within budget |"
    lines = [f"# budget= on CPU: {GPT}, global batch 16 x 64 tokens, AdamW; plain (unsplit) measured peak "
             f"{format_bytes(plain)}", "", "Command: `OMP_NUM_THREADS=2 python benchmarks/budget.py`", "", head,
             "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {format_bytes(r['budget'])} ({r['fraction']}x) | {r['plan_seconds']:.1f} s | "
                     f"{r['micro_batch']} x {r['accumulate']} | {r['checkpoint']} | {format_bytes(r['predicted'])} | "
                     f"{format_bytes(r['measured'])} | {r['ratio']:.3f} | {'yes' if r['within_budget'] else 'NO'} |")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "budget.md").write_text(text)
    (OUT / "budget.json").write_text(json.dumps({"plain_peak": plain, "model": GPT, "torch": torch.__version__,
                                                 "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed")
        return 0
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["predicted"] / 2**20 for r in rows], 0.4, label="predicted")
    ax.bar([x + 0.2 for x in xs], [r["measured"] / 2**20 for r in rows], 0.4, label="measured (allocator)")
    ax.scatter(list(xs), [r["budget"] / 2**20 for r in rows], color="red", marker="_", s=600, label="budget")
    ax.axhline(plain / 2**20, color="gray", ls="--", label="plain (unsplit) peak")
    ax.set_xticks(list(xs), [f"{r['fraction']}x\n{r['micro_batch']}x{r['accumulate']} {r['checkpoint']}" for r in rows])
    ax.set_ylabel("MiB")
    ax.set_title("wrap(budget=): split chosen, predicted vs measured peak (CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT / "budget.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
