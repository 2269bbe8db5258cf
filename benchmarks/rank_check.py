"""The planner's speed ranking against measured step times on CPU (issue 20 item 6).

For each workload (the CPU rows of the ladder: small Llama and GPT models from ``memwrap.models``; a handful of
the zoo's families), ``memwrap.plan(..., device="cpu")`` searches precision x checkpoint policy x micro-batch x
optimizer on fake tensors, under a budget that leaves several candidates fitting (75% of the plain fp32 run's
predicted peak, no margin), and ranks the fitting ones by the cost model on the ``"cpu"`` profile, calibrated on
this machine (``memwrap.memory.search.cost.calibrate_cpu``). The top K candidates are then run for real, each as
the plan configures it (``memwrap.wrap(model, optimizer, **candidate.options)``), in interleaved repetitions (one
update of every candidate per repetition, the order rotating), and the median seconds per update is taken. The
Spearman rank correlation between the predicted and the measured order is reported per workload and overall, next
to the same correlation for the A100 reference profile's prediction of the same candidates.

    python benchmarks/rank_check.py            # writes docs/benchmarks/rank_check.{md,json,png} (~3 min, 2 cores)
    python benchmarks/rank_check.py --quick    # 3 workloads, top 4, 3 repetitions (~40 s); prints, writes nothing
    python benchmarks/rank_check.py --render --notes notes.md   # rewrite the .md/.png from the .json with notes

The .md's "where the ranking is weak" section is the text of ``--notes`` (kept in the .json), written from the
figures of the run.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import memwrap  # noqa: E402
from memwrap.memory.search.cost import A100, calibrate_cpu, cost_terms  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")
MIB = 2**20


# ----------------------------------------------------------------------------- the statistics

def average_ranks(values: Sequence[float]) -> list[float]:
    """1-based ranks of ``values``, ties sharing the mean of the ranks they span (as Spearman's rho needs).

    Example:
        >>> average_ranks([10, 20, 20, 30])
        [1.0, 2.5, 2.5, 4.0]
    """
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of ``x`` and ``y``: the Pearson correlation of their average ranks (ties
    handled). NaN when either side has no spread (all tied) or fewer than 2 values: the order is then undefined.

    Example:
        >>> spearman([1, 2, 3], [30, 20, 10])
        -1.0
    """
    if len(x) != len(y):
        raise ValueError(f"spearman: x and y must have the same length, got {len(x)} and {len(y)}.")
    if len(x) < 2:
        return math.nan
    rx, ry = average_ranks(x), average_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx = sum((a - mx) ** 2 for a in rx)
    syy = sum((b - my) ** 2 for b in ry)
    if sxx == 0 or syy == 0:
        return math.nan
    return sxy / math.sqrt(sxx * syy)


# ----------------------------------------------------------------------------- the workloads

def _ids(mb: int, vocab: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (mb, seq), generator=torch.Generator().manual_seed(1000 * seed + mb))


def _lm_batch(vocab: int, seq: int) -> Callable[[int], Any]:
    def make(mb: int):
        ids = _ids(mb, vocab, seq)
        return {"input_ids": ids, "labels": ids}
    return make


QUICK = ("ladder-llama", "gpt2-tiny", "zoo-gpt2")


def workloads() -> dict[str, dict]:
    """name -> factory, make_batch(mb), loss_fn, global batch, micro-batches, where it comes from."""
    from memwrap.models import build_preset, get_preset, preset_batch
    from ladder import small_llama  # the ladder's CPU rows
    import zoo

    def gpt_tiny():
        torch.manual_seed(0)
        return build_preset("gpt2-tiny")

    out = {
        "ladder-llama": dict(factory=small_llama(16384, 4), batch=_lm_batch(16384, 128), loss=None, global_batch=4,
                             micro_batches=(1, 4), source="ladder.py's CPU Llama (vocab 16384, d 128, 4 layers), "
                                                          "seq 128"),
        "gpt2-tiny": dict(factory=gpt_tiny, batch=lambda mb: preset_batch("gpt2-tiny", mb, 128,
                                                                          generator=torch.Generator().manual_seed(mb)),
                          loss=get_preset("gpt2-tiny").loss, global_batch=4, micro_batches=(1, 4),
                          source="memwrap.models preset gpt2-tiny (4.3M params), seq 128"),
        "zoo-gpt2": dict(factory=zoo._hf("GPT2Config", "GPT2LMHeadModel", vocab_size=zoo.VOCAB, n_embd=64, n_layer=2,
                                         n_head=4, n_positions=zoo.SEQ * 2),
                         batch=_lm_batch(zoo.VOCAB, zoo.SEQ), loss=None, global_batch=8, micro_batches=(2, 8),
                         source="zoo.py's HF GPT-2 (d 64, 2 layers), seq 64"),
    }
    g = torch.Generator().manual_seed(0)

    def images(mb: int):
        return {"pixel_values": torch.randn(mb, 3, 64, 64, generator=g), "labels": torch.randint(0, 10, (mb,))}

    out.update({
        "zoo-llama": dict(factory=zoo._hf("LlamaConfig", "LlamaForCausalLM", **zoo._small()),
                          batch=_lm_batch(zoo.VOCAB, zoo.SEQ), loss=None, global_batch=8, micro_batches=(2, 8),
                          source="zoo.py's HF Llama (d 64, 2 layers), seq 64"),
        "zoo-bert": dict(factory=zoo._hf("BertConfig", "BertForMaskedLM", vocab_size=zoo.VOCAB, hidden_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                         max_position_embeddings=zoo.SEQ * 2),
                         batch=_lm_batch(zoo.VOCAB, zoo.SEQ), loss=None, global_batch=8, micro_batches=(2, 8),
                         source="zoo.py's HF BERT MLM (d 64, 2 layers), seq 64"),
        "zoo-resnet": dict(factory=zoo._resnet, batch=images, loss=None, global_batch=8, micro_batches=(2, 8),
                           source="zoo.py's HF ResNet-18 widths, 64x64 images"),
        "zoo-t5": dict(factory=zoo._hf("T5Config", "T5ForConditionalGeneration", vocab_size=zoo.VOCAB, d_model=64,
                                       d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0),
                       batch=lambda mb: {"input_ids": _ids(mb, zoo.VOCAB, zoo.SEQ),
                                         "labels": _ids(mb, zoo.VOCAB, zoo.SEQ, seed=1)},
                       loss=None, global_batch=8, micro_batches=(2, 8),
                       source="zoo.py's HF T5 (d 64, 2+2 layers), seq 64"),
        "zoo-lstm": dict(factory=lambda: (torch.manual_seed(0), zoo.LSTMLM())[1],
                         batch=lambda mb: (_ids(mb, zoo.VOCAB, zoo.SEQ), _ids(mb, zoo.VOCAB, zoo.SEQ, seed=1)),
                         loss=None, global_batch=8, micro_batches=(2, 4, 8),
                         source="zoo.py's LSTM language model (d 256, 2 layers), seq 64; no repeated blocks: "
                                "checkpointing refused"),
    })
    return out


# ----------------------------------------------------------------------------- one workload

SEARCH = dict(precisions=("fp32", "bf16", "bf16-true"), checkpoints=(None, "full"), optimizers=("adamw",),
              step_in_backward=(False,), chunked_loss=(False,), keep_optim=None, keep_precision=None)


def a100_seconds(c: Any, budget: int) -> float:
    """The same candidate's predicted seconds on the A100 reference profile (the plan's default), its terms formed
    as the planner forms them (``memwrap.memory.search.planner._candidate``; the margin is 0 here)."""
    est = c.estimate
    return sum(cost_terms(flops=est.flops, ops=est.ops_per_micro_batch, micro_batches=c.accumulate,
                          precision=c.precision, param_bytes=est.state["parameters"],
                          grad_bytes=est.state["gradients"], state_bytes=est.state["optimizer_state"],
                          offloaded=est.offloaded, paged_spill=max(0, est.paged_state - max(0, budget - est.peak)),
                          host_state=est.host_state, device=A100, flop_classes=est.flop_classes,
                          op_stats=est.op_stats).values())


def bandwidth_step(c: Any, profile: Any) -> float:
    """The optimizer term's bandwidth form on ``profile``: (2 * parameter + gradient + 2 * state bytes) / bandwidth."""
    est = c.estimate
    return cost_terms(flops=0, ops=0, micro_batches=1, precision=c.precision, param_bytes=est.state["parameters"],
                      grad_bytes=est.state["gradients"], state_bytes=est.state["optimizer_state"],
                      device=profile)["optimizer"]


class Update:
    """One candidate as the plan configures it (``wrap(model, optimizer, **candidate.options)``) and its training
    loop, the one ``memwrap.measure_peak`` runs (outputs held through backward, ``step()`` after every
    micro-batch: the wrapper steps at the window's end), timing the forward + backward and the optimizer apart."""

    def __init__(self, w: dict, c: Any):
        from memwrap.memory.tracing.batch import default_loss
        from memwrap.plugin.registry import create_optimizer

        model = w["factory"]().train()
        options = dict(c.options)
        inner = create_optimizer(options.pop("optim"), model.parameters(), model=model)
        self.model, self.opt = memwrap.wrap(model, inner, **options)
        self.batches = [w["batch"](c.micro_batch) for _ in range(c.accumulate)]
        self.loss_fn = w["loss"] or default_loss
        self.held: Any = None

    def __call__(self) -> tuple[float, float]:
        """One update: (seconds in forward + backward, seconds in step() + zero_grad())."""
        from memwrap.memory.tracing.batch import split_batch

        fb = opt = 0.0
        for batch in self.batches:
            t0 = time.perf_counter()
            args, kwargs, targets = split_batch(batch)
            outputs = self.model(*args, **kwargs)
            self.held = None
            loss = self.loss_fn(outputs, targets)
            self.held = outputs
            del outputs
            loss.backward()
            del loss
            t1 = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad()
            fb, opt = fb + t1 - t0, opt + time.perf_counter() - t1
        return fb, opt


def run_workload(name: str, w: dict, k: int, reps: int) -> dict:
    profile = calibrate_cpu()
    t0 = time.perf_counter()
    plain = memwrap.estimate(w["factory"], w["batch"](w["global_batch"]), loss_fn=w["loss"])
    budget = int(0.75 * plain.peak)
    p = memwrap.plan(w["factory"], w["batch"], budget=f"{budget}B", global_batch=w["global_batch"], loss_fn=w["loss"],
                     micro_batches=w["micro_batches"], margin=(0, 0), device="cpu", **SEARCH)
    plan_s = time.perf_counter() - t0
    fitting = [c for c in p.candidates if c.fits]
    top = fitting[:k]
    print(f"{name}: plain peak {plain.peak / MIB:.1f} MiB, budget {budget / MIB:.1f} MiB, {len(fitting)} of "
          f"{len(p.candidates)} fit, planned in {plan_s:.0f} s; timing the top {len(top)}", flush=True)
    loops, errors = [], {}
    for c in top:
        try:
            loop = Update(w, c)
            loop()  # warm-up: optimizer state, lazy kernels
            loop()
            loops.append(loop)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported, not timed
            errors[c.label] = f"{type(exc).__name__}: {str(exc)[:200]}"
            loops.append(None)
    times: list[list[tuple[float, float]]] = [[] for _ in top]
    for r in range(reps):
        for j in range(len(top)):
            i = (j + r) % len(top)  # rotate the order: no candidate always runs after the same one
            if loops[i] is not None:
                times[i].append(loops[i]())
    del loops
    gc.collect()
    rows = []
    for c, ts in zip(top, times):
        total = [a + b for a, b in ts]
        rows.append({"label": c.label, "options": {k_: str(v) for k_, v in c.options.items()},
                     "predicted_s": c.seconds, "a100_s": a100_seconds(c, budget), "terms": c.terms,
                     "ops_per_micro_batch": c.estimate.ops_per_micro_batch, "flops": c.estimate.flops,
                     "measured_s": statistics.median(total) if ts else None,
                     "measured_fwd_bwd_s": statistics.median(a for a, _ in ts) if ts else None,
                     "measured_optimizer_s": statistics.median(b for _, b in ts) if ts else None,
                     "spread": [min(total), max(total)] if ts else None,
                     "error": errors.get(c.label), "required": c.required})
    for c, r in zip(top, rows):
        if r["measured_s"] is not None:  # what one dispatched op really cost: the part of the forward + backward
            # that the compute term does not explain, per op the trace counted (diagnostic for the launches term)
            r["effective_op_s"] = ((r["measured_fwd_bwd_s"] - r["terms"]["compute"] - r["terms"].get("traffic", 0))
                                   / (c.accumulate * c.estimate.ops_per_micro_batch))
    ok = [r for r in rows if r["measured_s"] is not None]
    rho = spearman([r["predicted_s"] for r in ok], [r["measured_s"] for r in ok])
    rho_a100 = spearman([r["a100_s"] for r in ok], [r["measured_s"] for r in ok])
    # Which term mis-ranks: each part of the prediction against the part of the step it models.
    parts = {"launches_alone": spearman([r["terms"]["launches"] for r in ok], [r["measured_s"] for r in ok]),
             "compute_plus_launches_vs_fwd_bwd": spearman([r["terms"]["compute"] + r["terms"]["launches"] for r in ok],
                                                          [r["measured_fwd_bwd_s"] for r in ok]),
             "optimizer_vs_step": spearman([r["terms"]["optimizer"] for r in ok],
                                           [r["measured_optimizer_s"] for r in ok]),
             # What-ifs on the same measurements: the prediction with every matmul rated at fp32's speed at the
             # calibration size (no precision, no size), and with the optimizer term replaced by the measured step().
             "whatif_bf16_at_fp32_speed": spearman(
                 [r["predicted_s"] - r["terms"]["compute"] + c.estimate.flops / (profile.peak_flops * profile.mfu)
                  for c, r in zip(top, rows) if r["measured_s"] is not None], [r["measured_s"] for r in ok]),
             "whatif_measured_step": spearman([r["predicted_s"] - r["terms"]["optimizer"] + r["measured_optimizer_s"]
                                               for r in ok], [r["measured_s"] for r in ok]),
             # The optimizer term in its bandwidth form (what the cpu profile used before the step was timed there).
             "whatif_bandwidth_step": spearman(
                 [r["predicted_s"] - r["terms"]["optimizer"] + bandwidth_step(c, profile)
                  for c, r in zip(top, rows) if r["measured_s"] is not None], [r["measured_s"] for r in ok])}
    fastest = min(ok, key=lambda r: r["measured_s"]) if ok else None
    for r in rows:
        shown = f"{r['measured_s'] * 1e3:8.1f} ms" if r["measured_s"] is not None else f"error: {r['error']}"
        t = r["terms"]
        split = (f" (fwd+bwd {r['measured_fwd_bwd_s'] * 1e3:.1f}, step {r['measured_optimizer_s'] * 1e3:.1f})"
                 if r["measured_s"] is not None else "")
        print(f"  {r['label']:<32} predicted {r['predicted_s'] * 1e3:7.1f} ms (compute {t['compute'] * 1e3:.1f}, "
              f"launches {t['launches'] * 1e3:.1f}, traffic {t.get('traffic', 0) * 1e3:.1f}, optimizer "
              f"{t['optimizer'] * 1e3:.2f})  measured {shown}{split}",
              flush=True)
    print(f"  Spearman rho: cpu profile {rho:+.2f}, A100 profile {rho_a100:+.2f}; "
          + ", ".join(f"{k} {_f(v)}" for k, v in parts.items()) + f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"workload": name, "source": w["source"], "global_batch": w["global_batch"],
            "micro_batches": list(w["micro_batches"]), "plain_peak": plain.peak, "budget": budget,
            "fitting": len(fitting), "candidates": len(p.candidates), "plan_s": plan_s, "rows": rows, "rho": rho,
            "rho_a100": rho_a100, "parts": parts, "top1_is_fastest": bool(ok and fastest is ok[0]),
            "seconds": time.perf_counter() - t0}


# ----------------------------------------------------------------------------- reporting

PARTS = ("launches_alone", "compute_plus_launches_vs_fwd_bwd", "optimizer_vs_step", "whatif_bf16_at_fp32_speed",
         "whatif_measured_step", "whatif_bandwidth_step")


def summary(results: list[dict]) -> dict:
    """Overall figures: the mean of the per-workload rhos, and the pooled rho of the candidates' predicted and
    measured times each relative to its workload's first-ranked candidate."""
    rhos = [r["rho"] for r in results if not math.isnan(r["rho"])]
    rhos_a = [r["rho_a100"] for r in results if not math.isnan(r["rho_a100"])]
    px, py, pa = [], [], []
    for res in results:
        ok = [r for r in res["rows"] if r["measured_s"] is not None]
        if not ok:
            continue
        px += [r["predicted_s"] / ok[0]["predicted_s"] for r in ok]
        pa += [r["a100_s"] / ok[0]["a100_s"] for r in ok]
        py += [r["measured_s"] / ok[0]["measured_s"] for r in ok]
    mean_parts = {}
    for key in PARTS:
        vals = [r["parts"][key] for r in results if not math.isnan(r["parts"][key])]
        mean_parts[key] = statistics.mean(vals) if vals else math.nan
    return {"mean_parts": mean_parts, "mean_rho": statistics.mean(rhos) if rhos else math.nan,
            "mean_rho_a100": statistics.mean(rhos_a) if rhos_a else math.nan,
            "pooled_rho": spearman(px, py), "pooled_rho_a100": spearman(pa, py),
            "top1_hits": sum(r["top1_is_fastest"] for r in results), "workloads": len(results)}


def _f(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.2f}"


def markdown(result: dict) -> str:
    meta, res, s = result["meta"], result["workloads"], result["summary"]
    prof = meta["profile"]
    lines = ["# The planner's speed ranking against measured CPU step times", "",
             f"Generated by `{meta['command']}` on {meta['date']} (torch {meta['torch']}, {meta.get('cpu_model', 'a')} "
             f"CPU, {meta['cpus']} cores shared "
             f"with other jobs, {meta['threads']} torch thread(s)). Per workload, `memwrap.plan(..., device=\"cpu\")` "
             "searches precision (fp32, bf16 autocast, bf16-true) x checkpointing (none, full) x micro-batch x "
             "AdamW under a budget of 75% of the plain fp32 run's predicted peak (no margin), "
             f"ranking by speed alone; its top {meta['k']} fitting candidates run for real as the plan configures "
             f"them (`memwrap.wrap(model, optimizer, **candidate.options)`), {meta['reps']} interleaved repetitions "
             "of one update each after two warm-up updates; measured = the median. rho = Spearman's rank "
             "correlation (ties averaged) of predicted vs measured seconds per update; 1 = the plan's order is the "
             "measured order.", "",
             f"The `cpu` profile ({prof['source']}): fp32 matmul {prof['peak_flops'] / 1e9:.0f} GFLOP/s, bf16 "
             f"{prof['speed']['bf16']:.2f}x fp32, fp16 {prof['speed']['fp16']:.2f}x, "
             f"{prof['launch_s'] * 1e6:.2f} us per dispatched op, memory {prof['hbm_bytes_s'] / 1e9:.1f} GB/s "
             f"(calibrated in {meta['calibration_s'] * 1e3:.0f} ms). By matmul size, relative to that fp32 rate "
             "(what the compute term rates each traced matmul with, by its dtype and mean side): "
             + "; ".join(f"{name} " + ", ".join(f"{side}^3 {v:.2f}" for side, v in sorted(
                 (int(k), v) for k, v in prof.get("size_speed", {}).get(name, {}).items()))
                         for name in ("fp32", "bf16", "fp16") if prof.get("size_speed", {}).get(name))
             + ".", "",
             "Columns after the two profiles' rho diagnose the terms (cpu profile): the launches term alone against "
             "the measured step; compute + launches against the measured forward + backward; the optimizer term "
             "against the measured `step()` (n/a: all tied; the cpu profile times each candidate's step on probe "
             "parameters, memwrap.memory.search.step_timing). The three what-ifs rescore the same measurements: every "
             "matmul rated at fp32's speed at the calibration size (no precision, no size); the optimizer term "
             "replaced by the measured `step()`; the optimizer term in its bandwidth form ((2 x parameter + gradient "
             "+ 2 x state bytes) / bandwidth, what the cpu profile used before its steps were timed).", "",
             "| workload | fit / traced | rho (cpu profile) | rho (A100 profile) | plan's first is the fastest | "
             "launches alone | compute + launches vs fwd+bwd | optimizer vs step | what-if: bf16 at fp32 speed | "
             "what-if: measured step | what-if: bandwidth step |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in res:
        q = r["parts"]
        lines.append(f"| {r['workload']} | {r['fitting']} / {r['candidates']} | {_f(r['rho'])} | {_f(r['rho_a100'])} | "
                     f"{'yes' if r['top1_is_fastest'] else 'no'} | " + " | ".join(_f(q[k]) for k in PARTS) + " |")
    lines += [f"| **overall** (mean of the rhos) | | **{_f(s['mean_rho'])}** | {_f(s['mean_rho_a100'])} | "
              f"{s['top1_hits']} of {s['workloads']} | " + " | ".join(_f(s['mean_parts'][k]) for k in PARTS) + " |",
              f"| pooled (times relative to each plan's first) | | {_f(s['pooled_rho'])} | {_f(s['pooled_rho_a100'])} "
              "| | | | | | | |", ""]
    for r in res:
        lines += [f"## {r['workload']}: {r['source']}", "",
                  f"global batch {r['global_batch']}, micro-batches {r['micro_batches']}; budget "
                  f"{r['budget'] / MIB:.1f} MiB (plain peak {r['plain_peak'] / MIB:.1f} MiB); planned in "
                  f"{r['plan_s']:.0f} s.", "",
                  "| plan rank | candidate | predicted ms (cpu) | compute / launches / traffic / optimizer ms | measured ms | "
                  "fwd+bwd / step ms | spread ms | us per op (measured) | A100-profile ms |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for i, row in enumerate(r["rows"], 1):
            t = row["terms"]
            ran = row["measured_s"] is not None
            meas = f"{row['measured_s'] * 1e3:.1f}" if ran else f"error: {row['error']}"
            split = f"{row['measured_fwd_bwd_s'] * 1e3:.1f} / {row['measured_optimizer_s'] * 1e3:.1f}" if ran else ""
            spread = (f"{row['spread'][0] * 1e3:.0f}-{row['spread'][1] * 1e3:.0f}" if row["spread"] else "")
            per_op = f"{row['effective_op_s'] * 1e6:.1f}" if ran else ""
            lines.append(f"| {i} | `{row['label']}` | {row['predicted_s'] * 1e3:.1f} | {t['compute'] * 1e3:.1f} / "
                         f"{t['launches'] * 1e3:.1f} / {t.get('traffic', 0) * 1e3:.1f} / {t['optimizer'] * 1e3:.2f} | "
                         f"{meas} | {split} | {spread} | "
                         f"{per_op} | {row['a100_s'] * 1e3:.3f} |")
        lines.append("")
    lines += ["## Where the ranking is weak, and why", "", result.get("notes", "(see the tables)"), ""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = result["workloads"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    for r in res:
        ok = [row for row in r["rows"] if row["measured_s"] is not None]
        if not ok:
            continue
        ax.plot([row["predicted_s"] / ok[0]["predicted_s"] for row in ok],
                [row["measured_s"] / ok[0]["measured_s"] for row in ok], "o-", label=f"{r['workload']} "
                                                                                    f"(rho {_f(r['rho'])})")
    ax.set_xlabel("predicted s/update, relative to the plan's first (cpu profile)")
    ax.set_ylabel("measured s/update, relative to the plan's first")
    ax.axline((1, 1), slope=1, color="grey", lw=0.5, ls="--")
    ax.set_title("top candidates, in plan order")
    ax.legend(fontsize=7)
    names = [r["workload"] for r in res]
    x = range(len(names))
    bx.bar([i - 0.2 for i in x], [0 if math.isnan(r["rho"]) else r["rho"] for r in res], 0.4, label="cpu profile")
    bx.bar([i + 0.2 for i in x], [0 if math.isnan(r["rho_a100"]) else r["rho_a100"] for r in res], 0.4,
           label="A100 profile")
    bx.axhline(0, color="black", lw=0.5)
    bx.set_xticks(list(x), names, rotation=30, ha="right")
    bx.set_ylim(-1, 1)
    bx.set_ylabel("Spearman rho, predicted vs measured")
    bx.set_title("rank correlation per workload")
    bx.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's word for it."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 workloads, top 4, 3 repetitions; prints, writes nothing")
    ap.add_argument("--k", type=int, default=None, help="candidates timed per workload (default 6; --quick 4)")
    ap.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default 11; --quick 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared 2-core machine a second thread waits on the other "
                         "jobs and makes every matmul a scheduling measurement)")
    ap.add_argument("--workloads", default=None, help="comma-separated subset")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--notes", default=None, help="a text file whose content is the .md's 'where weak' section")
    ap.add_argument("--render", action="store_true", help="rewrite the .md and .png from the .json (and --notes), "
                                                           "running nothing")
    args = ap.parse_args(argv)
    if args.render:
        with open(os.path.join(args.out, "rank_check.json")) as fh:
            result = json.load(fh)
        if args.notes:
            with open(args.notes) as fh:
                result["notes"] = fh.read().strip()
            with open(os.path.join(args.out, "rank_check.json"), "w") as fh:
                json.dump(result, fh, indent=1, default=repr)
        with open(os.path.join(args.out, "rank_check.md"), "w") as fh:
            fh.write(markdown(result))
        plot(result, os.path.join(args.out, "rank_check.png"))
        return 0
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    k = args.k or (4 if args.quick else 6)
    reps = args.reps or (3 if args.quick else 11)
    t = time.perf_counter()
    profile = calibrate_cpu()
    cal_s = time.perf_counter() - t
    print(f"cpu profile: {profile}", flush=True)
    ws = workloads()
    chosen = args.workloads.split(",") if args.workloads else list(QUICK if args.quick else ws)
    unknown = [n for n in chosen if n not in ws]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; known: {', '.join(ws)}")
    results = [run_workload(n, ws[n], k, reps) for n in chosen]
    result = {"meta": {"torch": torch.__version__, "cpu_model": cpu_model(), "python": platform.python_version(), "cpus": os.cpu_count(),
                       "threads": args.threads, "k": k, "reps": reps, "calibration_s": cal_s,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "profile": profile.to_dict(),
                       "a100": A100.to_dict(),
                       "command": ("python benchmarks/rank_check.py " + " ".join(argv if argv is not None
                                                                                else sys.argv[1:])).strip()},
              "workloads": results, "summary": summary(results)}
    if args.notes:
        with open(args.notes) as fh:
            result["notes"] = fh.read().strip()
    s = result["summary"]
    print(f"\noverall: mean rho {_f(s['mean_rho'])} (A100 profile {_f(s['mean_rho_a100'])}), pooled "
          f"{_f(s['pooled_rho'])} (A100 {_f(s['pooled_rho_a100'])}); plan's first is the fastest in {s['top1_hits']} "
          f"of {s['workloads']}", flush=True)
    if args.quick:
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rank_check.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=repr)
    with open(os.path.join(args.out, "rank_check.md"), "w") as fh:
        fh.write(markdown(result))
    plot(result, os.path.join(args.out, "rank_check.png"))
    print(f"wrote {args.out}/rank_check.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
