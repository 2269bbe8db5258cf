"""The memwrap plugin manager: hook specs, built-in plugins and third-party plugins, one path.

Plugins are found through the entry-point group ``memwrap`` (built-ins included: they are the
entry points whose module lives in ``memwrap_plugins``), following pluggy's ``eggsample``.

Loading rules (also in ``docs/plugins.md``):

* ``MEMWRAP_DISABLE_PLUGIN_AUTOLOAD=1`` skips third-party entry points; built-ins still load.
  A skipped plugin can still be registered by hand: ``get_plugin_manager().register(module)``.
* ``MEMWRAP_BLOCK_PLUGINS=name1,name2`` skips the entry points with those names (built-in or not),
  e.g. to silence a broken plugin or settle a name conflict between two plugins.
* A plugin that fails to import or to register does not stop the others: memwrap emits one
  :class:`PluginLoadWarning` naming the entry point, its distribution and the cause, and keeps the
  failure in :func:`plugin_errors` (so a test or a CLI can turn it into a hard failure).
* From a source tree without installed metadata, the built-ins listed in ``pyproject.toml`` are
  registered directly, so ``import memwrap`` from a checkout still works.

Example:
    >>> from memwrap.plugins import get_plugin_manager
    >>> pm = get_plugin_manager()
    >>> "torch_optim" in {name for name, _ in pm.list_name_plugin()}
    True
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import tomllib
import warnings
from dataclasses import dataclass
from pathlib import Path

import pluggy

from memwrap import hookspecs

__all__ = [
    "hookimpl", "get_plugin_manager", "reset_plugin_manager", "plugin_info", "plugin_errors",
    "plugin_origin", "PluginInfo", "PluginLoadWarning", "ENTRY_POINT_GROUP", "BUILTIN_PACKAGE",
    "ENV_DISABLE_AUTOLOAD", "ENV_BLOCK",
]

hookimpl = pluggy.HookimplMarker("memwrap")

ENTRY_POINT_GROUP = "memwrap"
BUILTIN_PACKAGE = "memwrap_plugins"
ENV_DISABLE_AUTOLOAD = "MEMWRAP_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "MEMWRAP_BLOCK_PLUGINS"
_SOURCE_TREE = Path(__file__).resolve().parent.parent


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded or registered; the other plugins are unaffected."""


@dataclass(frozen=True)
class PluginInfo:
    """What memwrap knows about one plugin entry point.

    ``status`` is ``"loaded"``, ``"failed"`` (see ``error``), ``"blocked"`` (``MEMWRAP_BLOCK_PLUGINS``)
    or ``"skipped"`` (third-party while ``MEMWRAP_DISABLE_PLUGIN_AUTOLOAD`` is set).
    """

    name: str
    value: str
    distribution: str
    version: str
    builtin: bool
    status: str
    error: str | None = None

    @property
    def origin(self) -> str:
        """``"name (entry point 'mod') from distribution 'dist' 1.0"``: used in error messages."""
        return f"plugin {self.name!r} (entry point {self.value!r}) from distribution {self.distribution!r} {self.version}"


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_infos: list[PluginInfo] = []
_building = False


