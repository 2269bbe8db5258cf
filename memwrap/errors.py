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
