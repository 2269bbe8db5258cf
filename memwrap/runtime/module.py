"""WrappedModule: the forward path of one micro-batch.

1. gradient-sync control (DDP ``no_sync`` / FSDP2) unless this micro-batch closes the window,
2. floating inputs cast to the precision's storage dtype (bf16-true), autocast for the precision mode,
3. the user's module forward (checkpointed blocks inside it); with ``chunked_loss`` a call with
   labels runs the model's body, then its head and loss chunk by chunk (:mod:`memwrap.techniques.loss_head`),
4. floating outputs cast to fp32,
5. gradient hooks on outputs: incoming grad *= micro-batch weight (and the fp16 loss scale),
   so that an untouched ``loss.backward()`` yields exactly the big-batch gradient.
"""
from __future__ import annotations

import contextlib
import inspect
import types
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memwrap.errors import refuse_unwrapped
from memwrap.precision.base import Precision
from memwrap.runtime.gate import AccumulationGate
from memwrap.runtime.loss_graph import ENGINE_QUERIES_PRESENT, bypassing, walk
from memwrap.runtime.outputs import map_outputs

__all__ = ["WrappedModule", "map_outputs"]

_OUTPUT_MARK = "memwrap_output"  # autograd-node metadata key of the wrapped model's output aliases
# wrapper -> (inner forward function, forward copy with its signature); weak, and outside the wrapper's __dict__
# so that pickling a wrapper never meets the copy (pickle finds functions by name, and this one has none of its own).
_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _InnerSignature:
    """``WrappedModule.forward``: bound to a wrapper, it has the signature of the wrapped module's ``forward``.

    Trainer reads ``inspect.signature(model.forward)`` to decide whether to pass ``num_items_in_batch`` (only to a
    forward taking ``**kwargs``) and which batch columns to keep (``remove_unused_columns``); a bare
    ``forward(*args, **kwargs)`` answered "any keyword" and "no column". Each wrapper gets a copy of the function
    (same code) carrying the inner signature, made once per inner forward and bound as a real method, so
    torch.compile and ``model.forward.__func__`` (accelerate) see an ordinary method. No ``__set__``: an instance
    ``model.forward = ...`` (accelerate's output conversion) still wins, as it does over a plain function.
    """

    def __init__(self, func: Callable[..., Any]):
        self.func = func
        self.__doc__ = func.__doc__

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:  # the class attribute: the plain function (Trainer's find_labels reads this one)
            return self.func
        inner = instance.__dict__.get("_modules", {}).get("module")
        if inner is None:  # inside nn.Module.__init__
            return types.MethodType(self.func, instance)
        inner_forward = inner.forward
        key = getattr(inner_forward, "__func__", inner_forward)  # the function, not a new bound method each time
        cached = _FORWARDS.get(instance)
        if cached is None or cached[0] is not key:
            cached = (key, _with_signature(self.func, inner_forward))
            _FORWARDS[instance] = cached  # the value holds no reference to the wrapper: it is collected as before
        return types.MethodType(cached[1], instance)


