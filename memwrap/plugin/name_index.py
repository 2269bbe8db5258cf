"""What the plugin registries (optimizers, precisions) share: the merged name index and its per-plugin-set cache.

A registry collects entries ``(item, origin)`` from a pluggy hook; every name and alias of an item points at
its entry, and a name two plugins claim is a conflict, kept apart so that looking it up names both plugins
instead of silently picking one. The index is rebuilt only when the set of registered plugins changes.

Example:
    >>> by_name, conflicts = index_names([("a", "p1"), ("b", "p2")], lambda item: [item, item.upper()])
    >>> sorted(by_name), conflicts
    (['A', 'B', 'a', 'b'], {})
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from memwrap.plugin.manager import get_plugin_manager

__all__ = ["index_names", "PluginCache", "conflict_message"]

T = TypeVar("T")


def index_names(entries: Iterable[tuple[Any, str]], names_of: Callable[[Any], Iterable[str]]
                ) -> tuple[dict[str, tuple[Any, str]], dict[str, list[tuple[Any, str]]]]:
    """``(by_name, conflicts)`` over ``entries`` (``(item, origin)`` pairs): each of ``names_of(item)`` (already
    normalized) maps to its entry, and a name claimed by several entries maps, in ``conflicts``, to all of them."""
    by_name: dict[str, tuple[Any, str]] = {}
    conflicts: dict[str, list[tuple[Any, str]]] = {}
    for entry in entries:
        for n in dict.fromkeys(names_of(entry[0])):
            if n in conflicts:
                conflicts[n].append(entry)
            elif n in by_name:
                conflicts[n] = [by_name.pop(n), entry]
            else:
                by_name[n] = entry
    return by_name, conflicts


def conflict_message(kind: str, name: str, claims: Iterable[str]) -> str:
    """The error text for a name that several plugins claim, e.g. ``conflict_message("optimizer", "adamw", [...])``."""
    return (f"{kind} name {name!r} is claimed by more than one plugin: {'; '.join(claims)}. Uninstall one of them, "
            "or block one with MEMWRAP_BLOCK_PLUGINS=<plugin name>.")


class PluginCache(Generic[T]):
    """``collect()``'s result, recomputed when the plugin manager or its set of registered plugins changes.

    The plugin objects themselves are the key, compared by identity: holding them keeps their ids from being
    reused by a plugin registered later (a key of ids alone can mistake a new plugin for an unregistered one).

    Example:
        >>> cache = PluginCache(lambda: object())
        >>> cache.get() is cache.get()
        True
    """

    def __init__(self, collect: Callable[[], T]):
        self._collect = collect
        self._key: tuple | None = None
        self._value: T | None = None
        self._lock = threading.Lock()

    def get(self) -> T:
        pm = get_plugin_manager()
        key = (pm, *(plugin for _, plugin in sorted(pm.list_name_plugin(), key=lambda item: item[0])))
        with self._lock:
            old = self._key
            if old is None or len(old) != len(key) or any(a is not b for a, b in zip(old, key)):
                self._value, self._key = self._collect(), key
            return self._value
