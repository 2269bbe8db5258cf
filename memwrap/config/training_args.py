"""The ``TrainingArguments`` fields ``wrap()`` does not apply, each named with how a plain loop applies it.

:func:`memwrap.options_from` (and ``memwrap.integrations.transformers.trainer.wrap_options``, which calls it) returns the
fields that are ``wrap()`` options. Every other field whose value is not Hugging Face's default is named in one
warning, grouped by where it goes, each with the call that applies it: the optimizer you build, the LR scheduler,
your ``DataLoader``, ``torch.compile`` after ``wrap()``, and Trainer-only settings. Nothing is dropped in silence.

Duck-typed: transformers is never imported. A dataclass (``TrainingArguments``) is compared with a default instance
of its own class; any other object with the fields below, with Hugging Face's documented defaults.

Example:
    >>> from types import SimpleNamespace
    >>> unapplied(SimpleNamespace(per_device_train_batch_size=2, torch_compile=True), read=())
    {'per_device_train_batch_size': '2', 'torch_compile': 'True'}
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any

__all__ = ["plain_value", "unapplied", "warn_unapplied"]

# Where each field goes in a plain loop, and how: (group, field -> how; "{v}" is the field's value).
_HOMES: tuple[tuple[str, dict[str, str]], ...] = (
    ("optimizer (set them on the optimizer you pass to wrap(); a conversion to another optimizer keeps its values)", {
        "learning_rate": "AdamW(params, lr={v})",
        "weight_decay": "AdamW(params, weight_decay={v}) (Trainer's groups exempt biases and norm weights)",
        "adam_beta1": "AdamW(params, betas=({v}, beta2))",
        "adam_beta2": "AdamW(params, betas=(beta1, {v}))",
        "adam_epsilon": "AdamW(params, eps={v})",
        "optim_args": "the optimizer's own keywords (wrap() reads them only along with a chosen optimizer name)",
        "optim_target_modules": "the low-rank optimizer's target_modules (wrap() reads them only along with a chosen optimizer name)",
    }),
    ("LR scheduler and run length (build the scheduler on the returned optimizer, then memwrap.wrap(scheduler))", {
        "lr_scheduler_type": "transformers.get_scheduler({v}, optimizer, num_warmup_steps, num_training_steps)",
        "lr_scheduler_kwargs": "scheduler_specific_kwargs={v} of get_scheduler",
        "warmup_steps": "num_warmup_steps={v}",
        "warmup_ratio": "num_warmup_steps=int({v} * num_training_steps)",
        "num_train_epochs": "your loop's number of epochs",
        "max_steps": "your loop's number of updates (optimizer.updates counts them)",
    }),
    ("data loader (your DataLoader's own arguments)", {
        "per_device_train_batch_size": "DataLoader(batch_size={v}): one micro-batch; wrap(accumulate=) sums the window",
        "dataloader_num_workers": "DataLoader(num_workers={v})",
        "dataloader_pin_memory": "DataLoader(pin_memory={v})",
        "dataloader_drop_last": "DataLoader(drop_last={v})",
        "dataloader_persistent_workers": "DataLoader(persistent_workers={v})",
        "dataloader_prefetch_factor": "DataLoader(prefetch_factor={v})",
    }),
    ("compile (after wrap(), and not together with checkpoint=: see docs/compile.md)", {
        "torch_compile": "model = torch.compile(model) after wrap()",
        "torch_compile_backend": "torch.compile(model, backend={v})",
        "torch_compile_mode": "torch.compile(model, mode={v})",
    }),
    ("checkpointing (memwrap's checkpoint= policies take no Hugging Face kwargs)", {
        "gradient_checkpointing_kwargs": "checkpoint={{'policy': ..., 'mode': ...}} instead",
        "activation_checkpointing_kwargs": "checkpoint={{'policy': ..., 'mode': ...}} instead",
    }),
    ("seed", {"seed": "torch.manual_seed({v}) before building the model"}),
)
# Hugging Face defaults of those fields, for duck-typed templates that carry no dataclass defaults.
_HF_DEFAULTS = {"learning_rate": 5e-05, "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999,
                "adam_epsilon": 1e-08, "optim_args": None, "optim_target_modules": None, "lr_scheduler_type": "linear", "lr_scheduler_kwargs": None,
                "warmup_steps": 0, "warmup_ratio": None, "num_train_epochs": 3.0, "max_steps": -1,
                "per_device_train_batch_size": 8, "dataloader_num_workers": 0, "dataloader_pin_memory": True,
                "dataloader_drop_last": False, "dataloader_persistent_workers": False,
                "dataloader_prefetch_factor": None, "torch_compile": False, "torch_compile_backend": None,
                "torch_compile_mode": None, "gradient_checkpointing_kwargs": None,
                "activation_checkpointing_kwargs": None, "seed": 42}
# transformers 5 mirrors the deprecated name into the new one: name the setting once.
_MIRRORED = {"gradient_checkpointing_kwargs": "activation_checkpointing_kwargs"}
_NOT_A_SETTING = ("output_dir",)  # where Trainer writes; a plain loop has nothing to apply


def plain_value(value: Any) -> Any:
    """A Hugging Face str enum's value (``OptimizerNames.ADAMW_TORCH`` -> ``'adamw_torch'``); anything else as is."""
    return getattr(value, "value", value)  # HF's OptimizerNames / SchedulerType are str enums


