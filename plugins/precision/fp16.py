"""Built-in precision plugin: ``fp16``, fp32 weights, fp16 autocast and a GradScaler.

fp16's narrow exponent range lets small gradients underflow, so the loss is scaled (and the
scale backs off when a window overflows: that update is skipped, see docs/options.md).

Example:
    >>> model, optimizer = memwrap.wrap(model, optimizer, precision="16-mixed")  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.precision.base import AutocastPrecision, _scaler_device


class FP16(AutocastPrecision):
    """fp16 autocast plus a GradScaler, because fp16 gradients underflow without loss scaling."""

    name = "fp16"
    aliases = ("16", "16-mixed", "fp16-mixed", "float16", "half")
    autocast_dtype = torch.float16
    uses_scaler = True
    optimizer_requirement = "skips the update when GradScaler finds inf/NaN (every torch optimizer does)"
    description = "fp32 weights, forward under fp16 autocast, dynamic loss scaling (GradScaler)."
    memory_like = "bf16"  # autocast casts the same ops to a 2-byte type; the scaler adds two scalars

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(_scaler_device(device_type), enabled=True)


@hookimpl
def memwrap_precisions():
    return [FP16]
