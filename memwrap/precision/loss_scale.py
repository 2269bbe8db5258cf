"""GradScaler settings (the ``scaler=`` option of ``wrap()``) and when fp16 overflows become errors.

The scaler itself is torch's ``torch.amp.GradScaler``; this module only validates the user's settings
(before ``wrap()`` changes anything) and hands them to the scaler through its public
``load_state_dict``, so nothing private of torch is touched.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from memwrap.errors import closest_hint

__all__ = ["SCALER_SETTINGS", "SCALE_FLOOR", "check_scaler_option", "configure_scaler"]

# Public GradScaler constructor arguments that users tune; `enabled` is memwrap's (precision="fp16").
SCALER_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
# Under fp16 with on_nonfinite="raise", a non-finite window computed at a loss scale at or below this floor
# raises: the loss was no longer scaled up, so the overflow is not one that backing off the scale can absorb
# (DeepSpeed stops at its minimum loss scale, 1 by default, the same way).
SCALE_FLOOR = 1.0


def check_scaler_option(settings: Any, precision: str, uses_scaler: bool) -> dict[str, Any] | None:
    """Validate ``scaler=`` for a valid precision name, whose mode scales the loss or not (``uses_scaler``, the
    precision class's flag: this module sits below the precision registry); return it as a plain dict (``None``
    when not given).

    Example:
        >>> check_scaler_option({"init_scale": 1024, "growth_interval": 100}, "fp16", uses_scaler=True)
        {'init_scale': 1024.0, 'growth_interval': 100}
    """
    if settings is None:
        return None
    if not uses_scaler:
        raise ValueError(
            f"scaler={settings!r} sets up the fp16 GradScaler, which is used only with precision='fp16' (or fp16=True). "
            "Fix: pass precision='fp16', or drop scaler= (the other precisions do not scale the loss)."
        )
    if not isinstance(settings, dict):
        raise ValueError(
            f"scaler must be a dict of GradScaler settings ({', '.join(SCALER_SETTINGS)}), got {settings!r}. "
            "Fix: e.g. scaler={'init_scale': 2.0**10, 'growth_interval': 100}."
        )
    checked: dict[str, Any] = {}
    for name, value in settings.items():
        if name not in SCALER_SETTINGS:
            raise ValueError(
                f"unknown GradScaler setting {name!r} in scaler=; valid: {', '.join(SCALER_SETTINGS)}."
                f"{closest_hint(str(name), SCALER_SETTINGS)}"
            )
        checked[name] = _check_value(name, value)
    return checked


def _check_value(name: str, value: Any) -> float | int:
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if name == "growth_interval":
        if not number or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"scaler: growth_interval must be an int >= 1 (clean updates before the scale grows), got {value!r}.")
        return int(value)
    ok = number and math.isfinite(value) and {
        "init_scale": lambda v: v > 0, "growth_factor": lambda v: v > 1, "backoff_factor": lambda v: 0 < v < 1,
    }[name](value)
    if not ok:
        rule = {"init_scale": "a finite number > 0 (e.g. 2.0**16, torch's default)",
                "growth_factor": "a number > 1 (e.g. 2.0)", "backoff_factor": "a number in (0, 1) (e.g. 0.5)"}[name]
        raise ValueError(f"scaler: {name} must be {rule}, got {value!r}.")
    return float(value)


def configure_scaler(scaler: torch.amp.GradScaler, settings: dict[str, Any] | None) -> None:
    """Apply validated settings to a fresh, enabled ``scaler`` (through its public ``load_state_dict``).

    Example:
        >>> s = torch.amp.GradScaler("cpu")
        >>> configure_scaler(s, {"init_scale": 8.0}); s.get_scale()
        8.0
    """
    if not settings or not scaler.is_enabled():
        return
    state = scaler.state_dict()
    state.update({("scale" if k == "init_scale" else k): v for k, v in settings.items()})
    scaler.load_state_dict(state)
