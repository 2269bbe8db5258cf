"""Seed claims about bytes: per parameter, activations, accumulation (memory and maths)."""
from __future__ import annotations

import functools

import torch

import memwrap
from memwrap.models import build_preset, get_preset, lm_loss, preset_batch

from claims_common import _reduction, _row, change, gib

# Tolerances that turn a measured figure into a verdict. A claim stated as "about X" holds when the
# measurement is within REL_TOL of X; an exact byte count must match to within EXACT_TOL.
REL_TOL = 0.10
EXACT_TOL = 0.01


def _near(value: float, claimed: float, tol: float = REL_TOL) -> bool:
    return abs(value / claimed - 1) <= tol


# ----------------------------------------------------------------------------- bytes per parameter

def survey(ctx):
    return _row("none: a survey percentage without a source", "nothing to measure", "not measurable here",
                "a statistic about developers, not about memory or speed; no source is given")


def bert_large_weights(ctx):
    e = ctx.est("bert-large", 1, 128)
    n = get_preset(ctx.name("bert-large")).params
    b = e.breakdown["parameters"]
    ok = _near(b / 1e9, 1.3)
    return _row(f"{ctx.name('bert-large')} ({n / 1e6:.0f}M parameters, the real bert-large-uncased + 2-way head), fp32",
                f"{b / 1e9:.3f} GB ({gib(b)}) of parameters", "holds" if ok else "does not hold",
                f"{b / n:.0f} bytes x {n / 1e6:.0f}M parameters; nvidia-smi shows more (CUDA context, 0.3-0.6 GiB, "
                "and the caching "
                "allocator), which is not tensor memory", {"claimed": 1.3, "value": round(b / 1e9, 3), "unit": "GB"})


@functools.lru_cache(maxsize=None)
def _tiny_step_bytes() -> dict:
    torch.manual_seed(0)
    model = build_preset("gpt2-tiny")
    n = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = memwrap.create_optimizer("adamw", model, lr=1e-3)
    x, y = preset_batch("gpt2-tiny", 2, 16)
    lm_loss(model(x), y).backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    opt.step()
    from memwrap.plugin.state_size import measure_state_bytes

    state = measure_state_bytes(opt)
    lin = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    o16 = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
    o16.step()
    state16 = measure_state_bytes(o16) - 4  # minus the step counter
    return {"n": n, "param_bytes": param_bytes, "grads": grads, "state": state,
            "bf16_state_per_param": state16 / lin.weight.numel()}


def adamw_bytes(ctx):
    m = _tiny_step_bytes()
    per, per16 = m["state"] / m["n"], m["bf16_state_per_param"]
    fp32_ok, bf16_ok = _near(per, 8, EXACT_TOL), _near(per16, 8, EXACT_TOL)
    kind = "holds" if fp32_ok and bf16_ok else "holds only when" if fp32_ok else "does not hold"
    verdict = (f"the parameters are fp32 (the usual case, also under AMP): two moments of {per / 2:.0f} bytes each. "
               f"torch keeps the moments in the parameter's dtype, so bf16 parameters need {per16:.0f} bytes/param; "
               "8-bit Adam about 2" if kind == "holds only when" else
               f"measured {per:.2f} bytes/param for fp32 and {per16:.2f} for bf16 parameters (claim: 8, within "
               f"{100 * EXACT_TOL:.0f}%)")
    return _row(f"gpt2-tiny ({m['n'] / 1e6:.2f}M parameters) after one real AdamW step (torch, fused), CPU; "
                "and a bf16 Linear",
                f"{per:.4f} bytes/param of AdamW state (fp32 parameters); {per16:.1f} bytes/param "
                "for bf16 parameters", kind, verdict,
                {"claimed": 8, "value": round(per, 4), "unit": "bytes per parameter"})


def grad_bytes(ctx):
    m = _tiny_step_bytes()
    per = m["grads"] / m["n"]
    ok = _near(per, 4, EXACT_TOL)
    return _row("gpt2-tiny, one real backward, CPU", f"{per:.4f} bytes/param of gradients",
                "holds" if ok else "does not hold",
                "gradients take the parameter's dtype: 4 bytes for fp32 parameters, also under bf16/fp16 autocast, "
                "where the master weights stay fp32" if ok else
                f"measured {per:.4f} bytes/param, not 4 (within {100 * EXACT_TOL:.0f}%)",
                {"claimed": 4, "value": round(per, 4), "unit": "bytes per parameter"})


