"""The one guarded path for every call into a plugin: hooks, and the callables of the specs plugins return.

A plugin's failure stays in the plugin. :func:`call_hook` calls each implementation of a hook on its own,
so an implementation that raises (or returns what its hook forbids) is recorded in
:func:`memwrap.plugin.manager.plugin_errors` with its plugin, distribution and hook, reported once as a
:class:`~memwrap.plugin.manager.PluginLoadWarning`, and left out, while every other plugin's result is returned.
:func:`guard_fields` does the same for the callables a spec holds (an ``OptimizerSpec``'s ``state_bytes``,
``available``, ``factory`` ...): every callable field is wrapped, so a field added later is guarded without
an edit here. Nothing in memwrap calls ``pm.hook.memwrap_x()`` directly (a test checks it).

Example:
    >>> from memwrap.plugin.calls import call_hook
    >>> sorted(r.plugin for r in call_hook("memwrap_optimizers"))  # doctest: +SKIP
    ['adafactor', 'bitsandbytes', 'torch_optim']
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

from memwrap.plugin.manager import (PluginContractError, PluginError, PluginInfo, describe_failure, get_plugin_manager,
                             plugin_origin, record_failure)

__all__ = ["HookResult", "call_hook", "guard_callable", "guard_fields", "plugin_failure_of", "FieldRule"]

_BLAME = "__memwrap_plugin_failure__"  # set on an exception that came out of a plugin


@dataclasses.dataclass(frozen=True)
class HookResult:
    """One plugin's result of a hook: the plugin's registered name, its description, and what it returned."""

    plugin: str
    origin: str
    result: Any


def call_hook(name: str, *, validate: Callable[[Any], Any] | None = None, consequence: str = "",
              **kwargs: Any) -> list[HookResult]:
    """Call every implementation of hook ``name`` on its own; return the results of those that worked.

    ``validate(result)`` normalizes one result and raises (preferably
    :class:`~memwrap.plugin.manager.PluginContractError`, whose message is shown as is) when the plugin broke the
    hook's contract; that counts as the plugin's failure like an exception. ``consequence`` is appended to
    the warning (e.g. "Its optimizers are unavailable."). Results come in registration order (built-ins
    first); wrappers (``hookwrapper``/``wrapper`` implementations) are not called. A hook that no plugin
    implements and no spec declares returns ``[]``.

    Example:
        >>> [r.result for r in call_hook("memwrap_checkpoint_policies", validate=dict)]  # doctest: +SKIP
        [{'mlp-only': <function ...>}]
    """
    caller = getattr(get_plugin_manager().hook, name, None)
    if caller is None:
        return []
    missing = [arg for arg in (caller.spec.argnames if caller.spec is not None else ()) if arg not in kwargs]
    if missing:  # memwrap's own mistake: it must not read as every plugin failing
        raise TypeError(f"call_hook({name!r}) needs the hook's arguments {missing}")
    results = []
    for impl in caller.get_hookimpls():
        if impl.hookwrapper or impl.wrapper:
            continue
        try:
            result = impl.function(*[kwargs[arg] for arg in impl.argnames])
            if validate is not None:
                result = validate(result)
        except Exception as exc:  # noqa: BLE001 - whatever one plugin raises is that plugin's failure
            _blame(exc, record_failure(impl.plugin_name, name, exc, consequence))
            continue
        results.append(HookResult(impl.plugin_name, plugin_origin(impl.plugin_name), result))
    return results


@dataclasses.dataclass(frozen=True)
class FieldRule:
    """How a guarded callable treats its result and its failures.

    ``check(result)`` returns None, or what is wrong with the result (a contract violation: recorded and
    raised as :class:`~memwrap.plugin.manager.PluginError`). ``fallback(failure)`` turns a recorded failure into a
    result instead of raising (``available`` answers "not available, because ..."). ``caller_errors``:
    the callable also receives the caller's arguments (a factory's hyperparameters), so an exception it
    raises may be the caller's mistake (``lr=-1``): it keeps its type and gains a note naming the plugin,
    but is not recorded as the plugin's failure (:func:`plugin_failure_of` still finds the plugin).
    """

    check: Callable[[Any], str | None] | None = None
    fallback: Callable[[PluginInfo], Any] | None = None
    caller_errors: bool = False


def guard_callable(fn: Callable, plugin: str, what: str, rule: FieldRule = FieldRule()) -> Callable:
    """``fn`` wrapped so that its failure is recorded as plugin ``plugin``'s failure of ``what``.

    The wrapper keeps ``fn``'s name, docstring and signature (``__wrapped__``); guarding twice is harmless
    (the inner guard names the plugin that failed).

    Example:
        >>> guarded = guard_callable(lambda: 1 / 0, "my_plugin", "my_sgd.available")  # doctest: +SKIP
        >>> guarded()  # doctest: +SKIP
        Traceback (most recent call last):
        memwrap.plugin.manager.PluginError: plugin 'my_plugin' ...: my_sgd.available raised ZeroDivisionError: ...
    """

    def guarded(*args, **kwargs):
        try:
            result = fn(*args, **kwargs)
        except PluginError:
            raise
        except Exception as exc:
            if rule.caller_errors:
                _blame(exc, describe_failure(plugin, what, exc))
                raise
            failure = record_failure(plugin, what, exc)
            _blame(exc, failure)
            if rule.fallback is not None:
                return rule.fallback(failure)
            raise PluginError(failure) from exc
        problem = rule.check(result) if rule.check is not None else None
        if problem is not None:
            exc = PluginContractError(problem)
            failure = record_failure(plugin, what, exc)
            if rule.fallback is not None:
                return rule.fallback(failure)
            raise PluginError(failure)
        return result

    functools.update_wrapper(guarded, fn, updated=())  # not __dict__: fn may be a class
    return guarded


def guard_fields(obj: Any, plugin: str, label: str, rules: Mapping[str, FieldRule] | None = None) -> Any:
    """A shallow copy of the dataclass instance ``obj`` whose callable fields are guarded.

    Every field whose value is a function (or any callable that is not a class), and every field annotated
    ``Callable`` even when its value is a class (``factory=torch.optim.SGD``), is wrapped with
    :func:`guard_callable` as ``f"{label}.{field}"``, with ``rules[field]`` when given. Fields added later
    to the dataclass (or by a subclass) are covered the same way. ``__post_init__`` is not run again.

    Example:
        >>> spec = guard_fields(spec, "my_plugin", spec.name)  # doctest: +SKIP
    """
    guarded = copy.copy(obj)
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if value is None or not callable(value):
            continue
        if isinstance(value, type) and "Callable" not in str(field.type):
            continue  # a class held as a type (for isinstance checks), not as something to call
        rule = (rules or {}).get(field.name, FieldRule())
        object.__setattr__(guarded, field.name, guard_callable(value, plugin, f"{label}.{field.name}", rule))
    return guarded


def plugin_failure_of(exc: BaseException) -> PluginInfo | None:
    """The plugin failure behind ``exc`` (itself, or anything in its cause/context chain), or None.

    Lets a caller that loops over plugins' offerings (the planner) skip the one that failed, with a note
    naming it, and re-raise everything else.

    Example:
        >>> try:
        ...     plan_one(candidate)  # doctest: +SKIP
        ... except Exception as exc:
        ...     if plugin_failure_of(exc) is None: raise
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, PluginError):
            return exc.failure
        found = getattr(exc, _BLAME, None)
        if found is not None:
            return found
        exc = exc.__cause__ or exc.__context__
    return None


def _blame(exc: BaseException, failure: PluginInfo) -> None:
    if getattr(exc, _BLAME, None) is not None:
        return
    try:
        setattr(exc, _BLAME, failure)
        exc.add_note(f"(raised inside {failure.origin}, by {failure.hook})")
    except (AttributeError, TypeError):  # an exception type without __dict__: the note is a courtesy
        pass
