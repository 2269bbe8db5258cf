"""Precision modes: one small class each, overriding only what differs from the fp32 base.

The base class has a neutral body for every method (no autocast, a disabled GradScaler),
so the training path has one shape whatever the mode.
"""
from __future__ import annotations

import contextlib
import warnings

import torch

from memwrap.errors import closest_hint

__all__ = ["Precision", "TF32", "BF16", "FP16", "get_precision", "PRECISIONS"]


class Precision:
    """fp32: the neutral mode. No autocast, no loss scaling.

    Example:
        >>> p = get_precision("fp32")
        >>> with p.autocast("cpu"):
        ...     pass
    """

    name = "fp32"
    autocast_dtype: torch.dtype | None = None
    uses_scaler = False

    def check(self, device_type: str) -> None:
        """Raise if this mode cannot run on ``device_type``; the neutral mode runs anywhere."""

    def autocast(self, device_type: str):
        return contextlib.nullcontext()

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        # A disabled scaler turns every GradScaler call into a no-op, so callers keep one code path.
        return torch.amp.GradScaler(_scaler_device(device_type), enabled=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _scaler_device(device_type: str) -> str:
    # GradScaler only knows real backends; "meta"/fake devices never scale anything.
    return device_type if device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "xla") else "cpu"


class _Autocast(Precision):
    """Shared body of the autocast modes: run the forward under ``torch.autocast``."""

    def check(self, device_type: str) -> None:
        available = torch.amp.autocast_mode.is_autocast_available(device_type)
        if not available:
            raise ValueError(
                f"precision={self.name!r} needs autocast, which torch does not support on device "
                f"type {device_type!r}. Fix: move the model to a device with autocast support "
                f"(cuda, cpu, xpu, mps) or use precision='fp32'."
            )
        if device_type == "cuda" and self.autocast_dtype is torch.bfloat16 and torch.cuda.is_available():
            if not torch.cuda.is_bf16_supported():
                raise ValueError(
                    "precision='bf16' needs a GPU with bfloat16 support (Ampere or newer); this "
                    "one has none. Fix: use precision='fp16' (with loss scaling) or 'fp32'."
                )

    def autocast(self, device_type: str):
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


class BF16(_Autocast):
    """bf16 autocast: same exponent range as fp32, so no loss scaling is needed."""

    name = "bf16"
    autocast_dtype = torch.bfloat16


class FP16(_Autocast):
    """fp16 autocast plus a GradScaler, because fp16 gradients underflow without loss scaling."""

    name = "fp16"
    autocast_dtype = torch.float16
    uses_scaler = True

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(_scaler_device(device_type), enabled=True)


class TF32(Precision):
    """fp32 storage with TF32 tensor-core matmuls (CUDA Ampere+); on other devices it is plain fp32.

    TF32 is a global torch setting, not a context: it is switched on by :meth:`enable`
    (called by ``wrap``) and restored by :meth:`restore` (called by ``unwrap``).
    """

    name = "tf32"
    _previous: str | None = None

    def check(self, device_type: str) -> None:
        if device_type != "cuda":
            warnings.warn(
                f"precision='tf32' only changes CUDA matmuls; on {device_type!r} it trains in plain fp32.",
                stacklevel=4,
            )

    def enable(self) -> None:
        self._previous = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("high")

    def restore(self) -> None:
        if self._previous is not None:
            torch.set_float32_matmul_precision(self._previous)
            self._previous = None


PRECISIONS: dict[str, type[Precision]] = {"fp32": Precision, "tf32": TF32, "bf16": BF16, "fp16": FP16}


def get_precision(name: str) -> Precision:
    """Return a fresh precision mode by name.

    Example:
        >>> get_precision("bf16").autocast_dtype
        torch.bfloat16
    """
    try:
        return PRECISIONS[name]()
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown precision {name!r}; valid: {', '.join(PRECISIONS)}.{closest_hint(name, PRECISIONS)}"
        ) from None