def grads_equal_params(ctx):
    m = _tiny_step_bytes()
    equal = m["grads"] == m["param_bytes"]
    return _row("gpt2-tiny, one real backward, CPU",
                f"gradients {m['grads']:,} B {'=' if equal else '!='} parameters {m['param_bytes']:,} B",
                "holds" if equal else "does not hold",
                "one gradient per parameter, same dtype (memwrap never changes parameter dtypes)" if equal else
                f"gradients take {m['grads'] / m['param_bytes']:.3f}x the parameters' bytes")


def params_100m(ctx):
    name = ctx.name("gpt2")
    e = ctx.est("gpt2", 1, 128)
    n = get_preset(name).params
    per100m = e.breakdown["parameters"] / n * 1e8
    full100m = (e.state["parameters"] + e.state["gradients"] + e.state["optimizer_state"]) / n * 1e8
    ok = _near(per100m / 1e6, 400)
    return _row(f"{name} ({n / 1e6:.1f}M parameters), fp32", f"{e.breakdown['parameters'] / n:.3f} bytes/param: 100M "
                f"parameters = {per100m / 1e6:.0f} MB ({gib(per100m)})", "holds" if ok else "does not hold",
                (f"{per100m / 1e6:.0f} MB in decimal units ({per100m / 2**20:.0f} MiB); weights only: with gradients "
                 f"and AdamW state a 100M model needs {full100m / 1e9:.1f} GB before any activation") if ok else
                f"{per100m / 1e6:.0f} MB, more than {100 * REL_TOL:.0f}% away from 400 MB",
                {"claimed": 400, "value": round(per100m / 1e6, 1), "unit": "MB"})


def optimizer_alternatives(ctx):
    from memwrap.plugin.state_size import predict_state_bytes

    name = ctx.name("gpt2")
    with torch.device("meta"):
        model = build_preset(name)
    n = sum(p.numel() for p in model.parameters())
    per = {o: predict_state_bytes(o, model) / n for o in ("adamw", "adamw_8bit", "adafactor")}
    # "much less" read as at most half of AdamW's state
    smaller = [o for o in ("adamw_8bit", "adafactor") if per[o] <= per["adamw"] / 2]
    kind = "holds" if len(smaller) == 2 else "holds only when" if smaller else "does not hold"
    return _row(f"{name} ({n / 1e6:.0f}M parameters), optimizer state predicted by the plugins (checked against real "
                "optimizers in tests/test_optimizers.py)",
                ", ".join(f"{k} {v:.2f}" for k, v in per.items()) + " bytes/param", kind,
                ("" if kind == "holds" else
                 f"at most half of AdamW's state only for {', '.join(smaller) or 'neither'}; ") +
                "8-bit Adam stores ~2 bytes/param, but bitsandbytes keeps 32-bit state for embeddings (here "
                f"{100 * (get_preset(name).config.vocab_size * get_preset(name).config.n_embd) / n:.0f}% of the "
                "parameters), hence the average; Adafactor's factored state is nearly free",
                {"adamw": per["adamw"], "adamw_8bit": per["adamw_8bit"], "adafactor": per["adafactor"]})


# ----------------------------------------------------------------------------- activations

def activations_proportional(ctx):
    base, b2, s2 = ctx.est("gpt2", 4, 512), ctx.est("gpt2", 8, 512), ctx.est("gpt2", 4, 1024)
    # the forward phase's growth, not the activations left at the step's peak: a small model peaks in
    # the optimizer step, after the activations are freed, and the ratio of two near-zero figures is noise
    act = forward_activations(base)
    rb, rs = forward_activations(b2) / act, forward_activations(s2) / act
    seq_doubled = ctx.seq("gpt2", 1024) == 2 * ctx.seq("gpt2", 512)
    if not seq_doubled:  # --fast: Ctx.seq uses one length, so only the batch is doubled
        rs = float("nan")
    linear_b, linear_s = abs(rb - 2) < 0.05, seq_doubled and abs(rs - 2) < 0.1
    kind = "holds" if linear_b and linear_s else "holds only when" if linear_b or linear_s else "does not hold"
    seq_text = f"x{rs:.2f} for 2x sequence" if seq_doubled else "sequence not doubled (--fast uses one length)"
    return _row(f"{ctx.where('gpt2', 4, 512)}; batch and sequence doubled",
                f"activations x{rb:.2f} for 2x batch, {seq_text}", kind,
                "linear in batch; linear in sequence length only while attention does not materialise the T x T "
                "score matrix (torch's scaled_dot_product_attention here; an eager attention grows as T^2)",
                {"batch_x2": rb, "seq_x2": rs})


