"""Chunked LM-head loss: a causal LM's loss without its whole ``[tokens, vocab]`` logits.

With ``wrap(model, ..., chunked_loss=True)``, a call ``model(input_ids, labels=labels)`` runs the
model's body (everything up to the final norm) and then the head and the cross entropy chunk by
chunk of tokens: each chunk's logits, their fp32 upcast, the log-softmax and their gradients live
only while that chunk is computed, in forward and again in backward (the chunk is recomputed under
:func:`torch.utils.checkpoint.checkpoint`). The loss and every gradient equal the plain
computation's (Hugging Face's label shift, ``ignore_index=-100``, the mean over valid tokens or
``sum / num_items_in_batch``), up to fp32 summation order.

Which module is the body and which the head, whether the model softcaps or scales its logits: that
is model-family knowledge, which plugins provide through the ``memwrap_loss_heads`` hook (built-ins:
``plugins/loss_heads/zoo.py`` for memwrap's own GPT/Llama, ``plugins/loss_heads/hf.py`` for
Hugging Face causal LMs). The core stays free of transformers; a model no plugin recognizes is
refused at ``wrap()``.

Example:
    >>> import memwrap, torch
    >>> from memwrap.models import GPT, GPTConfig
    >>> net = GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=1, n_head=2, n_embd=32))
    >>> model = memwrap.wrap(net, chunked_loss=16)
    >>> ids = torch.randint(0, 512, (2, 32))
    >>> out = model(ids, labels=ids)
    >>> out["logits"] is None, out["loss"].shape
    (True, torch.Size([]))
"""
from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memwrap.plugin.calls import FieldRule, call_hook, guard_fields
from memwrap.plugin.manager import PluginContractError

