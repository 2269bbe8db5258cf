"""How long planning takes on the commands issue 20 names, with nothing cached, with the kernel-workspace fits cached,
and with the traces cached, against the issue's targets.

    OMP_NUM_THREADS=2 python benchmarks/planning_time.py            # one run of each command in each state
    OMP_NUM_THREADS=2 python benchmarks/planning_time.py --reps 3   # interleaved repetitions, median

Each command runs in a fresh process, as a user runs it. Three cache states, in this order for each command and
repetition, on a cache folder (``MEMWRAP_CACHE_DIR``) made empty for it:

* **cold**: nothing cached: the first plan on a new machine (it measures the kernel workspaces and the optimizer
  steps' temporaries, and traces every candidate);
* **fits**: the workspace fits the cold run measured are cached, the trace cache is off (``MEMWRAP_TRACE_CACHE=0``):
  a new model, or a new command, on a machine that planned before;
* **warm**: the traces too (the same command planned before, e.g. with another budget).

The CLI rows time the whole process (wall) and read the plan's own seconds (``planned in``, what ``plan()`` spends);
the two library rows (a default ``memwrap.plan()`` of a model under 10M parameters, ``budget=`` on it) read the
seconds the library reports (``Plan.seconds``, ``optimizer.budget_plan.plan_seconds``), after the imports. Repetitions
are interleaved (every command once, then again) so a slow spell of the machine does not land on one command.
Writes docs/benchmarks/planning_time.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
STATES = ("cold", "fits", "warm")
# name -> (memwrap plan arguments, or a library script; the target in seconds)
COMMANDS = {
    "llama-7b 1 GPU, 24 GiB": ("--preset llama-7b --batch 1 --seq 2048 --budget 24GiB", 10),
    "llama-3-8b batch 2, 24 GiB": ("--preset llama-3-8b --batch 2 --seq 2048 --budget 24GiB", 10),
    "llama-7b fsdp2 x4, 24 GiB": ("--preset llama-7b --world-size 4 --strategy fsdp2 --batch 8 --seq 2048 "
                                  "--budget 24GiB", 15),
    "llama-2-70b fsdp2 x8, 80 GiB": ("--preset llama-2-70b --world-size 8 --strategy fsdp2 --batch 8 --seq 4096 "
                                     "--budget 80GiB", 20),
    "plan() of gpt2-tiny (4.3M), default search": ("library:plan", 3),
    "budget= on gpt2-tiny, before the first step": ("library:budget", 2),
}
_LIBRARY = {
    "plan": """
import json, sys, memwrap
from memwrap.models import build_preset, preset_batch
p = memwrap.plan(build_preset("gpt2-tiny"), lambda mb: preset_batch("gpt2-tiny", mb, 64), budget="1GiB",
                 global_batch=8, margin=(0.08, "64MiB"))
json.dump({"seconds": p.seconds, "candidates": len(p.candidates), "fit": sum(c.fits for c in p.candidates),
           "best": p.best.label if p.best else None, "trace_cache": p.trace_cache}, open(sys.argv[1], "w"))
""",
    "budget": """
import json, sys, torch, memwrap
from memwrap.models import build_preset, preset_batch
model = build_preset("gpt2-tiny")
loader = [preset_batch("gpt2-tiny", 16, 64) for _ in range(2)]
model, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), loader, budget="1GiB")
for x, y in loader:
    model(x)
    break
bp = opt.budget_plan
c = bp.current
json.dump({"seconds": bp.plan_seconds, "candidates": None, "fit": None,
           "best": f"{c.micro_batch}x{c.accumulate} {c.precision} {c.checkpoint or 'no-ckpt'} {c.optim}",
           "trace_cache": {}}, open(sys.argv[1], "w"))
