"""Seed claims about checkpointing, precision, time (GPU) and whether big models fit a card."""
from __future__ import annotations

import math

import torch

import memwrap
from memwrap.models import GPT, GPTConfig, build_preset, get_preset, preset_batch

from claims_common import CARD_12, CARD_24, GIB, _reduction, _row, change, gib, pct


# ----------------------------------------------------------------------------- checkpointing, precision

def ckpt_memory(ctx):
    rows, best_total, best_act = [], 0.0, 0.0
    for p, b, s in (("gpt2", 8, 1024), ("bert-large", 8, 512)):
        none, full = ctx.est(p, b, s), ctx.est(p, b, s, checkpoint="full")
        total = _reduction(none, full)
        act = 1 - full.breakdown["activations"] / none.breakdown["activations"]
        best_total, best_act = max(best_total, total), max(best_act, act)
        rows.append(f"{ctx.name(p)}: peak {gib(none.peak)} -> {gib(full.peak)} ({change(total)}), activations at the "
                    f"peak {change(act)}")
    kind = "holds" if best_total >= 0.75 else ("holds only when" if best_act >= 0.75 else "does not hold")
    return _row("gpt2 8 x 1024 tokens and bert-large 8 x 512, fp32 AdamW, checkpoint='full' vs none", "; ".join(rows),
                kind, "read as activation memory (the checkpointed blocks keep only their inputs); the total peak "
                f"fell by at most {pct(best_total)}, less where weights, optimizer state and backward temporaries "
                "(the logits of a large vocabulary) are a large part of it",
                {"claimed": 75, "value": round(100 * best_total, 1), "unit": "% less peak memory (checkpointing)"})


# How far a GPU step-time figure may sit outside the claimed range and still count as agreeing with it: the
# medians of gpu_check.py's interleaved repetitions still move by a few per cent between runs.
NOISE = {"x": 0.1, "%": 3.0}  # speed-ups: 0.1x; overheads: 3 percentage points


def _gpu_or(ctx, check, key, claimed_lo, claimed_hi, setting, what, proxy=None, better="higher"):
    """A claim about GPU step time, judged from gpu_check.py's JSON (``ctx.gpu``) when it holds ``check``.

    ``better`` says which way is good ("higher" for a speed-up, "lower" for an overhead), so that a figure
    beyond the claimed range on the good side reads "holds: better than claimed", not "does not hold".
    """
    raw = ((ctx.gpu or {}).get("checks") or {}).get(check) or {}
    if raw.get("status") == "failed":
        return _row(setting, f"not measured: gpu_check.py ran {check!r} on {ctx.gpu.get('device', 'a GPU')} and it "
                    f"failed ({raw.get('error', 'no error recorded')})", "needs a GPU to measure",
                    f"a GPU step-time ratio ({what}); the GPU run failed, see its JSON")
    g = ctx.gpu_check(check)
    if g is None or g.get(key) is None or (ctx.gpu or {}).get("dry_run"):
        return _row(setting + (f"; CPU proxy: {proxy}" if proxy else ""), "not measured: no GPU result yet "
                    "(run benchmarks/gpu_check.py on a GPU)", "needs a GPU to measure",
                    f"a GPU step-time ratio ({what}); CPU timings do not transfer to GPU kernels")
    v, band = float(g[key]), NOISE["%" if "%" in what else "x"]
    sign = 1 if better == "higher" else -1
    low, high = (claimed_lo, claimed_hi) if sign == 1 else (claimed_hi, claimed_lo)  # worst and best end
    if sign * (v - low) < -band:
        kind, how = "does not hold", "worse than claimed"
    elif sign * (v - high) > band:
        kind, how = "holds", "better than claimed"
    else:
        kind, how = "holds", "within the claimed range" if claimed_lo <= v <= claimed_hi else "within the noise band"
    reps = f", median of {g['reps']} interleaved repetitions" if g.get("reps") else ""
    return _row(f"{g.get('setting') or setting} (gpu_check.py {check}{reps}); measured on "
                f"{ctx.gpu.get('device', 'GPU')}", f"{what}: {v:.2f}", kind,
                f"{how}: measured {v:.2f} against the claimed {claimed_lo}-{claimed_hi} ({better} is better; noise "
                f"band +/-{band:g})" + (" in this setting" if kind == "does not hold" else ""),
                {"claimed": (claimed_lo + claimed_hi) / 2, "value": v, "unit": what, "noise_band": band,
                 "better": better, "verdict": how})


def ckpt_time(ctx):
    none, full = ctx.est("gpt2", 8, 1024), ctx.est("gpt2", 8, 1024, checkpoint="full")
    proxy = f"recompute adds {pct(full.flops / none.flops - 1)} FLOPs (traced)"
    return _gpu_or(ctx, "checkpoint_overhead", "overhead_full_pct", 20, 30, "gpt2-style model, checkpoint='full' vs "
                   "none, same batch", "extra step time, %", proxy, better="lower")


