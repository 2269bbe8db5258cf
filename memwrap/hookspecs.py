"""Old import path, kept as a thin re-export: the hook specifications are :mod:`memwrap.plugin.hookspecs`.

Example:
    >>> from memwrap.hookspecs import memwrap_optimizers  # still works
"""
from __future__ import annotations

from memwrap.plugin.hookspecs import *  # noqa: F401,F403  (the re-export is the point of this module)
