"""Old import path, kept as a thin re-export for plugins and scripts written against it.

The optimizer registry is :mod:`memwrap.plugin.registry`; the state sizes that used to be importable from here are
:mod:`memwrap.plugin.state_size`. New code imports from those (docs/changelog.md lists every moved module).

Example:
    >>> from memwrap.registry import OptimizerSpec, predict_state_bytes  # still works
"""
from __future__ import annotations

from memwrap.plugin.registry import *  # noqa: F401,F403  (the re-export is the point of this module)
from memwrap.plugin.registry import __all__ as _REGISTRY
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes, scalar_step_bytes

__all__ = [*_REGISTRY, "predict_state_bytes", "measure_state_bytes", "scalar_step_bytes"]
