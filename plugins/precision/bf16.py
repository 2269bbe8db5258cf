"""Built-in precision plugin: ``bf16``, fp32 weights with the forward under bf16 autocast.

bf16 has fp32's exponent range, so no loss scaling is needed; the weights and the optimizer
stay fp32 (the update keeps full precision).

Example:
    >>> model, optimizer = memwrap.wrap(model, optimizer, precision="bf16-mixed")  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.precision.base import AutocastPrecision


class BF16(AutocastPrecision):
    """bf16 autocast: same exponent range as fp32, so no loss scaling is needed."""

    name = "bf16"
    aliases = ("bf16-mixed", "bfloat16", "bfloat16-mixed")
    autocast_dtype = torch.bfloat16
    description = "fp32 weights, forward under bf16 autocast; no loss scaling."


@hookimpl
def memwrap_precisions():
    return [BF16]
