"""Sharding as a plan dimension: which world sizes and strategies fit a per-GPU budget.

``memwrap.plan(..., world_size=[4, 8], strategy=["fsdp2", "ddp"])`` plans every layout (one
``plan()`` per world size and strategy, traces shared within each), merges the candidates and
reports per layout whether anything fits ("fits on 4 GPUs with FSDP2, not with DDP"). The global
batch is fixed: ``micro-batch x accumulate x world_size``. Optimizers memwrap refuses on FSDP2
shards (bitsandbytes 8-bit, Adafactor; :func:`memwrap.runtime.distributed.check_sharded_optimizer`) are
skipped under FSDP2 with that reason, never planned.

Example:
    >>> layouts(4, None, 8)
    [(4, 'fsdp2'), (4, 'ddp')]
    >>> layouts(1, None, 8)
    [(1, None)]
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from memwrap.memory.search.ranking import rank
from memwrap.precision.base import get_precision_class

__all__ = ["layouts", "plan_layouts", "layout_summary", "sharding_verdict", "sharded_code", "refused_specs",
           "fewest_gpus_first", "sharded_advice"]


def _as_list(value: Any) -> list:
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [value]


def layouts(world_size: Any, strategy: Any, global_batch: int,
            micro_batches: Iterable[int] | None = None) -> list[tuple[int, str | None]]:
    """The ``(world_size, strategy)`` pairs to plan, validated; ``strategy=None`` with several ranks means both.

    Raises ``ValueError`` naming the fix for a world size < 1, an unknown strategy, a strategy this
    torch cannot run, or a global batch that ``world_size`` (times a given micro-batch) does not divide.
    """
    # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
    from memwrap.memory.sharded.trace import STRATEGIES, check_sharding

    sizes = _as_list(world_size)
    strategies = _as_list(strategy)
    out: list[tuple[int, str | None]] = []
    for w in sizes:
        for s in strategies:
            if s is None and isinstance(w, int) and not isinstance(w, bool) and w > 1:
                out += [check_sharding(w, name) for name in ("fsdp2", "ddp") if name in STRATEGIES]
            else:
                out.append(check_sharding(w, s))
    out = list(dict.fromkeys(out))
    if not out:
        raise ValueError("no world size or strategy to plan: give world_size >= 1 and strategy 'fsdp2', 'ddp' or None.")
    for w, _ in out:
        if global_batch % w:
            ok = sorted({global_batch - global_batch % w, global_batch + w - global_batch % w} - {0})
            raise ValueError(f"global batch {global_batch} is not divisible by world_size {w}: every rank needs the same "
                             f"number of samples (micro-batch x accumulate x world_size = global batch). Fix: a global "
                             f"batch that is a multiple of {w} (e.g. {' or '.join(map(str, ok))}), or another world size.")
        for m in micro_batches or ():
            if (global_batch // w) % int(m):
                raise ValueError(f"global batch {global_batch} is not divisible by world_size {w} x micro-batch {m} = "
                                 f"{w * int(m)}. Fix: micro-batches dividing {global_batch // w} (the samples per rank), "
                                 f"or a global batch that is a multiple of {w * int(m)}.")
    return out


def plan_layouts(plan_fn: Callable, shardings: list[tuple[int, str | None]], model: Any, make_batch: Callable,
                 **kwargs: Any):
    """One plan per layout, merged: candidates that fit first, fewest GPUs first, then as ``rank`` orders them."""
    plans = []
    for w, s in shardings:
        try:
            plans.append(plan_fn(model, make_batch, world_size=w, strategy=s, **kwargs))
        except ValueError as exc:
            if "no candidate could be traced" not in str(exc):
                raise
            plans.append(None)  # every candidate refused under this layout (e.g. only 8-bit optimizers on FSDP2)
    real = [p for p in plans if p is not None]
    if not real:
        raise ValueError("no candidate could be traced under any world size and strategy.")
    first = real[0]
    cands = [c for p in real for c in p.candidates]
    ranked = fewest_gpus_first(rank(cands, first.budget, first.margin, keep_optim=first.keep_optim,
                                    keep_precision=first.keep_precision))
    skipped = [x for p in real for x in p.skipped]
    # type(first): the planner's Plan, taken from the plans it made (the planner imports this module)
    return type(first)(ranked, first.budget, first.global_batch, first.margin, sum(p.seconds for p in real), skipped,
                first.keep_optim, next((p.keep_note for p in real if p.keep_note), ""), first.keep_precision,
                dominators=[d for p in real for d in getattr(p, "dominators", [])])


def fewest_gpus_first(ranked: list) -> list:
    """``ranked`` (as :func:`memwrap.memory.search.planner.rank` orders it) with the fitting candidates on fewer GPUs
    first: a layout that fits on 4 GPUs beats a faster one on 8. Stable otherwise; a no-op for one layout."""
    order = {id(c): i for i, c in enumerate(ranked)}
    return sorted(ranked, key=lambda c: (not c.fits, c.estimate.world_size if c.fits else 0, order[id(c)]))


def sharded_advice(candidate: Any, category: str) -> str:
    """What to do when ``candidate`` (the smallest of a plan where nothing fits) is dominated by ``category`` under
    DDP or FSDP2; '' for a single-process candidate (the planner's own advice applies)."""
    w, s = candidate.estimate.world_size, candidate.estimate.strategy
    state = category in ("parameters", "gradients", "optimizer_state")
    if s == "fsdp2" and state:
        return (f"FSDP2 already shards it over {w} ranks: more ranks shrink it (see the per-GPU line below), or pick "
                f"precision='bf16-true' or an optimizer with less state.")
    if s == "ddp" and state:
        return (f"DDP keeps all of it on each of the {w} ranks: FSDP2 shards it (strategy='fsdp2', --strategy "
                f"fsdp2), or pick an optimizer with less state.")
    return ""


def layout_summary(plan: Any) -> list[dict[str, Any]]:
    """Per ``(world_size, strategy)`` among the plan's candidates: whether one fits, the best or smallest one."""
    groups: dict[tuple, list] = {}
    for c in plan.candidates:
        groups.setdefault((c.estimate.world_size, c.estimate.strategy), []).append(c)
    rows = []
    for (w, s), cands in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        fitting = [c for c in cands if c.fits]
        pick = fitting[0] if fitting else min(cands, key=lambda c: c.required)
        rows.append({"world_size": w, "strategy": s, "fits": bool(fitting), "candidate": pick.label,
                     "peak": pick.estimate.peak, "required": pick.required})
    return rows


def _layout_name(w: int, s: str | None) -> str:
    if s is None:
        return "1 GPU"
    return f"{w} GPU{'s' if w > 1 else ''} with {'FSDP2' if s == 'fsdp2' else 'DDP'}"


def sharding_verdict(plan: Any) -> str:
    """One line per plan over several layouts, e.g. ``fits on 4 GPUs with FSDP2; not on 4 GPUs with DDP (...)``.
    Empty for a single-process plan."""
    rows = layout_summary(plan)
    if len(rows) == 1 and rows[0]["strategy"] is None:
        return ""
    fits = [r for r in rows if r["fits"]]
    misses = [r for r in rows if not r["fits"]]
    parts = []
    if fits:
        parts.append("fits on " + ", ".join(_layout_name(r["world_size"], r["strategy"]) for r in fits))
    if misses:
        parts.append("not on " + ", ".join(
            f"{_layout_name(r['world_size'], r['strategy'])} (needs {plan.fmt(r['required'])} per GPU)"
            for r in misses))
    hint = _more_ranks_hint(plan, misses) if not fits else ""
    return f"per-GPU budget {plan.fmt(plan.budget)}: " + "; ".join(parts) + "." + hint


def _more_ranks_hint(plan: Any, misses: list[dict]) -> str:
    """When no layout fits: the smallest power-of-two multiple of the largest FSDP2 world size at which this
    rank's shards (parameters, gradients, optimizer state, which shrink as 1/world_size) would leave room.
    A hint to plan, not a prediction: everything else at the peak is assumed unchanged."""
    fsdp = [r for r in misses if r["strategy"] == "fsdp2"]
    if not fsdp:
        return ""
    w = max(r["world_size"] for r in fsdp)
    c = min((c for c in plan.candidates if c.estimate.world_size == w and c.estimate.strategy == "fsdp2"),
            key=lambda c: c.required)
    b = c.estimate.breakdown
    sharded = b["parameters"] + b["gradients"] + b["optimizer_state"]
    rest = c.estimate.peak - sharded
    for k in range(1, 11):
        peak = rest + sharded / 2**k
        if peak + plan.margin.of(int(peak)) <= plan.budget:
            return (f" Its shards (parameters, gradients, optimizer state: {plan.fmt(sharded)} of {c.label}'s peak) "
                    f"shrink as 1/world_size: plan --world-size {w * 2**k} to check whether that many GPUs fit.")
    return ""


def sharded_code(c: Any, global_batch: int, model: str = "model", optimizer: str = "optimizer") -> str:
    """The lines to paste for a sharded candidate: the launcher, ``fully_shard`` (FSDP2) or DDP, then ``wrap``."""
    est = c.estimate
    w, s = est.world_size, est.strategy
    opts = ", ".join(f"{k}={v!r}" for k, v in c.options.items())
    launch = (f"# torchrun --nproc-per-node {w} train.py   (global batch {global_batch} = micro-batch {c.micro_batch} x "
              f"accumulate {c.accumulate} x {w} ranks)")
    if s == "fsdp2":
        ckpt = c.checkpoint if isinstance(c.checkpoint, str) else "none" if c.checkpoint is None else "auto"
        launch += (f"\n# complete script: torchrun --nproc-per-node {w} examples/fsdp2_torchrun.py --micro-batch "
                   f"{c.micro_batch} --accumulate {c.accumulate} --precision {c.precision} --checkpoint {ckpt} "
                   f"[--preset NAME --seq N]")
    storage = get_precision_class(c.precision).param_dtype
    # The weights' dtype changes before DDP/FSDP2 sees them: wrap() refuses to convert parameters they already hold.
    convert = f"{model} = {model}.to({storage})  # {c.precision} stores the weights in it\n" if storage is not None else ""
    if s == "fsdp2":
        blocks = (f"for block in {model}.{est.stack}:  # one FSDP unit per block, then the root\n    fully_shard(block)\n"
                  if est.stack else "")
        shard = f"from torch.distributed.fsdp import fully_shard\n{blocks}fully_shard({model})\n"
    else:
        shard = (f"{model} = torch.nn.parallel.DistributedDataParallel({model}.to(device), device_ids=[local_rank])\n")
    return (f"{launch}\n{convert}{shard}{optimizer} = torch.optim.AdamW({model}.parameters())  # built on the "
            f"{'sharded' if s == 'fsdp2' else 'DDP'} parameters\nimport memwrap\n"
            f"{model}, {optimizer} = memwrap.wrap({model}, {optimizer}, {opts})")


def refused_specs(specs: list[dict], world_size: int, strategy: str | None) -> tuple[list[dict], list[tuple[str, str]]]:
    """Split ``specs`` into those FSDP2 can run and ``(label, why)`` for the optimizers it refuses."""
    if strategy != "fsdp2":
        return specs, []
    # import cost: sharded planning (torch.distributed's trackers), needed only with world_size > 1.
    from memwrap.memory.sharded.trace import fsdp2_refusals

    refused = fsdp2_refusals([s["optim"] for s in specs], world_size)
    keep = [s for s in specs if s["optim"] not in refused]
    skipped = [(f"fsdp2x{world_size} {s['micro_batch']} {s['precision']} {s['checkpoint'] or 'no-ckpt'} {s['optim']}",
                f"refused under FSDP2: {refused[s['optim']]}") for s in specs if s["optim"] in refused]
    return keep, skipped

