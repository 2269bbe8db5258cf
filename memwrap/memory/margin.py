"""The room a plan keeps free beyond each predicted peak: :class:`Margin`.

Example:
    >>> Margin.parse((0.1, "512MiB")).of(2**30)
    644245094
"""
from __future__ import annotations

import dataclasses
from typing import Any

from memwrap.memory.budget import parse_budget

__all__ = ["Margin"]


@dataclasses.dataclass(frozen=True)
class Margin:
    """Room kept free beyond the predicted tensor peak: ``fraction * peak + fixed`` bytes.

    It covers what no tensor trace sees: the CUDA context (300-600 MiB, outside
    ``max_memory_allocated``), the caching allocator's fragmentation and cached blocks
    (reserved - allocated, typically 5-10% of the peak) and library workspaces (cuBLAS, cuDNN,
    NCCL). See docs/planner.md for the measurements behind the defaults. ``0 <= fraction < 1``
    and ``fixed >= 0`` are checked on construction.

    Example:
        >>> Margin.parse(0.1)          # a bare fraction keeps the default fixed part
        Margin(fraction=0.1, fixed=1073741824)
        >>> Margin.parse((0.1, "0B"))  # (fraction, size): both explicit
        Margin(fraction=0.1, fixed=0)
    """

    fraction: float = 0.08
    fixed: int = 1 << 30

    def __post_init__(self):
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise ValueError(f"margin fraction {f!r} is not valid; give a fraction of the peak in [0, 1), "
                             f"e.g. 0.08 (8% of the peak; --margin on the command line).")
        if isinstance(self.fixed, bool) or not isinstance(self.fixed, int) or self.fixed < 0:
            raise ValueError(f"margin fixed part {self.fixed!r} is not valid; give a byte count >= 0 "
                             f"(or a size such as '1GiB' or '0B' to Margin.parse; --margin-bytes on the command line).")
        object.__setattr__(self, "fraction", float(f))

    def of(self, peak: int) -> int:
        return int(self.fraction * peak) + int(self.fixed)

    @classmethod
    def parse(cls, value: Any) -> Margin:
        """A :class:`Margin` from ``None`` (the default), a fraction (the default fixed part is
        kept), a ``(fraction, size)`` pair (size: bytes or a string such as ``"1GiB"`` or ``"0B"``),
        or a :class:`Margin`. Raises ``ValueError`` naming the margin for anything else."""
        if value is None:
            return cls()
        if isinstance(value, Margin):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls(value)
        if isinstance(value, tuple) and len(value) == 2:
            fixed = value[1]
            return cls(value[0], 0 if fixed in (None, "") else parse_budget(fixed, what="margin", allow_zero=True))
        raise ValueError(f"margin={value!r} is not valid; give a fraction of the peak in [0, 1) (e.g. 0.1, which "
                         f"keeps the default 1 GiB fixed part), a (fraction, size) pair such as (0.08, '1GiB') or "
                         f"(0.1, 0), or a memwrap.memory.search.planner.Margin.")
