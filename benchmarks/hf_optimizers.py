"""Optimizer state of every Hugging Face ``optim=`` name, measured after one real training step.

Model: a GPT-2-style model from ``memwrap.models`` (default 2 layers, width 256, GPT-2 vocabulary: the
tied token embedding is most of the parameters). Each optimizer is built by memwrap with Trainer's
hyperparameters (GaLore/APOLLO: ``target_modules="all-linear"``, ``rank=32``), takes one forward,
backward and step on a fixed batch, and its state is measured (unique storages of
``optimizer.state``) and compared with the planner's ``predict_state_bytes``. Names whose hardware or
GPU kernel is absent are listed as such. Only memory is reported: the CPU step times of these
libraries say nothing about their GPU speed.

Run:  python benchmarks/hf_optimizers.py [--layers 2] [--width 256] [--names galore_adamw ...]
Writes docs/benchmarks/hf_optimizers.json and prints the table used in docs/optimizers.md.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from memwrap.integrations.transformers.trainer import trainer_hyperparameters
from memwrap.models import build_preset
from memwrap.plugin.registry import create_optimizer, get_optimizer_spec
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
NAMES = (
    "adamw_torch adamw_torch_fused adamw_torch_xla adamw_torch_npu_fused adafactor adamw_anyprecision adamw_torch_4bit "
    "adamw_torch_8bit ademamix sgd adagrad adamw_bnb_8bit adamw_8bit ademamix_8bit lion_8bit lion_32bit "
    "paged_adamw_32bit paged_adamw_8bit paged_ademamix_32bit paged_ademamix_8bit paged_lion_32bit paged_lion_8bit "
    "rmsprop rmsprop_bnb rmsprop_bnb_8bit rmsprop_bnb_32bit galore_adamw galore_adamw_8bit galore_adafactor "
    "galore_adamw_layerwise galore_adamw_8bit_layerwise galore_adafactor_layerwise lomo adalomo grokadamw "
    "schedule_free_radam schedule_free_adamw schedule_free_sgd apollo_adamw apollo_adamw_layerwise stable_adamw"
).split()


def training_args(name: str) -> SimpleNamespace:
    """TrainingArguments' defaults for the fields Trainer's optimizer handlers read (duck-typed)."""
    low_rank = name.startswith(("galore", "apollo"))
    return SimpleNamespace(optim=name, learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                           weight_decay=0.0, warmup_steps=0, gradient_accumulation_steps=1,
                           optim_args="rank=32" if low_rank else None,
                           optim_target_modules="all-linear" if low_rank else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--names", nargs="*", default=NAMES)
    args = parser.parse_args()
    ids = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(0))
    meta = {"torch": torch.__version__, "python": platform.python_version(), "layers": args.layers,
            "width": args.width, "vocab": 50257, "batch": list(ids.shape)}
    path = OUT / "hf_optimizers.json"
    rows = {}
    if path.is_file():  # a rerun of some names replaces their rows and keeps the others
        old = json.loads(path.read_text())
        if old["meta"] == meta:
            rows = {r["name"]: r for r in old["rows"]}
    for name in args.names:
        torch.manual_seed(0)
        model = build_preset("gpt2", n_layer=args.layers, n_embd=args.width, n_head=4, block_size=64)
        n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        spec = get_optimizer_spec(name)
        row = {"name": name, "spec": spec.name, "params": n_params}
        try:
            hp = trainer_hyperparameters(training_args(name))
            predicted = predict_state_bytes(name, model, **hp)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = create_optimizer(name, model, **hp)
                start = time.perf_counter()
                logits = model(ids[:, :-1])
                F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
                opt.step()
                opt.zero_grad()
                row["seconds"] = time.perf_counter() - start
            measured = measure_state_bytes(opt)
            row.update(measured=measured, predicted=predicted, bytes_per_param=measured / n_params)
        except Exception as exc:  # hardware or GPU-only kernel absent: recorded, not hidden
            row["unavailable"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows[name] = row
        print(_line(row), flush=True)
        OUT.mkdir(parents=True, exist_ok=True)  # after every row: a run cut short keeps what it measured
        ordered = [rows[n] for n in NAMES if n in rows]
        path.write_text(json.dumps({"meta": meta, "rows": ordered}, indent=1))


def _line(row: dict) -> str:
    if "unavailable" in row:
        return f"| `{row['name']}` | - | - | not run here: {row['unavailable']} |"
    error = (row["predicted"] - row["measured"]) / max(row["measured"], 1)
    return (f"| `{row['name']}` | {row['measured'] / 2**20:.2f} MiB | {row['bytes_per_param']:.3f} | "
            f"predicted {row['predicted'] / 2**20:.2f} MiB ({error:+.1%}) |")


if __name__ == "__main__":
    main()
