"""Conformance kits for plugin authors: :func:`check_optimizer` (optimizer) and :func:`check_precision`
(precision). Run them in your plugin's tests.

The names below are re-exported from the modules that define them (``memwrap.testing`` was one module before).
"""
from __future__ import annotations

from memwrap.testing.optimizer import CHECKS, RegressionModel, check_optimizer, regression_batch
from memwrap.testing.precision import PRECISION_CHECKS, check_precision

__all__ = [
    'check_optimizer', 'check_precision', 'RegressionModel', 'regression_batch', 'CHECKS', 'PRECISION_CHECKS',
]