def forward_activations(e) -> int:
    """Bytes the forward pass adds at its peak (saved activations + forward temporaries), accumulate=1.

    The step's peak may sit in the optimizer step, after activations are freed, so the forward
    phase's peak minus the persistent state is the fair measure of "activations".
    """
    return e.phases["forward"] - e.state["parameters"] - e.state["buffers"] - e.state["optimizer_state"]


def activations_3_5x(ctx):
    settings = [("gpt2", 1, 1024), ("gpt2", 8, 1024), ("bert-large", 8, 512), ("resnet50", 32, 224),
                ("llama-7b", 1, 512)]
    ratios = []
    for p, b, s in settings:
        e = ctx.est(p, b, s)
        ratios.append((ctx.where(p, b, s), forward_activations(e) / e.breakdown["parameters"]))
    lo, hi = min(r for _, r in ratios), max(r for _, r in ratios)
    # "3-5x", with REL_TOL either side
    inside = [w for w, r in ratios if 3 * (1 - REL_TOL) <= r <= 5 * (1 + REL_TOL)]
    kind = "holds" if len(inside) == len(ratios) else "holds only when" if inside else "does not hold"
    lo_preset = settings[min(range(len(ratios)), key=lambda i: ratios[i][1])][0]
    hi_preset = settings[max(range(len(ratios)), key=lambda i: ratios[i][1])][0]
    examples = (" (a 7B model at batch 1 holds far less than its weights; a ResNet at batch 32 holds far more)"
                if (ctx.name(lo_preset), ctx.name(hi_preset)) == ("llama-7b", "resnet50") and lo < 1 < 5 < hi else "")
    verdict = (f"not a property of the model: the ratio ranged from {lo:.2f}x to {hi:.1f}x with batch, sequence "
               f"length and architecture{examples}")
    if kind == "holds only when":
        verdict = f"the setting is one of: {'; '.join(inside)}. Otherwise it is " + verdict
    elif kind == "holds":
        verdict = f"every setting measured gave {lo:.2f}x to {hi:.1f}x"
    return _row("; ".join(w for w, _ in ratios), "forward-pass memory at its peak / parameter bytes: " +
                ", ".join(f"{r:.2f}x" for _, r in ratios), kind, verdict, {"min": lo, "max": hi})


