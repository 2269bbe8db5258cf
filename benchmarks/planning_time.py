"""How long `memwrap plan` takes on the commands the docs and issues quote, and what it answers.

    OMP_NUM_THREADS=2 python benchmarks/planning_time.py            # one run of each command
    OMP_NUM_THREADS=2 python benchmarks/planning_time.py --reps 3   # interleaved repetitions, median

Each command runs in a fresh process (`python -m memwrap.cli plan ... --json FILE`), as a user runs it; wall
seconds and the child's CPU seconds (user + system, `resource.getrusage(RUSAGE_CHILDREN)`) are recorded, with
the candidates traced, how many fit and the verdict. Repetitions are interleaved (command 1, 2, ..., 1, 2, ...) so
a slow spell of the machine does not land on one command. Writes docs/benchmarks/planning_time.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
COMMANDS = {
    "llama-7b fsdp2 x4, 24 GiB": "--preset llama-7b --world-size 4 --strategy fsdp2 --batch 8 --seq 2048 --budget 24GiB --keep-precision any",
    "llama-2-70b fsdp2 x8, 80 GiB": "--preset llama-2-70b --world-size 8 --strategy fsdp2 --batch 8 --seq 4096 "
                                    "--budget 80GiB --keep-precision any",
    "llama-7b 1 GPU, 24 GiB": "--preset llama-7b --batch 1 --seq 2048 --budget 24GiB --keep-precision any",
    "llama-3-8b 1 GPU, 24 GiB": "--preset llama-3-8b --batch 2 --seq 2048 --budget 24GiB --keep-precision any",
    "gpt2-tiny, 1 GiB (margin alone over budget)": "--preset gpt2-tiny --batch 8 --seq 64 --budget 1GiB --keep-precision any",
}


def run(args: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "memwrap.cli", "plan", *args.split(), "--json", str(out)],
                              capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode not in (0, 3):  # 3: nothing fits, a valid answer
            raise SystemExit(f"memwrap plan {args} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "candidates": len(result["candidates"]), "fit": sum(c["fits"] for c in result["candidates"]),
            "skipped": len(result["skipped"]), "best": result["best"]["label"] if result["best"] else None,
            "verdict": result["verdict"], "sharding": result.get("sharding", ""), "exit": proc.returncode}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [r["name"] for r in rows]
    ax.barh(names, [r["wall_s"] for r in rows], label="wall s (median)")
    ax.barh(names, [r["cpu_s"] for r in rows], height=0.35, label="CPU s (median)")
    ax.axvline(60, color="red", linestyle="--", label="60 s target")
    ax.set_xlabel("seconds")
    ax.set_title("memwrap plan: planning time on this machine")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in COMMANDS}
    for rep in range(args.reps):
        for name, cmd in COMMANDS.items():
            r = run(cmd)
            runs[name].append(r)
            print(f"[{rep + 1}/{args.reps}] {name}: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, "
                  f"{r['candidates']} candidates, {r['fit']} fit; best {r['best']}", flush=True)
    rows = []
    for name, rs in runs.items():
        last = rs[-1]
        rows.append({"name": name, "command": f"memwrap plan {COMMANDS[name]}",
                     "wall_s": statistics.median(r["wall_s"] for r in rs),
                     "cpu_s": statistics.median(r["cpu_s"] for r in rs), "reps": [r["wall_s"] for r in rs],
                     **{k: last[k] for k in ("candidates", "fit", "skipped", "best", "verdict", "sharding")}})
    meta = {"command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python benchmarks/planning_time.py "
                       f"--reps {args.reps}", "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                             time.gmtime())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planning_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, OUT / "planning_time.png")
    lines = ["# Planning time of `memwrap plan`\n", f"`{meta['command']}` on {meta['cpus']} CPUs, {meta['date']}; "
             "median of the repetitions, each command in a fresh process.\n",
             "| command | wall s | CPU s | candidates | fit | best |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['command']}` | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['candidates']} | {r['fit']} | "
                     f"{r['best'] or 'nothing fits'} |")
    (OUT / "planning_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
