"""Old import path, kept as a thin re-export for plugins written against it (``from memwrap.plugins import hookimpl``).

The plugin manager is :mod:`memwrap.plugin.manager`; ``memwrap.hookimpl`` is the shortest spelling. docs/changelog.md
lists every moved module.

Example:
    >>> from memwrap.plugins import hookimpl, get_plugin_manager  # still works
"""
from __future__ import annotations

from memwrap.plugin.manager import *  # noqa: F401,F403  (the re-export is the point of this module)
from memwrap.plugin.manager import __all__  # noqa: F401
