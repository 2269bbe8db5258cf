"""Helpers for error messages that name the problem and the fix."""
from __future__ import annotations

import difflib
from collections.abc import Iterable


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
