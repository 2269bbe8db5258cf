"""``MemwrapCallback(budget=..., batch=...)``: Lightning's micro-batch and ``accumulate_grad_batches`` from a plan.

Lightning batches with the train DataLoader's one batch size and accumulates itself, so the plan is
made once at ``fit()``, right after the module's network is built, from ``batch`` (one sample global
batch): the micro-batch is the largest divisor of it that fits the budget (see
:mod:`memwrap.techniques.budget.static`). The callback sets ``trainer.accumulate_grad_batches`` and, unless a
``checkpoint`` was given, the checkpoint policy; the train DataLoader must use
``batch_size=callback.micro_batch`` (it is built after the plan: read it in ``train_dataloader()``),
and a larger batch is refused at its first step, with that fix. Lightning is not imported here.

Example:
    >>> cb = MemwrapCallback(budget="22GiB", batch=sample_global_batch)  # doctest: +SKIP
    >>> # in the LightningModule / DataModule:
    >>> def train_dataloader(self):  # doctest: +SKIP
    ...     return DataLoader(ds, batch_size=cb.micro_batch)
"""
from __future__ import annotations

from typing import Any

from memwrap.runtime.batch_split import batch_size

__all__ = ["check_budget", "plan_lightning_split", "check_micro_batch"]


def check_budget(budget: Any, batch: Any, margin: Any) -> None:
    """The callback's budget arguments, checked at construction (raise naming the fix)."""
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.budget import parse_budget

    if budget is None or batch is None:
        raise ValueError("MemwrapCallback plans the split from budget= and a sample global batch: give both, e.g. "
                         "MemwrapCallback(budget='22GiB', batch=next(iter(DataLoader(ds, batch_size=64))))"
                         + (" (margin= applies to budget=)" if budget is None and margin is not None else "") + ".")
    parse_budget(budget, what="budget")
    if margin is not None:
        # import cost: memwrap.memory's package loads the planner.
        from memwrap.memory.search.planner import Margin

        Margin.parse(margin)


def _precision(trainer: Any) -> str:
    name = str(getattr(trainer, "precision", "32-true"))
    if "bf16" in name:
        return "bf16-true" if "true" in name else "bf16"
    return "fp16" if name.startswith("16") else "fp32"


def plan_lightning_split(callback: Any, trainer: Any, pl_module: Any) -> Any:
    """Plan, then set ``trainer.accumulate_grad_batches``; returns the BudgetChoice."""
    # import cost: it loads the planner.
    from memwrap.techniques.budget.static import UNSET, plan_split

    checkpoint = UNSET if callback.checkpoint is None else callback.checkpoint
    device = "cuda" if getattr(getattr(trainer, "strategy", None), "root_device", None) is not None and \
        trainer.strategy.root_device.type == "cuda" else "cpu"
    choice = plan_split(pl_module, callback.batch, callback.budget, margin=callback.margin, checkpoint=checkpoint,
                        precision=_precision(trainer), optim=callback.optim or "adamw", device_type=device)
    if trainer is not None:
        trainer.accumulate_grad_batches = choice.accumulate
    return choice


def check_micro_batch(callback: Any, batch: Any) -> None:
    """Refuse a training batch larger than the planned micro-batch (the DataLoader was built without it)."""

    n = batch_size(batch)
    if n > callback.micro_batch:
        raise ValueError(
            f"the training batch has {n} samples but budget= planned micro-batches of {callback.micro_batch} "
            f"(x accumulate_grad_batches={callback.budget_plan.accumulate} = the global batch). Fix: build the train "
            f"DataLoader with batch_size=callback.micro_batch (in train_dataloader(), which runs after the plan).")
