"""memwrap: train models that do not fit in GPU memory by adding two lines to an unchanged loop.

Example:
    >>> import memwrap
    >>> model, optimizer = memwrap.wrap(model, optimizer, precision="bf16", accumulate=8)  # doctest: +SKIP

Names are resolved lazily (PEP 562) so ``import memwrap`` stays cheap and never imports an
optional dependency.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "wrap": "memwrap.wrapper",
    "unwrap": "memwrap.wrapper",
    "backward": "memwrap.wrapper",
    "options_from": "memwrap.config.options",
    "Options": "memwrap.config.options",
    "apply_checkpointing": "memwrap.checkpointing.apply",
    "remove_checkpointing": "memwrap.checkpointing.apply",
    "hookimpl": "memwrap.plugin.manager",
    "get_plugin_manager": "memwrap.plugin.manager",
    "create_optimizer": "memwrap.plugin.registry",
    "optimizers": "memwrap.plugin.registry",
    "precisions": "memwrap.precision.base",
    "OptimizerSpec": "memwrap.plugin.registry",
    "convert_optimizer": "memwrap.plugin.registry",
    "find_blocks": "memwrap.checkpointing.apply",
    "estimate": "memwrap.memory",
    "plan": "memwrap.memory",
    "Estimate": "memwrap.memory",
    "Plan": "memwrap.memory",
    "MemoryMonitor": "memwrap.memory",
    "measure_peak": "memwrap.memory",
    "parse_budget": "memwrap.memory",
    "save_checkpoint": "memwrap.state.checkpoint", "load_checkpoint": "memwrap.state.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memwrap' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + __all__)
