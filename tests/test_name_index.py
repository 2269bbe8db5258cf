"""The name index and plugin-set cache shared by the optimizer and precision registries."""
from __future__ import annotations

import pytest

import memwrap.plugin.manager
import memwrap.plugin.name_index
from memwrap.plugin.name_index import PluginCache, conflict_message, index_names


def test_index_names_keeps_conflicts_apart_with_every_claimant():
    entries = [("adamw", "p1"), ("lion", "p2"), ("adamw2", "p3")]
    names = {"adamw": ["adamw", "aw"], "lion": ["lion", "aw"], "adamw2": ["adamw", "x"]}
    by_name, conflicts = index_names(entries, names.__getitem__)
    assert set(by_name) == {"lion", "x"}
    assert conflicts == {"aw": [("adamw", "p1"), ("lion", "p2")], "adamw": [("adamw", "p1"), ("adamw2", "p3")]}
    msg = conflict_message("optimizer", "aw", ["p1 (adamw)", "p2 (lion)"])
    assert "claimed by more than one plugin: p1 (adamw); p2 (lion)" in msg and "MEMWRAP_BLOCK_PLUGINS" in msg


class _PM:
    def __init__(self, plugins):
        self.plugins = plugins

    def list_name_plugin(self):
        return list(self.plugins)


def test_cache_rebuilds_when_a_plugin_object_changes_even_under_the_same_name(monkeypatch):
    pm = _PM([("a", object())])
    monkeypatch.setattr(memwrap.plugin.name_index, "get_plugin_manager", lambda: pm)  # the name it calls
    calls = []
    cache = PluginCache(lambda: calls.append(1) or len(calls))
    assert cache.get() == 1 and cache.get() == 1  # same plugin objects: cached
    pm.plugins = [("a", object())]  # another object under the same name (an id could even be reused)
    assert cache.get() == 2
    pm.plugins = pm.plugins + [("b", object())]
    assert cache.get() == 3 and cache.get() == 3


def test_a_failed_collect_is_not_cached(monkeypatch):
    pm = _PM([("a", object())])
    monkeypatch.setattr(memwrap.plugin.name_index, "get_plugin_manager", lambda: pm)  # the name it calls
    outcomes = iter([RuntimeError("boom"), "ok"])

    def collect():
        out = next(outcomes)
        if isinstance(out, Exception):
            raise out
        return out

    cache = PluginCache(collect)
    with pytest.raises(RuntimeError):
        cache.get()
    assert cache.get() == "ok"
