"""Lightning integration: a callback that applies memwrap checkpointing and optimizers.

Lightning keeps doing what its flags do: precision (``Trainer(precision="bf16-mixed")``),
accumulation (``accumulate_grad_batches``, with DDP ``no_sync``), clipping
(``gradient_clip_val``), LR scheduling and the strategy (DDP, FSDP). The callback only

* checkpoints the module's blocks with a memwrap policy right after the module's own ``setup`` or
  ``configure_model`` has built them, before the strategy wraps or shards the model (the order FSDP
  needs, see docs/distributed.md), and
* converts the optimizer(s) returned by ``configure_optimizers`` to a memwrap optimizer
  (``"adamw_8bit"``, ``"adamw_bnb_8bit"``, ``"adafactor"``, a plugin's name), keeping each param
  group's lr and weight decay; LR schedulers returned alongside are re-pointed at the new optimizer
  with their state untouched, so the LR sequence is the one Lightning would have run.

So ``memwrap.wrap`` is never used inside a Lightning run: precision or accumulation would be done twice.

lightning is imported only when the callback is built, never by ``import memwrap``.

Example:
    >>> from memwrap.integrations.lightning.callback import MemwrapCallback
    >>> trainer = L.Trainer(callbacks=[MemwrapCallback(checkpoint="auto", optim="adamw_8bit")])  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memwrap.checkpointing.apply import apply_checkpointing, parse_checkpoint_option
from memwrap.plugin.registry import OptimizerUnavailableError, convert_optimizer, get_optimizer_spec
from memwrap.runtime.distributed import check_sharded_optimizer

__all__ = ["MemwrapCallback"]


def _callback_base() -> type:
    try:
        from lightning.pytorch.callbacks import Callback
    except ImportError:
        try:
            from pytorch_lightning.callbacks import Callback
        except ImportError as exc:
            raise ImportError(
                'MemwrapCallback needs Lightning: pip install lightning  (or: pip install "memwrap[lightning]")'
            ) from exc
    return Callback


def _is_overridden(name: str, pl_module: Any) -> bool:
    # Lightning's own test (it sees through functools.wraps), from the package the callback base came from.
    import importlib

    package = _callback_base().__module__.rsplit(".callbacks", 1)[0]
    return importlib.import_module(f"{package}.utilities.model_helpers").is_overridden(name, pl_module)


def _build_hook(pl_module: Any) -> str:
    """The last hook in which Lightning lets the module build its network before the strategy sets up."""
    # Lightning calls LightningModule.setup, then configure_sharded_model / configure_model only where overridden.
    for name in ("configure_model", "configure_sharded_model"):
        if hasattr(pl_module, name) and _is_overridden(name, pl_module):
            return name
    return "setup"


def _clips_under_amp(trainer: Any) -> bool:
    """True when Lightning will clip gradients under its mixed-precision plugin (which refuses fused optimizers)."""
    plugin = getattr(trainer, "precision_plugin", None)
    # By class name: MixedPrecision in Lightning 2, MixedPrecisionPlugin in pytorch_lightning 1.x.
    amp = any(c.__name__ in ("MixedPrecision", "MixedPrecisionPlugin") for c in type(plugin).__mro__)
    return amp and bool(getattr(trainer, "gradient_clip_val", None))


_MISSING = object()


@contextlib.contextmanager
def _unfused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Make ``optimizer`` read as an explicit ``fused=False`` choice while it is converted, unless the user chose."""
    # convert_optimizer keeps an explicit fused=/foreach= of the source; the source is discarded right after,
    # but its defaults are restored anyway so nothing the user holds changes.
    previous = optimizer.defaults.get("fused", _MISSING)
    if previous is not _MISSING and previous is not None:
        yield
        return
    optimizer.defaults["fused"] = False
    try:
        yield
    finally:
        if previous is _MISSING:
            optimizer.defaults.pop("fused", None)
        else:
            optimizer.defaults["fused"] = previous


