"""Built-in precision plugin: ``fp32``, the neutral mode (fp32 weights and maths).

Example:
    >>> import memwrap
    >>> model = memwrap.wrap(torch.nn.Linear(2, 2), precision="32-true")  # doctest: +SKIP
"""
from __future__ import annotations

from memwrap.plugin.manager import hookimpl
from memwrap.precision.base import Precision


class FP32(Precision):
    """Every method is the base's neutral one; only the names are added (Lightning's included)."""

    name = "fp32"
    aliases = ("32", "32-true", "float32", "fp32-true")


@hookimpl
def memwrap_precisions():
    return [FP32]
