"""Precision modes: the neutral base class and registry (base), loss scaling for fp16 (loss_scale). The
modes themselves are plugins (``plugins/precision/``).

The names below are re-exported from the modules that define them (``memwrap.precision`` was one module before).
"""
from __future__ import annotations

from memwrap.precision.base import (
    Precision, AutocastPrecision, PrecisionRow, PrecisionConflictError, UnknownPrecisionError, get_precision,
    get_precision_class, resolve_precision, precision_names, precisions, normalize_precision_name, PRECISIONS,
    convert_model, cast_floating,
)

__all__ = [
    'Precision', 'AutocastPrecision', 'PrecisionRow', 'PrecisionConflictError', 'UnknownPrecisionError',
    'get_precision', 'get_precision_class', 'resolve_precision', 'precision_names', 'precisions',
    'normalize_precision_name', 'PRECISIONS', 'convert_model', 'cast_floating',
]
