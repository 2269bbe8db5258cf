"""Memory sizes as humans write them: ``"24GiB"``, ``"24 GB"``, ``25769803776``.

Example:
    >>> parse_budget("24GiB")
    25769803776
    >>> format_bytes(25769803776)
    '24.00 GiB'
"""
from __future__ import annotations

import math
import numbers
import re

__all__ = ["parse_budget", "format_bytes", "ACCEPTED_FORMS"]

_UNITS = {
    "b": 1, "": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,  # nvidia-smi / docker style shorthands are binary
}
ACCEPTED_FORMS = ('an int number of bytes (25769803776), "24GiB", "24 GiB", "24GB" (decimal, 10**9), '
                  '"1.5 TiB", "512MiB", "24G" (binary); units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T')
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(value: int | float | str, *, what: str = "memory budget", allow_zero: bool = False) -> int:
    """Parse a memory size into bytes.

    GB/MB are decimal (10**9), GiB/MiB and the bare letters G/M binary (2**30), as on spec sheets
    and in ``nvidia-smi``. Raises ``ValueError`` naming ``what`` and listing the accepted forms for
    anything else; zero is accepted only with ``allow_zero`` (e.g. a margin of ``"0B"``).

    Example:
        >>> parse_budget("1.5 TiB") == int(1.5 * 2**40)
        True
        >>> parse_budget("24 GB")
        24000000000
        >>> parse_budget("0GiB", what="margin", allow_zero=True)
        0
    """
    sign = "non-negative" if allow_zero else "positive"

    def bad(result) -> bool:
        return result < 0 or (result == 0 and not allow_zero)

    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a size; accepted: {ACCEPTED_FORMS}.")
    if isinstance(value, numbers.Integral):
        if bad(value):
            raise ValueError(f"{what} must be {sign}, got {value!r}; accepted: {ACCEPTED_FORMS}.")
        return int(value)
    if isinstance(value, numbers.Real):
        if not math.isfinite(value) or bad(value):
            raise ValueError(f"{what} must be a {sign} finite size, got {value!r}; accepted: {ACCEPTED_FORMS}.")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{what} {value!r} ({type(value).__name__}) is not a size; accepted: {ACCEPTED_FORMS}.")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        from memwrap.errors import closest_hint

        hint = closest_hint(unit, [u for u in _UNITS if u]) if match else ""
        raise ValueError(f"cannot read {what} {value!r}.{hint.replace('Did you mean', 'Did you mean unit')} "
                         f"Accepted: {ACCEPTED_FORMS}.")
    number = float(match.group(1))
    result = int(round(number * _UNITS[unit]))
    if bad(result) or (result == 0 and number > 0):
        raise ValueError(f"{what} must be {sign}, got {value!r}; accepted: {ACCEPTED_FORMS}.")
    return result


def format_bytes(n: int | float, signed: bool = False) -> str:
    """Binary units with two decimals, e.g. ``'1.50 GiB'``.

    Example:
        >>> format_bytes(1536 * 2**20)
        '1.50 GiB'
    """
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"
