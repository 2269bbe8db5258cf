"""Activation checkpointing for any ``nn.Module``, applied with hooks (no module replacement).

Each selected module gets torch's composable ``torch.distributed._composable.checkpoint``: forward
hooks run the module under non-reentrant checkpointing, so module names, ``state_dict`` keys and
``named_parameters()`` stay exactly as they were, and the user's ``forward`` is untouched.

Example:
    >>> import memwrap
    >>> from memwrap.models import build_preset
    >>> model = build_preset("gpt2-tiny")
    >>> report = memwrap.apply_checkpointing(model, "auto", every=2, mode="selective")
    >>> report.modules
    ['transformer.h.0', 'transformer.h.2']
    >>> memwrap.remove_checkpointing(model) is model
    True
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.utils.checkpoint import _DEFAULT_DETERMINISM_MODE, _checkpoint_without_reentrant_generator
from torch.distributed._composable import checkpoint as _composable_checkpoint
from torch.distributed._composable.checkpoint_activation import _no_hook
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY  # the composable API's per-module registry

from memwrap.checkpointing.policies import (MODES, check_policy_name, find_blocks, parse_checkpoint_option,
                                         plugin_policies, select_modules, selective_policy)
from memwrap.errors import closest_hint

__all__ = ["CheckpointReport", "apply_checkpointing", "remove_checkpointing", "find_blocks",
           "parse_checkpoint_option", "is_checkpointed", "checkpoint_target", "check_wrap", "checkpoint_mode",
           "refuse_selective_norm_pass"]

_ROOT_ATTR = "_memwrap_checkpoint_report"
_MOD_ATTR = "_memwrap_checkpoint_hooks"


@dataclass(frozen=True)
class CheckpointReport:
    """What :func:`apply_checkpointing` did. ``modules`` are qualified names relative to the model."""

    modules: list[str]
    policy: str
    mode: str = "full"
    every: int = 1
    offload: bool = False
    classes: dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        kinds = ", ".join(f"{n} x{c}" for n, c in self.classes.items())
        shown = self.modules if len(self.modules) <= 6 else self.modules[:3] + ["..."] + self.modules[-2:]
        return (f"checkpointed {len(self.modules)} module(s) ({kinds}); policy={self.policy}, mode={self.mode}, "
                f"every={self.every}, offload={self.offload}: {', '.join(shown)}")


def _describe(policy) -> str:
    if policy is True or policy == "auto":
        return "auto"
    if isinstance(policy, str):
        return policy
    if isinstance(policy, type):
        return f"{{{policy.__name__}}}"
    if isinstance(policy, (set, frozenset, list, tuple)):
        return "{" + ", ".join(sorted(c if isinstance(c, str) else c.__name__ for c in policy)) + "}"
    return getattr(policy, "__qualname__", None) or repr(policy)


def _offload_hooks(module: nn.Module) -> list[tuple[dict, int]]:
    """Keep the checkpointed module's saved inputs on CPU (pinned when CUDA is up).

    Inside the region the checkpoint's own saved-tensor hooks are innermost, so ``save_on_cpu``
    entered around it only sees what checkpoint itself keeps: the module's positional tensor inputs.
    """
    stack: list = []

    def pre(mod, args, kwargs):
        ctx = None
        # enable_hook is off while checkpoint recomputes in backward: offloading then would hide
        # the recomputed tensors from checkpoint.
        if torch.is_grad_enabled() and _composable_checkpoint.state(mod).enable_hook:
            ctx = torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
            ctx.__enter__()
        stack.append(ctx)

    def post(mod, args, kwargs, output):
        ctx = stack.pop() if stack else None
        if ctx is not None:
            ctx.__exit__(None, None, None)

    # prepend: enter before checkpoint's pre-hook saves the inputs; appended post-hook exits after
    # checkpoint's (prepended) post-hook closed the region. always_call keeps the stack balanced on error.
    h1 = module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    h2 = module.register_forward_hook(post, with_kwargs=True, always_call=True)
    return [(module._forward_pre_hooks, h1.id), (module._forward_hooks, h2.id)]


@contextlib.contextmanager
def _keep_running_stats(norms: list[nn.Module]):
    """Undo the running-statistics update that a recomputed train-mode BatchNorm performs.

    Without this every checkpointed BatchNorm would count each batch twice (momentum applied
    twice, ``num_batches_tracked`` += 2). The recomputed outputs use batch statistics, so
    restoring the buffers afterwards does not change them.
    """
    saved = [[b.clone() if b is not None else None for b in (m.running_mean, m.running_var, m.num_batches_tracked)]
             for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in zip(norms, saved):
                for dst, src in zip((m.running_mean, m.running_var, m.num_batches_tracked), bufs):
                    if dst is not None:
                        dst.copy_(src)


def _contexts(selective: bool, norms: list[nn.Module]):
    """``context_fn`` for checkpoint: (forward context, recompute context)."""
    fwd, rec = contextlib.nullcontext(), contextlib.nullcontext()
    if selective:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts
        fwd, rec = create_selective_checkpoint_contexts(selective_policy)
    if not norms:
        return fwd, rec

    @contextlib.contextmanager
    def recompute():  # the selective recompute mode and the running-stats guard together
        with _keep_running_stats(norms), rec:
            yield

    return fwd, _EachEntry(recompute)


class _EachEntry:
    """A context manager that may be entered again: each entry enters a fresh one from ``make()``.

    Non-reentrant checkpoint enters its recompute context once per backward pass over the region; a second
    backward over a retained graph (``retain_graph=True``, step_in_backward's norm pass) enters the same object
    again, which a generator-based manager (``contextlib.contextmanager``) refuses.
    """

    def __init__(self, make):
        self.make = make
        self.open: list = []

    def __enter__(self):
        cm = self.make()
        out = cm.__enter__()
        self.open.append(cm)
        return out

    def __exit__(self, *exc):
        return self.open.pop().__exit__(*exc)


_EARLY_STOP = "early_stop" in inspect.signature(_checkpoint_without_reentrant_generator).parameters  # torch >= 2.7


def _checkpoint_pre_hook(module: nn.Module, args, kwargs, context_fn=None) -> None:
    """The composable API's forward pre-hook, with a recompute context that may be entered once per backward.

    torch's own wraps the recompute context in a one-use ``_no_hook(module)`` generator, so a second backward over
    a retained graph through a checkpointed module fails (AttributeError in contextlib). Same arguments as
    memwrap's call (non-reentrant, RNG preserved, the default determinism check and early stop).
    """
    state = _composable_checkpoint.state(module)
    if not state.enable_hook:
        return

    def contexts():
        fwd, rec = context_fn() if context_fn is not None else (contextlib.nullcontext(), None)
        return fwd, _EachEntry(lambda: _no_hook(module, rec))

    extra = (True,) if _EARLY_STOP else ()
    gen = _checkpoint_without_reentrant_generator(module, True, contexts, _DEFAULT_DETERMINISM_MODE, False, *extra,
                                                   *args, **kwargs)
    state._ac_generator = gen
    next(gen)


def _checkpoint_module(module: nn.Module, mode: str, offload: bool) -> None:
    registry = module.__dict__.get(REGISTRY_KEY) or {}
    if "checkpoint" in registry:
        raise RuntimeError(f"{type(module).__name__} is already checkpointed by torch.distributed._composable."
                           f"checkpoint outside memwrap; remove that call or let memwrap do it, not both")
    before_pre, before_post = set(module._forward_pre_hooks), set(module._forward_hooks)
    norms = [m for m in module.modules() if isinstance(m, _NormBase) and m.track_running_stats]
    context_fn = None
    if mode == "selective" or norms:
        context_fn = functools.partial(_contexts, selective=mode == "selective", norms=norms)
    # Explicit non-reentrant with RNG preserved: dropout masks match on recompute, frozen inputs
    # still give parameter gradients, and DDP sees each parameter ready once.
    _composable_checkpoint(module, use_reentrant=False, preserve_rng_state=True, context_fn=context_fn)
    added = set(module._forward_pre_hooks) - before_pre
    if len(added) == 1:  # the composable API's pre-hook, replaced by one that survives a second backward
        module._forward_pre_hooks[next(iter(added))] = functools.partial(_checkpoint_pre_hook, context_fn=context_fn)
    hooks = [(module._forward_pre_hooks, k) for k in added]
    hooks += [(module._forward_hooks, k) for k in set(module._forward_hooks) - before_post]
    if offload:
        hooks += _offload_hooks(module)
    module.__dict__[_MOD_ATTR] = hooks


def _uncheckpoint_module(module: nn.Module) -> None:
    for hook_dict, key in module.__dict__.pop(_MOD_ATTR):
        hook_dict.pop(key, None)
        # the side tables of register_forward_(pre_)hook keyed by the same id
        for side in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, side).pop(key, None)
    # Forget the composable API's per-module state so it can be applied again later.
    for key in (STATE_KEY, REGISTRY_KEY):
        table = module.__dict__.get(key)
        if table is not None:
            # the state table is keyed by the undecorated function, the registry by its name
            table.pop(getattr(_composable_checkpoint, "__wrapped__", _composable_checkpoint), None)
            table.pop("checkpoint", None)
            if not table:
                del module.__dict__[key]


def is_checkpointed(module: nn.Module) -> bool:
    """True when memwrap checkpointing is active on ``module`` itself (not its children)."""
    return _MOD_ATTR in module.__dict__


def current_report(model: nn.Module) -> CheckpointReport | None:
    """The report of the :func:`apply_checkpointing` call still active on ``model``, or None.

    Example: ``current_report(model)`` after ``apply_checkpointing(model)`` equals its returned report.
    """
    return model.__dict__.get(_ROOT_ATTR)


def resolve_policy(policy, every, mode, offload) -> tuple[object, int, str, bool]:
    """Resolve a plugin-named policy to its policy and options, exactly as apply_checkpointing does.

    Example: ``resolve_policy("auto", 1, "full", False) == ("auto", 1, "full", False)``.
    """
    if isinstance(policy, str) and policy != "auto":
        check_policy_name(policy)  # two plugins defining this name: say which, not "not known"
        named = plugin_policies()
        if policy not in named:
            valid = ["auto"] + sorted(named)
            raise ValueError(f"checkpoint policy {policy!r} is not known.{closest_hint(policy, valid)} Valid names: "
                             f"{', '.join(valid)}; or pass a set of module classes/class names or a callable. "
                             f"(Shorthands like 'selective' or 'every-2' belong to wrap(checkpoint=...).)")
        found = named[policy]
        if isinstance(found, dict):
            kw = parse_checkpoint_option(found)
            # Arguments passed explicitly (non-default) win over the plugin's.
            return (kw["policy"], every if every != 1 else kw.get("every", 1),
                    mode if mode != "full" else kw.get("mode", "full"), offload or kw.get("offload", False))
        policy = found
    kw = parse_checkpoint_option({"policy": policy, "every": every, "mode": mode, "offload": offload})
    return kw["policy"], kw["every"], kw["mode"], kw["offload"]


def apply_checkpointing(model: nn.Module, policy="auto", *, every: int = 1, mode: str = "full",
                        offload: bool = False) -> CheckpointReport:
    """Checkpoint the modules of ``model`` that ``policy`` selects; returns a :class:`CheckpointReport`.

    Args:
        policy: ``"auto"``/``True`` (repeated blocks, see :func:`find_blocks`), a set of module
            classes or class names, a callable ``(qualified_name, module) -> bool``, or the name of a
            plugin-registered policy.
        every: checkpoint only every ``every``-th selected module (the 1st, ``every+1``-th, ...).
        mode: ``"full"`` recomputes the whole module in backward; ``"selective"`` keeps matmul,
            convolution and attention outputs and recomputes the cheap ops.
        offload: keep the checkpointed modules' saved inputs on CPU (pinned when CUDA is available).

    Applying again with the same arguments returns the same report and changes nothing; with
    other arguments the previous checkpointing is removed first.

    Example:
        >>> report = apply_checkpointing(model, {"GPTBlock"}, mode="selective")  # doctest: +SKIP
        >>> print(report)  # doctest: +SKIP
        checkpointed 4 module(s) (GPTBlock x4); policy={GPTBlock}, mode=selective, every=1, offload=False: ...
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply_checkpointing needs an nn.Module, got {type(model).__name__}")
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not valid.{closest_hint(mode, MODES)} Use one of {MODES}")
    policy_r, every, mode, offload = resolve_policy(policy, every, mode, offload)
    chosen = select_modules(model, policy_r)[::every]
    report = CheckpointReport(modules=[n for n, _ in chosen], policy=_describe(policy), mode=mode, every=every,
                              offload=offload, classes=dict(Counter(type(m).__name__ for _, m in chosen)))
    previous = model.__dict__.get(_ROOT_ATTR)
    if previous is not None and previous == report and all(is_checkpointed(m) for _, m in chosen):
        return previous
    remove_checkpointing(model)
    for _, module in chosen:
        _checkpoint_module(module, mode, offload)
    model.__dict__[_ROOT_ATTR] = report
    if chosen:
        _disable_kv_cache(model)
    return report


_USE_CACHE_ATTR = "_memwrap_use_cache"


def _cache_configs(model: nn.Module) -> list:
    """Every distinct config object in ``model`` that turns a key/value cache on (``use_cache=True``).

    A Hugging Face model does not keep one config: T5's and BART's decoders, Whisper's decoder, the language model
    inside a vision-language model or inside a LightningModule each read the ``config`` of their own module, and
    composite configs hold sub-configs (``text_config``, ``decoder``, ...). Each is looked at, once.
    """
    found, seen = [], set()

    def visit(config, depth: int = 0) -> None:
        if config is None or id(config) in seen or depth > 4 or isinstance(config, (str, bytes, int, float, dict)):
            return
        seen.add(id(config))
        if getattr(config, "use_cache", None) is True:
            found.append(config)
        for value in getattr(config, "__dict__", {}).values():
            if hasattr(value, "use_cache"):  # a sub-config (text_config, decoder, encoder, ...)
                visit(value, depth + 1)

    for module in model.modules():
        visit(module.__dict__.get("config"))
    return found


def _disable_kv_cache(model: nn.Module) -> None:
    # A Hugging Face model with use_cache builds a key/value cache in every training forward, and the recompute
    # writes it again: memory for nothing, and a decoder that updates its cache in the recompute saves other tensors
    # than in the forward (T5: CheckpointError 56 vs 52 saved tensors; a causal LM under selective checkpointing:
    # "aten.slice.Tensor ... not found in storage"). transformers' gradient_checkpointing_enable turns the cache off
    # (Trainer does too); memwrap does the same on every config the model holds, and remove_checkpointing restores
    # exactly those it turned off.
    if _USE_CACHE_ATTR in model.__dict__:
        return
    configs = _cache_configs(model)
    if configs:
        model.__dict__[_USE_CACHE_ATTR] = configs
        for config in configs:
            config.use_cache = False


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_checkpointing` on ``model`` and all its submodules; returns ``model``.

    Example: ``remove_checkpointing(model)`` then ``model(x)`` stores all activations again.
    """
    for module in model.modules():
        if is_checkpointed(module):
            _uncheckpoint_module(module)
    model.__dict__.pop(_ROOT_ATTR, None)
    for config in model.__dict__.pop(_USE_CACHE_ATTR, None) or ():
        config.use_cache = True
    return model


# --- wrap()'s check (memwrap.validation runs it with the other techniques'; it only reads) ---------------------

def checkpoint_target(model: nn.Module) -> nn.Module:
    """The module whose blocks are checkpointed: under DDP the blocks live in ``.module``.

    FSDP2 shards in place, so there the model itself is the target.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> checkpoint_target(net) is net
        True
    """
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def check_wrap(call) -> dict | None:
    """``checkpoint=`` resolved against this model without applying it: ``{"checkpoint": apply_checkpointing's
    arguments}``, or None when ``wrap()`` leaves the model's checkpointing as it is. Raises naming the fix.

    Example:
        >>> from memwrap.validation import check_wrap as check_call
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        >>> check_call((net,), {"checkpoint": {"Linear"}}).checkpoint
        {'policy': {'Linear'}}
    """
    how = parse_checkpoint_option(call.opts.checkpoint)
    if call.model is not None and how is None:
        _refuse_selective_norm_pass(call, checkpoint_mode(None, call.model))
    if how is None or call.model is None:
        return None
    model = call.model
    _refuse_compiled(model)
    target = checkpoint_target(model)
    already = [name or "(root)" for name, m in target.named_modules() if is_checkpointed(m)]
    if already:
        raise ValueError(
            f"checkpoint={call.opts.checkpoint!r}, but {len(already)} module(s) of the model are already checkpointed "
            f"({', '.join(already[:3])}{', ...' if len(already) > 3 else ''}) by memwrap.apply_checkpointing or by an "
            "earlier wrap(checkpoint=...) not unwrapped. wrap() would replace that checkpointing and unwrap() would then "
            "remove it. Fix: drop checkpoint= (wrap() keeps and reports the existing checkpointing), unwrap the earlier "
            "wrapped model, or call memwrap.remove_checkpointing(model) first."
        )
    policy, every, mode, _ = resolve_policy(how["policy"], how.get("every", 1), how.get("mode", "full"),
                                            how.get("offload", False))
    _refuse_selective_norm_pass(call, mode)
    chosen = select_modules(target, policy)[::every]  # a policy that selects nothing fails here
    foreign = [name for name, m in chosen if "checkpoint" in (m.__dict__.get(REGISTRY_KEY) or {})]
    if foreign:
        raise ValueError(
            f"module {foreign[0]!r} is already checkpointed by torch.distributed._composable.checkpoint outside "
            "memwrap. Fix: remove that call and let wrap(checkpoint=...) do it, or drop checkpoint=."
        )
    return {"checkpoint": how}


def checkpoint_mode(checkpoint: Any, model: nn.Module) -> str | None:
    """The checkpoint mode ``model`` will train with: ``checkpoint=``'s as :func:`apply_checkpointing` resolves it (a
    plugin-named policy may set it), else that of the memwrap checkpointing already on the model; None: none.

    Example:
        >>> checkpoint_mode("selective", torch.nn.Linear(2, 2)), checkpoint_mode(None, torch.nn.Linear(2, 2))
        ('selective', None)
    """
    how = parse_checkpoint_option(checkpoint)
    if how is None:
        existing = current_report(model) or current_report(checkpoint_target(model))
        return existing.mode if existing is not None else None
    return resolve_policy(how["policy"], how.get("every", 1), how.get("mode", "full"), how.get("offload", False))[2]


def _refuse_selective_norm_pass(call, mode: str | None) -> None:
    """step_in_backward (or an optimizer updating inside backward) with clipping or fp16 runs the last micro-batch's
    backward twice over its graph (the norm pass, memwrap.techniques.norm_pass); torch's selective checkpoint allows
    one backward per region."""
    opts = call.opts
    # An optimizer that updates inside backward (LOMO, layer-wise GaLore) clips through the norm pass as well.
    in_backward = (call.optim_spec.updates_in_backward if call.optim_spec is not None
                   else getattr(call.optimizer, "updates_in_backward", False))
    if mode != "selective" or not (getattr(opts, "step_in_backward", False) or in_backward):
        return
    if opts.max_grad_norm is None and not call.precision.uses_scaler:
        return
    what = f"max_grad_norm={opts.max_grad_norm}" if opts.max_grad_norm is not None else f"precision={opts.precision!r}"
    refuse_selective_norm_pass(mode, what, getattr(opts, "step_in_backward", False))


def refuse_selective_norm_pass(mode: str | None, what: str, step_in_backward: bool = False) -> None:
    """Refuse torch's selective checkpointing (``mode``) where the norm pass runs for ``what`` (the clipping or fp16
    option): it backpropagates the last micro-batch twice, and selective checkpointing allows one backward per region.

    Example:
        >>> refuse_selective_norm_pass("full", "max_grad_norm=1.0")  # recomputed in both passes: allowed
    """
    if mode != "selective":
        return
    how = "step_in_backward=True" if step_in_backward else "an optimizer that updates inside backward"
    raise ValueError(
        f"checkpoint mode 'selective' with {how} and {what}: the norm pass backpropagates the "
        "window's last micro-batch twice (once for the global norm, once to step), and torch's selective "
        "checkpoint allows only one backward per checkpointed region. Fix: checkpoint='full' (recomputed in both "
        f"passes), or drop {'step_in_backward' if step_in_backward else 'that optimizer'} (or the clipping / fp16).")


def _refuse_compiled(model: nn.Module) -> None:
    compiled = [name or type(model).__name__ for name, m in model.named_modules()
                if hasattr(m, "_orig_mod") or m.__dict__.get("_compiled_call_impl") is not None]
    if compiled:
        raise ValueError(
            f"checkpoint= on a torch.compile'd model ({compiled[0]} is compiled): torch's non-reentrant checkpoint "
            "fails under torch.compile (recomputed values get different metadata). Fix: drop checkpoint= or compile "
            "after training setup without checkpointing; see docs/checkpointing.md."
        )
