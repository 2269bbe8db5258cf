"""Hugging Face ``Trainer`` integration: memwrap's optimizers and checkpoint policies, nothing else.

Trainer keeps doing what it already does: gradient accumulation (``gradient_accumulation_steps``,
with DDP ``no_sync`` through accelerate), mixed precision (``fp16``/``bf16``), clipping
(``max_grad_norm``), the LR scheduler and distribution. memwrap adds only

* the optimizer, by any memwrap name or Hugging Face string (``"adamw_8bit"``, ``"adamw_bnb_8bit"``,
  a plugin's name), built on Trainer's own param groups (weight decay split), and
* activation checkpointing with memwrap's policies (``"auto"``, ``"selective"``, ``"every-2"``,
  ``"offload"``, class sets, callables), instead of ``gradient_checkpointing=True``, and
* for optimizers that update inside backward (LOMO, layer-wise GaLore/APOLLO), whose gradients are gone when Trainer
  clips, ``max_grad_norm`` applied exactly by memwrap's norm pass inside Trainer's backward
  (:mod:`memwrap.integrations.transformers.norm_pass`).

Without ``optim=``, ``args.optim`` is taken over only where memwrap builds the very optimizer Trainer
would (same maths, same hyperparameters); for any other ``args.optim`` Trainer keeps its own.

So ``memwrap.wrap`` is never used inside a Trainer run: accumulation or precision would be done twice.
For a plain loop, :func:`wrap_options` turns a ``TrainingArguments`` into ``wrap()`` options.

transformers is imported only when these functions run, never by ``import memwrap``.

Example:
    >>> from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,  # doctest: +SKIP
    ...                   **memwrap_trainer_kwargs(model, args, optim="adamw_8bit", checkpoint="auto"))
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from memwrap.config.training_args import plain_value
from memwrap.checkpointing.apply import apply_checkpointing, current_report, parse_checkpoint_option
from memwrap.config.options import options_from, parse_options
from memwrap.integrations.transformers.budget import plan_trainer_split
from memwrap.integrations.transformers.norm_pass import TrainerNormPass, check_trainer_updates_in_backward
from memwrap.plugin.registry import (ConversionWarning, OptimizerUnavailableError, UnknownOptimizerError,
                                     create_optimizer, get_optimizer_spec)
from memwrap.runtime.distributed import check_sharded_optimizer
from memwrap.runtime.module import WrappedModule

__all__ = ["memwrap_trainer_kwargs", "memwrap_optimizer_class", "wrap_options", "checkpoint_report",
           "trainer_hyperparameters", "trainer_param_groups", "trainer_optimizer"]

# Every optimizer plugin that declares ``trainer_kwargs`` builds Trainer's optimizer for its Hugging Face names with
# Trainer's hyperparameters (tests/test_hf_optimizers.py compares each against Trainer's own); those names are taken
# over from args.optim. These are not, and why (Trainer keeps its own):
_NOT_TAKEN_OVER = {
    "adamw_anyprecision": "torchdistx's AnyPrecisionAdamW (not installable from PyPI; Trainer fails on it)",
}
# What Trainer builds under the HF name closest to a memwrap-only optimizer, for the warnings.
_TRAINER_MEANING = {
    "torch_adafactor": ("adafactor", "transformers.Adafactor(scale_parameter=False, relative_step=False), whose lr is "
                                     "an absolute step size"),
}

def memwrap_optimizer_class(optim: str, model: nn.Module | None = None,
                            max_grad_norm: float | None = None) -> type[torch.optim.Optimizer]:
    """A stand-in optimizer class that builds memwrap's optimizer ``optim`` when called.

    Trainer calls ``optimizer_cls(param_groups, **kwargs)``; ``__new__`` returns the optimizer from
    :func:`memwrap.create_optimizer` (a real bitsandbytes/torch optimizer, not an instance of the
    stand-in), so Trainer keeps its weight-decay grouping and DTensor mesh splitting. A plain
    function would not do: Trainer treats non-class callables as zero-argument factory factories.

    ``max_grad_norm`` (with an optimizer that updates inside backward, and ``model``): the optimizer comes with
    memwrap's norm pass attached (:mod:`memwrap.integrations.transformers.norm_pass`, kept as
    ``optimizer.memwrap_norm_pass``), so Trainer's run is clipped exactly; :func:`memwrap_trainer_kwargs` passes it.

    Example:
        >>> cls = memwrap_optimizer_class("adamw")
        >>> type(cls(nn.Linear(2, 2).parameters(), lr=0.1)).__name__
        'AdamW'
    """

    spec = get_optimizer_spec(optim)  # unknown names fail now, listing the valid ones
    if max_grad_norm is not None and not (spec.updates_in_backward and model is not None):
        raise ValueError(f"memwrap_optimizer_class({optim!r}, max_grad_norm={max_grad_norm}): the norm pass is for "
                         "optimizers that update inside backward, over a model; Trainer clips any other one itself. "
                         "Fix: drop max_grad_norm (Trainer's own max_grad_norm applies), or pass the model.")

    class MemwrapOptimizer(torch.optim.Optimizer):
        __doc__ = f"Builds memwrap optimizer {spec.name!r} (see memwrap_optimizer_class)."

        def __new__(cls, params: Any, **hyperparameters: Any) -> torch.optim.Optimizer:
            optimizer = create_optimizer(spec.name, params, model=model, **hyperparameters)
            check_sharded_optimizer(optimizer)  # FSDP in Trainer: clear error instead of a kernel failure
            if max_grad_norm is not None:
                # Trainer clips after backward, when these optimizers have freed every gradient: memwrap clips
                # inside it. Kept on the optimizer, which Trainer holds for the run.
                optimizer.memwrap_norm_pass = TrainerNormPass(model, optimizer, max_grad_norm)
            return optimizer

    MemwrapOptimizer.__qualname__ = MemwrapOptimizer.__name__ = f"MemwrapOptimizer[{spec.name}]"
    return MemwrapOptimizer


def trainer_hyperparameters(args: Any, optim: str | None = None) -> dict[str, Any]:
    """The hyperparameters Trainer passes to its optimizer for ``optim`` (default ``args.optim``).

    Learning rate, Adam betas/eps where Trainer passes them, parsed ``optim_args`` (keys that do not
    apply to the optimizer raise ``ValueError``) and ``optim_target_modules``. Weight decay is not among
    them: Trainer puts it in its param groups (``args.weight_decay`` on most weights, 0.0 on biases and
    norm weights), which :func:`trainer_param_groups` builds; :func:`trainer_optimizer` does both.

    Example:
        >>> opt = memwrap.create_optimizer(args.optim, trainer_param_groups(model, args), model=model,  # doctest: +SKIP
        ...                                **trainer_hyperparameters(args))
    """

    name = _key(optim if optim is not None else getattr(args, "optim", None))
    spec = get_optimizer_spec(name)
    if spec.trainer_kwargs is not None:
        return dict(spec.trainer_kwargs(name, args))
    # A plugin that does not say how Trainer builds it: the learning rate, and Adam's betas/eps where it takes them.
    found: dict[str, Any] = {"lr": args.learning_rate}
    if "betas" in spec.carries and hasattr(args, "adam_beta1"):
        found["betas"] = (args.adam_beta1, args.adam_beta2)
    if "eps" in spec.carries and hasattr(args, "adam_epsilon"):
        found["eps"] = args.adam_epsilon
    return found


def trainer_param_groups(model: nn.Module, args: Any, optim: str | None = None) -> Any:
    """The param groups ``Trainer.create_optimizer()`` builds for ``optim`` (default ``args.optim``).

    Two groups, as Trainer makes them with its own ``get_decay_parameter_names``: the trainable parameters it decays
    with ``weight_decay=args.weight_decay``, and the others (biases, LayerNorm/RMSNorm weights) with 0.0. For the
    optimizers whose Trainer handler replaces those groups (GaLore/APOLLO build their own target groups, LOMO takes
    the model), the model itself, which :func:`memwrap.create_optimizer` splits the same way.

    Example:
        >>> groups = trainer_param_groups(model, args)  # doctest: +SKIP
        >>> [g["weight_decay"] for g in groups]  # doctest: +SKIP
        [0.1, 0.0]
    """
    from transformers import Trainer

    spec = get_optimizer_spec(_key(optim if optim is not None else getattr(args, "optim", None)))
    if spec.needs_model:
        return model
    # An instance method that reads nothing of the instance: Trainer's own rule, not a copy of it.
    decay = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def trainer_optimizer(model: nn.Module, args: Any, optim: str | None = None, **overrides: Any) -> torch.optim.Optimizer:
    """Trainer's optimizer for a plain loop: its param groups and hyperparameters, built by memwrap.

    ``memwrap.create_optimizer(name, trainer_param_groups(model, args), model=model, **trainer_hyperparameters(args))``
    with ``overrides`` on top; the same param groups and hyperparameters as ``Trainer(model, args).create_optimizer()``.

    Example:
        >>> optimizer = trainer_optimizer(model, args)  # doctest: +SKIP
        >>> model, optimizer = memwrap.wrap(model, optimizer, accumulate=args.gradient_accumulation_steps)  # doctest: +SKIP
    """

    name = _key(optim if optim is not None else getattr(args, "optim", None))
    return create_optimizer(name, trainer_param_groups(model, args, name), model=model,
                            **{**trainer_hyperparameters(args, name), **overrides})


def _key(name: Any) -> str:
    return str(plain_value(name)).strip().lower().replace("-", "_")  # as the registry normalizes names


def _unscheduled_layerwise(name: str, args: Any) -> str | None:
    """Why Trainer's own ``*_layerwise`` optimizer would train at another learning rate than memwrap's, or None.

    transformers 5.24 makes its per-parameter schedulers only when ``get_scheduler`` receives its
    ``LayerWiseDummyOptimizer``; Trainer hands it the accelerate-wrapped one, so its layer-wise GaLore/APOLLO train
    at a constant ``learning_rate`` whatever ``lr_scheduler_type`` says. memwrap's follow the schedule (Trainer's
    scheduler writes their param groups): the two agree exactly only under a constant schedule.
    """
    schedule = _key(getattr(args, "lr_scheduler_type", "linear"))
    # galore_adafactor_layerwise: transformers 5.24 cannot build its own (relative_step is set after the per-parameter
    # optimizers are made), so there is no Trainer training to keep.
    if not name.endswith("_layerwise") or name == "galore_adafactor_layerwise" or schedule == "constant":
        return None
    return (f"Trainer's own layer-wise optimizers never see lr_scheduler_type={schedule!r} (transformers builds the "
            "scheduler on the accelerate-wrapped optimizer, so its per-parameter schedulers are not made) and train at "
            f"a constant learning_rate={getattr(args, 'learning_rate', None)!r}, while memwrap's follow the schedule")


def _trainer_equivalent(args: Any) -> Any:
    """memwrap's spec for ``args.optim`` when memwrap builds Trainer's optimizer for it, else None."""

    name = _key(getattr(args, "optim", None))
    if name in _NOT_TAKEN_OVER or _unscheduled_layerwise(name, args) is not None:
        return None
    try:
        spec = get_optimizer_spec(name)
    except UnknownOptimizerError:  # its plugin is blocked or missing: Trainer can still build its own
        return None
    return spec if spec.trainer_kwargs is not None else None


def _keep_trainer_optimizer_warning(args: Any, checkpointing: bool) -> None:
    name = _key(getattr(args, "optim", None))
    layerwise = _unscheduled_layerwise(name, args)
    why = (f"Trainer's is {_NOT_TAKEN_OVER[name]}" if name in _NOT_TAKEN_OVER
           else f"{layerwise} (with lr_scheduler_type='constant' memwrap's is taken over: the same training)"
           if layerwise is not None else "memwrap has no optimizer that reproduces it exactly")
    warnings.warn(
        f"Trainer keeps its own optimizer for TrainingArguments(optim={name!r})"
        f"{' and memwrap only applies checkpointing' if checkpointing else ''}: {why}. To use a memwrap optimizer "
        f"anyway, pass optim='...' explicitly to memwrap_trainer_kwargs.", UserWarning, stacklevel=4)


def _differs_from_trainer(optim: str, spec: Any, args: Any) -> None:
    """Warn when an explicit ``optim`` is not what Trainer builds under that name, or its lr means something else."""

    name = _key(optim)
    layerwise = _unscheduled_layerwise(name, args)
    if layerwise is not None:
        warnings.warn(f"optim={optim!r}: {layerwise}. memwrap's is built, so the run follows the schedule and differs "
                      "from Trainer's own optim of that name.", ConversionWarning, stacklevel=4)
        return
    if spec.trainer_kwargs is not None and name not in _NOT_TAKEN_OVER:
        return  # built exactly as Trainer builds that name
    if name not in _TRAINER_MEANING and name not in _NOT_TAKEN_OVER and not spec.conversion_note:
        return
    if name in _TRAINER_MEANING:
        trainer = f" Trainer's own optim={_TRAINER_MEANING[name][0]!r} is {_TRAINER_MEANING[name][1]}."
    elif name in _NOT_TAKEN_OVER:
        trainer = f" Trainer's own optim={name!r} is {_NOT_TAKEN_OVER[name]}."
    else:
        trainer = ""
    warnings.warn(
        f"optim={optim!r} builds memwrap's {spec.name!r} ({(spec.description or spec.name).rstrip('.')}) with "
        f"lr=learning_rate={args.learning_rate!r}.{trainer} {spec.conversion_note}".rstrip(),
        ConversionWarning, stacklevel=4)


def memwrap_trainer_kwargs(model: nn.Module, args: Any = None, *, optim: str | None = None, checkpoint: Any = None,
                           budget: Any = None, batch: Any = None, margin: Any = None,
                           **optimizer_kwargs: Any) -> dict[str, Any]:
    """Keyword arguments for ``transformers.Trainer`` that use memwrap's optimizer and checkpointing.

    Args:
        model: the model given to Trainer (not a ``memwrap.wrap``'ped one); checkpointing is applied
            to it now, in place.
        args: the ``TrainingArguments`` (required): ``learning_rate``, Adam betas/epsilon and the
            default ``optim``; checked for conflicts with ``checkpoint``.
        optim: memwrap optimizer name or alias. Default: ``args.optim``, taken over for every Hugging Face
            name whose plugin says how Trainer builds it (``OptimizerSpec.trainer_kwargs``: all of
            ``OptimizerNames`` but ``adamw_anyprecision``, see docs/optimizers.md), with Trainer's
            hyperparameters (``optim_args``, ``optim_target_modules`` included); for any other ``args.optim``
            Trainer keeps its own optimizer (one warning says so) and only checkpointing is applied.
        checkpoint: a memwrap checkpoint option (``"auto"``, ``"selective"``, ``"every-2"``, a class set, ...);
            ``None`` leaves checkpointing alone. Needs ``gradient_checkpointing=False``
            (``activation_checkpointing`` in transformers 5) in ``args``.
        budget: memory one device may use (``"22GiB"``), as ``memwrap.wrap(budget=)``: with ``batch`` (one
            sample of the per-device global batch, ``per_device_train_batch_size x gradient_accumulation_steps``
            samples) memwrap plans on fake tensors the largest per-device batch size dividing it that fits, sets
            ``args.per_device_train_batch_size`` and ``args.gradient_accumulation_steps`` from it (the global batch
            is kept) and, unless ``checkpoint`` is given (``False``: none), the checkpoint policy. The choice is
            printed and kept as ``model.memwrap_budget_plan``. ``margin`` as in ``memwrap.plan``.
        **optimizer_kwargs: hyperparameters overriding those taken from ``args``.

    Returns:
        ``{"optimizer_cls_and_kwargs": (cls, kwargs)}``, or ``{}`` when Trainer keeps its own
        optimizer: pass it on with ``Trainer(..., **kwargs)``.

    Example:
        >>> kwargs = memwrap_trainer_kwargs(model, args, optim="adamw_bnb_8bit", checkpoint="selective")  # doctest: +SKIP
        >>> Trainer(model=model, args=args, train_dataset=ds, **kwargs).train()  # doctest: +SKIP
    """
    _check_model(model)
    _check_args(args, checkpoint)
    choice = None
    if budget is not None or batch is not None or margin is not None:  # plan only: the args change below

        choice = plan_trainer_split(model, args, budget, batch, margin, checkpoint, optim)
        hf_checkpointing = any(getattr(args, n, False) for n in ("activation_checkpointing", "gradient_checkpointing"))
        if checkpoint is None and not hf_checkpointing:  # else the user's (or Hugging Face's) checkpointing stays
            checkpoint = choice.checkpoint
    # Every check runs before checkpointing touches the model, so a refused call leaves it as it was.
    built = _optimizer_kwargs(model, args, optim, checkpoint, optimizer_kwargs)
    if choice is not None:
        args.per_device_train_batch_size, args.gradient_accumulation_steps = choice.micro_batch, choice.accumulate
        model.__dict__["memwrap_budget_plan"] = choice
    if checkpoint is not None and checkpoint is not False:
        how = parse_checkpoint_option(checkpoint)
        if how is not None:
            apply_checkpointing(model, **how)
    return built


def checkpoint_report(model: nn.Module) -> Any:
    """What :func:`memwrap_trainer_kwargs` (``checkpoint=...``) checkpointed on ``model``: a
    :class:`memwrap.checkpointing.apply.CheckpointReport` (``modules``, ``policy``, ``mode``, ``every``, ``offload``,
    ``classes``), or None when memwrap applied no checkpointing to it. (A ``memwrap.wrap``'ped model carries the
    same report as ``model.checkpoint_report``.)

    Example:
        >>> kwargs = memwrap_trainer_kwargs(model, args, checkpoint="auto")  # doctest: +SKIP
        >>> print(checkpoint_report(model))  # doctest: +SKIP
        checkpointed 2 module(s) (LlamaDecoderLayer x2); policy=auto, mode=full, every=1, offload=False: ...
    """

    if not isinstance(model, nn.Module):
        raise TypeError(f"checkpoint_report() takes the model given to memwrap_trainer_kwargs(), got "
                        f"{type(model).__name__}.")
    return current_report(model)


def _optimizer_kwargs(model: nn.Module, args: Any, optim: str | None, checkpoint: Any,
                      overrides: dict[str, Any]) -> dict[str, Any]:
    if optim is not None:
        spec = get_optimizer_spec(optim)
        name = _key(optim)
        _differs_from_trainer(optim, spec, args)
    else:
        spec = _trainer_equivalent(args)
        if spec is None:
            if overrides:  # they were meant for memwrap's optimizer, which is not built: never drop them silently
                raise TypeError(
                    f"optimizer keyword arguments {sorted(overrides)} were given, but Trainer keeps its own optimizer "
                    f"for optim={plain_value(getattr(args, 'optim', None))!r}. Fix: pass optim='...' to build a memwrap "
                    "optimizer, or set them in TrainingArguments (optim_args).")
            _keep_trainer_optimizer_warning(args, checkpoint not in (None, False))
            return {}
        name = _key(args.optim)
    ok, hint = spec.available()
    if not ok:  # fail before Trainer's setup, not at its first step
        raise OptimizerUnavailableError(f"optimizer {spec.name!r} is not available: {hint}")
    hyperparameters = {**trainer_hyperparameters(args, name), **overrides}
    clip = None
    if spec.updates_in_backward:
        # Trainer clips after its backward, by when these optimizers have updated every parameter and freed its
        # gradient (Trainer's own LOMO and layer-wise GaLore clip nothing): memwrap's norm pass clips inside it.
        clip = check_trainer_updates_in_backward(model, args, spec.name, checkpoint)
    if spec.needs_model:
        # Trainer hands a "model" keyword to the optimizer in place of its param groups, as for its own GaLore/LOMO.
        hyperparameters["model"] = model
    return {"optimizer_cls_and_kwargs": (memwrap_optimizer_class(spec.name, model, clip), hyperparameters)}


def _check_model(model: Any) -> None:
    # Trainer accumulates, scales and clips itself: a wrap()'ped model (with its wrapped optimizer) would do it
    # a second time, e.g. one real update per gradient_accumulation_steps**2 micro-batches.
    if isinstance(model, WrappedModule):
        raise TypeError(
            "the model is memwrap.wrap()'ped; Trainer already does accumulation, mixed precision and clipping, so "
            "wrap()'s would apply twice. Fix: give Trainer the plain model (memwrap.unwrap(model)) and its own "
            "optimizer, and use memwrap_trainer_kwargs(model, args, optim=..., checkpoint=...) instead of wrap().")


def _check_args(args: Any, checkpoint: Any) -> None:
    if args is None:
        # Without them the optimizer would silently train with the backend's lr/betas/eps, not the run's.
        raise TypeError(
            "memwrap_trainer_kwargs needs the TrainingArguments (learning_rate, adam_beta1/2, adam_epsilon, optim, "
            "gradient_checkpointing). Fix: memwrap_trainer_kwargs(model, args, optim=..., checkpoint=...) with the "
            "same args given to Trainer.")
    if isinstance(args, type):
        raise TypeError("pass a TrainingArguments instance, not the class")
    # transformers 5 renamed gradient_checkpointing to activation_checkpointing (the old name is an alias).
    hf_name = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)), None)
    if checkpoint not in (None, False) and hf_name is not None:
        raise ValueError(
            f"checkpoint={checkpoint!r} and TrainingArguments({hf_name}=True) would checkpoint the model twice "
            f"(memwrap's hooks and Hugging Face's own). Fix: set {hf_name}=False and let memwrap checkpoint, or "
            "drop checkpoint= to keep Hugging Face's."
        )


def wrap_options(args: Any, **overrides: Any) -> dict[str, Any]:
    """``memwrap.wrap`` options for a plain loop from a ``TrainingArguments`` (e.g. the seeds' template).

    :func:`memwrap.options_from` with ``overrides``: it reads ``gradient_accumulation_steps``,
    ``fp16``/``bf16``/``tf32``, ``gradient_checkpointing`` (``activation_checkpointing``), ``optim`` (with its
    ``optim_target_modules``/``optim_args``) and ``max_grad_norm``, and names every other field that differs from its
    default in one warning, each with how a plain loop applies it (the optimizer you build, the scheduler, your
    ``DataLoader``, ``torch.compile`` after ``wrap()``, ...): the same fields, the same warning. ``overrides`` win,
    under memwrap's or Hugging Face's names, and values come back as plain strings (not HF enums).

    Example:
        >>> from types import SimpleNamespace
        >>> wrap_options(SimpleNamespace(gradient_accumulation_steps=8, fp16=True, optim="adamw_bnb_8bit"))
        {'gradient_accumulation_steps': 8, 'fp16': True, 'optim': 'adamw_bnb_8bit'}
    """

    # options_from's warning names the caller of options_from: re-issued from here, it names the caller of this one.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = options_from(args)
    for found in caught:
        warnings.warn(found.message, found.category, stacklevel=2)
    options = {k: plain_value(v) for k, v in options.items()}  # plain strings, not HF enums
    # Overrides given under memwrap's names replace the Hugging Face names they alias.
    for alias, target in (("gradient_accumulation_steps", "accumulate"), ("gradient_checkpointing", "checkpoint"),
                          ("activation_checkpointing", "checkpoint"), ("fp16", "precision"), ("bf16", "precision"),
                          ("tf32", "precision")):
        if target in overrides:
            options.pop(alias, None)
    options = {**options, **overrides}
    parse_options(**options)
    return options
