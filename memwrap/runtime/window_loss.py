"""The loss of an accumulation window, for logging (what Hugging Face Trainer logs as ``loss``).

Each micro-batch's loss is recorded with the weight its gradient gets in the window (``1/size``, or
``items / items_in_window`` with ``count_items``), so the window's loss is the same weighted mean
as its gradient: the mean over micro-batches, or over items. Losses stay on their device until
someone reads :attr:`WindowLoss.value`, so logging costs no synchronisation when it is not read.
"""
from __future__ import annotations

import numbers
from typing import Any

import torch

__all__ = ["WindowLoss"]


class WindowLoss:
    """Recorded micro-batch losses of the open window, and the last closed window's mean.

    The wrapped model records ``outputs.loss`` (Hugging Face outputs, or a dict with a ``"loss"``
    key) by itself; a loss computed outside the model is recorded with
    ``optimizer.record_loss(loss)``, which replaces an automatic record of the same micro-batch.

    Example:
        >>> from memwrap.runtime.gate import AccumulationGate
        >>> gate = AccumulationGate(2); log = WindowLoss(gate)
        >>> log.record(torch.tensor(1.0)); _ = gate.tick(); log.record(torch.tensor(3.0)); _ = gate.tick()
        >>> log.close(); log.value
        2.0
    """

    def __init__(self, gate: Any):
        self.gate = gate
        self._open: dict[int, tuple[float, torch.Tensor]] = {}  # micro-step -> (weight, detached loss)
        self._closed: list[tuple[float, torch.Tensor]] = []
        self._value: float | None = None

    @torch.compiler.disable  # reads the window's position, which changes every micro-batch
    def record(self, loss: torch.Tensor | float) -> None:
        """Record the current micro-batch's loss (a scalar); call before ``optimizer.step()``."""
        if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
            loss = torch.tensor(float(loss))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)
            raise ValueError(
                f"record_loss takes the micro-batch's scalar loss, got {what}. Fix: pass the loss you call "
                "backward() on (reduce per-item losses with .mean() first)."
            )
        step = self.gate.micro_step
        if step == 0:
            # A window starts: drop records of one that ended without closing (e.g. a window of zero items
            # ended early by the loader), so they cannot leak into this one.
            self._open = {}
        self._open[step] = (float(self.gate.weight()), loss.detach().reshape(()))

    def record_outputs(self, outputs: Any) -> None:
        """Record ``outputs.loss`` / ``outputs["loss"]`` when the model returned a scalar loss."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
        if isinstance(loss, torch.Tensor) and loss.is_floating_point() and loss.numel() == 1:
            self.record(loss)

    def close(self) -> None:
        """The window closed: its records become :attr:`value`'s; the next window starts empty."""
        self._closed = list(self._open.values())
        self._open = {}
        self._value = None

    @property
    def value(self) -> float | None:
        """Weighted mean loss of the last closed window; None when none of its micro-batches was recorded."""
        if self._value is None and self._closed:
            used = [(w, loss) for w, loss in self._closed if w > 0]  # a micro-batch without items adds nothing
            total = sum(w for w, _ in used)
            if total > 0:
                # Normalised by the recorded weights: exact when every micro-batch was recorded, and still a
                # mean (not a fraction of one) when some were not.
                self._value = float(sum(w * loss.double() for w, loss in used) / total)
        return self._value

    def state_dict(self) -> dict[str, Any]:
        return {"open": {step: (w, float(loss)) for step, (w, loss) in self._open.items()},
                "closed": [(w, float(loss)) for w, loss in self._closed]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._open = {int(step): (float(w), torch.tensor(loss)) for step, (w, loss) in state["open"].items()}
        self._closed = [(float(w), torch.tensor(loss)) for w, loss in state["closed"]]
        self._value = None