def amp_memory(ctx):
    parts, best = [], 0.0
    for p, b, s in (("gpt2", 8, 1024), ("bert-large", 8, 512), ("resnet50", 32, 224)):
        fp32, bf16 = ctx.est(p, b, s), ctx.est(p, b, s, precision="bf16")
        r = _reduction(fp32, bf16)
        best = max(best, r)
        parts.append(f"{ctx.name(p)} {change(r)}")
    return _row("gpt2 8x1024, bert-large 8x512, resnet50 32x224: fp32 vs bf16 autocast (fp16 saves the same bytes), "
                "AdamW", "peak memory: " + ", ".join(parts), "does not hold" if best < 0.45 else "holds only when",
                "mixed precision keeps fp32 master weights, fp32 gradients and fp32 optimizer state and adds 16-bit "
                "weight copies; only activations computed in 16 bits shrink (CPU autocast op list; gpu_check.py "
                "compares on CUDA)", {"claimed": 50, "value": round(100 * best, 1), "unit": "% less peak memory (AMP)"})


def amp_speed(ctx):
    return _gpu_or(ctx, "precision_step_time", "speedup_bf16_vs_fp32", 2, 3, "gpt2-style model, bf16 autocast vs "
                   "fp32 (no TF32), same batch", "speed-up, x")


def accum_time(ctx):
    return _gpu_or(ctx, "accumulation_overhead", "overhead_resnet50_pct", 15, 30, "resnet50, batch 32 vs 4 "
                   "micro-batches of 8, same global batch", "extra step time, %", better="lower")


def fp16_small_grads(ctx):
    g = torch.logspace(-10, -4, 10_000, dtype=torch.float64)

    def lost(t):
        back = t.double()
        return float((back == 0).double().mean()), float(((back - g).abs() / g).median())

    # With loss scaling the gradient is stored scaled (fp16) and unscaled in fp32 before the update.
    fp16, scaled, bf16 = lost(g.half()), lost((g * 65536).half().double() / 65536), lost(g.bfloat16())
    return _row("10,000 gradient values log-spaced in [1e-10, 1e-4], cast to fp16 / fp16 with GradScaler's initial "
                "scale 65536 / bf16 (real CPU tensors)",
                f"fp16: {pct(fp16[0])} become 0, median rel. error {fp16[1]:.1e}; fp16 + loss scaling: {pct(scaled[0])} "
                f"become 0, error {scaled[1]:.1e}; bf16: {pct(bf16[0])} become 0, error {bf16[1]:.1e}",
                "holds only when", "fp16 is used without loss scaling (fp16 flushes values below 6e-8 to zero and "
                "loses digits below 6e-5). memwrap's fp16 mode always scales the loss; bf16 has fp32's range",
                {"fp16": fp16, "fp16_scaled": scaled, "bf16": bf16})


# ----------------------------------------------------------------------------- does it fit?

def _t5_like():
    # T5-3B has 2.85B parameters; memwrap has no T5 preset, so a GPT-2-style decoder of the same size stands in.
    return GPT(GPTConfig(vocab_size=32128, block_size=512, n_layer=35, n_head=20, n_embd=2560, bias=True))


