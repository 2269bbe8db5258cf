"""A plain PyTorch loop with memwrap: two added lines, the loop itself unchanged.

    python examples/plain_loop.py --steps 8

bf16 autocast, exact gradient accumulation (4 micro-batches per update), checkpointed blocks and
8-bit AdamW (when bitsandbytes is installed), on CPU or GPU.
"""
from __future__ import annotations

import argparse
import importlib.util

import torch
from torch.utils.data import DataLoader

import memwrap
from memwrap.models import build_preset, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="micro-batches")
    parser.add_argument("--accumulate", type=int, default=4)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    loader = DataLoader(torch.randint(0, 256, (args.steps * 2, 33)), batch_size=2)

    optim = "adamw_8bit" if importlib.util.find_spec("bitsandbytes") else None
    model, optimizer, loader = memwrap.wrap(model, optimizer, loader, precision="bf16", accumulate=args.accumulate,
                                            checkpoint="auto", optim=optim, max_grad_norm=1.0)

    for tokens in loader:  # the loop as it was
        tokens = tokens.to(device)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    print(f"updates={optimizer.updates} last_loss={loss.item():.4f} optimizer={type(memwrap.unwrap(optimizer)).__name__}")
    print(model.checkpoint_report)


if __name__ == "__main__":
    main()
