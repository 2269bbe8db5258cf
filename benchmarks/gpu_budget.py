"""``wrap(..., budget=)`` on a lent GPU (issue 13), a check of ``benchmarks/gpu_check.py``.

GPT-2 (124M) with a global batch of 4 x the GPU check's batch, trained 2 updates under a budget that
holds a quarter of it per micro-batch (below the unsplit step's predicted peak): on CUDA the default margin includes the fixed 1 GiB (CUDA
context, workspaces), and ``torch.cuda.max_memory_allocated`` over the second update must stay within
the budget, the prediction within 10% of it, and ``MemoryMonitor``'s record must carry the plan.
``--dry-run``: the tiny GPT on the CPU (budget simulated, margin without its fixed part).
"""
from __future__ import annotations

from typing import Any

import torch

TOLERANCE = 0.10


def check_budget(s: Any) -> dict:
    import memwrap
    from memwrap.models import lm_loss

    global_batch = 4 * s.batch
    model = s.model()
    batches = s.batches(3, global_batch)
    cpu = tuple(t.cpu() for t in batches[0])
    whole = memwrap.estimate(s.build(), cpu, loss_fn=lm_loss).peak
    # Room for a quarter of the batch per micro-batch without checkpointing (+ the 1 GiB of margin CUDA needs):
    # the unsplit step does not fit, the plan must cut (or checkpoint).
    quarter = memwrap.estimate(s.build(), tuple(t[: s.batch] for t in cpu), loss_fn=lm_loss, accumulate=4).peak
    budget = int(quarter * 1.12) + (0 if s.dry else 2**30)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    wmodel, wopt, loader = memwrap.wrap(model, opt, batches, budget=f"{budget}B", monitor=1)
    wopt.monitor.log = None
    it = iter(loader)

    def update() -> None:
        while True:
            x, y = next(it)
            lm_loss(wmodel(x), y).backward()
            wopt.step()
            wopt.zero_grad()
            if wopt.did_update:
                return

    update()
    s.sync()
    if s.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update()
    s.sync()
    c = wopt.budget_plan.current
    measured = torch.cuda.max_memory_allocated() if s.device.type == "cuda" else None
    predicted = c.peak + c.batch_rest
    out = {"global_batch": global_batch, "budget": budget, "whole_predicted": whole, "plan": c.to_dict(),
           "line": c.line(), "predicted": predicted, "measured": measured,
           "monitor": wopt.monitor.records[-1] if wopt.monitor.records else None}
    if measured is not None:
        out["ratio"] = measured / predicted
        problems = [p for p, bad in (("measured peak over the budget", measured > budget),
                                     (f"measured/predicted {measured / predicted:.3f} outside {TOLERANCE:.0%}",
                                      abs(measured / predicted - 1) > TOLERANCE)) if bad]
        if problems:
            out.update(status="failed", error="; ".join(problems))
    return out