__all__ = ["LossHeadSpec", "LossHeadError", "linear_cross_entropy", "default_chunk_size", "loss_heads",
           "find_loss_head", "head_problem", "BoundLossHead", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # Hugging Face's (and torch's) default
MIN_CHUNK = 256  # tokens: smaller chunks cost more in per-chunk overhead than they save


class LossHeadError(ValueError):
    """``chunked_loss`` cannot be applied to this model (no adapter, two adapters, a sharded root ...)."""


@dataclasses.dataclass(frozen=True)
class LossHeadSpec:
    """A model-family adapter for the chunked loss, returned by a ``memwrap_loss_heads`` plugin.

    ``matches(model) -> bool`` recognizes the models the adapter handles (cheap: types and config
    only; it must not run the model). ``forward(model, args, kwargs, loss)`` runs one call
    ``model(*args, **kwargs)``: when the call carries labels it runs the model's body and returns an
    output like the model's with ``loss = loss(hidden, head_weight, labels, ...)`` (``loss`` is
    :func:`linear_cross_entropy` with the chunk size bound) and no logits; for a call without
    labels it returns None and the model runs unchanged. ``description`` names the families.

    ``head(model) -> nn.Module`` names the module the model's own forward calls as its LM head, whose
    call the adapter replaces by ``loss(hidden, head.weight, ..., bias=head.bias)``. memwrap then checks,
    at ``wrap()`` and at every labelled forward, that this call computes nothing else: a plain
    ``nn.Linear`` (or a subclass that keeps its ``forward``) with no hooks (see :func:`head_problem`);
    any other head is refused, since the adapter would skip what it does. An adapter without ``head``
    vouches itself that it reproduces the head exactly.

    Example:
        >>> spec = LossHeadSpec("mine", matches=lambda m: False, forward=lambda m, a, k, loss: None)
        >>> spec.name
        'mine'
    """

    name: str
    matches: Callable[[nn.Module], bool]
    forward: Callable[[nn.Module, tuple, dict, Callable[..., torch.Tensor]], Any]
    description: str = ""
    head: Callable[[nn.Module], nn.Module | None] | None = None


# ----------------------------------------------------------------------------- the loss

def default_chunk_size(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk when ``chunked_loss=True``: a chunk's logits about as large as the hidden states.

    ``tokens * hidden / vocab`` tokens (so one chunk of ``[chunk, vocab]`` logits holds as many numbers as the
    ``[tokens, hidden]`` hidden states), at least :data:`MIN_CHUNK` and at most ``tokens``.

    Example:
        >>> default_chunk_size(4096, 4096, 128256)  # Llama-3-8B, batch 2 x 2048
        256
    """
    return max(1, min(tokens, max(MIN_CHUNK, -(-tokens * hidden // vocab))))


def _chunk_sum(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor,
               transform: Callable[[torch.Tensor], torch.Tensor] | None, ignore_index: int) -> torch.Tensor:
    # The plain path's ops in its order: the head (autocast applies as it does to lm_head), the model's own
    # logit transform (softcapping, scaling), the fp32 upcast, then cross entropy, summed over the chunk.
    logits = F.linear(h, weight, bias)
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum")


def _loss_of_logits(logits, y, transform, ignore_index):
    if transform is not None:
        logits = transform(logits)
    return F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum")


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum of per-token cross entropies of ``h @ w.T + b``, chunk by chunk; backward recomputes each chunk.

    Like checkpointing each chunk, but the head's backward is written out so that the weight gradient is
    accumulated in place into one buffer: through autograd every chunk would hand the engine a fresh
    ``[vocab, hidden]`` gradient to add, one more weight-sized tensor alive at the peak (measured in
    benchmarks/chunked_loss.py). Autocast is recorded in forward and restored for the recompute, so each chunk
    runs in the dtypes the plain ``lm_head`` would.
    """

    @staticmethod
    def forward(ctx, h, w, b, y, transform, ignore_index, size):
        device = h.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.transform, ctx.ignore_index, ctx.size = transform, ignore_index, size
        ctx.save_for_backward(h, w, b, y)
        total = None
        with torch.no_grad():
            for start in range(0, h.shape[0], size):
                part = _chunk_sum(h[start:start + size], w, b, y[start:start + size], transform, ignore_index)
                total = part if total is None else total + part
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        h, w, b, y = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        device, enabled, dtype = ctx.autocast
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros_like(w) if need_w else None
        grad_b = torch.zeros_like(b) if need_b else None
        w_const, b_const = w.detach(), (b.detach() if b is not None else None)
        with torch.autocast(device, dtype=dtype, enabled=enabled), torch.enable_grad():
            for start in range(0, h.shape[0], ctx.size):
                hc = h[start:start + ctx.size].detach().requires_grad_(need_h)
                # Autograd does the loss's backward and the head's input gradient; the logits are not kept
                # (nothing saves them), only their gradient, caught on its way for the weight's gradient.
                logits = F.linear(hc, w_const, b_const)
                if not need_h:  # a frozen body: the logits are the graph's start
                    logits.requires_grad_()
                caught = []
                logits.register_hook(caught.append)
                loss = _loss_of_logits(logits, y[start:start + ctx.size],
                                       ctx.transform, ctx.ignore_index)
                target = hc if need_h else logits
                del logits
                (grad,) = torch.autograd.grad(loss, target, grad_out)
                del loss, target
                if need_h:
                    grad_h[start:start + ctx.size] = grad
                del grad
                g = caught[0]  # [chunk, vocab], in the dtype autocast gave the forward matmul
                if need_w:
                    if g.dtype == grad_w.dtype:
                        grad_w.addmm_(g.t(), hc.detach())
                    else:  # autocast: the matmul in g's dtype, as lm_head's backward; summed in the weight's
                        grad_w.add_(g.t() @ hc.detach().to(g.dtype))
                if need_b:
                    grad_b.add_(g.sum(0))
                del g, caught, hc
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         bias: torch.Tensor | None = None,
                         transform: Callable[[torch.Tensor], torch.Tensor] | None = None, shift: bool = False,
                         ignore_index: int = IGNORE_INDEX, num_items: int | torch.Tensor | None = None,
                         chunk_size: int | None = None, impl: str = "recompute") -> torch.Tensor:
    """Cross entropy of ``transform(hidden @ weight.T + bias)`` against ``labels``, one chunk of tokens at a time.

    ``hidden`` is ``[..., H]`` and ``labels`` ``[...]`` (``shift=True``: Hugging Face's causal shift, position
    ``t`` predicts ``labels[..., t + 1]``, the last position is ignored). The result is the mean over labels
    that are not ``ignore_index`` (NaN when there are none, as in torch), or the sum divided by
    ``num_items`` when given (Hugging Face's ``num_items_in_batch``). Each chunk's logits are freed after
    forward and recomputed in backward: at most one chunk's logits, their fp32 copy and their gradient are
    alive at any time. ``impl="recompute"`` (default) writes the head's backward out and accumulates the
    weight gradient in place; ``impl="checkpoint"`` runs each chunk under :func:`torch.utils.checkpoint.checkpoint`
    instead (simpler, one more weight-sized gradient at the peak; kept for comparison). ``chunk_size``
    defaults to :func:`default_chunk_size`. Pure torch; runs on fake tensors.

    Example:
        >>> h, w = torch.randn(2, 8, 4, requires_grad=True), torch.randn(10, 4, requires_grad=True)
        >>> y = torch.randint(0, 10, (2, 8))
        >>> plain = F.cross_entropy((h @ w.T)[:, :-1].flatten(0, 1), y[:, 1:].flatten())
        >>> torch.allclose(linear_cross_entropy(h, w, y, shift=True, chunk_size=3), plain)
        True
    """
    if shift:
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if tuple(hidden.shape[:-1]) != tuple(labels.shape):
        raise ValueError(f"labels of shape {tuple(labels.shape)} do not match the hidden states "
                         f"{tuple(hidden.shape)} (expected {tuple(hidden.shape[:-1])}). Fix: pass one label per "
                         "input token (Hugging Face style: labels = input_ids, with -100 where no loss is wanted).")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int (tokens per chunk) or None, got {chunk_size!r}.")
    if impl not in ("recompute", "checkpoint"):
        raise ValueError(f"impl must be 'recompute' or 'checkpoint', got {impl!r}.")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    n = h.shape[0]
    size = chunk_size or default_chunk_size(n, h.shape[-1], weight.shape[0])
    if n == 0:  # no tokens at all: torch's mean over nothing
        total = (h.sum() + weight.sum()).float() * 0.0
    elif impl == "recompute":
        total = _ChunkedLinearCrossEntropy.apply(h, weight, bias, y, transform, ignore_index, size)
    else:
        total = None
        for start in range(0, n, size):
            # No RNG inside a chunk: skipping the RNG-state save keeps the recompute cheap.
            part = checkpoint(_chunk_sum, h[start:start + size], weight, bias, y[start:start + size], transform,
                              ignore_index, use_reentrant=False, preserve_rng_state=False)
            total = part if total is None else total + part
    if num_items is not None:
        if isinstance(num_items, torch.Tensor):
            num_items = num_items.to(total.device)
        return total / num_items
    return total / (y != ignore_index).sum()


# ----------------------------------------------------------------------------- the adapters

def _validate(result: Any) -> list[LossHeadSpec]:
    if not isinstance(result, (list, tuple)) or not all(isinstance(s, LossHeadSpec) for s in result):
        raise PluginContractError(f"memwrap_loss_heads must return a list of memwrap.techniques.loss_head.LossHeadSpec, "
                                  f"got {result!r}")
    return list(result)


def loss_heads() -> list[tuple[LossHeadSpec, str]]:
    """Every registered loss-head adapter, guarded, with its plugin's description, in registration order.

    Example:
        >>> sorted(spec.name for spec, _ in loss_heads())  # doctest: +SKIP
        ['hf-causal-lm', 'zoo-lm']
    """

    # A matches() that fails counts as "not this adapter" (recorded and warned once); the others still match.
    rules = {"matches": FieldRule(check=lambda r: None if isinstance(r, bool) else
                                  f"matches() must return True or False, got {r!r}", fallback=lambda failure: False),
             "forward": FieldRule(caller_errors=True)}  # a bad labels shape is the caller's mistake
    out = []
    for r in call_hook("memwrap_loss_heads", validate=_validate, consequence="Its loss heads are unavailable."):
        for spec in r.result:
            out.append((guard_fields(spec, r.plugin, spec.name, rules), r.origin))
    return out


def _is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(model, FSDPModule)


def _refuse_root_wrappers(model: nn.Module) -> None:
    # The adapter runs the model's body directly, not model(...): whatever hangs on the root module's call
    # (DDP's reducer, FSDP2's root all-gather, the user's forward hooks) would be skipped.
    name = type(model).__name__
    if isinstance(model, nn.parallel.DistributedDataParallel):
        why = "DistributedDataParallel's forward prepares its gradient reduction"
    elif _is_fsdp2(model):
        why = "FSDP2's root forward gathers the root's parameters"
    elif model._forward_hooks or model._forward_pre_hooks:
        why = f"{name} has forward hooks on its root module ({len(model._forward_hooks) + len(model._forward_pre_hooks)})"
    elif model.__dict__.get("_compiled_call_impl") is not None:
        why = (f"{name}.compile() (in place) compiles only {name}(...) calls, so the body would run uncompiled; "
               "torch.compile(model) before wrap(), which memwrap looks through, or compiling after wrap() keeps it "
               "compiled")
    else:
        return
    raise LossHeadError(
        f"chunked_loss on {name}: the chunked loss runs the model's body and head itself, not {name}(...), and "
        f"{why}, which would then be skipped. Fix: drop chunked_loss= for this model (or remove the root hooks; for "
        "torch.compile: compile after wrap(), see docs/compile.md); see docs/chunked_loss.md.")


def _compiled_inner(model: nn.Module) -> tuple[nn.Module, Any]:
    """``(module, dynamo context)`` behind ``torch.compile(model)`` (an ``OptimizedModule``), else ``(model, None)``.

    The adapter runs on the original module under the user's own compile context (backend, mode and options
    as given to ``torch.compile``), the same code ``torch.compile(memwrap.wrap(...))`` would compile.
    """
    inner = getattr(model, "_orig_mod", None)
    ctx = getattr(model, "dynamo_ctx", None)
    if isinstance(inner, nn.Module) and callable(ctx):
        return inner, ctx
    return model, None


# Observers that register *global* module hooks only to learn which module is running (torch's MemTracker, which
# the planner's fake-tensor trace uses, and FlopCounterMode's tracker): skipping lm_head's call changes no value,
# only moves the head's memory and FLOPs to its parent module in their per-module tables.
def _observer_types() -> tuple[type, ...]:
    types: list[type] = []
    try:
        from torch.distributed._tools.mod_tracker import ModTracker
        types.append(ModTracker)
    except ImportError:  # a torch built without distributed
        pass
    from torch.utils.module_tracker import ModuleTracker
    types.append(ModuleTracker)
    return tuple(types)


def _foreign_hooks(hooks: dict) -> int:
    if not hooks:  # the usual case, at every labelled forward
        return 0
    observers = _observer_types()
    return sum(not isinstance(getattr(h, "__self__", None), observers) for h in hooks.values())


def head_problem(head: Any) -> str | None:
    """What the chunked loss would skip by not calling ``head`` (the LM head), or None when nothing.

    The chunked loss computes ``F.linear(hidden, head.weight, head.bias)`` in place of ``head(hidden)``: exact
    only for an ``nn.Linear`` (or a subclass) whose call is ``nn.Linear``'s, with no forward/backward hooks
    on it, no global module hooks (``torch.nn.modules.module.register_module_forward_hook``; torch's module
    trackers, which only observe, excepted) and no ``forward`` replaced on the instance (accelerate's hooks).
    Cheap (attribute reads): run at ``wrap()`` and at every labelled forward.

    Example:
        >>> head_problem(nn.Linear(4, 8)) is None
        True
        >>> _ = (h := nn.Linear(4, 8)).register_forward_hook(lambda m, i, o: o * 0.5)
        >>> head_problem(h)
        'it has 1 forward hook(s) on it'
    """
    if not isinstance(head, nn.Linear):
        return f"it is {type(head).__name__ if head is not None else 'None'}, not an nn.Linear"
    cls = type(head)
    overridden = [attr for attr in ("forward", "__call__", "_call_impl", "_wrapped_call_impl")
                  if getattr(cls, attr) is not getattr(nn.Linear, attr)]
    if overridden:
        return f"its class {cls.__module__}.{cls.__qualname__} overrides nn.Linear.{overridden[0]}"
    if "forward" in head.__dict__ or "__call__" in head.__dict__:
        return "its forward was replaced on the instance (e.g. by accelerate's device hooks)"
    from torch.nn.modules import module as m

    for what, own, everywhere in (
            ("forward hook(s)", (head._forward_hooks,), (m._global_forward_hooks,)),
            ("forward pre-hook(s)", (head._forward_pre_hooks,), (m._global_forward_pre_hooks,)),
            ("backward hook(s)", (head._backward_hooks, head._backward_pre_hooks),
             (m._global_backward_hooks, m._global_backward_pre_hooks))):
        count = sum(len(d) for d in own)
        if count:
            return f"it has {count} {what} on it"
        count = sum(_foreign_hooks(d) for d in everywhere)
        if count:
            return f"{count} global module {what} (torch.nn.modules.module.register_module_*) would not see its call"
    return None


def _head_name(model: nn.Module, head: Any) -> str:
    found = next((name for name, m in model.named_modules() if m is head), None)
    return f"{type(model).__name__}.{found}" if found else f"{type(model).__name__}'s LM head"


# Eager even inside a compiled model: TorchDynamo does not guard on module hooks (skip_nnmodule_hook_guards), so a
# traced check would keep its first answer and miss a hook added later; it costs one graph break before the loss,
# whose autograd.Function runs eagerly anyway.
@torch.compiler.disable
def _refuse_head(spec: LossHeadSpec, model: nn.Module, when: str) -> None:
    if spec.head is None:
        return
    head = spec.head(model)
    problem = head_problem(head)
    if problem is not None:
        _raise_head(model, head, problem, when)


def _raise_head(model: nn.Module, head: Any, problem: str, when: str) -> None:
    raise LossHeadError(
        f"chunked_loss {when}: the LM head {_head_name(model, head)} ({type(head).__name__}) cannot be chunked "
        f"exactly: {problem}. The chunked loss computes F.linear(hidden, head.weight, head.bias) in place of calling "
        "the head, so whatever else the head does would be skipped (its loss and gradients would differ). Fix: "
        "chunked_loss=False for this model (or remove the hook / use a plain nn.Linear head), or register a "
        "loss-head plugin (memwrap_loss_heads) that reproduces this head; see docs/chunked_loss.md.")


def find_loss_head(model: nn.Module) -> LossHeadSpec:
    """The one registered adapter that recognizes ``model``; raises :class:`LossHeadError` naming the fix.

    ``torch.compile(model)`` (an ``OptimizedModule``) is looked through: the adapter is the original module's.
    The adapter's LM head (``LossHeadSpec.head``) must be one the chunked loss reproduces exactly
    (:func:`head_problem`).

    Example:
        >>> from memwrap.models import build_preset
        >>> find_loss_head(build_preset("gpt2-tiny")).name
        'zoo-lm'
    """
    _refuse_root_wrappers(model)
    model, ctx = _compiled_inner(model)
    if ctx is not None and getattr(ctx, "fullgraph", False):
        raise LossHeadError(
            f"chunked_loss on torch.compile({type(model).__name__}, fullgraph=True): the chunked loss cannot be one "
            "graph (its LM-head check and its autograd.Function, whose backward catches each chunk's logit gradient, "
            "run eagerly), so the first forward would fail in TorchDynamo. Fix: torch.compile(model) without "
            "fullgraph=True (the body still compiles), or chunked_loss=False; see docs/compile.md.")
    _refuse_root_wrappers(model)
    heads = loss_heads()
    found = [(spec, origin) for spec, origin in heads if spec.matches(model)]
    if len(found) > 1:
        names = "; ".join(f"{spec.name!r} from {origin}" for spec, origin in found)
        raise LossHeadError(f"chunked_loss: more than one loss-head adapter recognizes {type(model).__name__} "
                            f"({names}). Fix: uninstall one, or block its plugin with MEMWRAP_BLOCK_PLUGINS=<name>.")
    if not found:
        known = "; ".join(f"{spec.name} ({spec.description})" for spec, _ in heads) or "none installed"
        raise LossHeadError(
            f"chunked_loss: no loss-head adapter recognizes {type(model).__module__}.{type(model).__name__}, so "
            f"memwrap cannot tell its body from its LM head (adapters: {known}). Fix: drop chunked_loss= for this "
            "model, or add an adapter plugin implementing the memwrap_loss_heads hook (docs/chunked_loss.md).")
    spec = found[0][0]
    _refuse_head(spec, model, "at wrap()")
    return spec


class BoundLossHead:
    """One wrapped model's chunked loss: its adapter and chunk size; called instead of ``model(*args, **kwargs)``.

    A call with labels goes through the adapter; a call without labels runs the model unchanged (its
    logits are wanted), with a one-time warning when it happens with gradients on (training). Each
    labelled call first checks the LM head again (:func:`head_problem`): a hook added after ``wrap()`` is
    refused there. For ``torch.compile(model)`` the adapter runs on the original module under that
    compile context.

    Example:
        >>> from memwrap.models import build_preset
        >>> net = build_preset("gpt2-tiny", n_layer=1)
        >>> head = BoundLossHead(find_loss_head(net), chunk_size=64)
        >>> ids = torch.randint(0, 4096, (1, 16))
        >>> head(net, (ids,), {"labels": ids})["logits"] is None
        True
    """

    def __init__(self, spec: LossHeadSpec, chunk_size: int | None = None):
        self.spec = spec
        self.chunk_size = chunk_size
        self.calls = {"chunked": 0, "plain": 0}
        self._warned = False
        self._compiled: tuple[Any, Callable] | None = None  # (dynamo context, self._run compiled under it)

    def loss(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, chunk_size=self.chunk_size, **kwargs)

    def _run(self, model: nn.Module, args: tuple, kwargs: dict) -> Any:
        def loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, **kw: Any) -> torch.Tensor:
            # Only a labelled call replaces the head; a hook added after wrap() is refused here, at that call.
            _refuse_head(self.spec, model, "at this forward")
            return self.loss(hidden, weight, labels, **kw)

        return self.spec.forward(model, args, kwargs, loss)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        inner, ctx = _compiled_inner(module)
        if ctx is None:
            out = self._run(module, args, kwargs)
        else:
            if self._compiled is None or self._compiled[0] is not ctx:
                self._compiled = (ctx, ctx(self._run))
            out = self._compiled[1](inner, args, kwargs)
        if out is not None:
            self.calls["chunked"] += 1
            return out
        self.calls["plain"] += 1
        if torch.is_grad_enabled() and not self._warned:
            self._warned = True
            warnings.warn(
                f"chunked_loss is on, but {type(inner).__name__}(...) was called without labels, so it computed its "
                "whole logits as usual (the chunked loss only replaces a loss the model computes from labels). Fix: "
                "call model(input_ids, labels=labels) and use outputs.loss, or drop chunked_loss= if you compute "
                "the loss from the logits yourself.", stacklevel=4)
        return module(*args, **kwargs)


def check_wrap(call) -> dict | None:
    """``wrap()``'s check of ``chunked_loss=`` (run by :mod:`memwrap.validation`): the model's adapter, found and
    checked now, as ``{"loss_head": BoundLossHead}``; None when the option is off. Raises naming the fix.

    Example:
        >>> from memwrap.validation import check_wrap as check_call
        >>> check_call((nn.Linear(2, 2),), {}).loss_head is None
        True
    """
    if call.model is None or call.opts.chunked_loss is False:
        return None
    chunk = None if call.opts.chunked_loss is True else call.opts.chunked_loss
    return {"loss_head": BoundLossHead(find_loss_head(call.model), chunk)}