def unapplied(args: Any, read: Any) -> dict[str, str]:
    """``{field: short repr}`` of every field of ``args`` not in ``read`` whose value is not Hugging Face's default.

    ``read`` holds the fields ``options_from`` turned into ``wrap()`` options (and their aliases).

    Example:
        >>> from types import SimpleNamespace
        >>> unapplied(SimpleNamespace(learning_rate=5e-05, seed=0), read=())
        {'seed': '0'}
    """
    changed = {}
    for name, default in _defaults(args).items():
        if name in read or name in _NOT_A_SETTING or not hasattr(args, name):
            continue
        value = getattr(args, name)
        if plain_value(value) == plain_value(default):
            continue
        if name in _MIRRORED and getattr(args, _MIRRORED[name], None) == value:
            continue
        text = repr(plain_value(value))
        changed[name] = text if len(text) <= 60 else text[:57] + "..."
    return changed


def warn_unapplied(args: Any, read: Any, stacklevel: int = 3) -> None:
    """One ``UserWarning`` naming each field :func:`unapplied` finds, with how a plain loop applies it.

    Example:
        >>> from types import SimpleNamespace
        >>> warn_unapplied(SimpleNamespace(dataloader_num_workers=4), read=())  # doctest: +SKIP
        UserWarning: TrainingArguments fields that wrap() does not apply, ...: dataloader_num_workers=4 -> DataLoader(num_workers=4).
    """
    changed = unapplied(args, read)
    if not changed:
        return
    parts = []
    for home, hows in _HOMES:
        mine = [f"{n}={changed[n]} -> {how.format(v=changed[n])}" for n, how in hows.items() if n in changed]
        for n in hows:
            changed.pop(n, None)
        if mine:
            parts.append(f"{home}: {'; '.join(mine)}")
    if changed:
        parts.append("other Trainer settings (apply those your loop needs): "
                     + ", ".join(f"{n}={v}" for n, v in changed.items()))
    warnings.warn("TrainingArguments fields that wrap() does not apply, to handle in your loop: "
                  + " | ".join(parts) + ".", UserWarning, stacklevel=stacklevel)


def _defaults(args: Any) -> dict[str, Any]:
    """Field defaults to compare ``args`` with: a default instance of its class where one can be built."""
    if not dataclasses.is_dataclass(args):
        return dict(_HF_DEFAULTS)  # duck-typed: only the fields whose default is known
    fields = [f for f in dataclasses.fields(args) if f.init]
    try:
        # __post_init__ normalizes values (report_to, accelerator_config, ...): compare like with like.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference = type(args)(output_dir=getattr(args, "output_dir", None))
        return {f.name: getattr(reference, f.name) for f in fields}
    except Exception:  # a subclass with required fields: the declared defaults will do
        return {f.name: f.default if f.default is not dataclasses.MISSING else
                (f.default_factory() if f.default_factory is not dataclasses.MISSING else None) for f in fields}
