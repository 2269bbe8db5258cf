"""Seed claims about bytes: per parameter, activations, accumulation (memory and maths)."""
from __future__ import annotations

import functools

import torch

import memwrap
from memwrap.models import build_preset, get_preset, lm_loss, preset_batch

from claims_common import _reduction, _row, change, gib


# ----------------------------------------------------------------------------- bytes per parameter

def survey(ctx):
    return _row("none: a survey percentage without a source", "nothing to measure", "not measurable here",
                "a statistic about developers, not about memory or speed; no source is given")


def bert_large_weights(ctx):
    e = ctx.est("bert-large", 1, 128)
    n = get_preset(ctx.name("bert-large")).params
    b = e.breakdown["parameters"]
    ok = abs(b / 1.3e9 - 1) < 0.1
    return _row(f"{ctx.name('bert-large')} ({n / 1e6:.0f}M parameters, the real bert-large-uncased + 2-way head), fp32",
                f"{b / 1e9:.3f} GB ({gib(b)}) of parameters", "holds" if ok else "does not hold",
                "4 bytes x 335M parameters; nvidia-smi shows more (CUDA context, 0.3-0.6 GiB, and the caching "
                "allocator), which is not tensor memory", {"claimed": 1.3, "value": round(b / 1e9, 3), "unit": "GB"})


@functools.lru_cache(maxsize=None)
def _tiny_step_bytes() -> dict:
    torch.manual_seed(0)
    model = build_preset("gpt2-tiny")
    n = sum(p.numel() for p in model.parameters())
    opt = memwrap.create_optimizer("adamw", model, lr=1e-3)
    x, y = preset_batch("gpt2-tiny", 2, 16)
    lm_loss(model(x), y).backward()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    opt.step()
    from memwrap.registry import measure_state_bytes

    state = measure_state_bytes(opt)
    lin = torch.nn.Linear(256, 256, bias=False).to(torch.bfloat16)
    o16 = torch.optim.AdamW(lin.parameters())
    lin(torch.randn(4, 256, dtype=torch.bfloat16)).sum().backward()
    o16.step()
    state16 = measure_state_bytes(o16) - 4  # minus the step counter
    return {"n": n, "grads": grads, "state": state, "bf16_state_per_param": state16 / lin.weight.numel()}


def adamw_bytes(ctx):
    m = _tiny_step_bytes()
    per = m["state"] / m["n"]
    return _row("gpt2-tiny (4.27M parameters) after one real AdamW step (torch, fused), CPU; and a bf16 Linear",
                f"{per:.4f} bytes/param of AdamW state (fp32 parameters); {m['bf16_state_per_param']:.1f} bytes/param "
                "for bf16 parameters", "holds only when",
                "the parameters are fp32 (the usual case, also under AMP): two moments of 4 bytes each. torch keeps "
                "the moments in the parameter's dtype, so bf16 parameters need 4 bytes/param; 8-bit Adam about 2",
                {"claimed": 8, "value": round(per, 4), "unit": "bytes per parameter"})


def grad_bytes(ctx):
    m = _tiny_step_bytes()
    per = m["grads"] / m["n"]
    return _row("gpt2-tiny, one real backward, CPU", f"{per:.4f} bytes/param of gradients", "holds",
                "gradients take the parameter's dtype: 4 bytes for fp32 parameters, also under bf16/fp16 autocast, "
                "where the master weights stay fp32", {"claimed": 4, "value": round(per, 4), "unit": "bytes per parameter"})


def grads_equal_params(ctx):
    m = _tiny_step_bytes()
    return _row("gpt2-tiny, one real backward, CPU", f"gradients {m['grads']:,} B = parameters {4 * m['n']:,} B",
                "holds", "one gradient per parameter, same dtype (memwrap never changes parameter dtypes)")


def params_100m(ctx):
    name = ctx.name("gpt2")
    e = ctx.est("gpt2", 1, 128)
    n = get_preset(name).params
    per100m = e.breakdown["parameters"] / n * 1e8
    return _row(f"{name} ({n / 1e6:.1f}M parameters), fp32", f"{e.breakdown['parameters'] / n:.3f} bytes/param: 100M "
                f"parameters = {per100m / 1e6:.0f} MB ({gib(per100m)})", "holds",
                "400 MB in decimal units (381 MiB); weights only: with gradients and AdamW state a 100M model "
                "needs 1.6 GB before any activation", {"claimed": 400, "value": round(per100m / 1e6, 1), "unit": "MB"})


def optimizer_alternatives(ctx):
    from memwrap.registry import predict_state_bytes

    name = ctx.name("gpt2")
    with torch.device("meta"):
        model = build_preset(name)
    n = sum(p.numel() for p in model.parameters())
    per = {o: predict_state_bytes(o, model) / n for o in ("adamw", "adamw_8bit", "adafactor")}
    return _row(f"{name} ({n / 1e6:.0f}M parameters), optimizer state predicted by the plugins (checked against real "
                "optimizers in tests/test_optimizers.py)",
                ", ".join(f"{k} {v:.2f}" for k, v in per.items()) + " bytes/param", "holds",
                "8-bit Adam stores ~2 bytes/param, but bitsandbytes keeps 32-bit state for embeddings (here "
                f"{100 * (get_preset(name).config.vocab_size * get_preset(name).config.n_embd) / n:.0f}% of the "
                "parameters), hence the average; Adafactor's factored state is nearly free",
                {"adamw": per["adamw"], "adamw_8bit": per["adamw_8bit"], "adafactor": per["adafactor"]})


