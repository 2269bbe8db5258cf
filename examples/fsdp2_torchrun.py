"""FSDP2 (fully_shard) + memwrap: checkpoint the blocks first, then shard them, then wrap.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 examples/fsdp2_torchrun.py --steps 8
    # what `memwrap plan --world-size 4 --strategy fsdp2 ...` chose, filled in:
    torchrun --nproc-per-node 4 examples/fsdp2_torchrun.py --preset llama-7b --seq 2048 \\
        --micro-batch 1 --accumulate 2 --precision bf16 --checkpoint full

Order matters for readability more than for correctness: like torchtitan, apply activation
checkpointing to the unsharded blocks, then ``fully_shard`` each block and the root. A precision that
stores the weights in another dtype (``--precision bf16-true``) converts the model before sharding:
``wrap()`` refuses to change the dtype of parameters FSDP2 already sharded. memwrap toggles
``set_requires_gradient_sync`` so each window reduce-scatters once, and clips over the sharded
(DTensor) gradients with the global norm. With ``--preset`` the model is built on the meta device
and materialised shard by shard (``to_empty``), so no rank ever holds the whole model; this is the
layout ``memwrap.estimate(..., strategy="fsdp2")`` traces.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memwrap
from memwrap.memory.tracing.trace import find_stack
from memwrap.precision.base import get_precision_class
from memwrap.models import build_preset, get_preset, lm_loss, preset_batch


def build(args, device):
    if args.preset is None:  # the small default: built on the device directly
        torch.manual_seed(0)
        return build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32).to(device)
    with torch.device("meta"):  # shapes only; each rank materialises its shards below
        return build_preset(args.preset)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8, help="micro-batches per rank")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--preset", default=None, help="a memwrap.models preset, e.g. llama-7b (default: a tiny GPT)")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--checkpoint", default="auto", help="a checkpoint policy, or none")
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    model = build(args, device)
    storage = get_precision_class(args.precision).param_dtype  # bf16-true stores the weights in bf16
    if storage is not None:  # 0. convert before sharding: FSDP2 shards the parameters as they are now
        model.to(storage)
    if args.checkpoint.lower() != "none":
        memwrap.apply_checkpointing(model, args.checkpoint)  # 1. checkpoint the blocks (unsharded)
    stack = find_stack(model, 2)
    for block in model.get_submodule(stack.name).children() if stack else ():  # 2. shard each block, then the root
        fully_shard(block)
    fully_shard(model)
    if args.preset is not None:  # materialise this rank's shards only, then initialise them
        model.to_empty(device=device)
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02)
    # 3. build the optimizer on the sharded (DTensor) parameters; torch's AdamW handles them,
    #    bitsandbytes' 8-bit optimizers do not (memwrap refuses them with a fix).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = memwrap.wrap(model, optimizer, accumulate=args.accumulate, precision=args.precision,
                                    max_grad_norm=args.max_grad_norm)

    g = torch.Generator().manual_seed(rank)  # each rank its own data shard
    vocab = get_preset(args.preset).vocab_size if args.preset else 256
    for _ in range(args.steps):  # the unchanged loop
        if args.preset:
            inputs, targets = (t.to(device) for t in preset_batch(args.preset, args.micro_batch, args.seq, generator=g))
        else:
            tokens = torch.randint(0, vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    print(f"rank={rank} world={world} updates={optimizer.updates} last_loss={loss.item():.4f} "
          f"grad_norm={optimizer.last_grad_norm:.4f}", flush=True)
    # Every rank leaves together: a rank tearing gloo down while its peer is still in the last collective's
    # cleanup aborted ("terminate called without an active exception") in 3 of 24 CPU runs.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
