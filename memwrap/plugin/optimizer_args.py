"""Checking an optimizer's hyperparameters before anything is built, and Hugging Face's ``optim_args``.

Backends check their arguments late and in their own words (bitsandbytes' 8-bit AdamW given
``betas=0.9`` fails with ``object of type 'float' has no len()``, GaLore with ``rank=0`` trains without
ever updating its targets), so memwrap checks the common hyperparameters itself, by name, before an
optimizer is built or ``wrap()`` changes anything; a plugin adds its own checks through
``OptimizerSpec.check_hyperparameters``. ``optim_args`` (Trainer's ``"k1=v1,k2=v2"`` string, or a dict)
are parsed here for both Trainer's route and ``wrap(optim_args=...)``.

Example:
    >>> check_hyperparameters("adamw_8bit", {"lr": 1e-3, "betas": (0.9, 0.999)})
    >>> parse_optim_args("rank=4, scale=0.5")
    {'rank': '4', 'scale': '0.5'}
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from memwrap.errors import closest_hint

__all__ = ["check_hyperparameters", "parse_optim_args", "typed_optim_args", "strtobool", "is_real"]


def is_real(value: Any) -> bool:
    """A finite real number that is not a bool (a 1-value floating tensor counts: torchao keeps lr in one)."""
    if isinstance(value, torch.Tensor):  # its value is not read: no sync, and it may be a fake tensor (the planner)
        return value.numel() == 1 and value.is_floating_point()
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _fail(name: str, where: str, key: str, value: Any, problem: str, fix: str) -> None:
    raise ValueError(f"optimizer {name!r}{where}: {key}={value!r} {problem}. Fix: {fix}.")


def _non_negative(name: str, where: str, key: str, value: Any, example: str) -> None:
    if isinstance(value, str):
        _fail(name, where, key, value, "is a string, not a number", f"{key}={example} (a number, not text)")
    if not is_real(value) or (not isinstance(value, torch.Tensor) and value < 0):
        _fail(name, where, key, value, "must be a finite number >= 0", f"e.g. {key}={example}")


def check_hyperparameters(name: str, hp: Mapping[str, Any], where: str = "") -> None:
    """Raise ``ValueError`` naming the hyperparameter and the fix when a common one is out of its domain.

    Checks ``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum`` and ``dampening`` where present
    (``lr=None`` is allowed: Adafactor's relative step); ``where`` says which param group, if any.

    Example:
        >>> check_hyperparameters("adamw_8bit", {"betas": 0.9})
        Traceback (most recent call last):
        ...
        ValueError: optimizer 'adamw_8bit': betas=0.9 must be a pair of numbers in [0, 1). Fix: e.g. betas=(0.9, 0.999).
    """
    if "lr" in hp and hp["lr"] is not None:
        _non_negative(name, where, "lr", hp["lr"], "1e-3")
    if "betas" in hp:
        betas = hp["betas"]
        ok = (isinstance(betas, Sequence) and not isinstance(betas, str) and len(betas) in (2, 3)
              and all(is_real(b) and 0 <= b < 1 for b in betas))
        if not ok:
            _fail(name, where, "betas", betas, "must be a pair of numbers in [0, 1)", "e.g. betas=(0.9, 0.999)")
    if "eps" in hp and hp["eps"] is not None:
        eps = hp["eps"]
        pair = isinstance(eps, Sequence) and not isinstance(eps, str)  # Adafactor's (eps1, eps2)
        if not (all(e is None or (is_real(e) and e >= 0) for e in eps) if pair else (is_real(eps) and eps >= 0)):
            _fail(name, where, "eps", eps, "must be a number >= 0", "e.g. eps=1e-8")
    for key, example in (("weight_decay", "0.01"), ("momentum", "0.9"), ("dampening", "0.0")):
        if key in hp and hp[key] is not None:
            _non_negative(name, where, key, hp[key], example)


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


def parse_optim_args(text: Any) -> dict[str, Any]:
    """Split Trainer's ``optim_args`` string ``"k1=v1,k2=v2"`` as ``transformers.trainer_optimizer`` does.

    A dict is accepted too (values are then used as given).
    """
    if not text:
        return {}
    if isinstance(text, Mapping):
        return dict(text)
    if not isinstance(text, str):
        raise TypeError(f"optim_args={text!r}: give a string 'key1=value1,key2=value2' or a dict.")
    found = {}
    for item in text.replace(" ", "").split(","):
        if item.count("=") != 1:
            raise ValueError(f"optim_args={text!r}: {item!r} is not key=value. Fix: write optim_args as "
                             "'key1=value1,key2=value2'.")
        key, value = item.split("=")
        found[key] = value
    return found


def typed_optim_args(optim_args: Any, name: str, accepted: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """``optim_args`` parsed and converted with ``accepted[key]``; unknown keys raise ``ValueError``.

    Trainer ignores ``optim_args`` keys its handler does not read, so a typo (``momentun=0.9``)
    trains silently without it; memwrap refuses instead and lists the keys that apply.
    """
    raw = parse_optim_args(optim_args)
    unknown = sorted(set(raw) - set(accepted))
    if unknown:
        valid = ", ".join(sorted(accepted)) or "none"
        raise ValueError(f"optim_args keys {unknown} do not apply to optim={name!r} (Trainer would ignore them); "
                         f"keys it reads: {valid}.{closest_hint(unknown[0], accepted)} Fix: remove them from "
                         "optim_args or choose the optimizer they belong to.")
    typed = {}
    for key, value in raw.items():
        try:
            typed[key] = accepted[key](value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"optim_args {key}={value!r} for optim={name!r}: {exc}") from None
    return typed
