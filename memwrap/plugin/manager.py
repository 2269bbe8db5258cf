"""The memwrap plugin manager: hook specs, built-in plugins and third-party plugins, one path.

Plugins are found through the entry-point group ``memwrap`` (built-ins included: they are the
entry points whose module lives in ``memwrap_plugins``), following pluggy's ``eggsample``.

Loading rules (also in ``docs/plugins.md``):

* ``MEMWRAP_DISABLE_PLUGIN_AUTOLOAD=1`` skips third-party entry points; built-ins still load.
  A skipped plugin can still be registered by hand: ``get_plugin_manager().register(module)``.
* ``MEMWRAP_BLOCK_PLUGINS=name1,name2`` skips the entry points with those names (built-in or not),
  e.g. to silence a broken plugin or settle a name conflict between two plugins.
* A plugin that fails to import or to register (wrong hook arguments, or a hook name that is not a
  memwrap hook, e.g. a typo) does not stop the others: memwrap emits one :class:`PluginLoadWarning`
  naming the entry point, its distribution and the cause, registers nothing of it, and keeps the
  failure in :func:`plugin_errors` (so a test or a CLI can turn it into a hard failure).
* A plugin that loaded but fails when called (a hook raises or returns the wrong type; a method of
  one of its specs raises or breaks its contract) is isolated the same way: every call into a plugin
  goes through :mod:`memwrap.plugin.calls`, which records the failure here with the hook or method
  that failed, warns once, and drops that plugin's result (or raises :class:`PluginError` naming it,
  where a result is required). Nothing of one plugin's failure reaches the other plugins.
* From a source tree without installed metadata, the built-ins listed in ``pyproject.toml`` are
  registered directly, so ``import memwrap`` from a checkout still works.

Example:
    >>> from memwrap.plugin.manager import get_plugin_manager
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
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pluggy

from memwrap.plugin import hookspecs
from memwrap.errors import closest_hint

__all__ = [
    "hookimpl", "get_plugin_manager", "reset_plugin_manager", "plugin_info", "plugin_errors",
    "plugin_origin", "PluginInfo", "PluginLoadWarning", "PluginError", "PluginContractError", "UnknownHookError",
    "record_failure", "describe_failure", "ENTRY_POINT_GROUP", "BUILTIN_PACKAGE", "ENV_DISABLE_AUTOLOAD", "ENV_BLOCK",
]

hookimpl = pluggy.HookimplMarker("memwrap")

ENTRY_POINT_GROUP = "memwrap"
BUILTIN_PACKAGE = "memwrap_plugins"
ENV_DISABLE_AUTOLOAD = "MEMWRAP_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "MEMWRAP_BLOCK_PLUGINS"
_SOURCE_TREE = Path(__file__).resolve().parents[2]  # memwrap/plugin/manager.py -> the checkout


class PluginLoadWarning(UserWarning):
    """A plugin could not be loaded or registered, or failed when called; the other plugins are unaffected."""


class PluginError(RuntimeError):
    """A call into a plugin failed; ``failure`` is its :func:`plugin_errors` entry (plugin, distribution, hook).

    Raised where the caller needs the result (a spec's ``state_bytes``, a factory returning no optimizer);
    the plugin's own exception, if any, is the ``__cause__``.
    """

    def __init__(self, failure: PluginInfo):
        super().__init__(failure.error)
        self.failure = failure


class PluginContractError(TypeError):
    """A plugin returned something its hook or method must not return (the message says what and what is due)."""


class UnknownHookError(pluggy.PluginValidationError):
    """A plugin implements a hook memwrap does not declare (usually a typo); the plugin is not registered."""

    def __init__(self, plugin: object, hook: str, message: str):
        super().__init__(plugin, message)
        self.hook = hook


@dataclass(frozen=True)
class PluginInfo:
    """What memwrap knows about one plugin entry point.

    ``status`` is ``"loaded"``, ``"failed"`` (see ``error``), ``"blocked"`` (``MEMWRAP_BLOCK_PLUGINS``)
    or ``"skipped"`` (third-party while ``MEMWRAP_DISABLE_PLUGIN_AUTOLOAD`` is set). A failure also names
    ``hook``, what failed (``"import"``, ``"register"``, a hook name such as ``"memwrap_optimizers"``, or a
    spec method such as ``"my_sgd.state_bytes"``), and keeps the ``exception``. A plugin registered by
    hand rather than through an entry point has ``value == ""`` and no distribution.
    """

    name: str
    value: str
    distribution: str
    version: str
    builtin: bool
    status: str
    error: str | None = None
    hook: str | None = None
    exception: BaseException | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def origin(self) -> str:
        """``"name (entry point 'mod') from distribution 'dist' 1.0"``: used in error messages."""
        if not self.value:
            return f"plugin {self.name!r} (registered at run time)"
        return f"plugin {self.name!r} (entry point {self.value!r}) from distribution {self.distribution!r} {self.version}"


_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_infos: list[PluginInfo] = []
_runtime_failures: dict[tuple[str, str], PluginInfo] = {}  # (plugin, hook) -> failure, once each
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
        _runtime_failures.clear()


def plugin_info() -> list[PluginInfo]:
    """Every entry point seen while building the manager, with its status.

    Example:
        >>> [i.name for i in plugin_info() if i.builtin]  # doctest: +SKIP
        ['adafactor', 'bitsandbytes', 'torch_optim']
    """
    get_plugin_manager()
    return list(_infos)


def plugin_errors() -> list[PluginInfo]:
    """Every plugin failure so far (empty when all is well): entry points that failed to load or register,
    then calls into loaded plugins that failed (a hook, or a method of a spec), each with ``name``,
    ``distribution``, ``hook`` and ``exception``.

    Example (a plugin's CI, after exercising the plugin):
        >>> assert not plugin_errors(), [e.error for e in plugin_errors()]  # doctest: +SKIP
    """
    loaded = [i for i in plugin_info() if i.status == "failed"]
    with _lock:
        return loaded + list(_runtime_failures.values())


def record_failure(plugin_name: str, hook: str, exc: BaseException, consequence: str = "") -> PluginInfo:
    """Record that calling ``hook`` of plugin ``plugin_name`` failed with ``exc``; warn the first time.

    Returns the :func:`plugin_errors` entry (the first one recorded for this plugin and hook). Used by
    :mod:`memwrap.plugin.calls`; a :class:`PluginContractError` is described by its message alone.

    Example:
        >>> record_failure("my_plugin", "memwrap_optimizers", RuntimeError("boom")).hook  # doctest: +SKIP
        'memwrap_optimizers'
    """
    with _lock:
        known = _runtime_failures.get((plugin_name, hook))
        if known is not None:
            return known
        info = describe_failure(plugin_name, hook, exc, consequence)
        _runtime_failures[(plugin_name, hook)] = info
    warnings.warn(info.error, PluginLoadWarning, stacklevel=4)
    return info


def describe_failure(plugin_name: str, hook: str, exc: BaseException, consequence: str = "") -> PluginInfo:
    """The :class:`PluginInfo` describing a failure of ``hook`` of plugin ``plugin_name``, without recording it.

    Example:
        >>> describe_failure("torch_optim", "adamw.factory", ValueError("bad lr")).distribution  # doctest: +SKIP
        'memwrap'
    """
    with _lock:
        base = next((i for i in _infos if i.name == plugin_name and i.status == "loaded"), None)
    fields = (dict(name=base.name, value=base.value, distribution=base.distribution, version=base.version,
                   builtin=base.builtin) if base is not None else
              dict(name=plugin_name, value="", distribution="", version="", builtin=False))
    origin = PluginInfo(**fields, status="failed").origin
    what = str(exc) if isinstance(exc, PluginContractError) else f"raised {type(exc).__name__}: {exc}"
    fix = (f"fix or uninstall {fields['distribution']!r}, or set {ENV_BLOCK}={plugin_name}" if fields["value"]
           else "fix or unregister it")
    message = (f"{origin}: {hook} {what}. {consequence + ' ' if consequence else ''}Other plugins are "
               f"unaffected; {fix}.")
    return PluginInfo(**fields, status="failed", error=message, hook=hook, exception=exc)


def plugin_origin(plugin_name: str) -> str:
    """Describe a registered plugin by name, with its distribution when it came from one.

    Example:
        >>> plugin_origin("torch_optim")  # doctest: +SKIP
        "plugin 'torch_optim' (entry point 'memwrap_plugins.optim.pytorch') from distribution 'memwrap' 0.1.0"
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


class _Manager(pluggy.PluginManager):
    """pluggy's manager, except that a plugin implementing an undeclared hook is refused at registration.

    pluggy keeps such implementations "pending" (only ``check_pending()`` complains), so a typo such as
    ``memwrap_optimizer`` would leave a plugin that loads fine and does nothing. Implementations meant for
    another plugin's hooks can say so with ``@memwrap.hookimpl(optionalhook=True)``.
    """

    def register(self, plugin: object, name: str | None = None) -> str | None:
        registered = super().register(plugin, name)
        if registered is None:  # blocked
            return None
        known = sorted(n for n, c in vars(self.hook).items() if getattr(c, "spec", None) is not None)
        for caller in self.get_hookcallers(plugin) or []:
            if caller.spec is None and any(i.plugin is plugin and not i.optionalhook for i in caller.get_hookimpls()):
                self.unregister(plugin)
                raise UnknownHookError(plugin, caller.name, (
                    f"plugin {registered!r} implements {caller.name!r}, which is not a memwrap hook (known: "
                    f"{', '.join(known)}).{closest_hint(caller.name, known)} Nothing of the plugin is registered; "
                    "fix the name, or mark the implementation @memwrap.hookimpl(optionalhook=True) if it belongs "
                    "to a hook that another plugin declares."))
        return registered


def _build_manager() -> tuple[pluggy.PluginManager, list[PluginInfo]]:
    pm = _Manager("memwrap")
    pm.add_hookspecs(hookspecs)
    autoload = not _env_flag(ENV_DISABLE_AUTOLOAD)
    blocked = {n.strip() for n in os.environ.get(ENV_BLOCK, "").split(",") if n.strip()}
    for name in blocked:
        pm.set_blocked(name)

    infos: list[PluginInfo] = []
    eps = _entry_points()
    # Built-ins the installed metadata does not list (none without an install; some when pyproject.toml gained
    # a plugin after an editable install) are registered from the source tree.
    _load_builtins_from_source_tree(pm, infos, blocked, listed={ep.name for ep in eps if _is_builtin(ep.value)})
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
                             f"{ENV_BLOCK}={name}.", "register")
    try:
        plugin = load()
    except Exception as exc:  # any import-time failure must not take the other plugins down
        return _failed(info, f"{origin} failed to import: {type(exc).__name__}: {exc}. Other plugins are "
                             f"unaffected; fix or uninstall {dist_name!r}, or set {ENV_BLOCK}={name}.", "import", exc)
    try:
        pm.register(plugin, name=name)
    except Exception as exc:
        return _failed(info, f"{origin} failed to register: {type(exc).__name__}: {exc}. Other plugins are "
                             f"unaffected; fix or uninstall {dist_name!r}, or set {ENV_BLOCK}={name}.",
                       getattr(exc, "hook", "register"), exc)
    return PluginInfo(**info, status="loaded")


def _describe_registered(name: str, infos: list[PluginInfo]) -> str:
    for info in infos:
        if info.name == name and info.status == "loaded":
            return info.origin
    return f"an already registered plugin named {name!r}"


def _failed(info: dict, message: str, hook: str | None = None, exc: BaseException | None = None) -> PluginInfo:
    warnings.warn(message, PluginLoadWarning, stacklevel=4)
    return PluginInfo(**info, status="failed", error=message, hook=hook, exception=exc)


def _load_builtins_from_source_tree(pm: pluggy.PluginManager, infos: list[PluginInfo], blocked: set[str],
                                    listed: set[str] = frozenset()) -> None:
    """Register the built-ins named in ``pyproject.toml`` that no installed metadata lists (``listed``)."""
    pyproject = _SOURCE_TREE / "pyproject.toml"
    if not pyproject.is_file():
        if listed:  # an installed memwrap: its metadata is the list
            return
        warnings.warn("memwrap's built-in plugins were not found: no entry points in group "
                      f"{ENTRY_POINT_GROUP!r} and no {pyproject}. Reinstall memwrap (pip install memwrap).",
                      PluginLoadWarning, stacklevel=3)
        return
    table = tomllib.loads(pyproject.read_text()).get("project", {}).get("entry-points", {}).get(ENTRY_POINT_GROUP, {})
    for name, value in sorted(table.items()):
        if _is_builtin(value) and name not in listed:
            infos.append(_load_one(pm, infos, name, value, lambda v=value: _import_builtin(v),
                                   "memwrap (source tree)", "", True, True, blocked))


def _import_builtin(value: str) -> object:
    module_name, _, attr = value.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # The missing module is the package or one of its folders (memwrap_plugins.optim), not a dependency.
        if exc.name is None or not f"{module_name}.".startswith(f"{exc.name}."):
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
