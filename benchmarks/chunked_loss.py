"""Chunked LM-head loss: peak memory and time of plain vs checkpointed chunks vs cut-cross-entropy, on CPU.

Run:  python benchmarks/chunked_loss.py [--tokens 1024 --hidden 768 --vocab 50257 --reps 3 --layers 2]

Two tables:

1. **The head and loss alone** (hidden states ``[tokens, hidden]`` -> loss, forward + backward, fp32):
   Hugging Face's plain path (``lm_head``, ``logits.float()``, cross entropy), memwrap's chunks
   (``memwrap.techniques.loss_head.linear_cross_entropy``, default and small chunk sizes; ``impl="recompute"``, the
   default, and ``impl="checkpoint"``, each chunk under ``torch.utils.checkpoint``) and
   cut-cross-entropy's ``impl="torch_compile"`` (its CPU path; its ``cce`` Triton kernel needs CUDA).
   Peak = most bytes the CPU allocator held above the inputs (the gradients of hidden and weight included) (torch.profiler memory events, as in
   ``memwrap.measure_peak``); time = median thread CPU time of one forward + backward (one intra-op
   thread, so neighbours on a shared machine do not skew it); errors = relative to the plain path's loss
   and gradients; "fake" = whether the method runs under ``FakeTensorMode`` (what the planner needs).
2. **A whole training step** of a GPT-2-shaped model (``--layers`` blocks, AdamW) with and without
   ``wrap(chunked_loss=True)``: ``memwrap.measure_peak`` vs ``memwrap.estimate``, and step time.

Writes docs/benchmarks/chunked_loss.{json,png,md}.
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import memwrap  # noqa: E402
from memwrap.techniques.loss_head import default_chunk_size, linear_cross_entropy  # noqa: E402
from memwrap.memory import measure_peak  # noqa: E402
from memwrap.memory.measure import allocator_growth  # noqa: E402
from memwrap.models import GPT, GPTConfig  # noqa: E402

OUT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
MiB = 2 ** 20


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)


def chunks(size, impl="recompute"):
    return lambda h, w, y: linear_cross_entropy(h, w, y, chunk_size=size, impl=impl)


def cce_compile(h, w, y):
    from cut_cross_entropy import linear_cross_entropy as cce

    return cce(h, w, y, impl="torch_compile")


def allocator_peak(fn) -> int:
    """Most bytes the CPU allocator held above its level when ``fn`` started (profiler memory events)."""
    gc.collect()
    return allocator_growth(fn)


def runs_on_fake(method, n, hidden, vocab) -> str:
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            h = torch.empty(n, hidden, requires_grad=True)
            w = torch.empty(vocab, hidden, requires_grad=True)
            y = torch.zeros(n, dtype=torch.long)
            method(h, w, y).backward()
        return "yes"
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"no ({type(exc).__name__})"


def head_rows(args) -> list[dict]:
    torch.manual_seed(0)
    n, hidden, vocab = args.tokens, args.hidden, args.vocab
    h0 = torch.randn(n, hidden)
    w0 = torch.randn(vocab, hidden) * 0.02
    y = torch.randint(0, vocab, (n,))
    y[: n // 8] = -100  # a prompt without loss

    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

    def run(method):
        h.grad = w.grad = None  # the gradients are created inside the measured call, as in a first backward
        loss = method(h, w, y)
        loss.backward()
        return loss.detach(), h.grad, w.grad

    ref = run(plain)
    default = default_chunk_size(n, hidden, vocab)
    methods = [("plain (HF ForCausalLMLoss)", plain),
               (f"recompute chunks={default} (chunked_loss=True)", chunks(None)),
               ("recompute chunks=64", chunks(64)),
               (f"checkpoint chunks={default}", chunks(None, "checkpoint")),
               ("checkpoint chunks=64", chunks(64, "checkpoint"))]
    try:
        import cut_cross_entropy  # noqa: F401

        methods.append(("cut-cross-entropy torch_compile", cce_compile))
    except ImportError:
        print("cut-cross-entropy not installed: its row is skipped (pip install cut-cross-entropy)")
    rows = []
    for name, method in methods:
        got = run(method)  # warm-up (torch.compile compiles here) and exactness
        errors = [float((a - b).norm() / b.norm()) for a, b in zip(got, ref)]
        peak = allocator_peak(lambda: run(method))
        times = []
        for _ in range(args.reps):
            start = time.thread_time()
            run(method)
            times.append(time.thread_time() - start)
        rows.append(dict(method=name, peak_mib=peak / MiB, seconds=statistics.median(times),
                         loss_rel_err=errors[0], grad_hidden_rel_err=errors[1], grad_weight_rel_err=errors[2],
                         fake=runs_on_fake(method, 64, 32, 512)))
        print(f"{name:<36}{peak / MiB:>9.1f} MiB{statistics.median(times):>8.2f} s  errors "
              f"{errors[0]:.1e} {errors[1]:.1e} {errors[2]:.1e}  fake: {rows[-1]['fake']}")
    return rows


def step_rows(args) -> list[dict]:
    seq = args.tokens // 2

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=args.vocab, block_size=seq, n_layer=args.layers, n_head=args.hidden // 64,
                             n_embd=args.hidden))

    ids = torch.randint(0, args.vocab, (2, seq))
    batch = {"idx": ids, "labels": ids}
    rows = []
    for name, opts in (("plain", {}), ("chunked_loss=True", {"chunked_loss": True})):
        est = memwrap.estimate(build, batch, **opts)
        measured = measure_peak(build, batch, **opts)["peak"]
        model = build()
        wmodel, opt = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4), **opts)
        times = []
        for i in range(args.reps + 1):
            start = time.thread_time()
            wmodel(ids, labels=ids)["loss"].backward()
            opt.step()
            opt.zero_grad()
            if i:  # the first step creates the optimizer state
                times.append(time.thread_time() - start)
        rows.append(dict(config=name, measured_mib=measured / MiB, estimated_mib=est.peak / MiB,
                         estimate_error=(est.peak - measured) / measured, seconds=statistics.median(times)))
        print(f"{name:<20} measured {measured / MiB:8.1f} MiB  estimated {est.peak / MiB:8.1f} MiB "
              f"({rows[-1]['estimate_error']:+.2%})  step {statistics.median(times):.2f} s")
        del model, wmodel, opt
    return rows


def write(args, heads, steps) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    shape = dict(tokens=args.tokens, hidden=args.hidden, vocab=args.vocab, layers=args.layers)
    (OUT / "chunked_loss.json").write_text(json.dumps(dict(shape=shape, head=heads, step=steps,
                                                           torch=torch.__version__), indent=2))
    lines = ["# Chunked LM-head loss on CPU", "",
             f"Command: `python benchmarks/chunked_loss.py --tokens {args.tokens} --hidden {args.hidden} --vocab "
             f"{args.vocab} --layers {args.layers} --reps {args.reps}` (torch {torch.__version__}, one thread).", "",
             f"## Head + loss alone: {args.tokens} tokens x {args.hidden} hidden -> {args.vocab} vocab, fp32, "
             "forward + backward", "",
             "| method | peak above inputs | time | loss err | grad(hidden) err | grad(weight) err | runs on fake tensors |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for r in heads:
        lines.append(f"| {r['method']} | {r['peak_mib']:.1f} MiB | {r['seconds']:.2f} s | {r['loss_rel_err']:.1e} | "
                     f"{r['grad_hidden_rel_err']:.1e} | {r['grad_weight_rel_err']:.1e} | {r['fake']} |")
    lines += ["", f"## Whole training step: GPT ({args.layers} blocks, {args.hidden} wide, vocab {args.vocab}), batch 2 x "
              f"{args.tokens // 2}, AdamW", "",
              "| configuration | measured peak | estimated (fake tensors) | estimate error | step time |",
              "|---|---:|---:|---:|---:|"]
    for r in steps:
        lines.append(f"| {r['config']} | {r['measured_mib']:.1f} MiB | {r['estimated_mib']:.1f} MiB | "
                     f"{r['estimate_error']:+.2%} | {r['seconds']:.2f} s |")
    lines += ["", "Reading: peaks include the weight gradient (vocab x hidden fp32) and the hidden states' gradient created "
              "in the call. `impl=\"checkpoint\"` (per-chunk `torch.utils.checkpoint`) keeps one more weight-sized "
              "gradient at its peak than `impl=\"recompute\"` (the default), whatever the chunk size: autograd hands "
              "each chunk's weight gradient to the engine to add. cut-cross-entropy's `torch_compile` path is the "
              "fastest on CPU (fused softmax; it drops ignored tokens first) but selects tokens with a data-dependent "
              "shape, so it cannot be traced on fake tensors for the planner; its Triton `cce` path needs CUDA (not "
              "measured here). The whole-step estimates model where the real autograd engine adds a tied weight's two "
              "gradients in place (under any dispatch mode it adds them out of place; memwrap/memory/tracing/grad_accumulation.py "
              "corrects the trace for it, see docs/planner.md)."]
    (OUT / "chunked_loss.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG (pip install memwrap[cli])")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["method"].replace(" (", "\n(") for r in heads]
    ax1.barh(names, [r["peak_mib"] for r in heads], color="tab:blue")
    ax1.set_xlabel("peak above inputs (MiB), head + loss fwd+bwd")
    ax1.invert_yaxis()
    ax2.barh(names, [r["seconds"] for r in heads], color="tab:orange")
    ax2.set_xlabel("CPU seconds, one thread")
    ax2.invert_yaxis()
    ax2.set_yticklabels([])
    fig.suptitle(f"LM head + cross entropy: {args.tokens} tokens, hidden {args.hidden}, vocab {args.vocab} (CPU)")
    fig.tight_layout()
    fig.savefig(OUT / "chunked_loss.png", dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-step", action="store_true", help="skip the whole-step table")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    heads = head_rows(args)
    steps = [] if args.no_step else step_rows(args)
    write(args, heads, steps)


if __name__ == "__main__":
    main()
