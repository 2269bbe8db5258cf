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

from memwrap.errors import closest_hint
from memwrap.plugin.optimizer_args import parse_optim_args, strtobool
from memwrap.plugin.optimizer_args import typed_optim_args as _typed
from memwrap.plugin.registry import OptimizerUnavailableError

__all__ = ["extra_hint", "module_available", "import_backend", "parse_optim_args", "typed_optim_args",
           "adam_kwargs", "strtobool", "tensors_of", "check_choice", "check_whole"]


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


def typed_optim_args(args: Any, name: str, accepted: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``args.optim_args`` (a ``TrainingArguments``) parsed and typed: :func:`memwrap.plugin.optimizer_args.typed_optim_args`."""
    return _typed(getattr(args, "optim_args", None), name, accepted)


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


def check_whole(name: str, key: str, value: Any, minimum: int, why: str, example: int) -> None:
    """Raise ``ValueError`` naming ``key`` unless ``value`` is an int >= ``minimum`` (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"optimizer {name!r}: {key}={value!r} must be a whole number >= {minimum} ({why}). Fix: e.g. "
                         f"{key}={example}.")


def check_choice(name: str, key: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming ``key`` and its valid values unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"optimizer {name!r}: {key}={value!r} is not one of {', '.join(map(repr, choices))}."
                         f"{closest_hint(value, choices)} Fix: {key}={choices[0]!r}.")
