"""Hugging Face ``Trainer`` integration: memwrap's optimizers and checkpoint policies, nothing else.

Trainer keeps doing what it already does: gradient accumulation (``gradient_accumulation_steps``,
with DDP ``no_sync`` through accelerate), mixed precision (``fp16``/``bf16``), clipping
(``max_grad_norm``), the LR scheduler and distribution. memwrap adds only

* the optimizer, by any memwrap name or Hugging Face string (``"adamw_8bit"``, ``"adamw_bnb_8bit"``,
  ``"adafactor"``, a plugin's name), built on Trainer's own param groups (weight decay split), and
* activation checkpointing with memwrap's policies (``"auto"``, ``"selective"``, ``"every-2"``,
  ``"offload"``, class sets, callables), instead of ``gradient_checkpointing=True``.

So ``memwrap.wrap`` is never used inside a Trainer run: accumulation or precision would be done twice.
For a plain loop, :func:`wrap_options` turns a ``TrainingArguments`` into ``wrap()`` options.

transformers is imported only when these functions run, never by ``import memwrap``.

Example:
    >>> from memwrap.integrations.transformers import memwrap_trainer_kwargs
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,  # doctest: +SKIP
    ...                   **memwrap_trainer_kwargs(model, args, optim="adamw_8bit", checkpoint="auto"))
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["memwrap_trainer_kwargs", "memwrap_optimizer_class", "wrap_options"]

# TrainingArguments fields a plain loop must handle itself: wrap() has no equivalent.
_LOOP_FIELDS = ("per_device_train_batch_size", "torch_compile", "dataloader_pin_memory", "dataloader_num_workers")


def memwrap_optimizer_class(optim: str, model: nn.Module | None = None) -> type[torch.optim.Optimizer]:
    """A stand-in optimizer class that builds memwrap's optimizer ``optim`` when called.

    Trainer calls ``optimizer_cls(param_groups, **kwargs)``; ``__new__`` returns the optimizer from
    :func:`memwrap.create_optimizer` (a real bitsandbytes/torch optimizer, not an instance of the
    stand-in), so Trainer keeps its weight-decay grouping and DTensor mesh splitting. A plain
    function would not do: Trainer treats non-class callables as zero-argument factory factories.

    Example:
        >>> cls = memwrap_optimizer_class("adamw")
        >>> type(cls(nn.Linear(2, 2).parameters(), lr=0.1)).__name__
        'AdamW'
    """
    from memwrap.registry import get_optimizer_spec

    spec = get_optimizer_spec(optim)  # unknown names fail now, listing the valid ones

    class MemwrapOptimizer(torch.optim.Optimizer):
        __doc__ = f"Builds memwrap optimizer {spec.name!r} (see memwrap_optimizer_class)."

        def __new__(cls, params: Any, **hyperparameters: Any) -> torch.optim.Optimizer:
            from memwrap.distributed import check_sharded_optimizer
            from memwrap.registry import create_optimizer

            optimizer = create_optimizer(spec.name, params, model=model, **hyperparameters)
            check_sharded_optimizer(optimizer)  # FSDP in Trainer: clear error instead of a kernel failure
            return optimizer

    MemwrapOptimizer.__qualname__ = MemwrapOptimizer.__name__ = f"MemwrapOptimizer[{spec.name}]"
    return MemwrapOptimizer


def _hyperparameters(spec: Any, args: Any) -> dict[str, Any]:
    """Trainer's optimizer hyperparameters that ``spec`` understands (weight decay lives in the groups)."""
    if args is None:
        return {}
    found: dict[str, Any] = {"lr": args.learning_rate}
    if "betas" in spec.carries and hasattr(args, "adam_beta1"):
        found["betas"] = (args.adam_beta1, args.adam_beta2)
    if "eps" in spec.carries and hasattr(args, "adam_epsilon"):
        found["eps"] = args.adam_epsilon
    return found


def _optim_name(optim: str | None, args: Any) -> str:
    if optim is not None:
        return optim
    name = getattr(args, "optim", None)
    if name is None:
        raise ValueError("memwrap_trainer_kwargs needs optim='...' (e.g. 'adamw_8bit') or TrainingArguments to read it from.")
    return getattr(name, "value", name)  # OptimizerNames is a str enum


