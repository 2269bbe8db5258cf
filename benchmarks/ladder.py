"""The memory ladder (issue 12, item 6), as torchtune's README shows it: from plain fp32 AdamW, add one
technique per row: true bf16 (Kahan-summed AdamW), activation checkpointing, paged 8-bit AdamW, the step
inside backward, the chunked LM-head loss.

Part 1, predicted on fake tensors (``memwrap.estimate``, nothing allocated): the device peak, the host memory
(paged optimizer state: CUDA unified memory that uses free device memory and spills to host RAM, counted
apart from the device peak), and the predicted step time relative to the first row (the planner's cost
model on its reference GPU) for llama-7b (batch 1 x 2048) and llama-3-8b (batch 2 x 2048; torchtune's
measured figure for Llama-3.1-8B at this shape on an RTX 4090: 18.9 GiB).

Part 2, measured on this CPU: the same ladder on a small Llama, the estimate's peak against the CPU
allocator's measured peak (``memwrap.memory.measure_peak``) per row. On CPU bitsandbytes' paged optimizers
fall back to ordinary host memory, which *is* this device's memory: there the comparison adds the paged
state back to the predicted device peak (said in the row).

    python benchmarks/ladder.py            # writes docs/benchmarks/ladder.{md,json,png}
    python benchmarks/ladder.py --fast     # tiny shapes, for a quick check (writes nothing)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import memwrap  # noqa: E402
from memwrap.memory import measure_peak  # noqa: E402
from memwrap.memory.search.cost import cost_terms  # noqa: E402
from memwrap.models import Llama, LlamaConfig, build_preset, preset_batch  # noqa: E402

GIB, MIB = 2**30, 2**20
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "benchmarks")
TORCHTUNE_8B = 18.9  # GiB, torchtune README: Llama-3.1-8B full fine-tune, batch 2, packed 2048, RTX 4090

# One technique per row, each row keeping the ones above (torchtune's order).
LADDER = [
    ("fp32 AdamW", dict(precision="fp32", optim="adamw")),
    ("+ bf16-true (Kahan AdamW)", dict(precision="bf16-true", optim="adamw")),
    ("+ activation checkpointing", dict(precision="bf16-true", optim="adamw", checkpoint="full")),
    ("+ paged 8-bit AdamW", dict(precision="bf16-true", optim="paged_adamw_8bit", compensation="none",
                                 checkpoint="full")),
    ("+ step in backward", dict(precision="bf16-true", optim="paged_adamw_8bit", compensation="none",
                                checkpoint="full", step_in_backward=True)),
    ("+ chunked loss", dict(precision="bf16-true", optim="paged_adamw_8bit", compensation="none",
                            checkpoint="full", step_in_backward=True, chunked_loss=True)),
]


def seconds(est, precision: str) -> float:
    """The planner's predicted seconds per update (memwrap.memory.search.cost), paged state assumed spilled."""
    return sum(cost_terms(flops=est.flops, ops=est.ops_per_micro_batch, micro_batches=1, precision=precision,
                          param_bytes=est.state["parameters"], grad_bytes=est.state["gradients"],
                          state_bytes=est.state["optimizer_state"], offloaded=est.offloaded,
                          paged_spill=est.paged_state, host_state=est.host_state,
                          flop_classes=est.flop_classes).values())


def predicted(preset: str, batch: int, seq: int) -> list[dict]:
    """Part 1: each row of the ladder estimated on fake tensors for ``preset``."""
    with torch.device("meta"):
        model = build_preset(preset)
    data = preset_batch(preset, batch, seq, labels=True)
    rows, first = [], None
    for name, opts in LADDER:
        t0 = time.perf_counter()
        est = memwrap.estimate(model, data, **opts)
        s = seconds(est, opts["precision"])
        first = first or s
        rows.append({"row": name, "options": opts, "peak": est.peak, "paged_state": est.paged_state,
                     "host": est.host, "breakdown": est.breakdown, "peak_phase": est.peak_phase,
                     "seconds": s, "relative_time": s / first, "method": est.method,
                     "trace_seconds": time.perf_counter() - t0})
        print(f"  {preset:<11} {name:<28} device {est.peak / GIB:7.2f} GiB  host {est.host / GIB:6.2f} GiB  "
              f"time {s / first:5.2f}x  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return rows


def small_llama(vocab: int, layers: int):
    def build():
        torch.manual_seed(0)
        return Llama(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512))
    return build


def measured(fast: bool) -> list[dict]:
    """Part 2: the ladder on a small Llama on this CPU: estimate vs the allocator's measured peak."""
    vocab, layers, batch, seq = (2048, 2, 2, 64) if fast else (16384, 4, 2, 256)
    build = small_llama(vocab, layers)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids, "labels": ids}
    rows = []
    for name, opts in LADDER:
        est = memwrap.estimate(build, data, **opts)
        meas = measure_peak(build, data, steps=1, **opts)["peak"]
        # On CPU, bitsandbytes' paged state is ordinary memory of this (only) device: add it back to compare.
        pred = est.peak + est.paged_state
        err = (pred - meas) / meas
        rows.append({"row": name, "options": opts, "predicted": pred, "measured": meas, "error": err,
                     "paged_added": est.paged_state})
        print(f"  cpu {name:<28} predicted {pred / MIB:8.2f} MiB  measured {meas / MIB:8.2f} MiB  "
              f"error {100 * err:+5.1f}%" + ("  (paged state added: CPU has no unified memory)" if est.paged_state
                                             else ""), flush=True)
    return rows, dict(vocab=vocab, layers=layers, hidden=128, batch=batch, seq=seq)


