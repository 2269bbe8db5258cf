"""The estimate against the measured peak over a zoo of model families (issue 20 item 4).

Each family is built small from its Hugging Face config (or by hand: an LSTM language model, and a model with tied
weights and a custom ``autograd.Function``), and each of six configurations runs for real on CPU
(:func:`memwrap.measure_peak`: the CPU allocator's peak of live bytes, steady state) next to
:func:`memwrap.estimate` (fake tensors). A cell that cannot be estimated or run says why.

Configurations: fp32 AdamW; bf16 + checkpoint="auto"; accumulate=4; bf16-true + step in backward; 8-bit AdamW
(bitsandbytes); chunked loss (causal LMs only). The loop keeps the model's outputs through backward (the estimate's
default ``keep_outputs=True``; ``measure_peak`` runs the same loop).

Writes docs/benchmarks/zoo.json, zoo.md and zoo.png.

    python benchmarks/zoo.py                 # every family and configuration (about 10 minutes on 2 cores)
    python benchmarks/zoo.py --families gpt2,resnet --configs fp32,acc4
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import memwrap  # noqa: E402
from memwrap.memory import measure_peak  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks")
VOCAB, SEQ, BATCH = 1024, 64, 4

CONFIGS = {
    "fp32": {},
    "bf16+ckpt": {"precision": "bf16", "checkpoint": "auto"},
    "acc4": {"accumulate": 4},
    "bf16-true+sib": {"precision": "bf16-true", "step_in_backward": True},
    "adamw_8bit": {"optim": "adamw_8bit"},
    "chunked": {"chunked_loss": True},
}
TRANSFORMER = "transformer"  # the families the 1% target applies to


def _ids(b=BATCH, t=SEQ, vocab=VOCAB, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _lm_batch():
    ids = _ids()
    return {"input_ids": ids, "labels": ids}


def _small(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=SEQ * 2)
    base.update(kw)
    return base


def _hf(config_cls: str, model_cls: str, **kw):
    def build():
        import transformers

        torch.manual_seed(0)
        config = getattr(transformers, config_cls)(**kw)
        return getattr(transformers, model_cls)(config)
    return build


class LSTMLM(nn.Module):
    """An LSTM language model (oneDNN's RNN kernels on CPU)."""

    def __init__(self, vocab=VOCAB, dim=256, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        return self.head(self.lstm(self.embed(x))[0])


class _Swish(torch.autograd.Function):
    """x * sigmoid(x), saving only its input (its own backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


class TiedCustom(nn.Module):
    """Hand-written: an embedding tied to the output head, blocks through a custom autograd.Function."""

    def __init__(self, vocab=VOCAB, dim=128, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


class Block(nn.Module):
    """Pre-norm MLP block whose activation is the custom Function."""

    def __init__(self, dim):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.down(_Swish.apply(self.up(self.norm(x))))


def _resnet():
    import transformers

    torch.manual_seed(0)
    # ResNet-18's widths and depths (11M parameters): the size at which oneDNN's convolution scratch was measured.
    cfg = transformers.ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512], depths=[2, 2, 2, 2],
                                    layer_type="basic", num_labels=10)
    return transformers.ResNetForImageClassification(cfg)


def families() -> dict[str, tuple]:
    """name -> (kind, factory, batch factory, causal LM?)."""
    g = torch.Generator().manual_seed(0)
    img = torch.randn(BATCH, 3, 64, 64, generator=g)
    labels10 = torch.randint(0, 10, (BATCH,), generator=g)
    audio = torch.randn(BATCH, 80, 200, generator=g)
    enc_dec = lambda: {"input_ids": _ids(), "labels": _ids(seed=1)}  # noqa: E731
    lm = _lm_batch
    return {
        "gpt2": (TRANSFORMER, _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=SEQ * 2), lm, True),
        "llama": (TRANSFORMER, _hf("LlamaConfig", "LlamaForCausalLM", **_small()), lm, True),
        "mistral": (TRANSFORMER, _hf("MistralConfig", "MistralForCausalLM", **_small()), lm, True),
        "qwen2": (TRANSFORMER, _hf("Qwen2Config", "Qwen2ForCausalLM", **_small()), lm, True),
        "gemma2": (TRANSFORMER, _hf("Gemma2Config", "Gemma2ForCausalLM", **_small(head_dim=16)), lm, True),
        "phi": (TRANSFORMER, _hf("PhiConfig", "PhiForCausalLM", **_small()), lm, True),
        "bert": (TRANSFORMER, _hf("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=128, max_position_embeddings=SEQ * 2), lm,
                 False),
        "roberta": (TRANSFORMER, _hf("RobertaConfig", "RobertaForMaskedLM", vocab_size=VOCAB, hidden_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     max_position_embeddings=SEQ * 2 + 2), lm, False),
        "vit": (TRANSFORMER, _hf("ViTConfig", "ViTForImageClassification", image_size=64, patch_size=8, hidden_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=10),
                lambda: {"pixel_values": img, "labels": labels10}, False),
        "t5": (TRANSFORMER, _hf("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=64, d_kv=16,
                                d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0), enc_dec, False),
        "bart": (TRANSFORMER, _hf("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=64,
                                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                  decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                  max_position_embeddings=SEQ * 2), enc_dec, False),
        "whisper": ("audio", _hf("WhisperConfig", "WhisperForConditionalGeneration", vocab_size=VOCAB, d_model=64,
                                 encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                 decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=80,
                                 max_source_positions=100, max_target_positions=SEQ * 2, pad_token_id=1,
                                 bos_token_id=0, eos_token_id=2, decoder_start_token_id=0),
                    lambda: {"input_features": audio, "labels": _ids()}, False),
        "mixtral": ("moe", _hf("MixtralConfig", "MixtralForCausalLM", **_small(num_local_experts=4,
                                                                            num_experts_per_tok=2)), lm, True),
        "resnet": ("cnn", _resnet, lambda: {"pixel_values": img, "labels": labels10}, False),
        "lstm": ("rnn", lambda: (torch.manual_seed(0), LSTMLM())[1], lambda: (_ids(), _ids(seed=1)), False),
        "tied-custom": ("hand-written", lambda: (torch.manual_seed(0), TiedCustom())[1],
                        lambda: (_ids(), _ids(seed=1)), False),
    }


def cell(name: str, family: tuple, config: str, device: str | torch.device | None = None) -> dict:
    """One cell: the estimate (fake trace) next to the measured peak of real steps on ``device`` (default CPU;
    benchmarks/gpu_check.py's ``zoo_cuda`` row measures on CUDA, where cuDNN's workspaces are what the trace misses)."""
    kind, factory, batch, causal = family
    options = dict(CONFIGS[config])
    row = {"family": name, "kind": kind, "config": config, "options": {k: str(v) for k, v in options.items()}}
    if config == "chunked" and not causal:
        return {**row, "status": "n/a", "why": "chunked loss applies to causal language models"}
    try:
        t0 = time.perf_counter()
        # Workspaces measured where the cell runs (a GPU: cuDNN's convolutions), the trace itself on the CPU.
        where = torch.device(device).type if device is not None else None
        est = memwrap.estimate(factory, batch(), workspace=where, **options)
        t1 = time.perf_counter()
    except ValueError as exc:  # the option is refused for this model (wrap() would refuse it the same way)
        return {**row, "status": "refused", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    except Exception as exc:  # noqa: BLE001 - a cell records why it could not be estimated
        return {**row, "status": "not estimated", "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    try:
        got = measure_peak(factory, batch(), device=device, **options)["peak"]
    except Exception as exc:  # noqa: BLE001 - a cell records why it could not run
        return {**row, "status": "not run", "predicted": est.peak, "why": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {**row, "status": "ok", "predicted": est.peak, "measured": got, "error": (est.peak - got) / got,
            "phase": est.peak_phase, "estimate_s": t1 - t0, "method": est.method}


def table(rows: list[dict]) -> str:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    lines = ["| family | kind | " + " | ".join(configs) + " |", "|---|---|" + "---:|" * len(configs)]
    for fam in dict.fromkeys(r["family"] for r in rows):
        cells = {r["config"]: r for r in rows if r["family"] == fam}
        kind = next(iter(cells.values()))["kind"]
        out = []
        for c in configs:
            r = cells.get(c)
            if r is None:
                out.append("")
            elif r["status"] == "ok":
                mark = "" if abs(r["error"]) <= (0.01 if kind == TRANSFORMER else 0.05) else " **x**"
                out.append(f"{r['error']:+.1%}{mark}")
            else:
                out.append(r["status"])
        lines.append(f"| {fam} | {kind} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def markdown(meta: dict, rows: list[dict]) -> str:
    ok = [r for r in rows if r["status"] == "ok"]
    within = sum(abs(r["error"]) <= 0.05 for r in ok)
    off = [r for r in rows if r["status"] not in ("ok", "n/a")]
    md = ["# The estimate over a zoo of model families (CPU)", "",
          f"`{meta['command'].strip()}` on {meta['cpus']} CPUs, torch {meta['torch']}, {meta['date']}. Each cell: "
          "(predicted - measured) / measured peak, the measurement being the CPU allocator's peak of live bytes in "
          "a steady-state update (`memwrap.measure_peak`), the loop keeping the model's outputs through backward. "
          "**x**: outside the target (1% for the transformer families, 5% for the others). n/a: the chunked loss "
          "on a model that is not a causal LM.", "",
          table(rows), "",
          f"{within} of {len(ok)} measured cells within 5%; {len(off)} cells refused or failed (below).", ""]
    md += [f"- {r['family']} / {r['config']}: {r['status']}: {r.get('why', '')}" for r in off]
    return "\n".join(md) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok"]
    fams = list(dict.fromkeys(r["family"] for r in rows))
    configs = list(CONFIGS)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(configs)
    for j, c in enumerate(configs):
        xs = [fams.index(r["family"]) + j * width for r in ok if r["config"] == c]
        ys = [100 * r["error"] for r in ok if r["config"] == c]
        ax.bar(xs, ys, width, label=c)
    ax.axhspan(-5, 5, color="green", alpha=0.08)
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xticks([i + 0.4 for i in range(len(fams))], fams, rotation=45, ha="right")
    ax.set_ylabel("predicted vs measured peak (%)")
    ax.set_title("memwrap.estimate vs the CPU allocator's measured peak (green: within 5%)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=None, help="comma-separated subset of the families")
    ap.add_argument("--configs", default=None, help=f"comma-separated subset of {', '.join(CONFIGS)}")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    fams = families()
    chosen = args.families.split(",") if args.families else list(fams)
    configs = args.configs.split(",") if args.configs else list(CONFIGS)
    unknown = [f for f in chosen if f not in fams] + [c for c in configs if c not in CONFIGS]
    if unknown:
        ap.error(f"unknown: {', '.join(unknown)} (families: {', '.join(fams)}; configs: {', '.join(CONFIGS)})")
    rows = []
    for name in chosen:
        for config in configs:
            try:
                row = cell(name, fams[name], config)
            except Exception:  # noqa: BLE001 - a broken family must not end the benchmark
                row = {"family": name, "kind": fams[name][0], "config": config, "status": "failed",
                       "why": traceback.format_exc(limit=2)[-300:]}
            rows.append(row)
            shown = (f"{row['error']:+7.2%}  predicted {row['predicted'] / 2**20:7.2f} MiB  measured "
                     f"{row['measured'] / 2**20:7.2f} MiB" if row["status"] == "ok" else f"{row['status']}: "
                     f"{row.get('why', '')[:120]}")
            print(f"{name:<12} {config:<14} {shown}", flush=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "cpus": os.cpu_count(), "device": "cpu",
            "command": "python benchmarks/zoo.py " + " ".join(sys.argv[1:])}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "zoo.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "zoo.md"), "w") as f:
        f.write(markdown(meta, rows))
    plot(rows, os.path.join(args.out, "zoo.png"))
    ok = [r for r in rows if r["status"] == "ok"]
    print(f"\n{sum(abs(r['error']) <= 0.05 for r in ok)}/{len(ok)} cells within 5%; wrote {args.out}/zoo.{{json,md,png}}")


if __name__ == "__main__":
    main()
