"""Lightning integration: a callback that applies memwrap checkpointing and optimizers.

Lightning keeps doing what its flags do: precision (``Trainer(precision="bf16-mixed")``),
accumulation (``accumulate_grad_batches``, with DDP ``no_sync``), clipping
(``gradient_clip_val``), LR scheduling and the strategy (DDP, FSDP). The callback only

* checkpoints the module's blocks with a memwrap policy in ``setup``, before the strategy wraps or
  shards the model (the order FSDP needs, see docs/distributed.md), and
* converts the optimizer(s) returned by ``configure_optimizers`` to a memwrap optimizer
  (``"adamw_8bit"``, ``"adamw_bnb_8bit"``, ``"adafactor"``, a plugin's name), keeping each param
  group's lr and weight decay; LR schedulers returned alongside are re-attached to the new optimizer.

So ``memwrap.wrap`` is never used inside a Lightning run: precision or accumulation would be done twice.

lightning is imported only when the callback is built, never by ``import memwrap``.

Example:
    >>> from memwrap.integrations.lightning import MemwrapCallback
    >>> trainer = L.Trainer(callbacks=[MemwrapCallback(checkpoint="auto", optim="adamw_8bit")])  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

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


class _Converter:
    """Replace optimizers in whatever structure ``configure_optimizers`` returned, re-pointing schedulers."""

    def __init__(self, optim: str, model: nn.Module):
        self.optim, self.model = optim, model
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
        from memwrap.distributed import check_sharded_optimizer
        from memwrap.registry import convert_optimizer

        if id(optimizer) not in self.converted:
            new = convert_optimizer(optimizer, self.optim, model=self.model)
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
    """Attach a scheduler built on ``old`` to ``new``, as if it had been built on ``new``."""
    for old_group, new_group in zip(old.param_groups, new.param_groups, strict=True):
        if "initial_lr" in old_group:
            new_group["initial_lr"] = old_group["initial_lr"]
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and not isinstance(
            scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        # Nothing has stepped yet, so re-running the base constructor from epoch -1 on the new
        # optimizer is exactly "built on new": initial LRs, step tracking, the first LR value.
        torch.optim.lr_scheduler.LRScheduler.__init__(scheduler, new, last_epoch=-1)
    else:  # ReduceLROnPlateau & co. only keep the reference
        scheduler.optimizer = new


def _apply_checkpoint(module: nn.Module, checkpoint: Any) -> Any:
    from memwrap.checkpointing import apply_checkpointing, parse_checkpoint_option

    how = parse_checkpoint_option(checkpoint)
    return None if how is None else apply_checkpointing(module, **how)


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

    After ``setup``, ``callback.report`` is the :class:`~memwrap.checkpointing.CheckpointReport`;
    after Lightning has called ``configure_optimizers``, ``callback.optimizers`` holds the optimizers it built.

    Example:
        >>> cb = MemwrapCallback(checkpoint="selective", optim="adamw_bnb_8bit")  # doctest: +SKIP
        >>> L.Trainer(precision="bf16-mixed", accumulate_grad_batches=8, callbacks=[cb]).fit(module)  # doctest: +SKIP
    """

    def __init__(self, checkpoint: Any = None, optim: str | None = None):
        super().__init__()
        if optim is not None:
            from memwrap.registry import get_optimizer_spec

            optim = get_optimizer_spec(optim).name  # unknown names fail now, listing the valid ones
        if checkpoint is not None and checkpoint is not False:
            from memwrap.checkpointing import parse_checkpoint_option

            parse_checkpoint_option(checkpoint)  # bad options fail now, not at fit()
        self.checkpoint = checkpoint
        self.optim = optim
        self.report = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._original: Any = None

    def setup(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if stage != "fit":
            return
        if self.checkpoint is not None and self.checkpoint is not False:
            self.report = _apply_checkpoint(pl_module, self.checkpoint)
        if self.optim is not None and self._original is None:
            # An instance attribute shadows the method: Lightning looks the hook up with getattr.
            original = pl_module.configure_optimizers
            self._original = original

            def configure_optimizers() -> Any:
                converter = _Converter(self.optim, pl_module)
                result = converter(original())
                self.optimizers = [new for _, new in converter.converted.values()]
                return result

            pl_module.configure_optimizers = configure_optimizers

    def teardown(self, trainer: Any, pl_module: nn.Module, stage: str) -> None:
        if self._original is not None:
            pl_module.__dict__.pop("configure_optimizers", None)
            self._original = None

    def state_dict(self) -> dict[str, Any]:
        return {"checkpoint": repr(self.checkpoint), "optim": self.optim}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the callback's settings come from its constructor."""
