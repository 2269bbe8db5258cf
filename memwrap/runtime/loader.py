"""The wrapped loader: yields the user's batches unchanged and plans each accumulation window on the gate.

It knows where the epoch ends (from ``len()``, or by looking ahead), weights micro-batches by their item
counts, resumes mid-epoch (replaying the epoch's order from saved random states), and gives the loop
Accelerate's flags (``sync_gradients``, ``end_of_dataloader``) and ``end_epoch()``.
"""
from __future__ import annotations

import collections
import itertools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from memwrap.state.rng import capture_rng, loader_generators, restore_rng

if TYPE_CHECKING:
    from memwrap.runtime.gate import AccumulationGate

__all__ = ["WrappedLoader"]


class WrappedLoader:
    """Yields the wrapped loader's batches unchanged and plans each accumulation window.

    Without ``count_items`` and with ``len()``, the window's size is known from the position in
    the epoch, so nothing is buffered. Otherwise the loader looks one window ahead: it holds up to
    ``accumulate`` batches (references, not copies) so the last, partial window and the item
    weights are known before the window's first forward. That look-ahead costs the memory of up
    to ``accumulate - 1`` extra batches wherever the underlying loader puts them (usually pinned
    or plain CPU memory).

    Only one pass at a time owns the window plan and the epoch position: the outermost one, the
    training loop. A pass started while it is open (an evaluation over the training loader) yields
    the batches and touches nothing.

    Attributes ``sync_gradients`` (this micro-batch closes the window) and ``end_of_dataloader``
    (it is the epoch's last) carry Accelerate's names; ``end_epoch()`` ends an epoch early (after
    ``break``) with the open window stepped by its true size.

    Example:
        >>> from memwrap.runtime.gate import AccumulationGate
        >>> loader = WrappedLoader([1, 2, 3], AccumulationGate(2))
        >>> list(loader)
        [1, 2, 3]
    """

    def __init__(self, loader: Iterable, gate: AccumulationGate, count_items: Callable[[Any], int] | None = None,
                 reduce_items: Callable[[int], float] | None = None, optimizer: Any = None):
        self.loader = loader
        self.gate = gate
        self.count_items = count_items
        # Under DDP the item total of a window is summed across ranks (set by the distributed integration).
        self.reduce_items = reduce_items
        self.optimizer = optimizer  # the wrapped optimizer: end_epoch() steps the open window through it
        self.end_of_dataloader = False  # the batch yielded last is the epoch's last (Accelerate's name)
        self._position = 0  # batches the owning pass yielded in this epoch (kept when it stopped early)
        self._owner: object | None = None  # token of the pass that owns the window plan
        self._yields = 0  # batches the owning passes yielded, ever: tells a nested pass from a stale owner
        self._resume: dict[str, Any] | None = None
        self._pass_rng: dict[str, Any] | None = None  # random states at the owning pass's start
        self._len_trusted = True
        self.budget_plan: Any = None  # budget=: cuts each batch into one window of micro-batches (memwrap.techniques.budget.plan)

    @property
    def position(self) -> int:
        """Batches consumed in the current epoch (0 after an epoch that ran to its end)."""
        return self._position

    @property
    def sync_gradients(self) -> bool:
        """Whether the batch in progress closes the accumulation window (its step() updates)."""
        return self.gate.sync_gradients

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
        if self._owner is not None:
            # A pass inside the training pass (an evaluation every k batches over this loader): its batches
            # are followed by no step(), so it must leave the window plan and the epoch position alone.
            yield from self._nested_pass()
            return
        token = self._owner = object()
        try:
            yield from self._owning_pass(token)
        finally:
            if self._owner is token:
                self._owner = None
            # A pass that planned a window no step() went into (an evaluation pass over the training
            # loader, or a stop right after a window's first batch) must not leave that plan to the next one.
            self.gate.drop_unused_plan()

    def _nested_pass(self) -> Iterator[Any]:
        ticks = yields = None
        for batch in self.loader:
            if ticks is not None and self.gate.ticks != ticks and self._yields == yields:
                raise RuntimeError(
                    "optimizer.step() ran on batches of a second pass over the wrapped loader while an earlier pass "
                    "(which owns the accumulation window) is still open, e.g. `it = iter(loader); next(it)` kept "
                    "around. Fix: finish or close the earlier iterator (`it.close()` or `del it`) before training.")
            ticks, yields = self.gate.ticks, self._yields
            yield batch

    def _owning_pass(self, token: object) -> Iterator[Any]:
        self.end_of_dataloader = False
        iterator = self._start(iter_fn=lambda: iter(self.loader))
        if self.budget_plan is not None:  # budget=: each batch is a window, cut into the micro-batches yielded
            batches = self.budget_plan.split_pass(self, iterator)
        elif self.count_items is None and self._len_trusted and _has_len(self.loader):
            batches = self._iter_by_len(iterator, token)
        else:
            batches = self._iter_lookahead(iterator, token)
        for batch, last in batches:
            self._position += 1
            self._yields += 1
            self.end_of_dataloader = last
            self.gate.start_micro_batch()
            yield batch
            if self._owner is not token:  # end_epoch() ended this pass
                return
        # The epoch ran to its end: a checkpoint taken now resumes at the next epoch's start, not past it.
        # (A `break` closes the generator at its yield, so a stopped epoch keeps its position.)
        self._position = 0
        self.end_of_dataloader = True

    def _start(self, iter_fn: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """The underlying iterator, advanced past the batches a resumed checkpoint already consumed."""
        resume, self._resume = self._resume, None
        generators = loader_generators(self.loader)
        skip = 0 if resume is None else int(resume["position"])
        replay = resume.get("pass_rng") if resume is not None and skip else None
        current = capture_rng() if replay is not None else None
        # The order of an epoch is drawn when its iteration starts (a shuffling sampler, worker seeds): keep
        # the random states of that moment, so that a mid-epoch resume replays the same order.
        if replay is not None:
            restore_rng(replay, generators)
        self._pass_rng = capture_rng(generators)
        self._position = 0
        iterator = iter_fn()
        for _ in range(skip):  # resuming mid-epoch: the loader must be deterministic
            try:
                next(iterator)
            except StopIteration:
                raise ValueError(
                    f"the loader state says {skip} batches of this epoch were consumed, but the loader yields only "
                    f"{self._position}. Fix: resume with the same data and loader settings.") from None
            self._position += 1
        if current is not None:
            # Back to the states of the resumed moment (dropout, augmentations); the generators to their saved state.
            restore_rng({**current, "generators": resume["generators"]}, generators)
        return iterator

    def _iter_by_len(self, iterator: Iterator[Any], token: object) -> Iterator[tuple[Any, bool]]:
        total = len(self.loader)
        for batch in iterator:
            if self._position >= total:  # len() was too small: plan the rest by exhaustion
                self._distrust_len(f"yielded more than len()={total} batches")
                yield from self._iter_lookahead(itertools.chain([batch], iterator), token)
                return
            if self.gate.micro_step == 0 and not self.gate.planned:
                size = min(self.gate.accumulate, total - self._position)
                if size < self.gate.accumulate:
                    self.gate.plan_window([1.0 / size] * size)
            yield batch, self._position + 1 == total
        if self._position < total and self._owner is token:
            # len() was too large: the window the last batch went into was planned longer than it is.
            self._distrust_len(f"stopped after {self._position} batches while len() said {total}")
            if self.gate.micro_step:
                self._close_window()

    def _iter_lookahead(self, iterator: Iterator[Any], token: object) -> Iterator[tuple[Any, bool]]:
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
            if len(buffer) == 1 and not exhausted:
                # Whether this batch is the epoch's last (end_of_dataloader): one batch more of look-ahead.
                try:
                    buffer.append(next(iterator))
                except StopIteration:
                    exhausted = True
            batch = buffer.popleft()
            yield batch, exhausted and not buffer

    def _weights(self, window: list[Any]) -> list[float]:
        if self.count_items is None:
            return [1.0 / len(window)] * len(window)
        items = [_item_count(self.count_items(batch), self._position + i) for i, batch in enumerate(window)]
        total = sum(items)
        if self.reduce_items is not None:
            total = self.reduce_items(total)
        if total <= 0:
            raise ValueError(
                f"count_items returned {items} for a whole window: no item to learn from. "
                "Fix count_items (it must count the items the loss averages over, e.g. non-padding tokens)."
            )
        return [n / total for n in items]

    def _distrust_len(self, what: str) -> None:
        if self._len_trusted:
            self._len_trusted = False
            warnings.warn(
                f"the wrapped loader {what}: its len() is wrong, so the accumulation windows cannot be planned from "
                "it. memwrap now finds the epoch's end by looking one window ahead (no batch and no gradient is "
                "lost; this epoch's last windows may be split differently). Fix: make the loader's __len__ return "
                "the number of batches it yields (a learning-rate schedule counted from len() is off too).",
                stacklevel=4)

    def end_epoch(self) -> bool:
        """End the epoch now: step the open window by its true size; the next pass starts a new epoch.

        For an epoch cut short by ``break`` (as Lightning's ``limit_train_batches`` does): the
        micro-batches of the open window are averaged over their true number (or item count) and the
        optimizer updates, as if the window had been planned that short. Without it, the next pass
        continues the open window (as a resumed run does). Returns whether an update was applied.

        Example:
            >>> for i, (x, y) in enumerate(loader):  # doctest: +SKIP
            ...     if i == limit:
            ...         break
            ...     loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
            >>> loader.end_epoch(); scheduler.step()  # doctest: +SKIP
        """
        updated = self._close_window()
        self._owner = None  # an open pass ends at its next batch request
        self._position = 0
        self.end_of_dataloader = True
        return updated

    def _close_window(self) -> bool:
        gate = self.gate
        if gate.micro_step == 0:
            gate.drop_unused_plan()
            return False
        if self.optimizer is None:
            raise RuntimeError("ending a window early needs the optimizer: wrap the loader with memwrap.wrap(model, "
                               "optimizer, loader, ...).")
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            raise RuntimeError(
                f"the accumulation window was left open after {gate.micro_step} micro-batch(es) under distributed "
                "training; those micro-batches skipped the gradient all-reduce, so the window cannot be closed "
                "here. Fix: give every rank the same number of batches, a multiple of accumulate per epoch, or a "
                "correct len().")
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        factor = gate.end_window_early()
        if factor is None:  # zero items: the window's gradient is exactly zero
            self.optimizer.zero_grad()
            return False
        with torch.no_grad():
            for p in params:
                p.grad.mul_(factor)
        gate.backward_seen = True  # the gradient of these micro-batches is there; no warning from step()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return bool(self.optimizer.did_update)

    def state_dict(self) -> dict[str, Any]:
        """Epoch position, and the random states to replay this epoch's order (``pass_rng``) on resume."""
        if self._resume is not None:  # loaded but not iterated yet: the loaded state is still the truth
            return dict(self._resume)
        return {"position": self._position, "pass_rng": self._pass_rng if self._position else None,
                "generators": [g.get_state() for g in loader_generators(self.loader)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume mid-epoch: the next iteration replays this epoch's order and skips the batches already consumed."""
        self.check_state_dict(state)
        generators = loader_generators(self.loader)
        for gen, saved in zip(generators, state.get("generators") or []):
            gen.set_state(saved)
        self._resume = {"position": int(state["position"]), "pass_rng": state.get("pass_rng"),
                        "generators": state.get("generators") or [g.get_state() for g in generators]}
        self._position = int(state["position"])

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """Raise if ``state`` cannot be loaded into this loader (changes nothing)."""
        position = state.get("position") if isinstance(state, dict) else None
        if not isinstance(position, int) or isinstance(position, bool) or position < 0:
            raise ValueError(f"not a memwrap loader state (position {position!r}); pass what loader.state_dict() returned.")
        if self._owner is not None:
            raise RuntimeError("load the loader state before iterating it, not inside a pass over it.")
        saved = state.get("generators")
        if saved is not None and len(saved) != len(loader_generators(self.loader)):
            raise ValueError(
                f"the loader state holds {len(saved)} generator state(s) but this loader has "
                f"{len(loader_generators(self.loader))}. Fix: build the DataLoader as in the saved run (same generator=).")


def _item_count(value: Any, index: int) -> int:
    """A micro-batch's item count as an int; refuse anything but a whole number >= 0."""
    count = None
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool):
        count = None
    elif isinstance(value, numbers.Integral):
        count = int(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        count = int(value)
    if count is None or count < 0:
        raise ValueError(
            f"count_items returned {value!r} for batch {index} of this epoch; it must be a whole number of items >= 0 "
            "(an int, an integral float or a 0-dim integer tensor). A fractional or negative count would weight the "
            "micro-batch wrongly. Fix: return the number of items the loss averages over, e.g. "
            "int((batch['labels'] != -100).sum()).")
    return count


def _has_len(obj: Any) -> bool:
    try:
        len(obj)
    except TypeError:
        return False
    return True
