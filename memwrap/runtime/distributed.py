"""Composition with torch.distributed data parallelism (DDP, FSDP2) during accumulation.

memwrap never replaces torch.distributed; it only tells it *when* to communicate:

* gradient sync: inside a window, every micro-batch but the last skips the gradient all-reduce
  (DDP ``no_sync``) or reduce-scatter (FSDP2 ``set_requires_gradient_sync(False)``), so a window
  costs one round of gradient communication instead of ``accumulate`` rounds;
* item counts: with ``count_items``, the window's item total is summed over the data-parallel
  ranks, so micro-batch weights reproduce the loss of the *global* big batch;
* sharded parameters: optimizers whose kernels cannot take ``DTensor`` parameters (bitsandbytes
  8-bit) are refused up front with a fix, instead of failing inside their first ``step()``;
* parameter dtype: a precision that stores parameters in another dtype (``bf16-true``) cannot convert
  them once DDP or FSDP has been built on them; that order is refused with the one that works
  (:func:`check_dtype_change`).

Why the item weight is ``world_size * n / T``: DDP and FSDP2 *average* gradients over the
data-parallel ranks. With micro-batch losses that are means over their ``n_{r,i}`` items, the
global big-batch gradient is ``sum_{r,i} S_{r,i} / T`` (``S`` the summed item losses, ``T`` the
global item total). Rank ``r`` contributes ``sum_i w_{r,i} S_{r,i} / n_{r,i}`` and the average
divides by ``W``, so ``w_{r,i} = W n_{r,i} / T``: the loader's window total is replaced by ``T / W``.
"""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["sync_control", "item_reducer", "is_sharded", "check_sharded_optimizer", "unwrap_compiled",
           "check_dtype_change"]


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module behind ``torch.compile`` (``OptimizedModule._orig_mod``), else ``model`` itself.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> unwrap_compiled(net) is net
        True
    """
    return getattr(model, "_orig_mod", model)


def _fsdp2_modules(model: nn.Module) -> list[nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _is_fsdp1(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def sync_control(model: nn.Module) -> Callable[[bool], contextlib.AbstractContextManager] | None:
    """Return ``f(sync) -> context`` that runs one micro-batch's forward with or without gradient sync.

    ``None`` for a model that syncs nothing (single process). The wrapped model enters
    ``f(gate.closes_window())`` around each training forward.

    Example:
        >>> sync_control(nn.Linear(2, 2)) is None
        True
    """
    model = unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP reads require_backward_grad_sync in forward (it prepares the reducer there), so the
        # forward alone needs the context; the backward may run after it has exited.
        return lambda sync: contextlib.nullcontext() if sync else model.no_sync()
    shards = _fsdp2_modules(model)
    if shards:
        return lambda sync: _fsdp2_sync(shards, sync)
    if _is_fsdp1(model):
        warnings.warn(
            "memwrap cannot skip gradient sync for FSDP1 (FullyShardedDataParallel): its no_sync() must also "
            "cover the backward, which memwrap does not own. Gradients stay exact, but every micro-batch "
            "reduce-scatters. Fix: migrate to FSDP2 (torch.distributed.fsdp.fully_shard).",
            stacklevel=3,
        )
    return None


@contextlib.contextmanager
def _fsdp2_sync(shards: list[nn.Module], sync: bool):
    # FSDP2 reduce-scatters in post-backward hooks, after this forward has returned: the flag must
    # stay as set through the backward, so it is set here and only the window's last forward turns it
    # back on. recurse=False per module also covers models whose root is not sharded itself.
    for module in shards:
        module.set_requires_gradient_sync(sync, recurse=False)
    yield


def _dp_groups(model: nn.Module) -> list[Any] | None:
    """Process groups whose ranks together form the model's data-parallel world (None: single process)."""
    model = unwrap_compiled(model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return [model.process_group]
    if _fsdp2_modules(model):
        from torch.distributed.tensor import DTensor

        param = next((p for p in model.parameters() if isinstance(p, DTensor)), None)
        if param is None:
            return None
        mesh = param.device_mesh
        # Every rank of the mesh: summing item totals over a tensor-parallel dimension too is harmless,
        # since those ranks see the same batch and the division by the mesh size cancels it (see module doc).
        return [mesh.get_group(dim) for dim in range(mesh.ndim)]
    return None


def item_reducer(model: nn.Module) -> Callable[[int], float] | None:
    """``f(local_window_items) -> T / W``: the denominator that makes DDP/FSDP2 weighting global.

    A collective: every data-parallel rank must call it once per window (the wrapped loader does,
    when ``count_items`` is set). ``None`` for a single-process model.

    Example:
        >>> item_reducer(nn.Linear(2, 2)) is None
        True
    """
    groups = _dp_groups(model)
    if groups is None:
        return None
    import torch.distributed as dist

    device = _comm_device(model, groups[0])

    def reduce(total: int) -> float:
        tensor = torch.tensor([int(total)], dtype=torch.int64, device=device)
        size = 1
        for group in groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            size *= dist.get_world_size(group)
        return int(tensor.item()) / size

    return reduce


def _comm_device(model: nn.Module, group: Any) -> torch.device:
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def is_sharded(params: Any) -> bool:
    """True when any parameter is a ``DTensor`` (FSDP2 / tensor parallel).

    Example:
        >>> is_sharded(nn.Linear(2, 2).parameters())
        False
    """
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return any(isinstance(p, DTensor) for p in params)


def _sharding_problem(optimizer: torch.optim.Optimizer) -> str | None:
    if type(optimizer).__module__.split(".")[0] == "bitsandbytes":
        return "bitsandbytes' kernels take plain tensors, and FSDP2 (fully_shard) parameters are DTensors"
    if isinstance(optimizer, getattr(torch.optim, "Adafactor", ())):
        # Measured on torch 2.13: the factored row/column norms reduce over the sharded dimension and
        # the in-place update that follows has no DTensor sharding strategy.
        return "its factored second moment reduces over the sharded dimension, which DTensor cannot do in place"
    return None


def check_sharded_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise a ``ValueError`` naming the fix when ``optimizer`` cannot step sharded (``DTensor``) parameters.

    bitsandbytes' 8-bit kernels receive plain tensors; on FSDP2 parameters their first ``step()``
    would fail with "got mixed torch.Tensor and DTensor". ``torch.optim.Adafactor`` fails too
    ("in-place operations that require placement changes are not supported"). Elementwise torch
    optimizers (AdamW, Adam, SGD, ...) handle DTensors and pass.

    Example:
        >>> check_sharded_optimizer(torch.optim.AdamW(nn.Linear(2, 2).parameters()))  # passes
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # a WrappedOptimizer's inner optimizer
    problem = _sharding_problem(inner)
    if problem is None:
        return
    params = [p for group in inner.param_groups for p in group["params"]]
    if is_sharded(params):
        raise ValueError(
            f"{type(inner).__name__} ({type(inner).__module__.split('.')[0]}) cannot update sharded parameters: "
            f"{problem}. Fix: under FSDP2 use an elementwise torch optimizer (optim='adamw', or "
            "torch.optim.AdamW(..., foreach=True)), or train with DDP, where every optimizer sees ordinary tensors."
        )


def _data_parallel(model: nn.Module) -> str | None:
    """The name of the data-parallel wrapper built on the model's parameters (DDP, FSDP2, FSDP1), or None."""
    model = unwrap_compiled(model)
    if any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        return "DistributedDataParallel"
    if _fsdp2_modules(model):
        return "FSDP2 (fully_shard)"
    if _is_fsdp1(model):
        return "FSDP1 (FullyShardedDataParallel)"
    return None


def check_dtype_change(model: nn.Module, precision: Any) -> None:
    """Raise a ``ValueError`` naming the fix when ``precision`` would change the dtype of parameters that DDP or FSDP
    already communicates.

    DDP builds its gradient buckets for the parameters' dtype when it is constructed, and FSDP2 its sharded
    parameters and all-gather buffers when ``fully_shard`` runs. Swapping the storage afterwards (what a
    precision's ``convert_module`` does, ``t.data = t.data.to(bf16)``) happens behind their back: measured on 2
    gloo ranks, DDP then never averaged the bf16 gradients (the ranks' weights drifted 11% apart in a few updates)
    and FSDP2 handed fp32 optimizer state bf16 gradients (``expected dtype float for end but got BFloat16`` at the
    first step). torch has no public way to rebuild either, so the order that works is required: convert first,
    then ``DDP(...)`` / ``fully_shard``. A model already in the precision's dtype passes (nothing to convert).

    Example:
        >>> from memwrap.precision.base import get_precision
        >>> check_dtype_change(nn.Linear(2, 2), get_precision("bf16-true"))  # single process: converted by wrap()
    """
    dtype = getattr(precision, "param_dtype", None)
    if dtype is None:
        return
    changing = next((n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != dtype), None)
    wrapper = _data_parallel(model) if changing is not None else None
    if wrapper is None:
        return
    current = str(model.get_parameter(changing).dtype).replace("torch.", "")
    short = str(dtype).replace("torch.", "")
    if wrapper.startswith("Distributed"):
        order = (f"model = model.to(torch.{short}); ddp = DistributedDataParallel(model, ...); optimizer = "
                 f"torch.optim.AdamW(ddp.parameters()); memwrap.wrap(ddp, optimizer, precision={precision.name!r})")
    else:
        order = (f"model = model.to(torch.{short}); then fully_shard each block and the model; optimizer = "
                 f"torch.optim.AdamW(model.parameters()); memwrap.wrap(model, optimizer, precision={precision.name!r})")
    raise ValueError(
        f"precision={precision.name!r} stores the parameters in {short}, but the model is already wrapped in {wrapper}, "
        f"which was built for their current dtype ({changing!r} is {current}): converting them now would happen behind "
        f"its back (DDP would stop averaging the gradients across ranks; FSDP's shards keep the old dtype). Fix: "
        f"convert first, then build {wrapper.split(' ')[0]} and the optimizer: {order}. See docs/distributed.md.")


def check_wrap(call) -> None:
    """``wrap()``'s check of the precision against a model DDP or FSDP2 already wraps (run by
    :mod:`memwrap.validation`): :func:`check_dtype_change`, refused with the order that works."""
    if call.model is not None:
        check_dtype_change(call.model, call.precision)


def check_stepping(call, optimizer: torch.optim.Optimizer) -> None:
    """The optimizer that will step, against sharded parameters: :func:`check_sharded_optimizer` (e.g. 8-bit
    bitsandbytes on FSDP2 shards fails now, with the fix, not at the first step)."""
    check_sharded_optimizer(optimizer)
