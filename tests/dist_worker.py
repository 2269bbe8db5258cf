"""Helper for tests/test_distributed.py: the model, data and scenarios run under torchrun (gloo, CPU).

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/dist_worker.py OUT_DIR``: each rank
writes ``OUT_DIR/rank<r>.json`` with the final parameters and communication counts of each scenario.
The test imports the same module to compute the single-process big-batch reference.
"""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

DIM, HIDDEN, BLOCKS = 8, 16, 3
ACCUMULATE, WINDOWS, MICRO_BATCH = 3, 3, 4
LR, MAX_NORM = 0.1, 0.05


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def micro_batch(window: int, rank: int, index: int) -> dict[str, torch.Tensor]:
    """Deterministic data; the number of valid items differs per rank and micro-batch."""
    g = torch.Generator().manual_seed(1000 * window + 100 * rank + index)
    x = torch.randn(MICRO_BATCH, DIM, generator=g)
    y = torch.randn(MICRO_BATCH, generator=g)
    valid = 1 + (7 * window + 3 * rank + 5 * index) % MICRO_BATCH
    mask = (torch.arange(MICRO_BATCH) < valid).float()
    return {"x": x, "y": y, "mask": mask}


def rank_batches(rank: int) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(w, rank, i) for w in range(WINDOWS) for i in range(ACCUMULATE)]


def masked_loss(pred: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean squared error over the valid items: what count_items must weight correctly."""
    return ((pred - batch["y"]).square() * batch["mask"]).sum() / batch["mask"].sum()


def count_items(batch: dict[str, torch.Tensor]) -> int:
    return int(batch["mask"].sum())


def reference(world: int, *, weighted: bool = True, max_norm: float | None = None) -> dict[str, torch.Tensor]:
    """One process, one big batch per window: all ranks' micro-batches, loss averaged over all items."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for w in range(WINDOWS):
        batches = [micro_batch(w, r, i) for r in range(world) for i in range(ACCUMULATE)]
        if weighted:
            total = sum(b["mask"].sum() for b in batches)
            loss = sum(((model(b["x"]) - b["y"]).square() * b["mask"]).sum() for b in batches) / total
        else:  # plain mean of the micro-batch losses (uniform weights)
            loss = sum(masked_loss(model(b["x"]), b) for b in batches) / len(batches)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --- scenarios (run under torchrun) -----------------------------------------------------------

def _full_state(model: nn.Module) -> dict[str, list]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in memwrap_unwrap(model).state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        out[name.removeprefix("module.")] = value.detach().flatten().tolist()
    return out


def _checkpointed(model: nn.Module) -> list[str]:
    """Names of the blocks checkpointed right now (read before unwrap(), which removes wrap()'s checkpointing)."""
    from memwrap.checkpointing.apply import is_checkpointed

    inner = getattr(model, "module", model)
    inner = getattr(inner, "module", inner)  # WrappedModule -> DDP -> Net
    return [n for n, m in inner.named_modules() if is_checkpointed(m)]


def memwrap_unwrap(model: nn.Module) -> nn.Module:
    import memwrap

    return memwrap.unwrap(model)


class _Counter:
    def __init__(self):
        self.calls: list[int] = []  # micro-step index of every gradient communication


def _ddp(model: nn.Module, counter: _Counter, step: list[int]) -> nn.Module:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    # One bucket for the whole (tiny) model: one hook call per all-reduce round.
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)

    def hook(state, bucket):
        counter.calls.append(step[0])
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp


def run_ddp(rank: int, precision: str, weighted: bool) -> dict:
    import memwrap

    counter, step = _Counter(), [0]
    model = _ddp(make_model(), counter, step)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    extra = {"count_items": count_items} if weighted else {}
    model, opt, loader = memwrap.wrap(model, opt, rank_batches(rank), accumulate=ACCUMULATE, checkpoint="auto",
                                      precision=precision, **extra)
    for batch in loader:
        masked_loss(model(batch["x"]), batch).backward()
        opt.step()
        opt.zero_grad()
        step[0] += 1
    return {"checkpointed": _checkpointed(model), "params": _full_state(model), "comm": counter.calls,
            "updates": opt.updates, "skipped": opt.skipped}


def run_ddp_plain(rank: int) -> dict:
    """The usual hand-written loop (loss / N, no no_sync): the contrast that all-reduces every micro-batch."""
    counter, step = _Counter(), [0]
    model = _ddp(make_model(), counter, step)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for i, batch in enumerate(rank_batches(rank)):
        (masked_loss(model(batch["x"]), batch) / ACCUMULATE).backward()
        step[0] += 1
        if (i + 1) % ACCUMULATE == 0:
            opt.step()
            opt.zero_grad()
    return {"params": _full_state(model), "comm": counter.calls}


