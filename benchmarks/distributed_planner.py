"""Per-rank peak under FSDP2 and DDP: memwrap's estimate vs the allocator-measured peak of every rank.

    python benchmarks/distributed_planner.py            # 2 and 4 ranks, FSDP2 and DDP, CPU (gloo)

For each world size the script launches itself under torchrun (CPU processes, gloo); every rank
builds the model, shards it (``fully_shard`` on each block, then the root) or wraps it in DDP,
runs a warm-up update and measures the next one with
:func:`memwrap.memory.sharded.measure.measure_rank_peak` (the c10 allocator's total, all threads).
The parent predicts the same runs with ``memwrap.estimate(..., world_size=W, strategy=S)`` and
writes docs/benchmarks/distributed_planner.{json,png,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
# gpt2-tiny widened and deepened: 16.5M parameters (66 MB fp32) over 8 blocks, so that model state
# (parameters, gradients, AdamW's two moments, DDP's buckets) is most of a rank's memory and sharding matters.
MODEL = dict(n_layer=8, n_embd=384, n_head=6)
BATCH, SEQ = 2, 128  # per rank: the global batch is BATCH x accumulate x world size
CASES = {"fp32": {}, "bf16 + full checkpointing, accumulate 2": {"precision": "bf16", "checkpoint": "full",
                                                                   "accumulate": 2}}
STRATEGIES = ("fsdp2", "ddp")


def make_model():
    from memwrap.models import build_preset

    torch.manual_seed(0)
    return build_preset("gpt2-tiny", **MODEL)


def make_batch(rank: int):
    from memwrap.models import preset_batch

    return preset_batch("gpt2-tiny", BATCH, SEQ, generator=torch.Generator().manual_seed(rank))


def worker(out_dir: str) -> None:
    import torch.distributed as dist

    from memwrap.memory.sharded.measure import measure_rank_peak
    from memwrap.models import lm_loss

    cuda = torch.cuda.is_available()  # benchmarks/gpu_check.py runs this worker on GPUs
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    rows = []
    for strategy in STRATEGIES:
        for case, options in CASES.items():
            r = measure_rank_peak(make_model, lambda: make_batch(rank), strategy=strategy, loss_fn=lm_loss,
                                  **options)
            rows.append({"strategy": strategy, "case": case, "peak": r["peak"], "baseline": r["baseline"],
                         "method": r["method"]})
    rows.append({"collective_temporaries": collective_temporaries()})
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(rows, fh)
    dist.barrier()  # leave together (a rank tearing gloo down early can abort its peer)
    dist.destroy_process_group()


def collective_temporaries() -> dict[str, int]:
    """Bytes the backend itself allocates (c10) inside one reduce-scatter and one all-gather of a block's size.

    FSDP2's own buffers are traced; what the communication backend allocates inside a collective is not (the
    fake process group allocates nothing). On CPU, gloo allocates a full-size temporary in both.
    """
    import tempfile

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from memwrap.memory.sharded.measure import _allocator_totals

    world = dist.get_world_size()
    block = make_model().transformer.h[0]
    n = sum(p.numel() for p in block.parameters())
    n += -n % world
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    full, shard = torch.ones(n, device=dev), torch.empty(n // world, device=dev)
    out = {"bytes": n * 4}
    for name, call in (("reduce_scatter", lambda: dist.reduce_scatter_tensor(shard, full)),
                       ("all_gather", lambda: dist.all_gather_into_tensor(full, shard))):
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call()
        with tempfile.TemporaryDirectory() as tmp:
            totals = _allocator_totals(prof, os.path.join(tmp, "t.json"))
        out[name] = (max(t for t, _ in totals) - (totals[0][0] - totals[0][1])) if totals else 0
    return out


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, tmp: Path) -> list[list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), __file__, "--worker", str(tmp)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(world)]


def predict(world: int, strategy: str, options: dict):
    import memwrap
    from memwrap.models import lm_loss

    return memwrap.estimate(make_model, lambda: make_batch(0), loss_fn=lm_loss, world_size=world, strategy=strategy,
                            **options)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    labels = [f"{r['strategy']} x{r['world_size']}\n{r['case'].split(',')[0]}" for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["predicted"] / 2**20 for r in rows], 0.4, label="predicted (estimate)")
    ax.bar([i + 0.2 for i in x], [max(r["measured"]) / 2**20 for r in rows], 0.4, label="measured (max over ranks)")
    for i, r in zip(x, rows):
        ax.annotate(f"{r['error']:+.2%}", (i, max(r["predicted"], max(r["measured"])) / 2**20), ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("per-rank peak (MiB)")
    ax.set_title("Per-rank peak: memwrap.estimate(world_size, strategy) vs allocator-measured, CPU/gloo")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    parser.add_argument("--worlds", default="2,4", help="world sizes to run (default 2,4)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    import tempfile

    n_params = sum(p.numel() for p in make_model().parameters())
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            ranks = measure(world, Path(tmp))
        seconds = time.perf_counter() - start
        temporaries = [r.pop()["collective_temporaries"] for r in ranks]
        for i, first in enumerate(ranks[0]):
            options = CASES[first["case"]]
            t0 = time.perf_counter()
            est = predict(world, first["strategy"], options)
            measured = [r[i]["peak"] for r in ranks]
            worst = max(measured, key=lambda m: abs(est.peak - m))
            rows.append({"world_size": world, "strategy": first["strategy"], "case": first["case"],
                         "options": options, "predicted": est.peak, "measured": measured,
                         "error": (est.peak - worst) / worst, "breakdown": est.breakdown,
                         "peak_phase": est.peak_phase, "estimate_seconds": time.perf_counter() - t0,
                         "measure_seconds": seconds, "method": est.method, "measure_method": first["method"],
                         "collective_temporaries": temporaries})
    print(f"{'strategy':<8} {'ranks':>5}  {'case':<40} {'predicted MiB':>13} {'measured MiB (per rank)':>30} {'error':>8}")
    for r in rows:
        meas = ", ".join(f"{m / 2**20:.2f}" for m in r["measured"])
        print(f"{r['strategy']:<8} {r['world_size']:>5}  {r['case']:<40} {r['predicted'] / 2**20:>13.2f} "
              f"{meas:>30} {r['error']:>+8.2%}")
    meta = {"command": "python benchmarks/distributed_planner.py", "torch": torch.__version__,
            "model": {"preset": "gpt2-tiny", **MODEL, "parameters": n_params}, "micro_batch": BATCH, "seq": SEQ,
            "optimizer": "adamw", "backend": "gloo (CPU)", "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "distributed_planner.json").write_text(json.dumps(meta, indent=1))
    plot(rows, OUT / "distributed_planner.png")
    lines = [f"# Per-rank peak under FSDP2 and DDP: predicted vs measured\n",
             f"`{meta['command']}` (torch {torch.__version__}, CPU, gloo). Model: `gpt2-tiny` with {MODEL} "
             f"({n_params / 1e6:.1f}M parameters), micro-batch {BATCH} x {SEQ} tokens per rank, AdamW. Measured: the c10 "
             f"CPU allocator's total live bytes of every rank during one steady-state update "
             f"(`memwrap.memory.sharded.measure.measure_rank_peak`). Error = (predicted - measured) / measured, "
             f"against the rank furthest from the prediction.\n",
             "| strategy | ranks | case | predicted MiB | measured MiB (each rank) | error |", "|---|---:|---|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r['strategy']} | {r['world_size']} | {r['case']} | {r['predicted'] / 2**20:.2f} | "
                     f"{', '.join(f'{m / 2**20:.2f}' for m in r['measured'])} | {r['error']:+.2%} |")
    temps = {r["world_size"]: r["collective_temporaries"] for r in rows}
    lines += ["", "Bytes the communication backend allocates itself inside one collective of a block's size "
              "(not traced: the fake process group allocates nothing), per rank:", "",
              "| ranks | block bytes | reduce-scatter temporaries | all-gather temporaries |", "|---:|---:|---|---|"]
    for world, per_rank in temps.items():
        lines.append(f"| {world} | {per_rank[0]['bytes']} | {', '.join(str(t['reduce_scatter']) for t in per_rank)} | "
                     f"{', '.join(str(t['all_gather']) for t in per_rank)} |")
    (OUT / "distributed_planner.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'distributed_planner.json'}, .png, .md")


if __name__ == "__main__":
    main()