def markdown(result: dict) -> str:
    lines = ["# The memory ladder: one technique per row", "",
             "Generated by `python benchmarks/ladder.py` on " + result["meta"]["date"] + " (" +
             result["meta"]["torch"] + ", " + str(result["meta"]["cpus"]) + " CPUs). Predicted rows are fake-tensor "
             "traces of the real step (`memwrap.estimate`, nothing allocated); the CPU rows measure the allocator.", "",
             "Device = the predicted peak that must fit on the GPU (tensors only; the planner adds its margin for the "
             "CUDA context and the allocator). Host = paged optimizer state (bitsandbytes' paged AdamW keeps it in "
             "CUDA unified memory: it uses device memory left free and spills to host RAM under pressure, so it is "
             "not in the device peak; host RAM for all of it is assumed). Time = the planner's predicted step time "
             "relative to the first row (reference GPU, paged state assumed fully spilled: a pessimistic paging "
             "term).", ""]
    for preset, info in result["predicted"].items():
        lines += [f"## {preset}, batch {info['batch']} x {info['seq']} tokens (predicted)", "",
                  "| row | device peak | host (paged) | rel. step time | peak in |", "|---|---:|---:|---:|---|"]
        for r in info["rows"]:
            lines.append(f"| {r['row']} | {r['peak'] / GIB:.2f} GiB | {r['host'] / GIB:.2f} GiB | "
                         f"{r['relative_time']:.2f}x | {r['peak_phase']} |")
        lines.append("")
    if "llama-3-8b" in result["predicted"]:
        last = result["predicted"]["llama-3-8b"]["rows"][-1]
        verdict = "at or below" if last["peak"] / GIB <= TORCHTUNE_8B else "ABOVE"
        lines += [f"llama-3-8b, all techniques: {last['peak'] / GIB:.2f} GiB predicted, {verdict} torchtune's "
                  f"measured {TORCHTUNE_8B} GiB for the same model and shape.", ""]
    m = result["measured"]
    c = m["model"]
    lines += [f"## Measured on CPU: Llama vocab {c['vocab']}, hidden {c['hidden']}, {c['layers']} layers, "
              f"batch {c['batch']} x {c['seq']}", "",
              "| row | predicted | measured | error |", "|---|---:|---:|---:|"]
    for r in m["rows"]:
        note = " (paged state added back: on CPU it is ordinary memory)" if r["paged_added"] else ""
        lines.append(f"| {r['row']}{note} | {r['predicted'] / MIB:.2f} MiB | {r['measured'] / MIB:.2f} MiB | "
                     f"{100 * r['error']:+.1f}% |")
    worst = max(abs(r["error"]) for r in m["rows"])
    lines += ["", f"Largest error: {100 * worst:.1f}% (target: within 5%).", "",
              "bitsandbytes is not traced (its kernels do not run on fake tensors): the planner counts its declared "
              "state bytes, exact, and no step temporaries, which is right for its fused CUDA kernels. Its CPU "
              "fallback dequantizes each parameter's state to fp32 inside the step: where the optimizer step is the "
              "peak (`--fast`'s 2-layer model), the measured CPU peak of the 8-bit rows is 25-36% above the "
              "prediction for that reason; here the peak is in backward and the rows match. The GPU check "
              "(`benchmarks/gpu_ladder.py`) measures the same rows with `max_memory_allocated`.", ""]
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["predicted"]), figsize=(6 * len(result["predicted"]), 4.5), squeeze=False)
    for ax, (preset, info) in zip(axes[0], result["predicted"].items()):
        names = [r["row"] for r in info["rows"]]
        dev = [r["peak"] / GIB for r in info["rows"]]
        host = [r["host"] / GIB for r in info["rows"]]
        x = range(len(names))
        ax.bar(x, dev, label="device peak")
        ax.bar(x, host, bottom=dev, label="host (paged state)", alpha=0.5)
        ax.axhline(24, color="red", linestyle="--", label="24 GiB")
        if preset == "llama-3-8b":
            ax.axhline(TORCHTUNE_8B, color="green", linestyle=":", label=f"torchtune {TORCHTUNE_8B} GiB")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("GiB")
        ax.set_title(f"{preset}, batch {info['batch']} x {info['seq']} (predicted)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", action="store_true", help="tiny shapes; prints, writes nothing")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    shapes = [("llama-tiny", 2, 128)] if args.fast else [("llama-7b", 1, 2048), ("llama-3-8b", 2, 2048)]
    result = {"meta": {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, "predicted": {}}
    for preset, batch, seq in shapes:
        result["predicted"][preset] = {"batch": batch, "seq": seq, "rows": predicted(preset, batch, seq)}
    rows, model = measured(args.fast)
    result["measured"] = {"model": model, "rows": rows}
    if args.fast:
        return 0
    with open(os.path.join(OUT, "ladder.json"), "w") as fh:
        json.dump(result, fh, indent=1, default=repr)
    with open(os.path.join(OUT, "ladder.md"), "w") as fh:
        fh.write(markdown(result))
    plot(result, os.path.join(OUT, "ladder.png"))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
