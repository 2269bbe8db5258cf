"""How a plan orders its candidates: those that fit first, your training maths before optimizers that approximate it
(``OptimizerSpec.approximates``: 8-bit, 4-bit or paged AdamW for AdamW) before other maths, each group by predicted
step time; then the candidates that do not fit, by the memory they need.

Example:
    >>> [c.optim for c in rank(cands, 8 * 2**30, Margin(), keep_optim="adamw") if c.fits][:1]  # doctest: +SKIP
    ['adamw']
"""
from __future__ import annotations

from typing import Any

import torch

from memwrap.memory.margin import Margin
from memwrap.plugin.registry import get_optimizer_spec
from memwrap.precision.base import get_precision, get_precision_class

__all__ = ["rank"]


def rank(candidates: list[Any], budget: int, margin: Margin, *, keep_optim: str | None = None,
         keep_precision: str | None = None) -> list[Any]:
    """Judge each candidate against ``budget`` (peak + margin) and order them: those that fit first, the
    ones keeping your training maths (``keep_optim`` and ``keep_precision``), then those that keep your optimizer or
    one that approximates it (``OptimizerSpec.approximates``: 8-bit, 4-bit or paged AdamW for AdamW) whatever else
    they change, then those with another optimizer, each group by predicted step time; then the candidates that do not fit by the memory they need.
    ``cost`` is relative to the fastest. Each candidate's ``changes`` names every option that changes the maths:
    the optimizer, the precision (``fp32 -> bf16-true``: weights stored in bf16), uncompensated bf16 updates.

    Example:
        >>> [c.optim for c in rank(cands, 8 * 2**30, Margin(), keep_optim="adamw") if c.fits][:1]  # doctest: +SKIP
        ['adamw']
    """
    fastest = min((c.seconds for c in candidates), default=0.0)
    near: dict[str, bool] = {}  # optimizer -> whether its spec approximates keep_optim (quantized/paged AdamW)
    for c in candidates:
        c.margin = margin.of(c.estimate.peak)
        c.fits = c.estimate.peak + c.margin <= budget
        c.cost = c.seconds / fastest if fastest > 0 else 1.0
        c.changes = ()
        if keep_optim is not None and c.optim != keep_optim:
            if c.optim not in near:
                near[c.optim] = _approximates(c.optim) == keep_optim
            c.changes = (f"optimizer {keep_optim} -> {c.optim}" + (f" (approximates {keep_optim}: the same update, its "
                                                                  "state stored in fewer bits or paged)"
                                                                  if near[c.optim] else ""),)
        if keep_precision is not None and _canonical(c.precision) != keep_precision:
            c.changes += (f"precision {keep_precision} -> {c.precision} ({_precision_effect(c.precision)})",)
        if c.extra.get("compensation") == "none":  # bf16 storage without compensated updates: small steps round away
            c.changes += (f"{c.precision} updates uncompensated (compensation='none')",)

    def closeness(c: Any) -> tuple[int, int]:
        # Your maths first; then what keeps your optimizer or an approximation of it (8-/4-bit AdamW), whatever else
        # changes (a precision, uncompensated bf16 updates); another optimizer's maths last: an approximation with
        # uncompensated updates stays ahead of another optimizer with them.
        other_optimizer = keep_optim is not None and c.optim != keep_optim and not near.get(c.optim)
        return int(other_optimizer), int(bool(c.changes))

    return sorted(candidates, key=lambda c: (0, closeness(c), c.seconds) if c.fits
                  else (1, c.required, c.seconds))


def _approximates(optim: str) -> str | None:
    """The optimizer ``optim``'s spec says it approximates (``OptimizerSpec.approximates``), or None."""

    try:
        return get_optimizer_spec(optim).approximates
    except ValueError:  # a name the registry no longer knows: its own maths
        return None


def _precision_effect(precision: str) -> str:
    """How a precision changes the maths, for ``changes``: its plugin's storage dtype and autocast."""

    try:
        mode = get_precision(precision)
    except ValueError:
        return "other arithmetic"
    stored = getattr(mode, "param_dtype", None)
    if stored is not None and stored != torch.float32:
        return f"weights, gradients and optimizer state stored in {str(stored).replace('torch.', '')}"
    if getattr(mode, "autocast_dtype", None) is not None or getattr(mode, "uses_scaler", False):
        return "matmuls in lower precision (autocast)"
    return "other arithmetic (e.g. TF32 matmuls)"


def _canonical(precision: str) -> str:
    """A precision alias's registered name (``"bf16-mixed"`` -> ``"bf16"``), or the name itself if unknown."""

    try:
        return get_precision_class(precision).name
    except ValueError:
        return precision