class _Converter:
    """Replace optimizers in whatever structure ``configure_optimizers`` returned, re-pointing schedulers."""

    def __init__(self, optim: str, model: nn.Module, *, unfused: bool = False):
        # unfused: Lightning will clip gradients under mixed precision, which it refuses for fused optimizers.
        self.optim, self.model, self.unfused = optim, model, unfused
        self.converted: dict[int, tuple[torch.optim.Optimizer, torch.optim.Optimizer]] = {}  # id(old) -> (old, new)

    def __call__(self, value: Any) -> Any:
        replaced = self._optimizers(value)
        self._schedulers(replaced, set())
        return replaced

    def _optimizers(self, value: Any) -> Any:
        if isinstance(value, torch.optim.Optimizer):
            return self._convert(value)
        if isinstance(value, dict):
            return {k: self._optimizers(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._optimizers(v) for v in value)
        return value

    def _convert(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if id(optimizer) not in self.converted:
            with _unfused(optimizer) if self.unfused else contextlib.nullcontext():
                new = convert_optimizer(optimizer, self.optim, model=self.model)
            if self.unfused and getattr(new, "_step_supports_amp_scaling", False):
                raise RuntimeError(
                    f"MemwrapCallback(optim={self.optim!r}) built a fused {type(new).__name__}, which unscales gradients "
                    "inside step(), so Lightning cannot clip them (gradient_clip_val) under mixed precision. Fix: "
                    "return the module's optimizer with fused=False from configure_optimizers, pick a non-fused "
                    "optim, or drop gradient_clip_val.")
            check_sharded_optimizer(new)
            self.converted[id(optimizer)] = (optimizer, new)
        return self.converted[id(optimizer)][1]

    def _schedulers(self, value: Any, seen: set[int]) -> None:
        if id(value) in seen:
            return
        seen.add(id(value))
        target = getattr(value, "optimizer", None)
        if isinstance(target, torch.optim.Optimizer) and id(target) in self.converted:
            _retarget(value, *self.converted[id(target)])
        elif isinstance(value, dict):
            for v in value.values():
                self._schedulers(v, seen)
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._schedulers(v, seen)
        elif hasattr(value, "scheduler"):  # a Lightning LRSchedulerConfig
            self._schedulers(value.scheduler, seen)


def _retarget(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Attach a scheduler built on ``old`` to ``new``, keeping everything the scheduler has done so far."""
    # No constructor is re-run: constructors act on the groups (LinearLR scales lr by start_factor, ConstantLR
    # by factor, OneCycleLR sets its start lr), and those groups were already acted on when ``new`` copied them.
    # So the new groups take the old groups' lr state as is and only the optimizer references move.
    for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
        for key in ("lr", "initial_lr"):
            if key in old_group:
                value = old_group[key]
                new_group[key] = value.clone() if isinstance(value, torch.Tensor) else value
    _repoint(scheduler, old, new)
    _track_steps(new)


def _repoint(scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    # SequentialLR and ChainedScheduler step inner schedulers that keep their own optimizer reference.
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
    for inner in getattr(scheduler, "_schedulers", None) or ():
        _repoint(inner, old, new)


def _track_steps(optimizer: torch.optim.Optimizer) -> None:
    """Wrap ``optimizer.step`` as ``LRScheduler.__init__`` does, which it never ran for ``optimizer``."""
    # The scheduler's first step() looks for this wrapper to check that optimizer.step() ran first; without
    # it, it warns that optimizer.step() "has been overridden".
    if hasattr(optimizer.step, "_wrapped_by_lr_sched") or not hasattr(optimizer.step, "__func__"):
        return
    func, ref = optimizer.step.__func__, weakref.ref(optimizer)  # a weak ref, as torch's: no cycle

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True
        return func.__get__(opt, type(opt))(*args, **kwargs)

    step._wrapped_by_lr_sched = True
    optimizer.step = step


def _apply_checkpoint(module: nn.Module, checkpoint: Any, after: str = "setup") -> Any:
    how = parse_checkpoint_option(checkpoint)
    if how is None:
        return None
    try:
        return apply_checkpointing(module, **how)
    except ValueError as exc:  # nothing matched: often a network that does not exist yet at this point
        raise ValueError(
            f"{exc} (MemwrapCallback checkpoints right after {type(module).__name__}.{after}(): build the network in "
            "__init__, setup() or configure_model(), not later.)") from exc


def _check_available(spec: Any) -> None:
    # As create_optimizer would, but when the callback is built rather than in the middle of fit().
    ok, hint = spec.available()
    if not ok:
        raise OptimizerUnavailableError(f"optimizer {spec.name!r} is not available: {hint}")


_CLASS: type | None = None


def __getattr__(name: str) -> Any:
    # PEP 562: the class is built on first access, so importing this module does not import Lightning.
    global _CLASS
    if name != "MemwrapCallback":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _CLASS is None:
        _CLASS = type("MemwrapCallback", (_MemwrapCallback, _callback_base()),
                      {"__module__": __name__, "__doc__": _MemwrapCallback.__doc__})
    return _CLASS


class _MemwrapCallback:
    """A Lightning ``Callback`` applying memwrap checkpointing and/or a memwrap optimizer.

    Args:
        checkpoint: memwrap checkpoint option (``"auto"``, ``"selective"``, ``"every-2"``, ``"offload"``,
            a class set, a callable, a dict); ``None`` leaves the module alone.
        optim: memwrap optimizer name or alias to convert the module's optimizer(s) to; ``None``
            keeps them.

    Checkpointing runs right after the module's ``configure_model`` (or its ``setup`` when it has no
    ``configure_model``), so networks built there are covered; ``callback.report`` is then the
    :class:`~memwrap.checkpointing.apply.CheckpointReport`. After Lightning has called ``configure_optimizers``,
    ``callback.optimizers`` holds the optimizers it built.

    Example:
        >>> cb = MemwrapCallback(checkpoint="selective", optim="adamw_bnb_8bit")  # doctest: +SKIP
        >>> L.Trainer(precision="bf16-mixed", accumulate_grad_batches=8, callbacks=[cb]).fit(module)  # doctest: +SKIP
    """

    def __init__(self, checkpoint: Any = None, optim: str | None = None, *, budget: Any = None, batch: Any = None,
                 margin: Any = None):
        super().__init__()
        if budget is not None or batch is not None or margin is not None:
            # optional dependency: Lightning, imported by that module.
            from memwrap.integrations.lightning.budget import check_budget

            check_budget(budget, batch, margin)  # a bad budget fails now, not at fit()
        self.budget, self.batch, self.margin = budget, batch, margin
        self.budget_plan = None  # set at fit(): the memwrap.techniques.budget.plan.BudgetChoice
        self.micro_batch: int | None = None  # the batch size the train DataLoader must use under budget=
        if optim is not None:
            spec = get_optimizer_spec(optim)  # unknown names fail now, listing the valid ones
            _check_available(spec)  # so does a missing backend, with its install command
            optim = spec.name
        if checkpoint is not None and checkpoint is not False:
            parse_checkpoint_option(checkpoint)  # bad options fail now, not at fit()
        self.checkpoint = checkpoint
        self.optim = optim
        self.report = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._module: nn.Module | None = None  # the module whose hooks are patched, if any
        self._original: dict[str, Any] | None = None  # its instance attributes the patches shadow

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if stage != "fit":
            return
        # A fit that raised before on_exception could run (or a new module) must not keep or block the patches.
        self._restore()
        self._module, self._original = pl_module, {}
        if self.budget is not None or (self.checkpoint is not None and self.checkpoint is not False):
            # Callback.setup runs before the module's setup and configure_model: patch the one that runs last.
            hook = _build_hook(pl_module)
            self._patch(pl_module, hook, lambda result: self._checkpoint(pl_module, hook, result, trainer))
        if self.optim is not None:
            unfused = _clips_under_amp(trainer)
            self._patch(pl_module, "configure_optimizers", lambda result: self._convert(pl_module, result, unfused))

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
        self._restore()  # Lightning skips teardown after an exception

    def _patch(self, pl_module: nn.Module, name: str, after: Callable[[Any], Any]) -> None:
        """Shadow ``pl_module.<name>`` with an instance attribute that passes its result through ``after``."""
        original = getattr(pl_module, name)
        self._original[name] = pl_module.__dict__.get(name, _MISSING)

        # Lightning looks hooks up with getattr, so the instance attribute wins; functools.wraps keeps
        # Lightning's is_overridden answer (which decides whether configure_model is called at all) unchanged.
        @functools.wraps(original)
        def hook(*args: Any, **kwargs: Any) -> Any:
            return after(original(*args, **kwargs))

        pl_module.__dict__[name] = hook

    def _checkpoint(self, pl_module: nn.Module, hook: str, result: Any, trainer: Any = None) -> Any:
        checkpoint = self.checkpoint
        if self.budget is not None:  # plan the split now that the network exists (memwrap.integrations.lightning.budget)
            # optional dependency: Lightning, imported by that module.
            from memwrap.integrations.lightning.budget import plan_lightning_split

            self.budget_plan = plan_lightning_split(self, trainer, pl_module)
            self.micro_batch = self.budget_plan.micro_batch
            checkpoint = self.budget_plan.checkpoint if checkpoint is None else checkpoint
        if checkpoint is not None and checkpoint is not False:
            self.report = _apply_checkpoint(pl_module, checkpoint, after=hook)
        return result

    def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
        if self.budget_plan is not None:
            # optional dependency: Lightning, imported by that module.
            from memwrap.integrations.lightning.budget import check_micro_batch

            check_micro_batch(self, batch)

    def _convert(self, pl_module: nn.Module, result: Any, unfused: bool) -> Any:
        converter = _Converter(self.optim, pl_module, unfused=unfused)
        result = converter(result)
        self.optimizers = [new for _, new in converter.converted.values()]
        return result

    def _restore(self) -> None:
        module, original = self._module, self._original
        self._module = self._original = None
        for name, value in (original or {}).items():
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                module.__dict__[name] = value

    def state_dict(self) -> dict[str, Any]:
        return {"checkpoint": repr(self.checkpoint), "optim": self.optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the callback's settings come from its constructor."""