def t5_3b(ctx):
    from memwrap.models import lm_loss as loss

    if ctx.fast:
        factory, budget, label = (lambda: build_preset("gpt2-tiny")), 96 * 2**20, "gpt2-tiny (fast mode), 96 MiB"
    else:
        factory, budget, label = _t5_like, CARD_24, "24 GiB"
    with torch.device("meta"):
        n = sum(p.numel() for p in factory().parameters())
    seq = 32 if ctx.fast else 512
    mk = lambda mb: (torch.randint(0, 256, (mb, seq)), torch.randint(0, 256, (mb, seq)))  # noqa: E731
    from memwrap.memory import plan

    optims = ("adamw", "adamw_8bit", "adafactor")
    p = plan(factory, mk, budget=budget, global_batch=8, micro_batches=(1,), precisions=("bf16",),
             checkpoints=("full",), optimizers=optims, loss_fn=loss, step_in_backward=(False,))
    c = {x.optim: x for x in p.candidates}
    # Issue 12's modes: true bf16 weights (no fp32 master copy; 8-bit Adam then steps them uncompensated, as
    # bitsandbytes does under Trainer's bf16) and paged state, with and without the step inside backward.
    q = plan(factory, mk, budget=budget, global_batch=8, micro_batches=(1,), precisions=("bf16-true",),
             checkpoints=("full",), optimizers=("adamw_8bit", "paged_adamw_8bit"), loss_fn=loss)
    t = {x.optim + ("+sib" if x.extra.get("step_in_backward") else ""): x for x in q.candidates}
    fits = [o for o, x in c.items() if x.fits]
    measured = "; ".join(f"bf16 autocast + {o}: {gib(x.estimate.peak)} + margin = {gib(x.required)}" +
                         (" fits" if x.fits else " does not fit") for o, x in c.items())
    measured += "; " + "; ".join(f"bf16-true + {o}: {gib(x.estimate.peak)} + margin = {gib(x.required)}"
                                 + (f" (+ {gib(x.estimate.paged_state)} paged state)" if x.estimate.paged_state else "")
                                 + (" fits" if x.fits else " does not fit") for o, x in t.items())
    eight = t.get("adamw_8bit")
    if "adamw_8bit" in fits:
        kind, why = "holds", "8-bit Adam's state fits next to fp32 weights and gradients"
    elif eight is not None and eight.fits:
        kind = "holds only when"
        why = ("the weights are stored in bf16 without fp32 masters (memwrap's precision='bf16-true'): then 8-bit "
               "Adam's state fits next to bf16 weights and gradients. With fp32 master weights (fp16/bf16 autocast, "
               "the post's fp16=True) weights + gradients alone are ~22.8 GB and 8-bit Adam's 2 B/param overflow "
               "24 GiB")
    else:
        kind, why = "does not hold", ("with fp32 master weights, weights (4 B/param) + gradients (4 B/param) alone are "
                                      "~22.8 GB; 8-bit Adam's 2 B/param state then overflows 24 GiB, and bf16 weights "
                                      "do not bring it under either")
    best = eight if eight is not None and eight.fits else c["adamw_8bit"]
    return _row(f"planner: T5-3B-sized decoder ({n / 1e9:.2f}B parameters; no T5 preset, a GPT-2-style stack of the "
                f"same size), micro-batch 1 x {seq} tokens, accumulate 8, full checkpointing, budget {label} (margin "
                "8% + 1 GiB); bf16 autocast (fp32 masters) and bf16-true", measured, kind, why,
                {"claimed": 24, "value": round(best.required / GIB, 2), "unit": "GiB needed"},
                fix="precision='bf16-true' with 8-bit Adam (planned above)" if kind == "holds only when" else
                "Adafactor (factored state) " + ("fits, per the plan" if "adafactor" in fits else "is closest")
                + "; otherwise bf16 weights without fp32 masters, freezing layers / LoRA, or paged optimizer state")


def llama_7b(ctx, combo: bool = False):
    name = ctx.name("llama-7b")
    spec = get_preset(name)
    seq = 32 if ctx.fast else 512
    budget = 64 * 2**20 if ctx.fast else CARD_24
    if combo:  # the post's recommended configuration, applied to LLaMA-7B
        e = memwrap.estimate(spec.factory, preset_batch(name, 2, seq), loss_fn=spec.loss, precision="bf16",
                             accumulate=8, checkpoint="full", optim="adamw_8bit")
        return _row(f"{name}: micro-batch 2 x {seq}, accumulate 8, checkpointing, fp16 (traced as bf16: same bytes), "
                    "adamw_8bit: the post's combination", f"predicted peak {gib(e.peak)}: parameters "
                    f"{gib(e.breakdown['parameters'])}, gradients {gib(e.breakdown['gradients'])}, optimizer state "
                    f"{gib(e.breakdown['optimizer_state'])}", "does not hold" if e.peak > budget else "holds",
                    "the combination cannot fit a full fine-tune of 7B parameters in 24 GiB: fp32 weights alone "
                    "exceed it", {"claimed": 24, "value": round(e.peak / GIB, 2), "unit": "GiB needed"},
                    fix="a frozen 4-bit base with LoRA adapters (QLoRA), or sharding over GPUs (FSDP)")
    from memwrap.memory import plan

    p = plan(spec.factory, lambda mb: preset_batch(name, mb, seq), budget=budget, global_batch=8, micro_batches=(1,),
             precisions=("bf16",), checkpoints=("full",), optimizers=("adamw_8bit", "adafactor"), loss_fn=spec.loss,
             step_in_backward=(False,))
    s = p.smallest
    weights = s.estimate.breakdown["parameters"]
    state = s.estimate.state["parameters"] + s.estimate.state["gradients"] + s.estimate.state["optimizer_state"]
    # Issue 12's modes (true bf16, paged 8-bit AdamW, step in backward, chunked loss): the same global batch of 8,
    # every micro-batch size, i.e. with and without accumulation.
    q = plan(spec.factory, lambda mb: preset_batch(name, mb, seq, labels=True), budget=budget, global_batch=8,
             precisions=("bf16-true",), checkpoints=("full",), optimizers=("paged_adamw_8bit", "adafactor"))
    accumulated = [c for c in q.candidates if c.accumulate > 1]
    acc_low = min(accumulated, key=lambda c: c.required)
    whole = q.best
    measured = (f"bf16 autocast: smallest predicted peak {gib(s.estimate.peak)} ({s.label}); fp32 weights alone "
                f"{gib(weights)}. bf16-true with accumulation (accumulate > 1): smallest {gib(acc_low.estimate.peak)} "
                f"+ margin = {gib(acc_low.required)} ({acc_low.label}; the window's bf16 gradients stay until its last "
                f"backward)" + (f". Without accumulation it fits: {whole.label}, {gib(whole.estimate.peak)} + margin = "
                                f"{gib(whole.required)}" + (f" (+ {gib(whole.estimate.paged_state)} paged state)"
                                                           if whole.estimate.paged_state else "")
                                if whole is not None and whole.accumulate == 1 else ""))
    if any(c.fits for c in accumulated):
        kind, why = "holds only when", "weights are bf16 without fp32 masters (precision='bf16-true') and the state paged"
    else:
        kind = "does not hold"
        why = ("accumulation shrinks only activations and keeps the window's gradients: a full fine-tune with "
               f"accumulation keeps weights and gradients ({gib(acc_low.estimate.state['parameters'])} each in bf16, "
               "more in fp32) on the card. What makes 7B fit 24 GiB is the opposite: bf16 weights, paged 8-bit state "
               "and the step inside backward, which frees each gradient at once, so no accumulation")
    return _row(f"planner: {name} ({spec.params / 1e9:.2f}B), global batch 8 x {seq}, full checkpointing, budget "
                f"{gib(budget)}: bf16 autocast (micro-batch 1 x accumulate 8; adamw_8bit / adafactor) and bf16-true "
                "(every micro-batch; paged_adamw_8bit / adafactor, step in backward, chunked loss)", measured, kind,
                why, {"claimed": 24, "value": round(acc_low.required / GIB, 2), "unit": "GiB needed with accumulation"},
                fix=(f"no accumulation: {whole.label} ({gib(whole.required)} with margin); " if whole is not None else "")
                + f"or shard the {gib(state)} of fp32-master weights, gradients and optimizer state over more than "
                  f"{math.ceil(state / budget)} such GPUs (FSDP), or a frozen quantized base with LoRA (QLoRA)")


