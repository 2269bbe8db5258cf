"""DDP + memwrap: the training loop is the plain one; memwrap adds no_sync, weighting and checkpointing.

Run on 2 CPU processes (gloo) or GPUs (nccl):

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/ddp_torchrun.py --steps 8

Every micro-batch but each window's last runs its forward and backward under DDP's ``no_sync()``,
so a window costs one gradient all-reduce. ``count_items`` makes the weighting that of the global
batch: item totals are summed across ranks.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import memwrap
from memwrap.models import build_preset, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="micro-batches per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights on every rank
    model = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32).to(device)
    # Build DDP first, then hand it to memwrap; checkpointing is applied to ddp.module's blocks.
    model = DDP(model, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    tokens = torch.randint(0, 256, (args.steps * dist.get_world_size() * 2, 33), generator=torch.Generator().manual_seed(1))
    dataset = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    loader = DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, shuffle=False))

    model, optimizer, loader = memwrap.wrap(
        model, optimizer, loader,
        accumulate=args.accumulate, checkpoint="auto", max_grad_norm=1.0,
        precision="bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32",
        count_items=lambda batch: batch[1].numel(),  # tokens: the loss is a mean over them
    )

    for x, y in loader:  # the unchanged loop
        loss = lm_loss(model(x.to(device)), y.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    print(f"rank={rank} updates={optimizer.updates} last_loss={loss.item():.4f} "
          f"checkpointed={len(model.checkpoint_report.modules)}", flush=True)
    # Every rank leaves together: a rank tearing gloo down while its peer is still in the last collective's
    # cleanup aborted ("terminate called without an active exception") in 3 of 24 CPU runs.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
