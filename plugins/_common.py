"""Helpers shared by the optimizer plugins (not a plugin itself: no entry point, no hooks).

* availability and install hints for optional libraries, checked without importing them;
* Hugging Face ``Trainer``'s reading of ``TrainingArguments`` (``optim_args`` strings, Adam betas),
  duck-typed so transformers is never imported, with a clear error for ``optim_args`` keys that the
  chosen optimizer does not use (Trainer would drop them without a word).

Example:
    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(optim_args="momentum=0.9, nesterov=True", learning_rate=0.1)
    >>> typed_optim_args(args, "sgd", {"momentum": float, "nesterov": strtobool})
    {'momentum': 0.9, 'nesterov': True}
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from memwrap.registry import OptimizerUnavailableError

__all__ = ["extra_hint", "module_available", "import_backend", "parse_optim_args", "typed_optim_args",
           "adam_kwargs", "strtobool", "tensors_of"]


def extra_hint(package: str, extra: str) -> str:
    """The install line for an optional backend, e.g. ``pip install "memwrap[galore]"``."""
    return f'{package} is not installed: pip install "memwrap[{extra}]"  (or: pip install {package})'


def module_available(module: str, package: str, extra: str) -> Callable[[], tuple[bool, str]]:
    """An ``available()`` for :class:`OptimizerSpec` that looks ``module`` up without importing it."""
    hint = extra_hint(package, extra)

    def available() -> tuple[bool, str]:
        if module in sys.modules:
            return sys.modules[module] is not None, hint
        try:
            return importlib.util.find_spec(module) is not None, hint
        except (ImportError, ValueError):
            return False, hint

    return available


def import_backend(module: str, package: str, extra: str):
    """Import an optional backend now, or raise :class:`OptimizerUnavailableError` with the install line."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise OptimizerUnavailableError(f"{extra_hint(package, extra)} ({exc})") from exc


def strtobool(value: Any) -> bool:
    """Trainer's reading of a boolean in ``optim_args`` ("true"/"1"/"yes" and "false"/"0"/"no")."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True
    if text in ("n", "no", "f", "false", "off", "0"):
        return False
    raise ValueError(f"not a boolean: {value!r} (use true or false)")


def parse_optim_args(text: Any) -> dict[str, str]:
    """Split Trainer's ``optim_args`` string ``"k1=v1,k2=v2"`` as ``transformers.trainer_optimizer`` does.

    A dict is accepted too (values are then used as given).
    """
    if not text:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    found = {}
    for item in str(text).replace(" ", "").split(","):
        if item.count("=") != 1:
            raise ValueError(f"optim_args={text!r}: {item!r} is not key=value. Fix: write optim_args as "
                             "'key1=value1,key2=value2'.")
        key, value = item.split("=")
        found[key] = value
    return found


def typed_optim_args(args: Any, name: str, accepted: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``args.optim_args`` parsed and converted with ``accepted[key]``; unknown keys raise ``ValueError``.

    Trainer ignores ``optim_args`` keys its handler does not read, so a typo (``momentun=0.9``)
    trains silently without it; memwrap refuses instead and lists the keys that apply.
    """
    raw = parse_optim_args(getattr(args, "optim_args", None))
    unknown = sorted(set(raw) - set(accepted))
    if unknown:
        valid = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"optim_args keys {unknown} do not apply to optim={name!r} (Trainer would ignore them); "
                         f"keys it reads: {valid}. Fix: remove them from TrainingArguments.optim_args or choose the "
                         "optimizer they belong to.")
    typed = {}
    for key, value in raw.items():
        try:
            typed[key] = accepted[key](value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"optim_args {key}={value!r} for optim={name!r}: {exc}") from None
    return typed


def adam_kwargs(args: Any) -> dict[str, Any]:
    """``betas`` and ``eps`` as Trainer passes them to Adam-style optimizers."""
    return {"betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


def tensors_of(params: Any) -> list[torch.Tensor]:
    """Every tensor in ``params`` (tensors or param-group dicts), in order."""
    out = []
    for item in params:
        group = item["params"] if isinstance(item, Mapping) else item
        out.extend([group] if isinstance(group, torch.Tensor) else group)
    return out
