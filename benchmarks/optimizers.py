"""Optimizer state bytes per parameter and CPU step time for every built-in optimizer.

Model: a GPT-2-style model from ``memwrap.models`` (default 4 layers, width 512, GPT-2 vocabulary:
about 38M parameters, 2/3 of them in the tied token embedding). One fixed random gradient; each
repetition times one ``optimizer.step()`` of every optimizer, in a rotating order (interleaved,
so machine load drifts hit all optimizers alike); the median is reported. AdamW runs twice: with
torch's fused CPU kernel (memwrap's default) and with the ``foreach`` kernel (torch's default).

Run:  python benchmarks/optimizers.py [--reps 7] [--layers 4] [--width 512]
Writes docs/benchmarks/optimizers.json and docs/benchmarks/optimizers.png.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

import memwrap
from memwrap.models import build_preset
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
VARIANTS = {  # label -> (registered name, hyperparameters)
    "adamw (fused)": ("adamw", {}),
    "adamw (foreach)": ("adamw", {"foreach": True}),
    "adamw_8bit": ("adamw_8bit", {}),
    "paged_adamw_8bit": ("paged_adamw_8bit", {}),
    "lion_8bit": ("lion_8bit", {}),
    "torch_adafactor": ("torch_adafactor", {}),  # the rows in docs/optimizers.md were measured with torch's
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = build_preset("gpt2", n_layer=args.layers, n_embd=args.width, n_head=8, block_size=256)
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dense = [p for p in params if id(p) not in embedding_ids]  # 8-bit optimizers quantize only these
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3

    optimizers, rows = {}, {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers warn that CPU has no paging
        for label, (name, hp) in VARIANTS.items():
            opt = memwrap.create_optimizer(name, model, **hp)
            opt.step()  # creates the state; not timed
            measured = measure_state_bytes(opt)
            rows[label] = {"optimizer": name, "hyperparameters": hp, "state_bytes": measured,
                           "state_bytes_predicted": predict_state_bytes(name, model, **hp),
                           "state_bytes_per_param": measured / n_params,
                           "state_bytes_per_non_embedding_param":
                               predict_state_bytes(name, dense, **hp) / sum(p.numel() for p in dense),
                           "times_s": []}
            optimizers[label] = opt

        labels = list(VARIANTS)
        for rep in range(args.reps):
            order = labels[rep % len(labels):] + labels[:rep % len(labels)]
            for label in order:
                start = time.perf_counter()
                optimizers[label].step()
                rows[label]["times_s"].append(time.perf_counter() - start)
    for row in rows.values():
        row["step_s_median"] = statistics.median(row["times_s"])
    fused, foreach = rows["adamw (fused)"]["step_s_median"], rows["adamw (foreach)"]["step_s_median"]

    print(f"model: {n_params / 1e6:.1f}M parameters ({(n_params - sum(p.numel() for p in dense)) / 1e6:.1f}M in embeddings); {args.reps} interleaved repetitions, median; "
          f"{torch.get_num_threads()} CPU threads; torch {torch.__version__}")
    print(f"{'optimizer':<18} {'state MB':>9} {'bytes/param':>12} {'non-emb b/p':>12} {'predicted':>10} {'step ms':>9} {'min-max ms':>13}")
    for label, row in rows.items():
        print(f"{label:<18} {row['state_bytes'] / 1e6:>9.1f} {row['state_bytes_per_param']:>12.3f} "
              f"{row['state_bytes_per_non_embedding_param']:>12.3f} "
              f"{'exact' if row['state_bytes'] == row['state_bytes_predicted'] else row['state_bytes_predicted']:>10} "
              f"{row['step_s_median'] * 1e3:>9.1f} {min(row['times_s']) * 1e3:>6.0f}-{max(row['times_s']) * 1e3:<6.0f}")
    print(f"fused AdamW is {foreach / fused:.2f}x faster than foreach AdamW on this CPU")

    OUT.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "optimizers", "parameters": n_params, "reps": args.reps,
              "model": f"gpt2 preset, n_layer={args.layers}, n_embd={args.width}",
              "threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
              "fused_over_foreach_speedup": foreach / fused, "rows": rows}
    (OUT / "optimizers.json").write_text(json.dumps(result, indent=2))
    _plot(rows, n_params)
    print(f"wrote {OUT / 'optimizers.json'} and {OUT / 'optimizers.png'}")


def _plot(rows: dict, n_params: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    y = range(len(labels))
    left.barh([i - 0.2 for i in y], [rows[k]["state_bytes_per_param"] for k in labels], height=0.4,
              color="tab:blue", label="whole model")
    left.barh([i + 0.2 for i in y], [rows[k]["state_bytes_per_non_embedding_param"] for k in labels], height=0.4,
              color="tab:cyan", label="non-embedding weights")
    left.set_yticks(list(y), labels)
    left.legend(loc="lower right", fontsize=8)
    left.set_xlabel("optimizer state, bytes per parameter")
    right.barh(list(y), [rows[k]["step_s_median"] * 1e3 for k in labels], color="tab:orange")
    right.set_yticks(list(y))
    right.set_xlabel("step time on CPU, ms (median)")
    right.set_yticklabels([])
    for ax in (left, right):
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"Built-in optimizers, {n_params / 1e6:.1f}M-parameter GPT (embeddings keep 32-bit state in 8-bit optimizers)")
    fig.tight_layout()
    fig.savefig(OUT / "optimizers.png", dpi=120)


if __name__ == "__main__":
    main()
