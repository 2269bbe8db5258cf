"""Built-in precision plugin: ``tf32``, fp32 storage with TF32 tensor-core matmuls (CUDA Ampere+).

TF32 is a process-wide torch setting, not a context. Several models may be wrapped with it at
once, so the setting is reference-counted: the first ``enable`` saves the user's value
(``torch.get_float32_matmul_precision()``), the last ``restore`` puts it back, whatever order the
models are unwrapped in.

Example:
    >>> torch.set_float32_matmul_precision("highest")
    >>> a = memwrap.wrap(net_a, precision="tf32"); b = memwrap.wrap(net_b, precision="tf32")  # doctest: +SKIP
    >>> memwrap.unwrap(a); memwrap.unwrap(b); torch.get_float32_matmul_precision()  # doctest: +SKIP
    'highest'
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.precision.base import Precision

_lock = threading.Lock()
_users = 0  # wrapped models currently holding TF32 on
_saved: str | None = None  # the user's setting before the first of them


class TF32(Precision):
    """fp32 weights; matmuls in TF32 while at least one model wrapped with it is not unwrapped."""

    name = "tf32"
    aliases = ("tensorfloat32", "tf32-mixed")
    description = "fp32 weights, CUDA matmuls in TF32 (torch.set_float32_matmul_precision('high'))."
    memory_like = "fp32"  # the same tensors as fp32; only the matmul kernels differ

    def __init__(self, compensation: str | None = None):
        super().__init__(compensation)
        self._hold: weakref.finalize | None = None

    def check(self, device_type: str) -> None:
        if device_type != "cuda":
            warnings.warn(
                f"precision='tf32' only changes CUDA matmuls; on {device_type!r} it trains in plain fp32.",
                stacklevel=4,
            )

    def enable(self) -> None:
        global _users, _saved
        with _lock:
            if self._hold is not None and self._hold.alive:
                return
            if _users == 0:
                _saved = torch.get_float32_matmul_precision()
            _users += 1
            torch.set_float32_matmul_precision("high")
        # A wrapped model dropped without unwrap() releases its hold when it is garbage-collected, so a
        # discarded model cannot keep TF32 on for the rest of the process.
        self._hold = weakref.finalize(self, _release)

    def restore(self) -> None:
        if self._hold is not None:
            self._hold()  # runs _release at most once, however often unwrap is called


def _release() -> None:
    global _users, _saved
    with _lock:
        _users -= 1
        if _users == 0 and _saved is not None:
            torch.set_float32_matmul_precision(_saved)
            _saved = None


@hookimpl
def memwrap_precisions():
    return [TF32]