def llama_combo(ctx):
    return llama_7b(ctx, combo=True)


def bert_base_3060(ctx):
    cfg = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
    name = "bert-tiny" if ctx.fast else "bert-large"
    spec = get_preset(name)
    factory = (lambda: spec.factory()) if ctx.fast else (lambda: spec.factory(**cfg))
    out = {}
    for seq in ((32,) if ctx.fast else (128, 512)):
        e = memwrap.estimate(factory, preset_batch(name, 8, seq), loss_fn=spec.loss)
        out[seq] = e.peak
    from memwrap.memory.search.planner import Margin

    m = Margin()
    fits = {s: v + m.of(v) <= CARD_12 for s, v in out.items()}
    return _row("BERT-base (110M; the bert-large preset with base sizes), batch 8, fp32 AdamW, eager attention, "
                "12 GiB card, planner margin 8% + 1 GiB",
                ", ".join(f"seq {s}: peak {gib(v)}" for s, v in out.items()), "does not hold" if all(fits.values())
                else "holds only when", "batch 8 fits a 12 GB card at sequence length 512 and below with plain "
                "fp32 AdamW" if all(fits.values()) else "the sequence is long", {s: v for s, v in out.items()})


def resnet_3060(ctx):
    from memwrap.memory.search.planner import Margin

    e32, e64 = ctx.est("resnet50", 32, 224), ctx.est("resnet50", 64, 224)
    slope = (e64.peak - e32.peak) / 32
    m = Margin()
    # largest b with peak(b) * 1.08 + 1 GiB <= 12 GiB, peak(b) affine in b (checked by the two traces)
    bmax = int(((CARD_12 - m.fixed) / (1 + m.fraction) - (e32.peak - 32 * slope)) / slope)
    return _row(f"{ctx.where('resnet50', 32, 224)} and 64; 12 GiB card, planner margin 8% + 1 GiB",
                f"batch 32 peaks at {gib(e32.peak)}; the largest fp32 batch predicted to fit is ~{bmax}", "does not hold",
                "a torchvision-style ResNet-50 at 224 px trains with batch 32 on 12 GB with room to spare; the "
                "table's times (+12% per epoch with accumulation) need a GPU and its accuracies a full ImageNet run",
                {"claimed": 32, "value": bmax, "unit": "largest batch on 12 GB"})


def stability(ctx):
    return _row("none: 'training stability' is not defined in the post", "nothing to measure", "not measurable here",
                "memwrap can only show that accumulation reproduces the big batch's gradient (row 'accumulation is "
                "the big batch'); a 'stability +15%' needs a metric and repeated runs")
