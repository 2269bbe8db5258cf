"""Helper for tests/test_budget.py: ``budget=`` under DDP on 2 CPU ranks (gloo), run by torchrun.

Rank 1's sequences are 4x longer than rank 0's, so alone it would choose a smaller micro-batch; both
ranks must adopt that one (the most conservative) and cut their batches into the same number of
micro-batches, or DDP's gradient all-reduce would not line up. Each rank writes ``OUT/rank<r>.json``.
"""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
from torch import nn

BATCH, DIM, HIDDEN = 16, 8, 64
SEQ = (8, 32)  # per rank


class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B]
        return self.down(torch.tanh(self.up(x))).mean(dim=(1, 2))


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(BATCH, SEQ[rank], DIM, generator=g), torch.randn(BATCH, generator=g)) for _ in range(2)]


def loss_fn(out, y):
    return (out - y).pow(2).mean()


def budget_for_rank1() -> int:
    """A budget in which rank 1's batch fits only at micro-batch 4 (from the planner's own estimates)."""
    import memwrap

    x, y = batches(1)[0]
    peak = memwrap.estimate(SeqNet(), (x[:4], y[:4]), accumulate=4).peak
    return int(peak * 1.08) + x[4:].numel() * 4 + y[4:].numel() * 4 + 1024


def main() -> None:
    import torch.distributed as dist

    import memwrap

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: dict = {}
    try:
        start = SeqNet()
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(start))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        budget = budget_for_rank1()
        wmodel, wopt, loader = memwrap.wrap(model, opt, batches(rank), budget=f"{budget}B", checkpoint=None)
        wopt.budget_plan.log = None
        micro = 0
        for x, y in loader:
            loss_fn(wmodel(x), y).backward()
            wopt.step()
            wopt.zero_grad()
            micro += 1
        c = wopt.budget_plan.current
        # The reference: one process, both ranks' unsplit batches, DDP's mean of the per-rank means.
        ref = copy.deepcopy(start)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for (x0, y0), (x1, y1) in zip(batches(0), batches(1)):
            ((loss_fn(ref(x0), y0) + loss_fn(ref(x1), y1)) / 2).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        diff = max(float((p - q).abs().max()) for p, q in zip(model.module.parameters(), ref.parameters()))
        out = {"micro_batch": c.micro_batch, "accumulate": c.accumulate, "proposed": c.proposed, "micro": micro,
               "updates": wopt.updates, "diff": diff, "plans": len(wopt.budget_plan.plans)}
    except Exception as err:  # reported to the test with its traceback
        import traceback

        out = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    finally:
        with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
        dist.barrier()  # leave together (a rank tearing gloo down early can abort its peer)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
