"""WrappedModule: the forward path of one micro-batch.

1. gradient-sync control (DDP ``no_sync`` / FSDP2) unless this micro-batch closes the window,
2. autocast for the precision mode,
3. the user's module forward (checkpointed blocks inside it),
4. floating outputs cast to fp32,
5. gradient hooks on outputs: incoming grad *= micro-batch weight (and the fp16 loss scale),
   so that an untouched ``loss.backward()`` yields exactly the big-batch gradient.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memwrap.accumulation import AccumulationGate
from memwrap.precision import Precision

__all__ = ["WrappedModule", "map_outputs"]


class WrappedModule(nn.Module):
    """Transparent wrapper around the user's model; see the module docstring for the path.

    ``state_dict()`` keys are the inner model's, attributes not found on the wrapper are looked
    up on the inner model (``model.config``), and ``train()``/``eval()`` reach it.

    Example:
        >>> import memwrap, torch
        >>> model = memwrap.wrap(torch.nn.Linear(2, 2), precision="bf16")
        >>> model(torch.ones(1, 2)).dtype
        torch.float32
    """

    def __init__(self, module: nn.Module, gate: AccumulationGate, precision: Precision,
                 scaler: torch.amp.GradScaler, device_type: str,
                 sync_context: Callable[[bool], contextlib.AbstractContextManager] | None = None):
        super().__init__()
        self.module = module
        # Plain attributes (not submodules or buffers): they must not show up in state_dict.
        object.__setattr__(self, "_gate", gate)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_scaler", scaler)
        object.__setattr__(self, "_device_type", device_type)
        object.__setattr__(self, "_sync_context", sync_context)
        object.__setattr__(self, "_hooks_bypassed", _Bypass())
        object.__setattr__(self, "checkpoint_report", None)
        # The inner module's keys, without a "module." prefix, so checkpoints stay interchangeable.
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Grad mode, not train/eval mode, decides: a model trained in eval mode (frozen BatchNorm or
        # dropout off) still needs its gradients weighted; an eval forward without backward never
        # fires the hooks, and no forward moves the window (only optimizer.step() does).
        training = torch.is_grad_enabled()
        with self._sync(training), self._precision.autocast(self._device_type):
            outputs = self.module(*args, **kwargs)
        return self._finish(outputs, training)

    # Both read the window's state, which changes between micro-batches: under torch.compile they
    # must run eagerly every call, or the first micro-batch's weight and sync decision get baked in.
    @torch.compiler.disable
    def _sync(self, training: bool) -> contextlib.AbstractContextManager:
        if training and self._sync_context is not None:
            return self._sync_context(self._gate.closes_window())
        return contextlib.nullcontext()

    @torch.compiler.disable
    def _finish(self, outputs: Any, training: bool) -> Any:
        factor = self._grad_factor() if training else None
        # With accumulation a hook goes on even at weight 1 (a one-batch last window): it also tells
        # optimizer.step() that this micro-batch had its backward.
        needs_hook = factor is not None or (training and self._gate.accumulate > 1)
        hook = _GradScale(factor, self._hooks_bypassed, self._gate) if needs_hook else None
        return map_outputs(outputs, lambda t: _finish_output(t, hook))

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Weight (and fp16-scale) the whole loss once, with the output hooks standing aside.

        See :func:`memwrap.backward` for when this is needed.
        """
        factor = self._grad_factor()
        self._gate.backward_seen = True
        self._hooks_bypassed.on = True
        try:
            (loss if factor is None else loss * factor).backward(**kwargs)
        finally:
            self._hooks_bypassed.on = False

    def _grad_factor(self) -> float | torch.Tensor | None:
        weight = self._gate.weight()
        if self._scaler.is_enabled():
            # scaler.scale() also initialises the scale lazily, which unscale_() later requires.
            return self._scaler.scale(torch.tensor(weight, dtype=torch.float32, device=self._scale_device()))
        return None if weight == 1.0 else weight

    def _scale_device(self) -> torch.device:
        param = next(self.module.parameters(), None)
        return param.device if param is not None else torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def __getitem__(self, index: Any) -> Any:
        # Dunder lookups skip __getattr__; indexing a wrapped nn.Sequential should still work.
        return self.module[index]

    def extra_repr(self) -> str:
        return f"precision={self._precision.name}, accumulate={self._gate.accumulate}"


def _finish_output(t: torch.Tensor, hook: _GradScale | None) -> torch.Tensor:
    if t.is_floating_point() and t.dtype != torch.float32 and t.dtype != torch.float64:
        t = t.float()
    if hook is not None and t.requires_grad:
        # Hook a fresh alias, never the model's own tensor: when one output is computed from another
        # inside forward (a loss from the logits), a hook on the shared tensor would weight that path twice.
        t = t.view_as(t)
        t.register_hook(hook)
    return t


class _Bypass:
    """Shared flag: set while memwrap.backward() has already weighted the whole loss."""

    __slots__ = ("on",)

    def __init__(self):
        self.on = False


class _GradScale:
    """Backward hook multiplying the incoming gradient by a fixed factor (weight x loss scale)."""

    __slots__ = ("factor", "bypass", "gate")

    def __init__(self, factor: float | torch.Tensor | None, bypass: _Bypass, gate: AccumulationGate):
        self.factor = factor
        self.bypass = bypass
        self.gate = gate

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        self.gate.backward_seen = True
        if self.bypass.on or self.factor is None:
            return None  # gradient unchanged
        factor = self.factor
        if isinstance(factor, torch.Tensor) and factor.device != grad.device:
            factor = factor.to(grad.device, non_blocking=True)
        return grad * factor


def map_outputs(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor nested in tuples, lists, dicts, namedtuples and dataclass-like outputs.

    Example:
        >>> map_outputs({"a": (torch.ones(1),)}, lambda t: t * 2)
        {'a': (tensor([2.]),)}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        items = {k: map_outputs(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        if dataclasses.is_dataclass(obj):  # e.g. Hugging Face ModelOutput: a dict and a dataclass
            return type(obj)(**items)
        try:
            return type(obj)(items)
        except TypeError:
            obj.update(items)
            return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_outputs(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_outputs(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_outputs(v, fn) for v in obj)
    return obj


def _strip_prefix(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> dict:
    inner = prefix + "module."
    for key in list(state_dict):
        if key.startswith(inner):
            state_dict[prefix + key[len(inner):]] = state_dict.pop(key)
    return state_dict


def _add_prefix(state_dict: dict, prefix: str, *args: Any) -> None:
    # The save hook strips exactly one "module.", so loading adds exactly one back, even to keys that
    # already start with "module." (a wrapped DDP model, or a model whose child is called "module").
    for key in [k for k in state_dict if k.startswith(prefix)]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
