"""Register a run-time pluggy plugin for the duration of a ``with`` block (shared by the plugin tests)."""
from __future__ import annotations

import types

from memwrap.plugin.manager import get_plugin_manager, hookimpl


class registered:
    """``with registered("name", memwrap_optimizers=fn): ...``: each hook function is marked as an implementation,
    the plugin is registered on entry and unregistered on exit; the block receives the plugin object."""

    def __init__(self, name: str, **hooks):
        self.plugin = types.SimpleNamespace(**{k: hookimpl(v) for k, v in hooks.items()})
        self.name = name

    def __enter__(self):
        get_plugin_manager().register(self.plugin, name=self.name)
        return self.plugin

    def __exit__(self, *exc):
        get_plugin_manager().unregister(self.plugin)
        return False