def memwrap_trainer_kwargs(model: nn.Module, args: Any = None, *, optim: str | None = None, checkpoint: Any = None,
                           **optimizer_kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Trainer`` that use memwrap's optimizer and checkpointing.

    Args:
        model: the model given to Trainer; checkpointing is applied to it now, in place.
        args: the ``TrainingArguments`` (for ``learning_rate``, Adam betas/epsilon and the default
            ``optim``); checked for conflicts with ``checkpoint``.
        optim: memwrap optimizer name or alias; default ``args.optim`` (HF strings such as
            ``"adamw_bnb_8bit"`` resolve to memwrap's ``adamw_8bit``).
        checkpoint: a memwrap checkpoint option (``"auto"``, ``"selective"``, ``"every-2"``, a class set, ...);
            ``None`` leaves checkpointing alone. Needs ``gradient_checkpointing=False``
            (``activation_checkpointing`` in transformers 5) in ``args``.
        **optimizer_kwargs: hyperparameters overriding those taken from ``args``.

    Returns:
        ``{"optimizer_cls_and_kwargs": (cls, kwargs)}``: pass it on with ``Trainer(..., **kwargs)``.

    Example:
        >>> kwargs = memwrap_trainer_kwargs(model, args, optim="adamw_bnb_8bit", checkpoint="selective")  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=ds, **kwargs).train()  # doctest: +SKIP
    """
    from memwrap.registry import get_optimizer_spec

    if args is not None:
        _check_args(args, checkpoint)
    name = _optim_name(optim, args)
    spec = get_optimizer_spec(name)
    ok, hint = spec.available()
    if not ok:  # fail before Trainer's setup, not at its first step
        from memwrap.registry import OptimizerUnavailableError

        raise OptimizerUnavailableError(f"optimizer {spec.name!r} is not available: {hint}")
    if checkpoint is not None and checkpoint is not False:
        from memwrap.checkpointing import apply_checkpointing, parse_checkpoint_option

        how = parse_checkpoint_option(checkpoint)
        if how is not None:
            apply_checkpointing(model, **how)
    hyperparameters = {**_hyperparameters(spec, args), **optimizer_kwargs}
    return {"optimizer_cls_and_kwargs": (memwrap_optimizer_class(spec.name, model), hyperparameters)}


def _check_args(args: Any, checkpoint: Any) -> None:
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name is an alias).
    hf_name = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)), None)
    if checkpoint not in (None, False) and hf_name is not None:
        raise ValueError(
            f"checkpoint={checkpoint!r} and TrainingArguments({hf_name}=True) would checkpoint the model twice "
            f"(memwrap's hooks and Hugging Face's own). Fix: set {hf_name}=False and let memwrap checkpoint, or "
            "drop checkpoint= to keep Hugging Face's."
        )
    if isinstance(args, type):
        raise TypeError("pass a TrainingArguments instance, not the class")


def wrap_options(args: Any, **overrides: Any) -> dict[str, Any]:
    """``memwrap.wrap`` options for a plain loop from a ``TrainingArguments`` (e.g. the seeds' template).

    Reads ``gradient_accumulation_steps``, ``fp16``/``bf16``/``tf32``, ``gradient_checkpointing``,
    ``optim`` and ``max_grad_norm`` (see :func:`memwrap.options_from`); ``overrides`` win. Fields a
    plain loop handles itself (batch size, ``torch_compile``, data-loader settings) are named in one
    warning when they differ from the defaults, so nothing is silently dropped.

    Example:
        >>> from types import SimpleNamespace
        >>> wrap_options(SimpleNamespace(gradient_accumulation_steps=8, fp16=True, optim="adamw_bnb_8bit"))
        {'gradient_accumulation_steps': 8, 'fp16': True, 'optim': 'adamw_bnb_8bit'}
    """
    from memwrap.config import options_from, parse_options

    options = options_from(args)
    options = {k: getattr(v, "value", v) for k, v in options.items()}  # plain strings, not HF enums
    # Overrides given under memwrap's names replace the Hugging Face names they alias.
    for alias, target in (("gradient_accumulation_steps", "accumulate"), ("gradient_checkpointing", "checkpoint"),
                          ("fp16", "precision"), ("bf16", "precision"), ("tf32", "precision")):
        if target in overrides:
            options.pop(alias, None)
    options = {**options, **overrides}
    parse_options(**options)
    ignored = [f"{name}={getattr(args, name)!r}" for name in _LOOP_FIELDS if _differs(args, name)]
    if ignored:
        warnings.warn(
            f"TrainingArguments fields with no wrap() equivalent, to handle in your loop: {', '.join(ignored)} "
            "(batch size and workers go to your DataLoader, torch_compile is torch.compile(model)).",
            stacklevel=2,
        )
    return options


def _differs(args: Any, name: str) -> bool:
    defaults = {"per_device_train_batch_size": 8, "torch_compile": False, "dataloader_pin_memory": True,
                "dataloader_num_workers": 0}
    return hasattr(args, name) and getattr(args, name) != defaults[name]
