"""True bf16 at a fine-tuning learning rate: fp32 master weights vs bf16 weights, uncompensated and compensated.

A small GPT (memwrap.models, byte vocabulary) is first trained briefly in fp32 on memwrap's demo
corpus (the "pretrained" model). From that same checkpoint, each mode then fine-tunes for
``--updates`` AdamW updates at a fine-tuning learning rate (default 2e-5) on the same batches:

* ``bf16 (fp32 weights)``: the reference: fp32 weights and AdamW, forward under bf16 autocast;
* ``bf16-true, none``: weights, gradients and AdamW state in bf16, updates not compensated;
* ``bf16-true, kahan``: the same, AdamW converted to torch-optimi's AdamW with Kahan summation;
* ``bf16-true, stochastic``: torchao's AdamW with bf16 stochastic rounding (when torchao runs here).

Reported per mode: the training-loss curve, the final loss (mean of the last 10% of updates) on the
training stream and on held-out text, its gap to the reference, and how far the weights moved
from the checkpoint relative to the reference's movement (``||w - w0|| / ||w_ref - w0||``; 0 means
every update was rounded away) and in which direction (cosine with the reference's movement).

Run:  python benchmarks/bf16_true.py [--updates 300] [--lr 2e-5]   (about 3 minutes on 2 CPU cores)
Writes docs/benchmarks/bf16_true.json, .png and .md.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import memwrap
from memwrap.demo.corpus import corpus_tokens
from memwrap.models import build_preset

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
MODES = {  # label -> wrap options
    "bf16 (fp32 weights)": {"precision": "bf16"},
    "bf16-true, none": {"precision": "bf16-true", "compensation": "none"},
    "bf16-true, kahan": {"precision": "bf16-true", "compensation": "kahan"},
    "bf16-true, stochastic": {"precision": "bf16-true", "compensation": "stochastic"},
}


def batches(tokens: torch.Tensor, n: int, batch: int, seq: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        starts = torch.randint(0, len(tokens) - seq - 1, (batch,), generator=g)
        x = torch.stack([tokens[s:s + seq] for s in starts])
        y = torch.stack([tokens[s + 1:s + seq + 1] for s in starts])
        out.append((x, y))
    return out


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


@torch.no_grad()
def evaluate(model, data) -> float:
    return sum(lm_loss(model(x), y).item() for x, y in data) / len(data)


def pretrain(args, train) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_preset("gpt2-tiny", vocab_size=256, n_layer=args.layers, n_embd=args.width, n_head=4,
                         block_size=args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, weight_decay=0.0)
    for x, y in train:
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model


def fine_tune(label, options, base, train, held_out) -> dict:
    model = copy.deepcopy(base)
    w0 = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=ARGS.lr, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the conversion notice, torchao's import messages
        wmodel, wopt = memwrap.wrap(model, opt, **options)
    start = time.perf_counter()
    losses = []
    for x, y in train:
        loss = lm_loss(wmodel(x), y)
        losses.append(loss.item())
        loss.backward()
        wopt.step()
        wopt.zero_grad()
    seconds = time.perf_counter() - start
    wmodel.eval()
    held = evaluate(wmodel, held_out)
    delta = torch.cat([(p.detach().float() - a).flatten() for p, a in zip(model.parameters(), w0)])
    return {"label": label, "options": options, "losses": losses, "held_out_loss": held, "seconds": seconds,
            "optimizer": type(memwrap.unwrap(wopt)).__module__.split(".")[0] + "." + type(memwrap.unwrap(wopt)).__name__,
            "delta": delta}


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--replot", action="store_true", help="redraw the PNG and Markdown from the JSON, no training")
    ARGS = args = parser.parse_args()
    if args.replot:
        saved = json.loads((OUT / "bf16_true.json").read_text())
        _plot(saved["rows"], argparse.Namespace(**{**vars(args), "lr": saved["setting"]["lr"],
                                                   "updates": saved["setting"]["updates"]}))
        _markdown(saved["rows"], saved["setting"], max(1, saved["setting"]["updates"] // 10))
        return
    torch.set_num_threads(args.threads)
    tokens = corpus_tokens()
    cut = int(0.9 * len(tokens))
    train_tokens, held_tokens = tokens[:cut], tokens[cut:]
    base = pretrain(args, batches(train_tokens, args.pretrain_steps, args.batch, args.seq, seed=1))
    stream = batches(train_tokens, args.updates, args.batch, args.seq, seed=2)
    held_out = batches(held_tokens, 16, args.batch, args.seq, seed=3)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"GPT: {args.layers} layers, width {args.width}, {n_params / 1e6:.2f}M parameters; pretrained loss "
          f"{evaluate(base, held_out):.4f} (held out); fine-tuning {args.updates} updates at lr {args.lr:g}")

    runs = []
    for label, options in MODES.items():
        try:
            runs.append(fine_tune(label, options, base, stream, held_out))
        except Exception as exc:  # e.g. torchao cannot compile here: report it, keep the others
            print(f"{label}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})")
            continue
    ref = runs[0]
    tail = max(1, args.updates // 10)
    rows = []
    for run in runs:
        final = sum(run["losses"][-tail:]) / tail
        moved = float(run["delta"].norm() / ref["delta"].norm())
        cosine = float(F.cosine_similarity(run["delta"], ref["delta"], dim=0))
        rows.append({"mode": run["label"], "optimizer": run["optimizer"], "final_train_loss": final,
                     "gap_to_reference": final - sum(ref["losses"][-tail:]) / tail,
                     "held_out_loss": run["held_out_loss"], "held_out_gap": run["held_out_loss"] - ref["held_out_loss"],
                     "moved_vs_reference": moved, "cosine_with_reference": cosine,
                     "seconds": run["seconds"], "losses": run["losses"]})
    header = f"{'mode':<24}{'optimizer':<22}{'train loss':>11}{'gap':>9}{'held out':>10}{'gap':>9}{'moved':>8}{'cos':>7}{'s':>6}"
    print(header)
    for r in rows:
        print(f"{r['mode']:<24}{r['optimizer']:<22}{r['final_train_loss']:>11.4f}{r['gap_to_reference']:>+9.4f}"
              f"{r['held_out_loss']:>10.4f}{r['held_out_gap']:>+9.4f}{r['moved_vs_reference']:>8.3f}"
              f"{r['cosine_with_reference']:>7.3f}{r['seconds']:>6.0f}")
    setting = {"model": f"GPT (memwrap.models gpt2-tiny shape), {args.layers} layers, width {args.width}, byte vocabulary",
               "parameters": n_params, "batch": args.batch, "seq": args.seq, "updates": args.updates, "lr": args.lr,
               "pretrain": f"{args.pretrain_steps} fp32 AdamW steps at lr {args.pretrain_lr:g}",
               "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "command": "python benchmarks/bf16_true.py " + " ".join(
                   f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items())}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bf16_true.json").write_text(json.dumps({"setting": setting, "rows": rows}, indent=1))
    _plot(rows, args)
    _markdown(rows, setting, tail)
    print(f"wrote {OUT / 'bf16_true.json'}, .png, .md")


def _plot(rows, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, gap) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(3, 2))
    window = max(1, args.updates // 30)

    def smooth(values):
        values = torch.tensor(values)
        return values.unfold(0, window, 1).mean(1) if len(values) >= window else values

    reference = torch.tensor(rows[0]["losses"])
    for r in rows:
        curve = smooth(r["losses"])
        steps = range(window, window + len(curve))
        ax.plot(steps, curve, label=f"{r['mode']} ({r['optimizer']})")
        gap.plot(steps, smooth((torch.tensor(r["losses"]) - reference).tolist()), label=r["mode"])
    ax.set_ylabel(f"training loss (moving mean of {window})")
    ax.set_title(f"fine-tuning at lr {args.lr:g}: fp32 master weights vs true bf16\n"
                 "(the reference, Kahan and stochastic-rounding curves lie on top of each other)")
    ax.legend(fontsize=8)
    gap.axhline(0, color="grey", linewidth=0.5)
    gap.set_xlabel("update")
    gap.set_ylabel("loss - reference loss")
    fig.tight_layout()
    fig.savefig(OUT / "bf16_true.png", dpi=120)


def _markdown(rows, setting, tail) -> None:
    lines = ["# True bf16 at a fine-tuning learning rate", "",
             f"Setting: {setting['model']} ({setting['parameters'] / 1e6:.2f}M parameters), batch {setting['batch']} x "
             f"{setting['seq']} tokens, {setting['updates']} AdamW updates at lr {setting['lr']:g} from a checkpoint "
             f"({setting['pretrain']}); torch {setting['torch']}, {setting['threads']} CPU threads.", "",
             f"Command: `{setting['command']}`", "",
             f"Final loss = mean of the last {tail} updates' training losses; held out = mean loss on 16 held-out batches "
             "after fine-tuning; moved = ||w - w0|| / ||w_ref - w0|| (0: every update rounded away); cos = cosine between "
             "the mode's and the reference's weight change.", "",
             "| mode | optimizer | final loss | gap | held out | gap | moved | cos |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['optimizer']} | {r['final_train_loss']:.4f} | {r['gap_to_reference']:+.4f} | "
                     f"{r['held_out_loss']:.4f} | {r['held_out_gap']:+.4f} | {r['moved_vs_reference']:.3f} | "
                     f"{r['cosine_with_reference']:.3f} |")
    lines += ["", "The same batches in the same order for every mode; CPU wall times are in the JSON (a shared machine: "
              "not a speed comparison).", "", "![loss curves](bf16_true.png)", ""]
    (OUT / "bf16_true.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