def _count_reduce_scatter(counter: _Counter, step: list[int]):
    import torch.distributed as dist

    # FSDP2 calls reduce_scatter_single from torch 2.13 on, reduce_scatter_tensor before (2.11)
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original = getattr(dist, name)

    def counting(*args, **kwargs):
        counter.calls.append(step[0])
        return original(*args, **kwargs)

    setattr(dist, name, counting)  # FSDP2 looks it up on the module at call time
    return lambda: setattr(dist, name, original)


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def run_fsdp(rank: int, order: str, use_memwrap: bool = True, precision: str = "fp32") -> dict:
    import memwrap

    counter, step = _Counter(), [0]
    model = make_model()
    checkpoint = None
    if order == "before":  # the documented order: checkpoint the blocks, then shard (like torchtitan)
        memwrap.apply_checkpointing(model, "auto")
    elif order == "after":  # wrap() checkpoints an already-sharded model
        checkpoint = "auto"
    model = _shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loader = rank_batches(rank)
    if use_memwrap:
        model, opt, loader = memwrap.wrap(model, opt, loader, accumulate=ACCUMULATE, count_items=count_items,
                                          checkpoint=checkpoint, max_grad_norm=MAX_NORM, precision=precision)
    restore = _count_reduce_scatter(counter, step)
    try:
        for i, batch in enumerate(loader):
            loss = masked_loss(model(batch["x"]), batch)
            (loss if use_memwrap else loss / ACCUMULATE).backward()
            step[0] += 1
            if use_memwrap:
                opt.step()
                opt.zero_grad()
            elif (i + 1) % ACCUMULATE == 0:
                opt.step()
                opt.zero_grad()
    finally:
        restore()
    from torch.distributed.fsdp import FSDPModule

    units = sum(1 for m in model.modules() if isinstance(m, FSDPModule))
    counts = {"updates": opt.updates, "skipped": opt.skipped} if use_memwrap else {}
    return {"checkpointed": _checkpointed(model), "params": _full_state(model), "comm": counter.calls,
            "fsdp_units": units, **counts}


def run_sharded_optimizers(rank: int) -> dict:
    """Which optimizers memwrap refuses on FSDP2 parameters, and whether each really fails or steps."""
    from memwrap.runtime.distributed import check_sharded_optimizer

    batch = micro_batch(0, rank, 0)
    factories = {"adamw": lambda p: torch.optim.AdamW(p), "adafactor": lambda p: torch.optim.Adafactor(p)}
    try:
        import bitsandbytes as bnb

        factories["bnb_adamw8bit"] = lambda p: bnb.optim.AdamW8bit(p)
    except ImportError:
        pass
    result = {}
    for name, factory in factories.items():
        model = _shard(make_model())
        opt = factory(model.parameters())
        try:
            check_sharded_optimizer(opt)
            refused = None
        except ValueError as err:
            refused = str(err)
        masked_loss(model(batch["x"]), batch).backward()
        try:
            opt.step()
            stepped = None
        except Exception as err:  # the failure memwrap's check replaces with a clear message
            stepped = f"{type(err).__name__}: {str(err)[:200]}"
        result[name] = {"refused": refused, "step_error": stepped}
    return result