def get_plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide plugin manager, creating it (and loading plugins) on first use.

    Example:
        >>> pm = get_plugin_manager()
        >>> pm.project_name
        'memwrap'
    """
    global _manager, _building
    with _lock:
        if _manager is None:
            if _building:
                # A plugin module asked for the manager while being imported by it.
                raise RuntimeError("get_plugin_manager() was called while plugins are loading; a plugin must not "
                                   "use the plugin manager or the optimizer registry at import time")
            _building = True
            try:
                _manager, infos = _build_manager()
            finally:
                _building = False
            _infos[:] = infos
        return _manager


def reset_plugin_manager() -> None:
    """Forget the current manager; the next :func:`get_plugin_manager` rebuilds it from scratch.

    Meant for tests and for long-lived processes that installed a plugin at run time.

    Example:
        >>> reset_plugin_manager(); get_plugin_manager() is get_plugin_manager()
        True
    """
    global _manager
    with _lock:
        _manager = None
        _infos.clear()


def plugin_info() -> list[PluginInfo]:
    """Every entry point seen while building the manager, with its status.

    Example:
        >>> [i.name for i in plugin_info() if i.builtin]  # doctest: +SKIP
        ['adafactor', 'bitsandbytes', 'torch_optim']
    """
    get_plugin_manager()
    return list(_infos)


def plugin_errors() -> list[PluginInfo]:
    """The entry points that failed to load or register (empty when all is well).

    Example:
        >>> assert not plugin_errors(), [e.error for e in plugin_errors()]  # doctest: +SKIP
    """
    return [i for i in plugin_info() if i.status == "failed"]


def plugin_origin(plugin_name: str) -> str:
    """Describe a registered plugin by name, with its distribution when it came from one.

    Example:
        >>> plugin_origin("torch_optim")  # doctest: +SKIP
        "plugin 'torch_optim' (entry point 'memwrap_plugins.torch_optim') from distribution 'memwrap' 0.1.0"
    """
    for info in plugin_info():
        if info.name == plugin_name and info.status == "loaded":
            return info.origin
    return f"plugin {plugin_name!r} (registered at run time)"


# -- building ------------------------------------------------------------------------------------

def _entry_points() -> list[importlib.metadata.EntryPoint]:
    # Indirection so that tests can present a different set of installed entry points.
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _is_builtin(value: str) -> bool:
    return value.split(":")[0].split(".")[0] == BUILTIN_PACKAGE


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def _build_manager() -> tuple[pluggy.PluginManager, list[PluginInfo]]:
    pm = pluggy.PluginManager("memwrap")
    pm.add_hookspecs(hookspecs)
    autoload = not _env_flag(ENV_DISABLE_AUTOLOAD)
    blocked = {n.strip() for n in os.environ.get(ENV_BLOCK, "").split(",") if n.strip()}
    for name in blocked:
        pm.set_blocked(name)

    infos: list[PluginInfo] = []
    eps = _entry_points()
    if not any(_is_builtin(ep.value) for ep in eps):
        _load_builtins_from_source_tree(pm, infos, blocked)
    # Built-ins first, so that a third-party entry point can never take a built-in's name.
    for ep in sorted(eps, key=lambda e: (not _is_builtin(e.value), e.name)):
        dist = getattr(ep, "dist", None)
        dist_name = dist.name if dist is not None else "<unknown>"
        version = dist.version if dist is not None else ""
        builtin = _is_builtin(ep.value)
        # A built-in goes through _import_builtin: metadata that lists it can be visible while the package is
        # not importable (a checkout on sys.path next to a memwrap.egg-info left by an editable install).
        load = (lambda v=ep.value: _import_builtin(v)) if builtin else ep.load
        infos.append(_load_one(pm, infos, ep.name, ep.value, load, dist_name, version, builtin, autoload, blocked))
    return pm, infos


def _load_one(pm, infos, name, value, load, dist_name, version, builtin, autoload, blocked) -> PluginInfo:
    info = dict(name=name, value=value, distribution=dist_name, version=version, builtin=builtin)
    if name in blocked:
        return PluginInfo(**info, status="blocked")
    if not builtin and not autoload:
        return PluginInfo(**info, status="skipped")
    origin = PluginInfo(**info, status="failed").origin
    if pm.has_plugin(name):
        return _failed(info, f"{origin} was not loaded: the plugin name {name!r} is already taken by "
                             f"{_describe_registered(name, infos)}. Rename one entry point, or block one with "
                             f"{ENV_BLOCK}={name}.")
    try:
        plugin = load()
    except Exception as exc:  # any import-time failure must not take the other plugins down
        return _failed(info, f"{origin} failed to import: {type(exc).__name__}: {exc}. Other plugins are "
                             f"unaffected; fix or uninstall {dist_name!r}, or set {ENV_BLOCK}={name}.")
    try:
        pm.register(plugin, name=name)
    except Exception as exc:
        return _failed(info, f"{origin} failed to register: {type(exc).__name__}: {exc}. Other plugins are "
                             f"unaffected; fix or uninstall {dist_name!r}, or set {ENV_BLOCK}={name}.")
    _warn_unknown_hooks(pm, plugin, origin)
    return PluginInfo(**info, status="loaded")


def _describe_registered(name: str, infos: list[PluginInfo]) -> str:
    for info in infos:
        if info.name == name and info.status == "loaded":
            return info.origin
    return f"an already registered plugin named {name!r}"


def _failed(info: dict, message: str) -> PluginInfo:
    warnings.warn(message, PluginLoadWarning, stacklevel=4)
    return PluginInfo(**info, status="failed", error=message)


def _warn_unknown_hooks(pm: pluggy.PluginManager, plugin: object, origin: str) -> None:
    # pluggy keeps implementations of unknown hooks "pending" without a word; a typo in a hook
    # name would then silently do nothing, so say it once.
    known = [n for n in dir(hookspecs) if n.startswith("memwrap_")]
    for caller in pm.get_hookcallers(plugin) or []:
        if caller.spec is None and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls()):
            from memwrap.errors import closest_hint

            warnings.warn(f"{origin} implements {caller.name!r}, which is not a memwrap hook "
                          f"(known: {', '.join(known)}).{closest_hint(caller.name, known)}",
                          PluginLoadWarning, stacklevel=5)


def _load_builtins_from_source_tree(pm: pluggy.PluginManager, infos: list[PluginInfo], blocked: set[str]) -> None:
    """Register the built-ins named in ``pyproject.toml`` when no installed metadata lists them."""
    pyproject = _SOURCE_TREE / "pyproject.toml"
    if not pyproject.is_file():
        warnings.warn("memwrap's built-in plugins were not found: no entry points in group "
                      f"{ENTRY_POINT_GROUP!r} and no {pyproject}. Reinstall memwrap (pip install memwrap).",
                      PluginLoadWarning, stacklevel=3)
        return
    table = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    for name, value in sorted(table.items()):
        if _is_builtin(value):
            infos.append(_load_one(pm, infos, name, value, lambda v=value: _import_builtin(v),
                                   "memwrap (source tree)", "", True, True, blocked))


def _import_builtin(value: str) -> object:
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (BUILTIN_PACKAGE, module_name):
            raise
        # Not installed: the package memwrap_plugins is the folder plugins/ next to memwrap/.
        folder = _SOURCE_TREE / "plugins"
        spec = importlib.util.spec_from_file_location(BUILTIN_PACKAGE, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        package = importlib.util.module_from_spec(spec)
        sys.modules[BUILTIN_PACKAGE] = package
        spec.loader.exec_module(package)
        module = importlib.import_module(module_name)
    return getattr(module, attr) if attr else module
