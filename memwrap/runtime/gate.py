"""Gradient accumulation: the gate that owns the window state (the wrapped loader is in :mod:`memwrap.runtime.loader`).

One :class:`AccumulationGate` per ``wrap()`` call is the only keeper of counters; the wrapped
model reads the current micro-batch's weight from it, the wrapped optimizer ticks it, and the
wrapped loader plans each window (its size at epoch end, and item-count weights).
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["AccumulationGate"]


class AccumulationGate:
    """State of the accumulation window: where we are in it, how big it is, how much each micro-batch weighs.

    A window normally holds ``accumulate`` micro-batches weighing ``1/accumulate`` each. A planned
    window (from the wrapped loader) may be shorter (the epoch's last, partial window) or carry
    per-micro-batch weights ``items_i / items_in_window``.

    Example:
        >>> gate = AccumulationGate(2)
        >>> gate.weight(), gate.closes_window()
        (0.5, False)
        >>> gate.tick(), gate.tick()
        (False, True)
    """

    def __init__(self, accumulate: int = 1):
        self.accumulate = int(accumulate)
        self.micro_step = 0
        self.windows = 0
        self._planned: list[float] | None = None
        self._backward_seen = False
        # Between a step() and the next micro-batch's start: whether that step() closed the window (else None).
        self._finished_closed: bool | None = None
        self.ticks = 0  # micro-batches counted since construction (not saved): lets the loader see steps happen
        # budget=: each batch's cut sets accumulate (memwrap.techniques.budget.plan), so a saved value is not a setting to match.
        self.varies = False
        # A weak reference to a callable run when a backward pass reaches the wrapped model's outputs (step_in_backward
        # checks there that no second backward follows its updates); held weakly so the gate keeps no optimizer alive.
        self.backward_watch: Any = None
        # A weak reference to step_in_backward's norm pass (memwrap.techniques.norm_pass), or None: the wrapped model
        # hands it the outputs of each forward and memwrap.backward runs its two passes.
        self.norm_pass: Any = None

    @property
    def backward_seen(self) -> bool:
        """Set by the wrapped model's gradient hooks; lets step() notice a call without a backward."""
        return self._backward_seen

    @backward_seen.setter
    def backward_seen(self, value: bool) -> None:
        self._backward_seen = value
        if value:  # a backward pass started: a new micro-batch is under way
            self._finished_closed = None
            watch = self.backward_watch() if self.backward_watch is not None else None
            if watch is not None:
                watch()

    @property
    def watches_backward(self) -> bool:
        """Whether the wrapped model's outputs need a gradient hook even at weight 1 (to see each backward start)."""
        return self.accumulate > 1 or (self.backward_watch is not None and self.backward_watch() is not None)

    @property
    def window_size(self) -> int:
        return len(self._planned) if self._planned is not None else self.accumulate

    @property
    def planned(self) -> bool:
        return self._planned is not None

    @property
    def sync_gradients(self) -> bool:
        """Whether the micro-batch in progress closes the window (Accelerate's ``sync_gradients``).

        True from the moment the window's last micro-batch starts until the next one starts (the loader
        yields it, or its backward begins), so it can be read before or after ``optimizer.step()``.
        """
        return self.closes_window() if self._finished_closed is None else self._finished_closed

    def start_micro_batch(self) -> None:
        """Mark that a new micro-batch has started (the wrapped loader yields it); see ``sync_gradients``."""
        self._finished_closed = None

    def weight(self) -> float:
        """Weight of the current micro-batch's gradient in the window's mean."""
        return self._weight_at(self.micro_step)

    def _weight_at(self, index: int) -> float:
        if self._planned is not None:
            return self._planned[min(index, len(self._planned) - 1)]
        return 1.0 / self.accumulate

    def closes_window(self) -> bool:
        """Whether the current micro-batch is the window's last (its backward must sync gradients)."""
        return self.micro_step >= self.window_size - 1

    def plan_window(self, weights: list[float]) -> None:
        """Fix the size and weights of the window that starts now (called by the loader)."""
        if self.micro_step != 0:
            raise RuntimeError(
                f"plan_window called in the middle of a window (micro-step {self.micro_step}); "
                "the loader and the optimizer's step() calls are out of step. Call optimizer.step() once per batch."
            )
        if not weights:
            raise ValueError("a window needs at least one micro-batch")
        self._planned = [float(w) for w in weights]

    def drop_unused_plan(self) -> None:
        """Forget a planned window that no micro-batch has gone into yet (``micro_step == 0``)."""
        if self.micro_step == 0:
            self._planned = None

    def end_window_early(self) -> float | None:
        """Make the micro-batches done so far the whole window; return the factor for their gradient.

        Their gradient was weighted for the window as planned (sum of weights ``S < 1``); multiplied by
        the returned ``1/S`` it is their mean (or item mean), as if the window had been planned this
        short. The gate is left with the window's last micro-batch in progress, so the next ``tick()``
        closes it. Returns None (and empties the window) when those micro-batches weigh nothing
        (zero items): their gradient is exactly zero and there is nothing to update.

        Example:
            >>> gate = AccumulationGate(4); gate.tick(); gate.end_window_early()
            False
            4.0
        """
        done = self.micro_step
        if done == 0:
            raise RuntimeError("end_window_early needs at least one finished micro-batch in the window")
        used = [self._weight_at(i) for i in range(done)]
        total = math.fsum(used)
        if total == 0:
            self.micro_step, self._planned = 0, None
            return None
        self._planned = [w / total for w in used]
        self.micro_step = done - 1
        return 1.0 / total

    def tick(self) -> bool:
        """Count one micro-batch as done; return True when it closed the window."""
        self.ticks += 1
        self.micro_step += 1
        if self.micro_step < self.window_size:
            self._finished_closed = False
            return False
        self.micro_step = 0
        self._planned = None
        self.windows += 1
        self._finished_closed = True
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"accumulate": self.accumulate, "micro_step": self.micro_step, "windows": self.windows,
                "planned": None if self._planned is None else list(self._planned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.varies:
            self.accumulate = int(state["accumulate"])
        elif state["accumulate"] != self.accumulate:
            raise ValueError(
                f"checkpoint was saved with accumulate={state['accumulate']} but this run uses "
                f"accumulate={self.accumulate}; resume with the same accumulate to reproduce the run."
            )
        self.micro_step = state["micro_step"]
        self.windows = state["windows"]
        self._planned = None if state["planned"] is None else list(state["planned"])

