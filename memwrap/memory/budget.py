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

from memwrap.errors import closest_hint

__all__ = ["parse_budget", "format_bytes", "unit_for", "ACCEPTED_FORMS"]

_UNITS = {
    "b": 1, "": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,  # nvidia-smi / docker style shorthands are binary
}
ACCEPTED_FORMS = ('a size with its unit: "24GiB", "24 GiB", "24GB" (decimal, 10**9), "1.5 TiB", "512MiB", '
                  '"24G" (binary), "4096B" (bytes), or an int number of bytes (25769803776); units: B, KB, MB, GB, '
                  'TB, KiB, MiB, GiB, TiB, K, M, G, T')
# An int budget below this is almost surely a size in GiB/GB given without its unit (24 -> 24 bytes).
_SMALLEST_INT_BUDGET = 2**20
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_budget(value: int | float | str, *, what: str = "memory budget", allow_zero: bool = False) -> int:
    """Parse a memory size into bytes.

    GB/MB are decimal (10**9), GiB/MiB and the bare letters G/M binary (2**30), as on spec sheets
    and in ``nvidia-smi``. A string needs its unit (``"24"`` is refused: write ``"24GiB"``, or
    ``"24B"`` if bytes are meant); an int is a number of bytes, and a budget given as an int below
    1 MiB is refused as a size whose unit was forgotten (``budget=24``). Raises ``ValueError``
    naming ``what`` and listing the accepted forms for anything else; zero is accepted only with
    ``allow_zero`` (e.g. a margin of ``"0B"`` or ``0``).

    Example:
        >>> parse_budget("1.5 TiB") == int(1.5 * 2**40)
        True
        >>> parse_budget("24 GB")
        24000000000
        >>> parse_budget("0GiB", what="margin", allow_zero=True)
        0
        >>> parse_budget("24")
        Traceback (most recent call last):
        ...
        ValueError: memory budget '24' has no unit: it would be read as 24 bytes. Write '24GiB' (or '24GB' for decimal gigabytes; '24B' if you mean bytes).
    """
    sign = "non-negative" if allow_zero else "positive"

    def bad(result) -> bool:
        return result < 0 or (result == 0 and not allow_zero)

    if isinstance(value, bool):
        raise ValueError(f"{what} {value!r} is not a size; accepted: {ACCEPTED_FORMS}.")
    if isinstance(value, numbers.Integral):
        if bad(value):
            raise ValueError(f"{what} must be {sign}, got {value!r}; accepted: {ACCEPTED_FORMS}.")
        if not allow_zero and value < _SMALLEST_INT_BUDGET:
            raise ValueError(f"{what} {value!r} is read as {value} bytes, which no training step fits in: an int is a "
                             f"number of bytes. Write '{value}GiB' (or '{value}GB'), or pass the bytes as "
                             f"'{value}B' if you really mean bytes.")
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
        hint = closest_hint(unit, [u for u in _UNITS if u]) if match else ""
        raise ValueError(f"cannot read {what} {value!r}.{hint.replace('Did you mean', 'Did you mean unit')} "
                         f"Accepted: {ACCEPTED_FORMS}.")
    number = float(match.group(1))
    if unit == "" and number != 0:  # "24": a unit forgotten, not 24 bytes ("0" needs none)
        n = match.group(1)
        raise ValueError(f"{what} {value!r} has no unit: it would be read as {n} bytes. Write '{n}GiB' (or '{n}GB' "
                         f"for decimal gigabytes; '{n}B' if you mean bytes).")
    result = int(round(number * _UNITS[unit]))
    if bad(result) or (result == 0 and number > 0):
        raise ValueError(f"{what} must be {sign}, got {value!r}; accepted: {ACCEPTED_FORMS}.")
    return result


_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def unit_for(largest: int | float) -> tuple[str, int]:
    """The largest binary unit in which ``largest`` bytes is at least 1 (GiB at most: tables of training
    memory read in GiB): one report uses one unit, chosen from its largest figure.

    Example:
        >>> unit_for(300 * 2**20)
        ('MiB', 1048576)
    """
    return next(((u, s) for u, s in _BINARY[1:] if abs(largest) >= s), ("B", 1))


def format_bytes(n: int | float, signed: bool = False, unit: str | None = None) -> str:
    """Binary units with two decimals, e.g. ``'1.50 GiB'``; ``unit`` fixes the unit (e.g. a report's own).

    Example:
        >>> format_bytes(1536 * 2**20)
        '1.50 GiB'
        >>> format_bytes(8 * 2**30, unit="MiB")
        '8192.00 MiB'
    """
    sign = "-" if n < 0 else ("+" if signed and n > 0 else "")
    n = abs(n)
    if unit is not None:
        size = dict(_BINARY)[unit]
        return f"{sign}{n / size:.2f} {unit}" if size > 1 else f"{sign}{int(n)} B"
    for name, size in _BINARY[:-1]:
        if n >= size:
            return f"{sign}{n / size:.2f} {name}"
    return f"{sign}{int(n)} B"
