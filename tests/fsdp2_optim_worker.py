"""Helper for tests/test_plan_pruning.py: which optimizers really train under FSDP2 (2 gloo ranks).

usage: python -m torch.distributed.run --nproc-per-node 2 tests/fsdp2_optim_worker.py OUT_DIR NAME [NAME ...]
For each optimizer, the same model trains three updates under DDP and under FSDP2 (``fully_shard`` on each layer,
then the root) through ``memwrap.wrap``; rank r writes ``OUT_DIR/rank<r>.json`` with, per optimizer, the largest
parameter difference FSDP2 vs DDP, or the error FSDP2 raised.
"""
from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import memwrap
from memwrap.plugin.registry import create_optimizer

WIDTH = 256  # even shards, as in real models (a layer too small to split over the ranks fails for other reasons)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH))


def train(name: str, strategy: str) -> torch.Tensor:
    net = model()
    if strategy == "ddp":
        net = nn.parallel.DistributedDataParallel(net)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (net[0], net[2]):
            fully_shard(layer)
        fully_shard(net)
    opt = create_optimizer(name, net.parameters(), model=net, lr=1e-3,
                           **({"target_modules": "all-linear"} if name.startswith(("galore", "apollo")) else {}))
    wmodel, wopt = memwrap.wrap(net, opt)
    for step in range(3):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, WIDTH, generator=g)
        (wmodel(x) - y).pow(2).mean().backward()
        wopt.step()
        wopt.zero_grad()
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).flatten()
                      for p in net.parameters()])


def main(out: str, names: list[str]) -> None:
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    results = {}
    for name in names:
        reference = train(name, "ddp")
        try:
            sharded = train(name, "fsdp2")
            results[name] = {"max_diff": float((sharded - reference).abs().max())}
        except Exception as exc:  # noqa: BLE001 - what FSDP2 raises is the result
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        dist.barrier()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as fh:
        json.dump(results, fh)
    dist.barrier()  # leave together (a rank tearing gloo down early can abort its peer)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
