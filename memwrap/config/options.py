"""The options of ``wrap()``: one frozen dataclass, Hugging Face aliases, validation.

Every option has a neutral default, so ``wrap(model, optimizer)`` changes nothing about the
training maths; each option turns on exactly one concern.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

from memwrap.errors import closest_hint, require_name
from memwrap.precision.base import get_precision_class
from memwrap.checkpointing.policies import parse_checkpoint_option
from memwrap.config.training_args import warn_unapplied
from memwrap.plugin.registry import conversion_hyperparameters
from memwrap.precision.loss_scale import check_scaler_option

__all__ = ["Options", "parse_options", "options_from", "given_names", "HF_ALIASES"]


@dataclasses.dataclass(frozen=True)
class Options:
    """Validated options of :func:`memwrap.wrap`.

    Example:
        >>> parse_options(precision="bf16", gradient_accumulation_steps=4).accumulate
        4
    """

    precision: str = "fp32"
    accumulate: int = 1
    max_grad_norm: float | None = None
    count_items: Callable[[Any], int] | None = None
    checkpoint: Any = None
    optim: str | None = None
    on_nonfinite: str = "skip"
    monitor: int | None = None
    scaler: dict[str, Any] | None = None  # fp16 GradScaler settings (memwrap.precision.loss_scale)
    compensation: str | None = None  # how a precision without master weights keeps small updates (bf16-true)
    step_in_backward: bool = False  # each parameter steps as soon as its gradient is final (memwrap.techniques.step_in_backward)
    chunked_loss: bool | int = False  # a model's loss from labels without whole logits; int: tokens per chunk (memwrap.techniques.loss_head)
    budget: int | None = None  # bytes one device may use: micro-batch and unset options planned per batch (memwrap.techniques.budget.plan)
    margin: Any = None  # room kept free beyond the predicted peak under budget= (memwrap.memory.margin.Margin.parse)
    budget_may_change: tuple[str, ...] = ()  # options budget= may choose besides checkpointing: "precision", "optim"
    # Settings of the optim= optimizer your optimizer has no counterpart for, under Trainer's names: GaLore/APOLLO's
    # target nn.Linear layers, and optim_args ("rank=64,scale=0.25" or a dict) parsed as Trainer parses them.
    optim_target_modules: Any = None
    optim_args: Any = None

    def to_kwargs(self) -> dict[str, Any]:
        """The options that differ from the defaults, ready for ``wrap(**kwargs)``."""
        default = Options()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(Options))
# The Hugging Face TrainingArguments names that users know from the seeds.
HF_ALIASES = ("gradient_accumulation_steps", "fp16", "bf16", "tf32", "gradient_checkpointing",
              "activation_checkpointing", "optim", "max_grad_norm")  # transformers 5 renamed gradient_checkpointing
ON_NONFINITE = ("skip", "raise")
# The option each Hugging Face name sets (max_grad_norm and optim are spelled the same in both).
ALIAS_TARGETS = {"gradient_accumulation_steps": "accumulate", "fp16": "precision", "bf16": "precision",
                 "tf32": "precision", "gradient_checkpointing": "checkpoint", "activation_checkpointing": "checkpoint"}


def given_names(raw: dict[str, Any]) -> set[str]:
    """The options a ``wrap()`` call set, under memwrap's names (a Hugging Face flag set to False sets nothing).

    Example:
        >>> sorted(given_names({"gradient_accumulation_steps": 4, "bf16": True, "fp16": False, "budget": "8GiB"}))
        ['accumulate', 'budget', 'precision']
    """
    return {ALIAS_TARGETS.get(k, k) for k, v in raw.items() if k not in ALIAS_TARGETS or v}


def parse_options(**raw: Any) -> Options:
    """Validate keyword options (memwrap names or Hugging Face aliases) into :class:`Options`.

    Raises ``TypeError`` for unknown names and ``ValueError`` for bad values; both messages name
    the fix.

    Example:
        >>> parse_options(fp16=True, gradient_checkpointing=True).precision
        'fp16'
    """
    unknown = [k for k in raw if k not in OPTION_NAMES and k not in HF_ALIASES]
    if unknown:
        name = unknown[0]
        raise TypeError(
            f"unknown option {name!r}; valid options: {', '.join(OPTION_NAMES)} "
            f"(Hugging Face names accepted: {', '.join(HF_ALIASES)}).{closest_hint(name, OPTION_NAMES + HF_ALIASES)}"
        )
    values = _resolve_aliases(raw)
    _validate(values)
    return Options(**values)


def _resolve_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    values = {k: v for k, v in raw.items() if k in OPTION_NAMES}

    def take(alias: str, target: str, value: Any) -> None:
        if target in values and values[target] != value:
            raise ValueError(
                f"{alias}={raw[alias]!r} conflicts with {target}={values[target]!r}; "
                f"give the setting once (memwrap name or Hugging Face name, not both)."
            )
        values[target] = value

    if "gradient_accumulation_steps" in raw:
        take("gradient_accumulation_steps", "accumulate", raw["gradient_accumulation_steps"])
    flags = [k for k in ("fp16", "bf16") if raw.get(k)]
    if len(flags) > 1:
        raise ValueError("fp16=True and bf16=True were both given; choose one mixed-precision mode.")
    if flags:
        take(flags[0], "precision", flags[0])
    elif raw.get("tf32"):
        take("tf32", "precision", "tf32")
    for alias in ("gradient_checkpointing", "activation_checkpointing"):
        if raw.get(alias):
            take(alias, "checkpoint", values.get("checkpoint") or "auto")
    if raw.get("optim") is not None:
        optim = raw["optim"]
        take("optim", "optim", getattr(optim, "value", optim))  # HF's OptimizerNames is a str enum
    if "max_grad_norm" in raw:
        norm = raw["max_grad_norm"]
        # HF uses 0 to mean "no clipping".
        values["max_grad_norm"] = None if norm in (None, 0) else norm
    return values


def _validate(values: dict[str, Any]) -> None:
    # The precision plugins decide what exists; names and aliases ("BF16", "bf16-mixed") become the canonical name,
    # and the plugin checks its own settings (compensation=).
    precision_class = get_precision_class(values.get("precision", "fp32"))
    precision = values["precision"] = precision_class.name
    precision_class(compensation=values.get("compensation"))
    if not isinstance(values.get("step_in_backward", False), bool):
        raise ValueError(f"step_in_backward must be True or False, got {values['step_in_backward']!r}.")
    chunked = values["chunked_loss"] = False if values.get("chunked_loss") is None else values.get("chunked_loss", False)
    if not isinstance(chunked, bool) and (not isinstance(chunked, numbers.Integral) or chunked < 1):
        raise ValueError(f"chunked_loss must be True, False or an int >= 1 (tokens per chunk), got {chunked!r}. "
                         "Fix: chunked_loss=True picks the chunk size; see docs/chunked_loss.md.")
    _validate_budget(values)
    accumulate = values.get("accumulate", 1)
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) or accumulate < 1:
        raise ValueError(
            f"accumulate must be an int >= 1 (micro-batches per optimizer update), got {accumulate!r}. "
            f"Fix: e.g. accumulate=8 for a global batch of 8 micro-batches; 1 disables accumulation."
        )
    values["accumulate"] = int(accumulate)
    norm = values.get("max_grad_norm")
    if norm is not None and (isinstance(norm, bool) or not isinstance(norm, numbers.Real) or not norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None (no clipping), got {norm!r}.")
    count = values.get("count_items")
    if count is not None and not callable(count):
        raise ValueError(
            f"count_items must be a callable(batch) -> int (e.g. lambda b: int((b['labels'] != -100).sum())), got {count!r}."
        )
    if values.get("optim") is not None:
        require_name(values["optim"], "optim", "optim={0}", "adamw_8bit")
    _validate_optim_settings(values)
    mode = values.get("on_nonfinite", "skip")
    if mode not in ON_NONFINITE:
        raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {mode!r}.{closest_hint(mode, ON_NONFINITE)}")
    if values.get("checkpoint") is not None:
        # Here rather than when the model is wrapped, so that estimate() and plan() reject a policy typo
        # ("fulll") with the same message before any tracing.
        parse_checkpoint_option(values["checkpoint"])

    values["scaler"] = check_scaler_option(values.get("scaler"), precision,
                                           uses_scaler=bool(get_precision_class(precision).uses_scaler))
    monitor = values.get("monitor")
    if monitor is not None and (isinstance(monitor, bool) or not isinstance(monitor, numbers.Integral) or monitor < 1):
        raise ValueError(f"monitor must be None or an int >= 1 (log memory every k updates), got {monitor!r}.")


def _validate_optim_settings(values: dict[str, Any]) -> None:
    """``optim_target_modules=`` / ``optim_args=`` belong to ``optim=`` and are checked against it (memwrap.plugin.registry)."""
    targets, optim_args = values.get("optim_target_modules"), values.get("optim_args")
    if isinstance(targets, list):
        values["optim_target_modules"] = targets = tuple(targets)  # Options is frozen: a hashable value
    if isinstance(optim_args, dict):
        values["optim_args"] = optim_args = tuple(sorted(optim_args.items()))
    if targets is None and not optim_args:
        return
    if values.get("optim") is None:
        given = "optim_target_modules" if targets is not None else "optim_args"
        raise ValueError(f"{given}= sets up the optimizer that optim= builds, and no optim= was given. Fix: add "
                         "optim='galore_adamw' (or another name), or set it on the optimizer you build yourself "
                         "(memwrap.create_optimizer(name, model, target_modules=..., rank=...)).")

    conversion_hyperparameters(values["optim"], optim_args=dict(optim_args) if isinstance(optim_args, tuple)
                               else optim_args, target_modules=targets)


def _validate_budget(values: dict[str, Any]) -> None:
    """``budget=`` (a size with its unit), ``margin=`` and ``budget_may_change=``; see memwrap.techniques.budget.plan."""
    if values.get("budget") is not None:
        # import cost: memwrap.memory's package loads the planner.
        from memwrap.memory.budget import parse_budget

        values["budget"] = parse_budget(values["budget"], what="budget")
    if values.get("margin") is not None:
        # import cost: memwrap.memory's package loads the planner.
        from memwrap.memory.margin import Margin

        Margin.parse(values["margin"])
    may = values.get("budget_may_change") or ()
    may = (may,) if isinstance(may, str) else may
    allowed = ("precision", "optim")
    if not isinstance(may, (tuple, list, set, frozenset)) or any(m not in allowed for m in may):
        raise ValueError(f"budget_may_change={values.get('budget_may_change')!r} is not valid; give a tuple of "
                         f"{allowed} (options the budget may choose besides the micro-batch and checkpointing), e.g. "
                         "budget_may_change=('precision', 'optim').")
    values["budget_may_change"] = tuple(sorted(set(may)))


def options_from(training_args: Any) -> dict[str, Any]:
    """Read memwrap options from any object with Hugging Face ``TrainingArguments`` attributes.

    Duck-typed, so transformers is never imported. Returns keyword arguments for ``wrap``. Every other field whose
    value is not Hugging Face's default (learning rate, scheduler, batch size, ``dataloader_*``, ``torch_compile``,
    ...) is named in one ``UserWarning``, each with how a plain loop applies it (:mod:`memwrap.config.training_args`).

    Example:
        >>> from types import SimpleNamespace
        >>> options_from(SimpleNamespace(gradient_accumulation_steps=8, bf16=True))
        {'gradient_accumulation_steps': 8, 'bf16': True}
    """
    found = {name: getattr(training_args, name) for name in HF_ALIASES if hasattr(training_args, name)}
    if not found:
        raise TypeError(
            f"{type(training_args).__name__} has none of the TrainingArguments attributes "
            f"{', '.join(HF_ALIASES)}; pass a TrainingArguments-like object or memwrap options directly."
        )
    found = {k: v for k, v in found.items() if v is not None}
    # TrainingArguments always has an optim; its default only means "AdamW", which the user's own
    # optimizer already is or deliberately is not: convert only when one was chosen.
    default = _field_default(training_args, "optim")
    if "optim" in found and default is not None and getattr(found["optim"], "value", found["optim"]) == getattr(default, "value", default):
        del found["optim"]
    if "gradient_checkpointing" in found:
        found.pop("activation_checkpointing", None)  # transformers 5 keeps both names for one setting
    if "optim" in found:  # the chosen optimizer's own settings, under Trainer's names (GaLore's targets, optim_args)
        found.update({n: getattr(training_args, n) for n in ("optim_target_modules", "optim_args")
                      if getattr(training_args, n, None)})
    parse_options(**found)  # validate now, so a bad TrainingArguments fails here and not inside wrap()

    # Every other field that is not at its default is named, with how a plain loop applies it: none is dropped silently.
    warn_unapplied(training_args, read={*HF_ALIASES, *found})
    return found


def _field_default(obj: Any, name: str) -> Any:
    field = getattr(type(obj), "__dataclass_fields__", {}).get(name)
    if field is None or field.default is dataclasses.MISSING:
        return None
    return field.default
