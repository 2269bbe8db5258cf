"""``memwrap_trainer_kwargs(..., budget=, batch=)``: the per-device batch size and accumulation steps from a plan.

Trainer batches and accumulates itself with one batch size, so the plan is made once, from a sample of
the per-device global batch (``per_device_train_batch_size x gradient_accumulation_steps`` samples),
with a micro-batch that divides it (see :mod:`memwrap.techniques.budget.static`). transformers is not imported.

Example:
    >>> kwargs = memwrap_trainer_kwargs(model, args, budget="22GiB", batch=collator(samples[:32]))  # doctest: +SKIP
    >>> args.per_device_train_batch_size, args.gradient_accumulation_steps  # doctest: +SKIP
    (8, 4)
"""
from __future__ import annotations

from typing import Any

from memwrap.plugin.registry import get_optimizer_spec
from memwrap.runtime.batch_split import batch_size

__all__ = ["plan_trainer_split"]


def plan_trainer_split(model: Any, args: Any, budget: Any, batch: Any, margin: Any, checkpoint: Any,
                       optim: str | None) -> Any:
    """The :class:`~memwrap.techniques.budget.plan.BudgetChoice` for Trainer (nothing is changed here)."""
    # import cost: it loads the planner.
    from memwrap.techniques.budget.static import UNSET, plan_split

    if budget is None or batch is None:
        raise ValueError("memwrap_trainer_kwargs plans the batch split from budget= and a sample batch: give both, "
                         "e.g. memwrap_trainer_kwargs(model, args, budget='22GiB', batch=next(iter(loader))) where the "
                         "sample holds per_device_train_batch_size x gradient_accumulation_steps samples"
                         + (" (margin= applies to budget=)" if budget is None and margin is not None else "") + ".")
    global_batch = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps)
    n = batch_size(batch)
    if n != global_batch:
        raise ValueError(f"the sample batch has {n} samples but the per-device global batch is {global_batch} "
                         f"(per_device_train_batch_size={args.per_device_train_batch_size} x "
                         f"gradient_accumulation_steps={args.gradient_accumulation_steps}). Fix: pass a batch of "
                         f"{global_batch} samples, as the collator builds them, or set those args to the global batch "
                         "you want.")
    name = optim or getattr(getattr(args, "optim", None), "value", getattr(args, "optim", None)) or "adamw"
    try:
        name = get_optimizer_spec(name).name
    except ValueError:
        name = "adamw"  # Trainer's own optimizer: AdamW's state is the common, and a conservative, guess
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    hf_checkpointing = any(getattr(args, n, False) for n in ("gradient_checkpointing", "activation_checkpointing"))
    if hf_checkpointing:
        fixed = "full"  # Hugging Face's own checkpointing recomputes every layer: plan with that
    elif checkpoint is None:
        fixed = UNSET
    else:
        fixed = checkpoint
    device = "cuda" if getattr(args, "use_cpu", False) is False and _cuda() else "cpu"
    # Trainer's compute_loss returns the loss alone (its outputs are dropped before backward): planned as that loop.
    return plan_split(model, batch, budget, margin=margin, checkpoint=fixed, precision=precision, optim=name,
                      device_type=device, keep_outputs=False)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