def run_fsdp_fp16_inf_on_one_rank(rank: int) -> dict:
    """fp16 + FSDP2, with an inf planted in rank 0's gradient shard only, right before the second window's step.

    Every rank must skip that update together (torch's DTensor dispatch max-reduces GradScaler's found_inf
    over the shards), or loss scales and parameters would drift apart.
    """
    import memwrap

    model = _shard(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = memwrap.wrap(model, opt, accumulate=ACCUMULATE, precision="fp16")
    windows = []
    for i, batch in enumerate(rank_batches(rank)):
        masked_loss(model(batch["x"]), batch).backward()
        if i == 2 * ACCUMULATE - 1 and rank == 0:
            memwrap.unwrap(model).head.weight.grad._local_tensor.view(-1)[0] = float("inf")
        opt.step()
        opt.zero_grad()
        if (i + 1) % ACCUMULATE == 0:
            windows.append({"updated": opt.did_update, "scale": float(opt.scaler.get_scale())})
    return {"windows": windows, "params": _full_state(model)}


# --- bf16-true: the parameters must be bf16 before DDP / fully_shard is built on them ----------------------------

ADAM_LR = 1e-2


def _bf16_optimizer(name: str, params) -> torch.optim.Optimizer:
    # wrap(precision="bf16-true") converts either to its torch-optimi Kahan-summed equivalent.
    return torch.optim.AdamW(params, lr=ADAM_LR) if name == "adamw" else torch.optim.SGD(params, lr=LR)


def bf16_true_reference(world: int, optimizer: str = "sgd", precision: str = "bf16-true",
                        ranks: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """One process, one big batch per window (all ranks' micro-batches concatenated), the same precision and optimizer.

    ``ranks``: only those ranks' data (a run whose gradients were never averaged follows its own rank's)."""
    import warnings

    import memwrap

    model = make_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ConversionWarning (AdamW -> optimi's Kahan AdamW)
        wmodel, opt = memwrap.wrap(model, _bf16_optimizer(optimizer, model.parameters()), precision=precision)
    for win in range(WINDOWS):
        batches = [micro_batch(win, r, i) for r in (ranks or range(world)) for i in range(ACCUMULATE)]
        big = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
        masked_loss(wmodel(big["x"]), big).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def run_bf16_true(rank: int, strategy: str, optimizer: str = "sgd", convert_first: bool = True) -> dict:
    """bf16-true under DDP or FSDP2. ``convert_first``: the supported order (model.to(bf16), then DDP/fully_shard);
    otherwise wrap() gets an fp32 model that DDP/FSDP2 was already built on, which it must refuse, changing nothing."""
    import warnings

    import memwrap

    model = make_model()
    if convert_first:
        model = model.to(torch.bfloat16)
    model = nn.parallel.DistributedDataParallel(model) if strategy == "ddp" else _shard(model)
    opt = _bf16_optimizer(optimizer, model.parameters())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wmodel, wopt, loader = memwrap.wrap(model, opt, rank_batches(rank), accumulate=ACCUMULATE,
                                                count_items=count_items, precision="bf16-true")
    except ValueError as err:
        return {"refused": str(err), "dtypes": sorted({str(p.dtype) for p in model.parameters()})}
    for batch in loader:
        masked_loss(wmodel(batch["x"]), batch).backward()
        wopt.step()
        wopt.zero_grad()
    state = {k: v.float() for k, v in _full_state_tensors(model).items()}
    return {"params": {k: v.flatten().tolist() for k, v in state.items()}, "updates": wopt.updates,
            "optimizer": type(wopt.optimizer).__module__.split(".")[0] + "." + type(wopt.optimizer).__name__,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _full_state_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name.removeprefix("module."): (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            for name, v in model.state_dict().items()}


SCENARIOS = {
    "ddp_fp32": lambda r: run_ddp(r, "fp32", weighted=True),
    "ddp_bf16": lambda r: run_ddp(r, "bf16", weighted=False),
    "ddp_fp16": lambda r: run_ddp(r, "fp16", weighted=False),
    "ddp_plain": run_ddp_plain,
    "fsdp_before": lambda r: run_fsdp(r, "before"),
    "fsdp_after": lambda r: run_fsdp(r, "after"),
    "fsdp_bf16": lambda r: run_fsdp(r, "before", precision="bf16"),
    "fsdp_fp16_inf_one_rank": run_fsdp_fp16_inf_on_one_rank,
    "fsdp_plain": lambda r: run_fsdp(r, "none", use_memwrap=False),
    "sharded_optimizers": run_sharded_optimizers,
    "ddp_bf16_true": lambda r: run_bf16_true(r, "ddp"),
    "ddp_bf16_true_adamw": lambda r: run_bf16_true(r, "ddp", "adamw"),
    "ddp_bf16_true_after": lambda r: run_bf16_true(r, "ddp", convert_first=False),
    "fsdp_bf16_true": lambda r: run_bf16_true(r, "fsdp2"),
    "fsdp_bf16_true_adamw": lambda r: run_bf16_true(r, "fsdp2", "adamw"),
    "fsdp_bf16_true_after": lambda r: run_bf16_true(r, "fsdp2", convert_first=False),
}


# --- per-rank memory (tests/test_sharded_plan.py): predicted vs measured peaks ---------------------

MEMORY_MODEL = dict(n_layer=4, n_embd=128, n_head=4)  # gpt2-tiny, narrower
MEMORY_BATCH, MEMORY_SEQ = 2, 64
MEMORY_CASES = {"plain": {}, "full_accumulate": {"checkpoint": "full", "accumulate": 2}}


def memory_model():
    from memwrap.models import build_preset

    torch.manual_seed(0)
    return build_preset("gpt2-tiny", **MEMORY_MODEL)


def memory_batch(rank: int):
    from memwrap.models import preset_batch

    g = torch.Generator().manual_seed(rank)
    return preset_batch("gpt2-tiny", MEMORY_BATCH, MEMORY_SEQ, generator=g)


def run_memory(rank: int) -> dict:
    """This rank's allocator-measured peak of one steady-state update, per strategy and case."""
    from memwrap.memory.sharded.measure import measure_rank_peak
    from memwrap.models import lm_loss

    out = {}
    for strategy in ("ddp", "fsdp2"):
        for case, options in MEMORY_CASES.items():
            r = measure_rank_peak(memory_model, lambda: memory_batch(rank), strategy=strategy, loss_fn=lm_loss,
                                  **options)
            out[f"{strategy}/{case}"] = {"peak": r["peak"], "baseline": r["baseline"]}
    return out


ON_REQUEST = {"memory": run_memory}  # run only when named on the command line


def main() -> None:
    import torch.distributed as dist

    out_dir = sys.argv[1]
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {}
    try:
        for name in names:
            try:
                results[name] = {**SCENARIOS, **ON_REQUEST}[name](rank)
            except Exception as err:  # reported per scenario, so one failure does not hide the others
                import traceback

                results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"world": dist.get_world_size(), "results": results}, f)
        dist.barrier()  # leave together (a rank tearing gloo down early can abort its peer)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
