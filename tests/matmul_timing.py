"""An independent measurement of matmul speed for the cost-profile tests: single calls, the fastest of ``reps``."""
from __future__ import annotations

import math
import time

import torch


def bf16_over_fp32(side: int, reps: int = 5) -> float:
    """bf16 / fp32 speed of a ``side`` x ``side`` matmul on this machine, timed call by call (not in batches)."""
    rate = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(side, side).to(dtype), torch.randn(side, side).to(dtype)
        torch.mm(a, b)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
        rate[dtype] = 1 / best
    return rate[torch.bfloat16] / rate[torch.float32]