""",
}


def run(args: str, state: str, cache: Path) -> dict:
    env = {**os.environ, "MEMWRAP_CACHE_DIR": str(cache), "MEMWRAP_TRACE_CACHE": "0" if state == "fits" else "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        if args.startswith("library:"):
            cmd = [sys.executable, "-c", _LIBRARY[args.split(":", 1)[1]], str(out)]
        else:
            cmd = [sys.executable, "-m", "memwrap.cli", "plan", *args.split(), "--json", str(out), "--quiet"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode not in (0, 3):  # 3: nothing fits, a valid answer
            raise SystemExit(f"{args} ({state}) failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text())
    if args.startswith("library:"):
        planned, cands, fit, best, tc = (result[k] for k in ("seconds", "candidates", "fit", "best", "trace_cache"))
    else:
        planned, cands = result["seconds"], len(result["candidates"])
        fit, best, tc = sum(c["fits"] for c in result["candidates"]), result["best"], result.get("trace_cache", {})
        best = best["label"] if best else None
    return {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "planned_s": planned, "candidates": cands, "fit": fit, "best": best, "trace_cache": tc}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    names = [r["name"] for r in rows]
    height = 0.27
    for i, state in enumerate(STATES):
        ax.barh([k + (i - 1) * height for k in range(len(rows))], [r[state]["planned_s"] for r in rows], height=height,
                label=f"{state} (median)")
    ax.scatter([r["target_s"] for r in rows], range(len(rows)), marker="|", s=400, color="red", label="target", zorder=3)
    ax.set_yticks(range(len(rows)), names, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("seconds planning (log)")
    ax.set_title("memwrap planning time: nothing cached / workspace fits cached / traces cached")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    runs: dict[str, dict[str, list[dict]]] = {name: {s: [] for s in STATES} for name in COMMANDS}
    for rep in range(args.reps):
        for name, (cmd, _) in COMMANDS.items():
            cache = Path(tempfile.mkdtemp(prefix="memwrap-planning-time-"))
            try:
                for state in STATES:
                    r = run(cmd, state, cache)
                    runs[name][state].append(r)
                    print(f"[{rep + 1}/{args.reps}] {name} ({state}): planned in {r['planned_s']:.1f} s, "
                          f"{r['wall_s']:.1f} s wall; {r['candidates']} candidates, best {r['best']}", flush=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
    rows = []
    for name, by_state in runs.items():
        row = {"name": name, "command": (f"memwrap plan {COMMANDS[name][0]}" if not COMMANDS[name][0].startswith(
            "library:") else COMMANDS[name][0]), "target_s": COMMANDS[name][1]}
        for state, rs in by_state.items():
            row[state] = {"planned_s": statistics.median(r["planned_s"] for r in rs),
                          "wall_s": statistics.median(r["wall_s"] for r in rs),
                          "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                          "reps": [round(r["planned_s"], 2) for r in rs], "trace_cache": rs[-1]["trace_cache"]}
        last = by_state["warm"][-1]
        row.update({k: last[k] for k in ("candidates", "fit", "best")})
        rows.append(row)
    meta = {"command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '?')} python benchmarks/planning_time.py "
                       f"--reps {args.reps}", "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "planning_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, OUT / "planning_time.png")
    (OUT / "planning_time.md").write_text(render(rows, meta))
    print(render(rows, meta))


def render(rows: list[dict], meta: dict) -> str:
    """The markdown table of ``rows`` (what main() writes to docs/benchmarks/planning_time.md)."""
    lines = ["# Planning time\n", f"`{meta['command']}` on {meta['cpus']} CPUs, {meta['date']}; median of the "
             "repetitions, each in a fresh process. Seconds planning (`planned in`, what `plan()` spends; the process "
             "adds about 2.5 s of imports, in the wall column). **cold**: nothing cached (first plan on a machine); "
             "**fits**: kernel-workspace fits and probe answers cached, trace cache off (a new model or command); "
             "**warm**: traces cached (the same command planned before, e.g. with another budget).\n",
             "| command | target s | cold s | fits s | warm s | warm wall s | candidates | best |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        mark = {s: ("" if r[s]["planned_s"] <= r["target_s"] else " (over)") for s in STATES}
        what = r["name"] if r["command"].startswith("library:") else f"`{r['command']}`"
        lines.append(f"| {what} | {r['target_s']} | {r['cold']['planned_s']:.1f}{mark['cold']} | "
                     f"{r['fits']['planned_s']:.1f}{mark['fits']} | {r['warm']['planned_s']:.2f}{mark['warm']} | "
                     f"{r['warm']['wall_s']:.1f} | {r['candidates'] if r['candidates'] is not None else '-'} | "
                     f"{r['best'] or 'nothing fits'} |")
    return "\n".join(lines) + "\n"



if __name__ == "__main__":
    main()
