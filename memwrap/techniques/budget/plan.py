"""``wrap(..., budget="22GiB")``: plan the micro-batch at the first batch, then cut every batch to fit.

The loader's batches are the global batch (what one optimizer update sees). At the first batch,
and again whenever a batch is larger than every shape planned so far, :class:`BudgetPlanner` asks
:func:`memwrap.plan` (fake tensors, nothing allocated) for the largest micro-batch, and the fastest
setting of the options the user left unset (checkpoint policy; precision and optimizer only with
``budget_may_change=``), whose predicted peak plus margin fits the budget. It applies that choice
(checkpointing) and the wrapped loader yields the batch cut into that many micro-batches
(:mod:`memwrap.runtime.batch_split`), each weighted by its true size (or item count), as one window.

Plans are cached per shape: a batch whose shapes are all no larger than a planned one reuses that
plan. Under DDP/FSDP2 every rank adopts the most conservative rank's plan (smallest micro-batch)
and the same number of micro-batches per window, so the collectives line up.

Example:
    >>> model, optimizer, loader = memwrap.wrap(model, optimizer, loader, budget="22GiB")  # doctest: +SKIP
    >>> for x, y in loader:          # micro-batches of each global batch  # doctest: +SKIP
    ...     loss_fn(model(x), y).backward(); optimizer.step(); optimizer.zero_grad()
    >>> print(optimizer.budget_plan)  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from memwrap.runtime.batch_split import (Feed, batch_size, cut_batch, describe_shapes, feeds_by_layout, for_planner,
                                         split_even)
from memwrap.techniques.budget.checks import check_budget_options, optimizer_name, user_set
from memwrap.techniques.budget.ranks import agree_any, agree_max, agree_plan, world
from memwrap.memory.budget import format_bytes
from memwrap.checkpointing.apply import apply_checkpointing, checkpoint_target, current_report, remove_checkpointing
from memwrap.checkpointing.policies import parse_checkpoint_option
from memwrap.memory.search.planner import Margin, default_checkpoints, default_optimizers
from memwrap.memory.search.space import AsBuilt
from memwrap.plugin.registry import get_optimizer_spec
from memwrap.precision.base import precisions as registered
from memwrap.runtime.batch_split import _tensors

__all__ = ["BudgetChoice", "BudgetPlanner", "BudgetTooSmallError", "MAY_CHANGE", "check_budget_options"]

MAY_CHANGE = ("precision", "optim")  # options budget= changes only when the user opts in


class BudgetTooSmallError(ValueError):
    """Nothing fits the budget, even one sample per micro-batch (raised before any step)."""


@dataclasses.dataclass
class BudgetChoice:
    """The plan in force for a batch shape: micro-batch, window, options, predicted peak vs budget."""

    micro_batch: int
    accumulate: int  # micro-batches per window for ``batch`` samples
    batch: int  # samples in the global batch planned
    shapes: tuple  # per-sample shapes and dtypes planned (see describe_shapes)
    precision: str
    checkpoint: Any
    optim: str
    peak: int  # predicted tensor peak of the micro-batch step
    batch_rest: int  # bytes of the rest of the global batch, alive while its micro-batches run
    margin: int
    budget: int
    plan_seconds: float
    candidate: Any = dataclasses.field(repr=False, default=None)
    plan: Any = dataclasses.field(repr=False, default=None)  # the memwrap.plan() Plan it came from
    proposed: int | None = None  # the micro-batch this rank found alone, before the ranks agreed (DDP/FSDP2)

    @property
    def required(self) -> int:
        """Predicted peak + the rest of the global batch + margin: what must fit in the budget."""
        return self.peak + self.batch_rest + self.margin

    @property
    def options(self) -> dict[str, Any]:
        return {"precision": self.precision, "checkpoint": self.checkpoint, "optim": self.optim}

    def line(self) -> str:
        policy = self.checkpoint if self.checkpoint is not None else "none"
        return (f"[memwrap] budget plan: global batch {self.batch} = micro-batch {self.micro_batch} x accumulate "
                f"{self.accumulate}, checkpoint {policy}, precision {self.precision}, optimizer {self.optim}; "
                f"predicted peak {format_bytes(self.peak)} + batch {format_bytes(self.batch_rest)} + margin "
                f"{format_bytes(self.margin)} = {format_bytes(self.required)} of budget {format_bytes(self.budget)} "
                f"(planned in {self.plan_seconds:.1f} s)")

    __str__ = line

    def to_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "accumulate": self.accumulate, "batch": self.batch,
                "precision": self.precision, "checkpoint": repr(self.checkpoint) if self.checkpoint is not None
                else None, "optim": self.optim, "peak": self.peak, "batch_rest": self.batch_rest,
                "margin": self.margin, "required": self.required, "budget": self.budget,
                "plan_seconds": self.plan_seconds, "proposed": self.proposed}


class BudgetPlanner:
    """Plans per batch shape, applies the plan, and cuts batches into micro-batches (see the module docstring).

    Attributes: ``current`` (the :class:`BudgetChoice` in force), ``history`` (every choice made, in order),
    ``plans`` (the cache), ``plan_seconds`` (total time spent planning), ``log`` (called with one line per
    plan chosen or changed; ``print`` by default, None for silence).
    """

    def __init__(self, model: Any, optimizer: Any, opts: Any, raw: dict[str, Any], device_type: str,
                 log: Callable[[str], Any] | None = print):
        self.model, self.optimizer, self.opts = model, optimizer, opts
        self.budget = int(opts.budget)
        self.set_by_user = user_set(raw)
        self.device_type = device_type
        # On CPU there is no CUDA context, allocator cache or library workspace: the margin's fixed part (which
        # covers those) would be memory that does not exist, so the default keeps only the fractional part.
        default = Margin() if device_type == "cuda" else Margin(Margin().fraction, 0)
        self.margin = Margin.parse(opts.margin) if opts.margin is not None else default
        self.optim_name = optimizer_name(optimizer, opts)
        self.log = log
        # The loop's shape the plans assume: wrap(budget=) cannot see the user's loop, so the safe side (a loop that
        # holds the model's outputs through backward); Trainer and Lightning drop them (plan_split(keep_outputs=False)).
        self.keep_outputs = True
        self.plans: list[BudgetChoice] = []
        self.history: list[BudgetChoice] = []
        self.current: BudgetChoice | None = None
        self.plan_seconds = 0.0
        self._applied_checkpoint: Any = _UNSET
        self._foreign_checkpoint: bool | None = None  # the model came checkpointed by the user (set at the first plan)
        # How the loop calls the model, when the batch's layout does not say it (a dict fed as model(batch["ids"])):
        # learned from the first forward (see _learning_window); None: the layout's reading (model(**batch), ...).
        self.feed: Feed | None = None

    # --- the loader's side -----------------------------------------------------------------
    def split_pass(self, loader: Any, iterator: Iterator[Any]) -> Iterator[tuple[Any, bool]]:
        """Yield ``(micro_batch, is_epoch_last)`` for every batch of ``iterator``, one planned window per batch.

        Called by :class:`memwrap.runtime.loader.WrappedLoader`. The next batch is fetched before the window's
        last micro-batch is yielded, to know whether it is the epoch's last (``end_of_dataloader``).
        """
        end = object()
        upcoming = next(iterator, end)
        while upcoming is not end:
            batch, upcoming = upcoming, None
            if self._must_learn(batch):
                # The first window starts with one sample; the model's first call on it says how the loop feeds the
                # model, and the plan made then cuts the rest of the batch (the window keeps the whole batch).
                window = self._learning_window(loader, batch)
                n = batch_size(batch)
                if n == 1:
                    upcoming = next(iterator, end)
                else:
                    loader._position -= 1
                yield window["first"], n == 1 and upcoming is end
                micros = window.get("micros")
                if micros is None:
                    window["hook"].remove()
                    raise RuntimeError(
                        "budget= learns how your loop calls the model from the model's first call, but the first "
                        "micro-batch went by without one. Fix: call the wrapped model on each micro-batch the loader "
                        "yields (a batch skipped before any forward leaves nothing to plan from).")
                for i, micro in enumerate(micros[1:], start=1):
                    last = i == len(micros) - 1
                    if last:
                        upcoming = next(iterator, end)
                    else:
                        loader._position -= 1
                    yield micro, last and upcoming is end
                del batch, micros, window
                continue
            micros, sizes = self.cut(batch)
            loader.gate.plan_window(self._weights(loader, micros, sizes))
            for i, micro in enumerate(micros):
                last = i == len(micros) - 1
                if last:
                    upcoming = next(iterator, end)
                else:
                    loader._position -= 1  # the loader counts batches of the epoch: one per window, at its last
                yield micro, last and upcoming is end
            del batch, micros, micro

    def _weights(self, loader: Any, micros: list[Any], sizes: list[int]) -> list[float]:
        if loader.count_items is not None:
            return loader._weights(micros)  # item counts, summed across ranks as the loader does without budget=
        total = sum(sizes)
        return [n / total for n in sizes]

    def cut(self, batch: Any) -> tuple[list[Any], list[int]]:
        """Plan (when this shape is new), apply, and cut ``batch``; returns the micro-batches and their sizes."""
        n = batch_size(batch)
        shapes = describe_shapes(batch)
        choice = self._covering(n, shapes)
        if agree_any(choice is None):
            choice = self._new_plan(batch, n, shapes, choice)
        self._apply(choice)
        count = self._count(n, choice)
        count = agree_max(count)
        if count > n:
            raise ValueError(f"this rank's batch has {n} samples but the ranks agreed on {count} micro-batches per "
                             "window. Fix: give every rank batches of the same size (drop_last=True).")
        sizes = split_even(n, count)
        micros = cut_batch(batch, sizes)
        # The gate's accumulate is this window's size: the wrapped model weights (and the optimizer checks) only
        # when it is above 1, and a checkpoint records it (the gate accepts any value back, see gate.varies).
        self.model._gate.accumulate = count
        return micros, sizes

    def _must_learn(self, batch: Any) -> bool:
        """Whether this batch's layout leaves open how the loop calls the model (then the first forward tells)."""
        if self.feed is not None or self.current is not None:
            return False
        return not feeds_by_layout(self._plan_module(), batch)

    def _learning_window(self, loader: Any, batch: Any) -> dict[str, Any]:
        """The first window when the call must be learned: its first micro-batch (one sample) and a hook on the
        wrapped model that, at its first call, records the feed, plans the batch, applies the plan and fixes the
        window (``micros``: the first micro-batch's slot, then the rest of the batch cut to the plan)."""
        n = batch_size(batch)
        window: dict[str, Any] = {"first": cut_batch(batch, [1, n - 1])[0] if n > 1 else batch}

        def first_call(module: Any, args: tuple, kwargs: dict) -> None:
            window["hook"].remove()
            self.feed = Feed.learn(window["first"], args, kwargs)
            shapes = describe_shapes(batch)
            choice = self._covering(n, shapes)
            if agree_any(choice is None):
                choice = self._new_plan(batch, n, shapes, choice)
            self._apply(choice)
            # The first micro-batch holds one sample; the rest are cut to the plan's micro-batch (or to the user's
            # accumulate=, counting the first).
            rest = agree_max(max(1, self._count(n, choice) - 1, -(-(n - 1) // choice.micro_batch))) if n > 1 else 0
            sizes = [1] + split_even(n - 1, min(rest, n - 1)) if n > 1 else [1]
            micros = cut_batch(batch, sizes)
            self.model._gate.accumulate = len(sizes)
            loader.gate.plan_window(self._weights(loader, micros, sizes))
            window["micros"] = micros

        window["hook"] = self.model.register_forward_pre_hook(first_call, with_kwargs=True)
        return window

    def _count(self, n: int, choice: BudgetChoice) -> int:
        count = -(-n // choice.micro_batch)
        if "accumulate" in self.set_by_user:
            wanted = min(self.opts.accumulate, n)  # a short batch (the epoch's last) has fewer, one sample each
            if -(-n // wanted) > choice.micro_batch:
                raise ValueError(
                    f"accumulate={wanted} contradicts budget={format_bytes(self.budget)}: a batch of {n} samples in "
                    f"{wanted} micro-batches needs micro-batches of {-(-n // wanted)}, but the largest that fits is "
                    f"{choice.micro_batch} ({count} micro-batches). Fix: drop accumulate= (budget= sets it per batch), "
                    f"or raise the budget.")
            count = wanted
        return count

    # --- planning ----------------------------------------------------------------------------
    def _covering(self, n: int, shapes: tuple) -> BudgetChoice | None:
        """A cached plan for a batch at least as large as this one in every dimension (the one in force first, so
        that batches of varying length do not switch plans back and forth)."""
        for choice in ([self.current] if self.current is not None else []) + self.plans:
            if choice.batch >= n and _dominates(choice.shapes, shapes):
                return choice
        return None

    def _new_plan(self, batch: Any, n: int, shapes: tuple, local: BudgetChoice | None) -> BudgetChoice:
        start = time.perf_counter()
        widen = False
        if local is None:
            try:
                local = self._search(batch, n, shapes)
            except BudgetTooSmallError:
                # Options the user opted in to (budget_may_change) change the training maths: tried only when
                # nothing keeping the user's precision and optimizer fits, at any micro-batch.
                if not self._may_change():
                    raise
                widen = True
                local = self._search(batch, n, shapes, widen=True)
        choice = agree_plan(local, lambda m: self._search(batch, n, shapes, only=m, widen=widen))
        choice.proposed = local.micro_batch
        choice.plan_seconds = time.perf_counter() - start
        self.plan_seconds += choice.plan_seconds
        if choice not in self.plans:
            self.plans.append(choice)
        return choice

    def _may_change(self) -> set[str]:
        # Precision and optimizer change only before the first update: afterwards parameters and optimizer state
        # exist in the chosen form, and a re-plan (a bigger shape) keeps them.
        return set(self.opts.budget_may_change) if getattr(self.optimizer, "updates", 0) == 0 else set()

    def _space(self, widen: bool = False) -> dict[str, Any]:
        may = self._may_change() if widen else set()
        if self._foreign_checkpoint:
            checkpoints = (None,)  # the model's own checkpointing stays; the trace sees it
        elif "checkpoint" in self.set_by_user:
            checkpoints = (self.opts.checkpoint,)
        else:
            checkpoints = default_checkpoints()
        precisions = (self.model._precision.name,)
        if "precision" in may:
            precisions = tuple(dict.fromkeys([self.opts.precision] + [r.name for r in registered()
                                                                     if _runs_on(r, self.device_type)]))
        current = self.current.optim if self.current is not None else self.optim_name
        optimizers = (current,) if "optim" not in may else tuple(
            dict.fromkeys((self.optim_name,) + _steppable(default_optimizers())))
        # step_in_backward and chunked_loss are fixed at wrap() (budget= applies neither): plan the user's settings only.
        return {"checkpoints": checkpoints, "precisions": precisions, "optimizers": optimizers,
                "step_in_backward": (bool(self.opts.step_in_backward),), "chunked_loss": (self.opts.chunked_loss,)}

    def _search(self, batch: Any, n: int, shapes: tuple, only: int | None = None, widen: bool = False) -> BudgetChoice:
        """The largest micro-batch (fastest setting at that size) that fits; ``only``: that micro-batch size."""
        import memwrap

        per_sample = _tensor_bytes(batch, self._device()) / n
        if only is not None:
            sizes = [only]
        elif "accumulate" in self.set_by_user:
            sizes = [-(-n // min(self.opts.accumulate, n))]
        else:
            sizes = sorted({-(-n // k) for k in _powers_of_two(n)}, reverse=True)
        module = self._plan_module()
        space = self._space(widen)
        # Under DDP each rank's step also holds DDP's gradient buckets: plan one rank of a DDP run. (An FSDP2 model is
        # planned as one process holding whole parameters: an over-estimate, so the plan stays on the safe side.)
        ddp = isinstance(self.model.module, torch.nn.parallel.DistributedDataParallel)
        ranks, strategy = (world(), "ddp") if ddp and world() > 1 else (1, None)
        tried = []
        start = time.perf_counter()
        for m in sizes:
            count = -(-n // m)
            micro = cut_batch(batch, split_even(n, count))[0] if count > 1 else batch
            micro = self.feed.call(micro) if self.feed is not None else for_planner(micro)  # as the loop calls it
            rest = int(per_sample * (n - m))
            room = self.budget - rest
            try:
                the_plan = memwrap.plan(module, lambda _mb, micro=micro: micro, budget=f"{max(room, 1)}B",
                                        global_batch=m * count * ranks, micro_batches=[m], margin=self.margin,
                                        world_size=ranks, strategy=strategy,
                                        max_grad_norm=self.opts.max_grad_norm, keep_optim=self._keep(module),
                                        keep_precision=self.model._precision.name,
                                        keep_outputs=self.keep_outputs, exhaustive=False, **space)  # the best only
            except (RuntimeError, TypeError) as exc:
                raise ValueError(
                    f"budget= could not trace one training step of the model on this batch ({type(exc).__name__}: "
                    f"{exc}). The planner calls the model as your loop's first call did"
                    f"{f' ({self.feed})' if self.feed is not None else ''}, or when the batch's layout says how, as "
                    "memwrap.estimate does: a tuple (inputs, targets) as "
                    "model(inputs) (model(*inputs) for a tuple of inputs, model(**inputs) for a dict), a dict or "
                    "mapping as model(**batch), a tensor as model(batch). Fix: make the loader's batches follow that "
                    "convention, or drop budget= and choose the split with `memwrap plan` and accumulate=.") from exc
            tried.append((m, count, rest, the_plan))
            if the_plan.best is not None and room > 0:
                c = the_plan.best
                return BudgetChoice(m, count, n, shapes, c.precision, c.checkpoint, c.optim, c.estimate.peak, rest,
                                    c.margin, self.budget, time.perf_counter() - start, c, the_plan)
        if "accumulate" in self.set_by_user and only is None:
            m, count, rest, p = tried[-1]
            raise ValueError(
                f"accumulate={self.opts.accumulate} contradicts budget={format_bytes(self.budget)}: a batch of {n} in "
                f"{count} micro-batches of {m} needs {format_bytes(p.smallest.required + rest)} at least "
                f"({p.smallest.label}). Fix: drop accumulate= (budget= then picks the micro-batch per batch), raise "
                f"accumulate, or raise the budget. Nothing was run.")
        raise BudgetTooSmallError(self._too_small(n, tried, widen))

    def _too_small(self, n: int, tried: list, widen: bool) -> str:
        m, count, rest, p = tried[-1]
        low = p.smallest
        need = low.required + rest
        hints = [p.verdict]
        if not widen and ("precision" not in self.opts.budget_may_change or "optim" not in self.opts.budget_may_change):
            hints.append("budget_may_change=('precision', 'optim') lets the plan pick a lower precision or an optimizer "
                         "with less state")
        if "checkpoint" in self.set_by_user:
            hints.append(f"dropping checkpoint={self.opts.checkpoint!r} lets the plan choose a checkpoint policy")
        return (f"budget={format_bytes(self.budget)} cannot hold a global batch of {n} even at micro-batch {m} "
                f"({count} micro-batches): the smallest configuration ({low.label}) needs "
                f"{format_bytes(need)} (peak {format_bytes(low.estimate.peak)} + rest of the batch {format_bytes(rest)}"
                f" + margin {format_bytes(low.margin)}). Smallest budget that works: {format_bytes(need)} "
                f"(budget='{-(-need // 2**20)}MiB'). What would help: " + "; ".join(hints) + ". Nothing was run.")

    def _keep(self, module: torch.nn.Module) -> str:
        """The optimizer in force, planned as it is built (its class, param groups and hyperparameters: the state a
        real step creates), named by the registry name that describes it."""

        inner = getattr(self.optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):  # planned ahead of a framework's loop: a name, no optimizer
            return self._current_option("optim")  # (memwrap.techniques.budget.static; the framework builds it from that name)
        return AsBuilt(inner, module, self._current_option("optim"))

    def _plan_module(self) -> torch.nn.Module:
        target = checkpoint_target(self.model.module)
        if self._foreign_checkpoint is None:
            # Checkpointing the model had before wrap() (not wrap's own) is the user's setting: left as it is.
            self._foreign_checkpoint = current_report(target) is not None and not self.model._owns_checkpointing
        if self.model._owns_checkpointing:
            # Each traced candidate applies its policy itself: the trace starts from the model without ours.
            remove_checkpointing(target)
            object.__setattr__(self.model, "_owns_checkpointing", False)
            self._applied_checkpoint = _UNSET
        return target

    def _device(self) -> torch.device:
        return next(self.model.module.parameters()).device

    # --- applying ----------------------------------------------------------------------------
    def _apply(self, choice: BudgetChoice) -> None:
        if not self._foreign_checkpoint and not _same(choice.checkpoint, self._applied_checkpoint):
            target = checkpoint_target(self.model.module)
            remove_checkpointing(target)
            how = parse_checkpoint_option(choice.checkpoint)
            if how is not None:
                apply_checkpointing(target, **how)
            object.__setattr__(self.model, "checkpoint_report", current_report(target))
            object.__setattr__(self.model, "_owns_checkpointing", how is not None)
            self._applied_checkpoint = choice.checkpoint
        for name in ("precision", "optim"):
            if getattr(choice, name) != self._current_option(name):
                # import cost: it loads the planner.
                from memwrap.techniques.budget.apply import change_option

                change_option(self, name, getattr(choice, name))
        if choice is self.current:
            return
        self.current = choice
        self.history.append(choice)
        monitor = getattr(self.optimizer, "monitor", None)
        if monitor is not None and hasattr(monitor, "expect"):
            monitor.expect(choice.peak + choice.batch_rest, self.budget, choice.line())
        if self.log is not None:
            self.log(choice.line())

    def _current_option(self, name: str) -> Any:
        if name == "precision":
            return self.model._precision.name
        current = self.current.optim if self.current is not None else self.optim_name
        return current

    def __str__(self) -> str:
        return self.current.line() if self.current is not None else "[memwrap] budget plan: not planned yet " \
            "(plans at the first batch)"

    def state_dict(self) -> dict[str, Any]:
        return {"history": [c.to_dict() for c in self.history], "plan_seconds": self.plan_seconds}


_UNSET = object()


def _same(a: Any, b: Any) -> bool:
    return a is b or (b is not _UNSET and repr(a) == repr(b))


def _runs_on(row: Any, device_type: str) -> bool:
    name = row.name
    # fp16 loss scaling and TF32 are CUDA features; on CPU they are not what the budget can choose.
    return device_type == "cuda" or name not in ("fp16", "tf32")


def _steppable(names: tuple[str, ...]) -> tuple[str, ...]:
    """Optimizers that step after backward: one that updates inside backward (LOMO, layer-wise GaLore) rules out
    the accumulation a budget plan may need (wrap() refuses it with accumulate > 1)."""

    return tuple(n for n in names if not getattr(get_optimizer_spec(n), "updates_in_backward", False))


def _powers_of_two(n: int) -> list[int]:
    out, k = [], 1
    while k < n:
        out.append(k)
        k *= 2
    return out + [n]


def _dominates(big: tuple, small: tuple) -> bool:
    if len(big) != len(small):
        return False
    for (p1, s1, d1), (p2, s2, d2) in zip(big, small):
        if p1 != p2 or d1 != d2 or len(s1) != len(s2) or any(a < b for a, b in zip(s1, s2)):
            return False
    return True


def _tensor_bytes(batch: Any, device: torch.device) -> int:
    seen, total = set(), 0
    for _, t in _tensors(batch):
        st = t.untyped_storage()
        if t.device == device and st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += t.numel() * t.element_size()
    return total
