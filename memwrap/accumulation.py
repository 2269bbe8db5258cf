"""Gradient accumulation: the gate that owns the window state, and the wrapped loader.

One :class:`AccumulationGate` per ``wrap()`` call is the only keeper of counters; the wrapped
model reads the current micro-batch's weight from it, the wrapped optimizer ticks it, and the
wrapped loader plans each window (its size at epoch end, and item-count weights).
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

__all__ = ["AccumulationGate", "WrappedLoader"]


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
        # Set by the wrapped model's gradient hooks; lets step() notice a call without a backward.
        self.backward_seen = False

    @property
    def window_size(self) -> int:
        return len(self._planned) if self._planned is not None else self.accumulate

    @property
    def planned(self) -> bool:
        return self._planned is not None

    def weight(self) -> float:
        """Weight of the current micro-batch's gradient in the window's mean."""
        if self._planned is not None:
            return self._planned[min(self.micro_step, len(self._planned) - 1)]
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

    def tick(self) -> bool:
        """Count one micro-batch as done; return True when it closed the window."""
        self.micro_step += 1
        if self.micro_step < self.window_size:
            return False
        self.micro_step = 0
        self._planned = None
        self.windows += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"accumulate": self.accumulate, "micro_step": self.micro_step, "windows": self.windows,
                "planned": None if self._planned is None else list(self._planned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["accumulate"] != self.accumulate:
            raise ValueError(
                f"checkpoint was saved with accumulate={state['accumulate']} but this run uses "
                f"accumulate={self.accumulate}; resume with the same accumulate to reproduce the run."
            )
        self.micro_step = state["micro_step"]
        self.windows = state["windows"]
        self._planned = None if state["planned"] is None else list(state["planned"])


class WrappedLoader:
    """Yields the wrapped loader's batches unchanged and plans each accumulation window.

    Without ``count_items`` and with ``len()``, the window's size is known from the position in
    the epoch, so nothing is buffered. Otherwise the loader looks one window ahead: it holds up to
    ``accumulate`` batches (references, not copies) so the last, partial window and the item
    weights are known before the window's first forward. That look-ahead costs the memory of up
    to ``accumulate - 1`` extra batches wherever the underlying loader puts them (usually pinned
    or plain CPU memory).

    Example:
        >>> loader = WrappedLoader([1, 2, 3], AccumulationGate(2))
        >>> list(loader)
        [1, 2, 3]
    """

    def __init__(self, loader: Iterable, gate: AccumulationGate, count_items: Callable[[Any], int] | None = None,
                 reduce_items: Callable[[int], float] | None = None):
        self.loader = loader
        self.gate = gate
        self.count_items = count_items
        # Under DDP the item total of a window is summed across ranks (set by the distributed integration).
        self.reduce_items = reduce_items
        self.position = 0  # batches yielded in the current epoch
        self._skip = 0

    def __len__(self) -> int:
        return len(self.loader)  # raises TypeError like the original when it has no len

    def set_epoch(self, epoch: int) -> None:
        for target in (self.loader, getattr(self.loader, "sampler", None), getattr(self.loader, "batch_sampler", None)):
            if target is not None and hasattr(target, "set_epoch"):
                target.set_epoch(epoch)
                return
        raise AttributeError(f"{type(self.loader).__name__} has no set_epoch(); nothing to forward it to.")

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not yet set during unpickling
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        self.position = 0
        iterator = iter(self.loader)
        for _ in range(self._skip):  # resuming mid-epoch: the loader must be deterministic
            next(iterator)
            self.position += 1
        self._skip = 0
        try:
            if self.count_items is None and _has_len(self.loader):
                yield from self._iter_by_len(iterator)
            else:
                yield from self._iter_lookahead(iterator)
        finally:
            # A pass that planned a window no step() went into (an evaluation pass over the training
            # loader, or a stop right after a window's first batch) must not leave that plan to the next one.
            self.gate.drop_unused_plan()
        # The epoch ran to its end: a checkpoint taken now resumes at the next epoch's start, not past it.
        # (A `break` closes the generator at its yield, so a stopped epoch keeps its position.)
        self.position = 0

    def _iter_by_len(self, iterator: Iterator[Any]) -> Iterator[Any]:
        total = len(self.loader)
        for batch in iterator:
            if self.gate.micro_step == 0 and not self.gate.planned:
                size = min(self.gate.accumulate, total - self.position)
                if size < self.gate.accumulate:
                    self.gate.plan_window([1.0 / size] * size)
            self.position += 1
            yield batch

    def _iter_lookahead(self, iterator: Iterator[Any]) -> Iterator[Any]:
        buffer: collections.deque = collections.deque()
        exhausted = False
        while True:
            if self.gate.micro_step == 0 and not self.gate.planned:
                while not exhausted and len(buffer) < self.gate.accumulate:
                    try:
                        buffer.append(next(iterator))
                    except StopIteration:
                        exhausted = True
                if not buffer:
                    return
                window = list(buffer)[: self.gate.accumulate]
                self.gate.plan_window(self._weights(window))
            if not buffer:
                try:
                    buffer.append(next(iterator))
                except StopIteration:
                    return
            self.position += 1
            yield buffer.popleft()

    def _weights(self, window: list[Any]) -> list[float]:
        if self.count_items is None:
            return [1.0 / len(window)] * len(window)
        items = [int(self.count_items(batch)) for batch in window]
        total = sum(items)
        if self.reduce_items is not None:
            total = self.reduce_items(total)
        if total <= 0:
            raise ValueError(
                f"count_items returned {items} for a whole window: no item to learn from. "
                "Fix count_items (it must count the items the loss averages over, e.g. non-padding tokens)."
            )
        return [n / total for n in items]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration skips the batches already consumed (deterministic loaders only)."""
        self._skip = int(state["position"])


def _has_len(obj: Any) -> bool:
    try:
        len(obj)
    except TypeError:
        return False
    return True
