"""FSDP2 (fully_shard) + memwrap: checkpoint the blocks first, then shard them, then wrap.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --steps 8

Order matters for readability more than for correctness: like torchtitan, apply activation
checkpointing to the unsharded blocks, then ``fully_shard`` each block and the root. memwrap toggles
``set_requires_gradient_sync`` so each window reduce-scatters once, and clips over the sharded
(DTensor) gradients with the global norm.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memwrap
from memwrap.models import build_preset, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="micro-batches per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32).to(device)
    memwrap.apply_checkpointing(model, "auto")        # 1. checkpoint the blocks (unsharded)
    for block in model.transformer.h:                 # 2. shard each block, then the root
        fully_shard(block)
    fully_shard(model)
    # 3. build the optimizer on the sharded (DTensor) parameters; torch's AdamW handles them,
    #    bitsandbytes' 8-bit optimizers do not (memwrap refuses them with a fix).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = memwrap.wrap(model, optimizer, accumulate=args.accumulate, max_grad_norm=1.0)

    g = torch.Generator().manual_seed(rank)  # each rank its own data shard
    for _ in range(args.steps):  # the unchanged loop
        tokens = torch.randint(0, 256, (2, 33), generator=g).to(device)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    print(f"rank={rank} world={world} updates={optimizer.updates} last_loss={loss.item():.4f} "
          f"grad_norm={optimizer.last_grad_norm:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