def image_batch(ctx):
    # The claim's batch is 32 x 224 px whatever the mode; --fast traces smaller images (Ctx.seq), so the
    # traced figure is quoted only when the trace used the claim's side.
    b, side = 32, 224
    exact = b * 3 * side * side * 4
    traced = ctx.seq("resnet50", side) == side
    if traced:
        other = ctx.est("resnet50", b, side).breakdown["other"]
        with_labels = f"{other / 1e6:.1f} MB with the labels, traced"
        setting = f"{ctx.where('resnet50', b, side)}: the input batch (category 'other' of the trace: images + labels)"
    else:
        with_labels = "not traced: --fast traces smaller images"
        setting = f"resnet50, batch {b} x {side} px, fp32: the input batch (arithmetic)"
    conv1 = b * 64 * (side // 2) ** 2 * 4
    claimed = 150e6
    ok = _near(exact, claimed, 0.25)  # "about": 25% either side
    if ok:
        verdict = f"{b} x 3 x {side} x {side} x 4 bytes = {exact / 1e6:.1f} MB"
    else:
        factor = claimed / exact if exact < claimed else exact / claimed
        verdict = (f"{b} x 3 x {side} x {side} x 4 bytes = {exact / 1e6:.1f} MB, {factor:.1f}x "
                   f"{'less' if exact < claimed else 'more'} than claimed")
        if abs(conv1 - claimed) < abs(exact - claimed):
            verdict += (f"; 150 MB is closer to the first convolution's output ({conv1 / 1e6:.0f} MB), "
                        "an activation")
    return _row(setting, f"{exact / 1e6:.1f} MB of images ({with_labels})",
                "holds" if ok else "does not hold", verdict,
                {"claimed": 150, "value": round(exact / 1e6, 1), "unit": "MB"})


def memory_formula(ctx):
    e = ctx.est("gpt2", 4, 1024, accumulate=2)
    n = get_preset(ctx.name("gpt2")).params
    state = e.breakdown["parameters"] + e.breakdown["gradients"] + e.breakdown["optimizer_state"]
    weights_grads = e.breakdown["parameters"] + e.breakdown["gradients"]
    opt_per = e.breakdown["optimizer_state"] / n
    ok = _near(state / n, 8)
    as_large = ", as large as weights and gradients together" if _near(e.breakdown["optimizer_state"],
                                                                        weights_grads) else ""
    return _row(f"{ctx.where('gpt2', 4, 1024, accumulate=2)} (gradients alive at the peak)",
                f"weights + gradients + AdamW state = {state / n:.1f} bytes/param at the peak (formula: 8); "
                f"temporaries {gib(e.breakdown['temporaries'])} (logits and their gradient) not in the formula",
                "holds" if ok else "does not hold",
                f"it leaves out the optimizer state ({opt_per:.0f} bytes/param with AdamW{as_large}) and the backward "
                "temporaries; memwrap.estimate traces them all" if not ok else
                f"the persistent state is {state / n:.1f} bytes/param, within {100 * REL_TOL:.0f}% of 8",
                {"claimed": 8, "value": round(state / n, 2), "unit": "bytes per parameter"})


# ----------------------------------------------------------------------------- accumulation

def _accum(ctx, preset, batch, seq, n, **opts):
    plain = ctx.est(preset, batch, seq, **opts)
    acc = ctx.est(preset, batch // n, seq, accumulate=n, **opts)
    return plain, acc


def accum_resnet(ctx):
    parts, red = [], {}
    for n in (2, 4, 8):
        plain, acc = _accum(ctx, "resnet50", 32, 224, n)
        red[n] = _reduction(plain, acc)
        parts.append(f"x{n}: {change(red[n])}")
    first = next((n for n in (2, 4, 8) if red[n] >= 0.6), None)
    kind = "holds only when" if first else "does not hold"
    verdict = (f"accumulate >= {first} (global batch 32 split into micro-batches of {32 // first} or fewer): "
               "activations are most of this peak, and only they shrink" if first else "no split reached 60%")
    return _row(f"{ctx.where('resnet50', 32, 224)} vs the same global batch in 2, 4, 8 micro-batches",
                f"peak {gib(plain.peak)} plain; " + ", ".join(parts), kind, verdict,
                {"claimed": 60, "value": round(100 * red[4], 1), "unit": "% less peak memory (accumulate 4)"})


def accum_4gb_16gb(ctx):
    plain, acc = _accum(ctx, "gpt2", 16, 1024, 4)
    ratio = acc.peak / plain.peak
    ok = ratio <= 0.25 * (1 + REL_TOL)
    return _row(f"{ctx.where('gpt2', 16, 1024)} vs 4 micro-batches of 4", f"peak {gib(plain.peak)} -> {gib(acc.peak)}: "
                f"{ratio:.2f}x (the claim needs 0.25x)", "holds" if ok else "does not hold",
                f"the peak fell to {ratio:.2f}x, within {100 * REL_TOL:.0f}% of 0.25x" if ok else
                "accumulation divides only the activations by N; weights, gradients and optimizer state "
                f"({gib(acc.state['parameters'] + acc.state['gradients'] + acc.state['optimizer_state'])} here) stay, "
                "so 4 GB reaches a 16 GB job only if the model state is a small part of 4 GB",
                {"claimed": 75, "value": round(100 * (1 - ratio), 1), "unit": "% less peak memory (accumulate 4)"})


def accum_1_over_n(ctx):
    n_micro = 8
    plain, acc = _accum(ctx, "bert-large", 8, 512, n_micro)
    ratio = acc.peak / plain.peak
    ok = ratio <= (1 + REL_TOL) / n_micro
    return _row(f"{ctx.where('bert-large', 8, 512)} vs 8 micro-batches of 1", f"peak {gib(plain.peak)} -> "
                f"{gib(acc.peak)} = {ratio:.3f}x (1/N = {1 / n_micro:.3f})", "holds" if ok else "does not hold",
                f"the peak fell to within {100 * REL_TOL:.0f}% of 1/N" if ok else
                "only activations scale as 1/N; the peak also holds weights, gradients (alive across the window) "
                "and optimizer state", {"claimed": 87.5, "value": round(100 * (1 - ratio), 1),
                                        "unit": "% less peak memory (accumulate 8)"})


def amp_accum_halves(ctx):
    fp32 = ctx.est("resnet50", 8, 224, accumulate=4)
    bf16 = ctx.est("resnet50", 8, 224, accumulate=4, precision="bf16")
    r = 1 - bf16.peak / fp32.peak
    return _row(f"{ctx.where('resnet50', 8, 224, accumulate=4)}, fp32 vs bf16 autocast (fp16 saves the same bytes)",
                f"peak {gib(fp32.peak)} -> {gib(bf16.peak)}: {change(r)}", "does not hold" if r < 0.45 else "holds",
                "autocast halves the saved activations that run in 16 bits, but fp32 master weights, fp32 gradients "
                "and optimizer state stay; traced with CPU autocast (CUDA casts a similar op list; gpu_check.py "
                "measures it)", {"claimed": 50, "value": round(100 * r, 1), "unit": "% less peak memory (AMP)"})