# ----------------------------------------------------------------------------- activations

def activations_proportional(ctx):
    base, b2, s2 = ctx.est("gpt2", 4, 512), ctx.est("gpt2", 8, 512), ctx.est("gpt2", 4, 1024)
    rb = b2.breakdown["activations"] / base.breakdown["activations"]
    rs = s2.breakdown["activations"] / base.breakdown["activations"]
    kind = "holds" if abs(rb - 2) < 0.05 and abs(rs - 2) < 0.1 else "holds only when"
    return _row(f"{ctx.where('gpt2', 4, 512)}; batch and sequence doubled",
                f"activations x{rb:.2f} for 2x batch, x{rs:.2f} for 2x sequence", kind,
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
    return _row("; ".join(w for w, _ in ratios), "forward-pass memory at its peak / parameter bytes: " +
                ", ".join(f"{r:.2f}x" for _, r in ratios), "does not hold",
                f"not a property of the model: the ratio ranged from {lo:.2f}x to {hi:.1f}x with batch, sequence "
                "length and architecture (a 7B model at batch 1 holds far less than its weights; a ResNet at "
                "batch 32 holds far more)", {"min": lo, "max": hi})


def image_batch(ctx):
    b, side = 32, 224
    exact = b * 3 * side * side * 4
    e = ctx.est("resnet50", b, side)
    other = e.breakdown["other"]
    conv1 = b * 64 * (side // 2) ** 2 * 4
    return _row(f"{ctx.where('resnet50', b, side)}: the input batch (category 'other' of the trace: images + labels)",
                f"{exact / 1e6:.1f} MB of images ({other / 1e6:.1f} MB with the labels, traced)", "does not hold",
                f"32 x 3 x 224 x 224 x 4 bytes = {exact / 1e6:.1f} MB, 7.8x less than claimed; 150 MB is closer to "
                f"the first convolution's output ({conv1 / 1e6:.0f} MB), an activation",
                {"claimed": 150, "value": round(exact / 1e6, 1), "unit": "MB"})


def memory_formula(ctx):
    e = ctx.est("gpt2", 4, 1024, accumulate=2)
    n = get_preset(ctx.name("gpt2")).params
    state = e.breakdown["parameters"] + e.breakdown["gradients"] + e.breakdown["optimizer_state"]
    return _row(f"{ctx.where('gpt2', 4, 1024, accumulate=2)} (gradients alive at the peak)",
                f"weights + gradients + AdamW state = {state / n:.1f} bytes/param at the peak (formula: 8); "
                f"temporaries {gib(e.breakdown['temporaries'])} (logits and their gradient) not in the formula",
                "does not hold", "it leaves out the optimizer state (8 bytes/param with AdamW, as large as weights "
                "and gradients together) and the backward temporaries; memwrap.estimate traces them all",
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
    return _row(f"{ctx.where('gpt2', 16, 1024)} vs 4 micro-batches of 4", f"peak {gib(plain.peak)} -> {gib(acc.peak)}: "
                f"{ratio:.2f}x (the claim needs 0.25x)", "does not hold",
                "accumulation divides only the activations by N; weights, gradients and optimizer state "
                f"({gib(acc.state['parameters'] + acc.state['gradients'] + acc.state['optimizer_state'])} here) stay, "
                "so 4 GB reaches a 16 GB job only if the model state is a small part of 4 GB",
                {"claimed": 75, "value": round(100 * (1 - ratio), 1), "unit": "% less peak memory (accumulate 4)"})


def accum_1_over_n(ctx):
    plain, acc = _accum(ctx, "bert-large", 8, 512, 8)
    ratio = acc.peak / plain.peak
    return _row(f"{ctx.where('bert-large', 8, 512)} vs 8 micro-batches of 1", f"peak {gib(plain.peak)} -> "
                f"{gib(acc.peak)} = {ratio:.3f}x (1/N = {1 / 8:.3f})", "does not hold",
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


def accum_equivalence(ctx):
    torch.manual_seed(0)
    ref = build_preset("gpt2-tiny", n_layer=1)
    x, y = preset_batch("gpt2-tiny", 8, 16)
    y_pad = y.clone()
    for i, keep in enumerate((16, 4, 16, 8, 16, 12, 2, 16)):  # variable valid lengths, -100 = padding
        y_pad[i, keep:] = -100
    out = {}
    for label, targets in (("equal", y), ("padded", y_pad)):
        big = build_preset("gpt2-tiny", n_layer=1)
        big.load_state_dict(ref.state_dict())
        lm_loss(big(x), targets).backward()
        g_ref = torch.cat([p.grad.flatten() for p in big.parameters()])
        naive = build_preset("gpt2-tiny", n_layer=1)
        naive.load_state_dict(ref.state_dict())
        for i in range(4):
            (lm_loss(naive(x[2 * i:2 * i + 2]), targets[2 * i:2 * i + 2]) / 4).backward()
        g_naive = torch.cat([p.grad.flatten() for p in naive.parameters()])
        m = build_preset("gpt2-tiny", n_layer=1)
        m.load_state_dict(ref.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=0.0)
        loader = [(x[2 * i:2 * i + 2], targets[2 * i:2 * i + 2]) for i in range(4)]
        wm, wo, wl = memwrap.wrap(m, opt, loader, accumulate=4, count_items=lambda b: int((b[1] != -100).sum()))
        for i, (xb, yb) in enumerate(wl):
            lm_loss(wm(xb), yb).backward()
            if i < 3:
                wo.step()
        g_mw = torch.cat([p.grad.flatten() for p in m.parameters()])
        rel = lambda g: float((g - g_ref).norm() / g_ref.norm())  # noqa: E731
        out[label] = (rel(g_naive), rel(g_mw))
    return _row("gpt2-tiny (1 layer), real CPU run: batch 8 x 16 vs 4 micro-batches of 2 (loss/4 as in the post, and "
                "memwrap with count_items); then the same with padded targets of unequal lengths",
                f"relative gradient error, equal lengths: loss/N {out['equal'][0]:.1e}, memwrap {out['equal'][1]:.1e}; "
                f"padded: loss/N {out['padded'][0]:.1e}, memwrap {out['padded'][1]:.1e}", "holds only when",
                "every micro-batch's loss averages the same number of items. With padding or variable lengths, "
                "dividing by N weights tokens unequally; memwrap's count_items weights each micro-batch by its "
                "share of the window's items and matches the big batch", {"equal": out["equal"], "padded": out["padded"]})


def lr_scaling(ctx):
    torch.manual_seed(0)
    ref = build_preset("gpt2-tiny", n_layer=1)
    x, y = preset_batch("gpt2-tiny", 8, 16)

    def update(accumulate: int, lr: float) -> torch.Tensor:
        m = build_preset("gpt2-tiny", n_layer=1)
        m.load_state_dict(ref.state_dict())
        before = torch.cat([p.detach().flatten().clone() for p in m.parameters()])
        opt = torch.optim.AdamW(m.parameters(), lr=lr)
        wm, wo = memwrap.wrap(m, opt, accumulate=accumulate)
        mb = 8 // accumulate
        for i in range(accumulate):
            lm_loss(wm(x[i * mb:(i + 1) * mb]), y[i * mb:(i + 1) * mb]).backward()
            wo.step()
            wo.zero_grad()
        return torch.cat([p.detach().flatten() for p in m.parameters()]) - before

    big, acc, scaled = update(1, 1e-3), update(4, 1e-3), update(4, 4e-3)
    same = float((acc - big).norm() / big.norm())
    ratio = float(scaled.norm() / big.norm())
    return _row("gpt2-tiny (1 layer), one AdamW update: batch 8 (lr 1e-3) vs 4 micro-batches of 2 with lr 1e-3 and "
                "with lr 4e-3 (the post's base_lr * accum_steps)",
                f"same lr: same update up to float rounding ({same:.1e} relative; Adam's g/sqrt(v) amplifies "
                f"rounding on near-zero gradients); lr x4: update {ratio:.2f}x larger",
                "holds only when", "the global batch really grew beyond the one the lr was tuned for. When "
                "accumulation replaces a batch that did not fit, the update is already the big batch's: keep the "
                "lr (x N makes each update N times larger here). For Adam, square-root scaling is the usual "
                "rule; linear scaling is SGD's", {"same_lr_rel_diff": same, "scaled_ratio": ratio})


def batchnorm(ctx):
    torch.manual_seed(0)
    x = torch.randn(32, 16) * torch.linspace(0.5, 3, 16) + torch.linspace(-2, 2, 16)
    bn, gn = torch.nn.BatchNorm1d(16).train(), torch.nn.GroupNorm(4, 16)
    with torch.no_grad():
        full = bn(x)
        micro = torch.cat([bn(x[i:i + 8]) for i in range(0, 32, 8)])
        g_full, g_micro = gn(x), torch.cat([gn(x[i:i + 8]) for i in range(0, 32, 8)])
    d_bn, d_gn = float((full - micro).abs().max()), float((g_full - g_micro).abs().max())
    return _row("BatchNorm1d and GroupNorm, batch 32 vs 4 micro-batches of 8, real CPU tensors",
                f"max output difference: BatchNorm {d_bn:.3f}, GroupNorm {d_gn:.1e}", "holds",
                "BatchNorm normalises with the micro-batch's statistics (memwrap warns when wrap() sees BatchNorm "
                "with accumulate > 1). GroupNorm fixes it (per sample); SyncBatchNorm does not: it syncs statistics "
                "across processes, not across the micro-batches of one process", {"bn": d_bn, "gn": d_gn})