def _with_signature(func: Callable[..., Any], inner_forward: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``func`` whose ``__signature__`` is ``inner_forward``'s, with ``self`` in front (bound away)."""
    try:
        inner = inspect.signature(inner_forward)
    except (TypeError, ValueError):  # a builtin without a signature: keep *args, **kwargs
        return func
    copied = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, func.__closure__)
    copied.__kwdefaults__, copied.__qualname__, copied.__doc__ = func.__kwdefaults__, func.__qualname__, func.__doc__
    copied.__module__ = func.__module__
    copied.__dict__.update(func.__dict__)
    self_param = inspect.Parameter("_memwrap_self", inspect.Parameter.POSITIONAL_ONLY)  # never an inner name
    copied.__signature__ = inner.replace(parameters=[self_param, *inner.parameters.values()])
    return copied


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
                 sync_context: Callable[[bool], contextlib.AbstractContextManager] | None = None,
                 loss_head: Callable[[nn.Module, tuple, dict], Any] | None = None):
        super().__init__()
        self.module = module
        # Plain attributes (not submodules or buffers): they must not show up in state_dict.
        object.__setattr__(self, "_gate", gate)
        object.__setattr__(self, "_precision", precision)
        object.__setattr__(self, "_scaler", scaler)
        object.__setattr__(self, "_device_type", device_type)
        object.__setattr__(self, "_sync_context", sync_context)
        # chunked_loss: called instead of the module (memwrap.techniques.loss_head.BoundLossHead); None: the module itself.
        object.__setattr__(self, "_loss_head", loss_head)
        object.__setattr__(self, "_hooks_bypassed", _Bypass(weakref.ref(self)))
        object.__setattr__(self, "checkpoint_report", None)
        object.__setattr__(self, "_owns_checkpointing", False)  # whether unwrap() removes the checkpointing
        object.__setattr__(self, "_opaque_warned", False)
        object.__setattr__(self, "_grad_input_warned", False)
        object.__setattr__(self, "_loss_log", None)  # the optimizer's WindowLoss, set by wrap(): records outputs.loss
        # The inner module's keys, without a "module." prefix, so checkpoints stay interchangeable.
        self._register_state_dict_hook(_strip_prefix)
        self._register_load_state_dict_pre_hook(_add_prefix)

    @_InnerSignature  # Trainer's inspect.signature(model.forward) sees the wrapped module's parameters
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Grad mode, not train/eval mode, decides: a model trained in eval mode (frozen BatchNorm or
        # dropout off) still needs its gradients weighted; an eval forward without backward never
        # fires the hooks, and no forward moves the window (only optimizer.step() does).
        training = torch.is_grad_enabled()
        if torch.compiler.is_compiling() and self.checkpoint_report is not None and self.checkpoint_report.modules:
            _refuse_compiled_checkpointing(self.checkpoint_report)
        if training and (self._gate.accumulate > 1 or self._scaler.is_enabled()):  # else nothing is weighted
            args, kwargs, stray = self._unweight_inputs(args, kwargs)
            if stray is not None:
                self._warn_grad_input(stray)
        # Floating inputs in the parameters' storage dtype (bf16-true: bf16, as Lightning's bf16-true): norms with
        # bf16 weights refuse fp32 inputs, and autocast does not cast them. Outputs come back fp32 (_finish).
        args, kwargs = self._precision.convert_input((args, kwargs))
        with self._sync(training), self._precision.autocast(self._device_type):
            if self._loss_head is None:
                outputs = self.module(*args, **kwargs)
            else:  # a labelled call: the model's body, then its head and loss chunk by chunk
                outputs = self._loss_head(self.module, args, kwargs)
        return self.finish_outputs(outputs)

    def finish_outputs(self, outputs: Any) -> Any:
        """What ``forward`` does with the inner module's outputs: hooked aliases (micro-batch weight, loss scale, the
        norm pass's start), the loss recorded for ``window_loss``.

        Also the body of a forward hook on the plain model where another loop calls the model itself
        (:mod:`memwrap.integrations.transformers.norm_pass`: Trainer with an optimizer that updates inside backward).

        Example:
            >>> outputs = wrapped.finish_outputs(wrapped.module(x))  # what wrapped(x) returns  # doctest: +SKIP
        """
        training = torch.is_grad_enabled()
        outputs, opaque = self._finish(outputs, training)
        if training and self._loss_log is not None:
            self._loss_log.record_outputs(outputs)
        if opaque:
            self._warn_opaque(outputs)
        return outputs

    @torch.compiler.disable
    def _unweight_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple | None]:
        # An output of an earlier call fed back in (an RNN cell, an unrolled or iterative model): the
        # gradient reaching it through this call was already weighted by this call's output hook, and its
        # own hook will weight it again. An alias that divides by its factor keeps one weighting per path.
        # The arguments are only scanned; they are rebuilt only when one of them is such an output, so a
        # model that fills in a dict or list it was given still fills in the caller's object.
        grad_inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grad_inputs:
            return args, kwargs, None
        derived = next((t for t in grad_inputs if _output_hook(t) is None and self._reaches_an_output(t)), None)
        stray = tuple(derived.shape) if derived is not None else None
        if not any(_scaling(_output_hook(t)) for t in grad_inputs):
            return args, kwargs, stray

        def unweight(t: torch.Tensor) -> torch.Tensor:
            hook = _output_hook(t) if t.requires_grad else None
            if not _scaling(hook):
                return t
            alias = t.view_as(t)
            alias.register_hook(_GradScale(hook.factor, hook.bypass, hook.gate, inverse=True))
            return alias

        return map_outputs(args, unweight), map_outputs(kwargs, unweight), stray

    def _reaches_an_output(self, t: torch.Tensor, budget: int = 64) -> bool:
        """Whether ``t``'s autograd history reaches an output alias of this model within ``budget`` nodes.

        Bounded on purpose: an input built from a large graph (an upstream network) is not searched
        through; only the short paths of a loop feeding outputs back are.
        """
        return any(_OUTPUT_MARK in node.metadata for node in walk([t.grad_fn], stop=_is_output, budget=budget))

    def _refuse_paths_around_outputs(self, current: Any) -> None:
        """Refuse a backward whose loss reaches this model's parameters other than through its outputs, where the
        output hooks weight the gradient (accumulation) or loss-scale it (fp16): that term would be neither."""
        params = {id(p): name for name, p in self.module.named_parameters() if p.requires_grad}
        found = bypassing(current, _is_output, params)
        if not found:
            return  # none, or the backward's roots could not be read (see memwrap.runtime.loss_graph)
        what = []
        if self._gate.accumulate > 1:
            what.append(f"weighted by its micro-batch's share of the window (accumulate={self._gate.accumulate})")
        if self._scaler.is_enabled():
            what.append("loss-scaled (fp16)")
        raise RuntimeError(
            f"This backward reaches parameter {found[0]!r}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "")
            + " other than through the wrapped model's outputs: a loss term computed from the parameters (an L2 "
            "penalty), a head or tied weight applied outside the model, or a tensor the model kept instead of "
            f"returning it. That term's gradient would not be {' nor '.join(what) or 'weighted'}, so the gradient "
            "would not be the big batch's. Nothing was accumulated through the outputs (a parameter reached only "
            "that way may already hold this micro-batch's part). Fix: finish this loss with memwrap.backward(loss, "
            "model), which weights the whole loss once, or compute the term inside the model's forward and return "
            "it with the outputs.")

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
        # optimizer.step() that this micro-batch had its backward (and step_in_backward that a backward starts).
        needs_hook = factor is not None or (training and self._gate.watches_backward)
        hook = _GradScale(factor, self._hooks_bypassed, self._gate, zero=self._gate.weight() == 0) if needs_hook else None
        found = []
        aliases = []

        def finish(t: torch.Tensor) -> torch.Tensor:
            found.append(True)
            out = _finish_output(t, hook)
            if hook is not None and out.requires_grad:
                aliases.append(out)
            return out

        outputs = map_outputs(outputs, finish)
        norm = self._norm_pass()
        if norm is not None and aliases:
            # step_in_backward with clipping or fp16: the first pass starts where these outputs get their gradient.
            norm.track(aliases)
        # Only when no tensor was found at all: tensors that do not require grad (a frozen model run in
        # grad mode) are a plain forward, not an output memwrap failed to see into.
        weighs = factor is not None or (training and self._gate.accumulate > 1)  # not only watching (step_in_backward)
        return outputs, bool(weighs and not found and outputs is not None)

    # Raised from forward() (finish_outputs() for the opaque one, a frame deeper), so that the stacklevel points at the
    # user's model(...) call.
    def _warn_opaque(self, outputs: Any) -> None:
        if self._opaque_warned:
            return
        object.__setattr__(self, "_opaque_warned", True)
        warnings.warn(
            f"model(...) returned a {type(outputs).__name__} in which memwrap found no tensor that requires grad, "
            "so it cannot weight this micro-batch's gradients (nor apply the fp16 loss scale). memwrap looks "
            "into tensors, tuples, lists, dicts, namedtuples and dataclasses. Fix: return one of those, or call "
            "memwrap.backward(loss, model) instead of loss.backward(); if this forward is not trained, run it "
            "under torch.no_grad().",
            stacklevel=6,
        )

    def _warn_grad_input(self, shape: tuple) -> None:
        if self._grad_input_warned:
            return
        object.__setattr__(self, "_grad_input_warned", True)
        warnings.warn(
            f"model(...) got an input computed from one of its earlier outputs (shape {shape}), e.g. a recurrent "
            "loop feeding torch.cat([x, h]) back: the gradient along that path is weighted once per call, not once "
            "(outputs passed back unchanged are handled). Fix: finish the micro-batch with "
            "memwrap.backward(loss, model), which weights the loss once whatever the graph.",
            stacklevel=5,
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients only at a window boundary, like the wrapped optimizer's ``zero_grad()``.

        Loops (and trainers) that clear with ``model.zero_grad()`` would otherwise throw away the
        window's earlier micro-batches.

        Example:
            >>> import memwrap, torch
            >>> net = torch.nn.Linear(2, 1)
            >>> model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
            >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); model.zero_grad()
            >>> net.weight.grad is None  # mid-window: kept
            False
        """
        if self.__dict__.get("_unwrapped"):  # memwrap.unwrap(model) undid what wrap() set up
            refuse_unwrapped(self, "zero_grad()")
        if self._gate.micro_step == 0:
            super().zero_grad(set_to_none)

    @contextlib.contextmanager
    def unweighted(self):
        """Gradients through the outputs are the plain ones inside this block (the hooks stand aside).

        For ``torch.autograd.grad`` through the model (gradient penalties): finish such a loss with
        :func:`memwrap.backward`, which weights the whole loss once.

        Example:
            >>> import memwrap, torch
            >>> model = memwrap.wrap(torch.nn.Linear(2, 1), precision="fp32")
            >>> x = torch.ones(1, 2, requires_grad=True)
            >>> with model.unweighted():
            ...     (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
        """
        previous = self._hooks_bypassed.on
        self._hooks_bypassed.on = True
        try:
            yield self
        finally:
            self._hooks_bypassed.on = previous

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Weight (and fp16-scale) the whole loss once, with the output hooks standing aside.

        See :func:`memwrap.backward` for when this is needed.
        """
        factor = self._grad_factor()
        self._gate.backward_seen = True
        if self._gate.weight() == 0 and self._sync_context is None:
            # A micro-batch without items adds nothing; its loss may be 0/0 = NaN, and NaN * 0 would poison
            # the window. (Under DDP/FSDP the backward must still run for the collectives; see docs/faq.md.)
            return
        previous = self._hooks_bypassed.on
        self._hooks_bypassed.on = True
        try:
            weighted = loss if factor is None else loss * factor
            norm = self._norm_pass()
            if norm is not None:  # step_in_backward with clipping or fp16: both passes from the loss itself
                norm.backward(weighted, **kwargs)
            else:
                weighted.backward(**kwargs)
        finally:
            self._hooks_bypassed.on = previous

    def _norm_pass(self) -> Any:
        ref = self._gate.__dict__.get("norm_pass")
        return ref() if ref is not None else None

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


@torch.compiler.disable
def _refuse_compiled_checkpointing(report: Any) -> None:
    # Raised from an eager frame: an exception raised in code being traced would only make torch.compile
    # fall back to eager for this frame (where is_compiling() is False), and then fail in backward.
    raise RuntimeError(
        f"torch.compile of a model wrapped with checkpointing ({len(report.modules)} checkpointed module(s), e.g. "
        f"{report.modules[0]!r}): torch's non-reentrant checkpoint fails under torch.compile's AOTAutograd backends "
        "(inductor, the default) in backward (CheckpointError: recomputed values have different metadata). Fix: "
        "choose one: compile the wrapped model without checkpoint=, or checkpoint without compiling; see "
        "docs/checkpointing.md."
    )


def _finish_output(t: torch.Tensor, hook: _GradScale | None) -> torch.Tensor:
    if t.is_floating_point() and t.dtype != torch.float32 and t.dtype != torch.float64:
        t = t.float()
    if hook is not None and t.requires_grad:
        # Hook a fresh alias, never the model's own tensor: when one output is computed from another
        # inside forward (a loss from the logits), a hook on the shared tensor would weight that path twice.
        t = t.view_as(t)
        t.register_hook(hook)
        # Recognised if fed back into the model, directly or through other ops. Kept in the autograd node's
        # metadata, which lives as long as the node (Python grad_fn wrappers are not stable across versions).
        t.grad_fn.metadata[_OUTPUT_MARK] = hook
    return t


def _is_output(node: Any) -> bool:
    return _OUTPUT_MARK in node.metadata


def _output_hook(t: torch.Tensor) -> _GradScale | None:
    """The hook of a wrapped model's output alias, or None for any other tensor."""
    return t.grad_fn.metadata.get(_OUTPUT_MARK) if t.grad_fn is not None else None


def _scaling(hook: _GradScale | None) -> bool:
    """Whether ``hook`` changes gradients (a weight or loss scale that is neither 1 nor 0)."""
    return hook is not None and hook.factor is not None and not hook.zero


class _Bypass:
    """Shared by one wrapped model's output hooks: ``on`` while memwrap.backward() has already weighted the whole
    loss; ``task``, the backward whose loss graph was last checked for paths around the outputs; ``owner``, the
    wrapped model (weakly: its hooks must not keep it alive)."""

    __slots__ = ("on", "task", "owner")

    def __init__(self, owner: Callable[[], Any]):
        self.on = False
        self.task = -1
        self.owner = owner


class _GradScale:
    """Backward hook multiplying the incoming gradient by a fixed factor (weight x loss scale), or
    dividing by it (``inverse``: an output fed back in as an input, see ``_unweight_inputs``)."""

    __slots__ = ("factor", "bypass", "gate", "zero", "inverse")

    def __init__(self, factor: float | torch.Tensor | None, bypass: _Bypass, gate: AccumulationGate,
                 zero: bool = False, inverse: bool = False):
        self.factor = factor
        self.bypass = bypass
        self.gate = gate
        self.zero = zero
        self.inverse = inverse

    def __call__(self, grad: torch.Tensor) -> torch.Tensor | None:
        if ENGINE_QUERIES_PRESENT and not self.bypass.on and self.factor is not None and not self.inverse:
            task = torch._C._current_graph_task_id()
            if task != self.bypass.task:  # once per backward: its first output hook, before any weighted gradient
                self.bypass.task = task
                owner = self.bypass.owner()
                if owner is not None:
                    owner._refuse_paths_around_outputs(torch._C._current_autograd_node())
        self.gate.backward_seen = True
        if self.bypass.on or self.factor is None:
            return None  # gradient unchanged
        if self.zero:
            # A micro-batch with no items (count_items == 0) contributes nothing, even if its loss was
            # 0/0 = NaN: NaN * 0 would poison the whole window.
            return torch.zeros_like(grad)
        factor = self.factor
        if isinstance(factor, torch.Tensor) and factor.device != grad.device:
            factor = factor.to(grad.device, non_blocking=True)
        return grad / factor if self.inverse else grad * factor


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
