"""DDP with accumulation: a plain loop (all-reduce every micro-batch) vs memwrap (one all-reduce per window).

Launches itself under torchrun with 2 CPU processes (gloo):

    python benchmarks/ddp_no_sync.py [--accumulate 8] [--windows 4] [--reps 5]

Interleaved repetitions, median per-window time and ratio; writes docs/benchmarks/ddp_no_sync.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import memwrap

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(4)], nn.Linear(1024, 1))


def seconds_per_window(use_memwrap, accumulate, windows):
    model = nn.parallel.DistributedDataParallel(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if use_memwrap:
        model, opt = memwrap.wrap(model, opt, accumulate=accumulate)
    x = torch.randn(4, 1024)
    for window in range(windows + 1):  # window 0 warms up
        if window == 1:
            dist.barrier()
            start = time.perf_counter()
        for _ in range(accumulate):
            loss = model(x).pow(2).mean()
            if use_memwrap:  # the unchanged loop
                loss.backward()
                opt.step()
                opt.zero_grad()
            else:  # the seeds' loop: every backward all-reduces
                (loss / accumulate).backward()
        if not use_memwrap:
            opt.step()
            opt.zero_grad()
    dist.barrier()
    return (time.perf_counter() - start) / windows


def worker(args):
    dist.init_process_group("gloo")
    plain, wrapped = [], []
    for rep in range(args.reps):
        order = [(plain, False), (wrapped, True)]
        for times, flag in order if rep % 2 == 0 else order[::-1]:
            times.append(seconds_per_window(flag, args.accumulate, args.windows))
    if dist.get_rank() == 0:
        ratios = [p / w for p, w in zip(plain, wrapped)]
        result = {"accumulate": args.accumulate, "world_size": dist.get_world_size(), "params": sum(p.numel() for p in make_model().parameters()),
                  "plain_ms": 1e3 * statistics.median(plain), "memwrap_ms": 1e3 * statistics.median(wrapped),
                  "speedup_median": statistics.median(ratios), "speedups": ratios}
        Path(args.result).write_text(json.dumps(result))
    dist.barrier()  # leave together (a rank tearing gloo down early can abort its peer)
    dist.destroy_process_group()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accumulate", type=int, default=8)
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.result:
        return worker(args)
    args.out.mkdir(parents=True, exist_ok=True)
    result_path = args.out / "ddp_no_sync.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
                    __file__, "--accumulate", str(args.accumulate), "--windows", str(args.windows), "--reps",
                    str(args.reps), "--result", str(result_path)], check=True, env=env)
    r = json.loads(result_path.read_text())
    r["meta"] = {"torch": torch.__version__, "backend": "gloo", "device": "cpu", "reps": args.reps}
    result_path.write_text(json.dumps(r, indent=2))
    print(f"{'accumulate':>10} {'plain ms/window':>16} {'memwrap ms/window':>18} {'median speedup':>15}")
    print(f"{r['accumulate']:>10} {r['plain_ms']:>16.0f} {r['memwrap_ms']:>18.0f} {r['speedup_median']:>14.2f}x")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["plain loop\n(all-reduce every micro-batch)", "memwrap\n(no_sync inside the window)"],
           [r["plain_ms"], r["memwrap_ms"]], color=["tab:gray", "tab:blue"])
    ax.set_ylabel("ms per window (median)")
    ax.set_title(f"DDP, 2 CPU ranks (gloo), accumulate={r['accumulate']}")
    fig.tight_layout()
    fig.savefig(args.out / "ddp_no_sync.png", dpi=120)


if __name__ == "__main__":
    main()
