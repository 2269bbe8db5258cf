"""Helpers for error messages that name the problem and the fix."""
from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


def closest_hint(value: object, choices: Iterable[str]) -> str:
    """Return `` Did you mean 'x'?`` for the closest valid choice, or an empty string.

    Example:
        >>> closest_hint("bf61", ["fp32", "bf16"])
        " Did you mean 'bf16'?"
    """
    if not isinstance(value, str):
        return ""
    match = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.5)
    return f" Did you mean {match[0]!r}?" if match else ""


def require_name(value: object, what: str, usage: str, example: str) -> None:
    """Raise a ``TypeError`` naming the fix unless ``value`` is a ``str``.

    For arguments that take one name (``precision``, ``optim``, an optimizer name): a list or
    tuple would otherwise reach a dict lookup and fail with ``unhashable type: 'list'``.
    ``usage`` shows the corrected call with ``{0}`` where the name goes; a one-element list or
    tuple of a str suggests that str, anything else suggests ``example``.

    Example:
        >>> require_name(["bf16"], "precision", "precision={0}", "bf16")
        Traceback (most recent call last):
        ...
        TypeError: precision must be a single name (a str), got ['bf16'] (list). Fix: precision='bf16'.
    """
    if isinstance(value, str):
        return
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else []
    name = items[0] if len(items) == 1 and isinstance(items[0], str) else example
    raise TypeError(f"{what} must be a single name (a str), got {value!r} ({type(value).__name__}). "
                    f"Fix: {usage.format(repr(name))}.")


def refuse_unwrapped(wrapper: Any, call: str) -> None:
    """Raise: ``wrapper`` was passed to :func:`unwrap`, so it would train without what ``wrap()`` set up.

    Example:
        >>> import memwrap, torch
        >>> model = memwrap.wrap(torch.nn.Linear(2, 2), precision="tf32"); _ = memwrap.unwrap(model)
        >>> model(torch.ones(1, 2))
        Traceback (most recent call last):
        ...
        RuntimeError: forward on a WrappedModule that memwrap.unwrap() was called on: ...
    """
    kind = "model" if hasattr(wrapper, "module") else "optimizer"  # a WrappedModule or a WrappedOptimizer
    inner = type(wrapper.module if kind == "model" else wrapper.optimizer).__name__
    undone = wrapper.__dict__.get("_unwrapped")
    raise RuntimeError(
        f"{call} on a {type(wrapper).__name__} that memwrap.unwrap() was called on: unwrap() undid what wrap() set up "
        f"({undone}), so this wrapper would go on training without it. Fix: use the {inner} that unwrap() returned "
        f"(your own {kind}), or wrap it again: model, optimizer = memwrap.wrap(model, optimizer, ...).")
