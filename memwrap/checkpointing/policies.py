"""Which modules to checkpoint, and how the ``checkpoint=`` option is spelled.

A *policy* selects modules: ``"auto"`` (the model's repeated blocks), a set of module classes or
class names, a callable ``(qualified_name, module) -> bool``, or a name registered by a plugin
through the ``memwrap_checkpoint_policies`` hook. Applying the selection lives in
:mod:`memwrap.checkpointing.apply`.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch import nn

from memwrap.errors import closest_hint
from memwrap.plugin.manager import PluginContractError

__all__ = ["find_blocks", "select_modules", "parse_checkpoint_option", "plugin_policies", "check_policy_name",
           "selective_policy", "SAVE_OPS", "MODES"]

MODES = ("full", "selective")
_KWARGS = ("policy", "every", "mode", "offload")
_SHORTHANDS = ("auto", "full", "selective", "offload", "every-<k>")


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def _numel(module: nn.Module) -> int:
    # numel works on meta/fake parameters, so auto-detection never allocates.
    return sum(p.numel() for p in module.parameters())


def _repeated_containers(model: nn.Module) -> list[tuple[str, nn.Module, type]]:
    """ModuleList/Sequential containers (root included) whose children share one non-leaf class.

    One child is enough: a one-layer stack is still a stack of blocks.
    """
    found = []
    for name, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.children())
        classes = {type(k) for k in kids}
        # Leaf layers (a lone Linear/Conv) gain nothing from checkpointing: their input is saved
        # either way. Containers as children would only nest the search one level down.
        if len(classes) == 1 and all(any(True for _ in k.children()) for k in kids) \
                and not isinstance(kids[0], _CONTAINERS):
            found.append((name, mod, type(kids[0])))
    return found


def _candidate_classes(model: nn.Module, limit: int = 8) -> str:
    counts: Counter = Counter()
    sizes: dict[type, int] = {}
    for name, mod in model.named_modules():
        if name and any(True for _ in mod.children()) and not isinstance(mod, _CONTAINERS):
            counts[type(mod)] += 1
            sizes[type(mod)] = sizes.get(type(mod), 0) + _numel(mod)
    ranked = sorted(counts, key=lambda c: -sizes[c])[:limit]
    return ", ".join(f"{c.__name__} (x{counts[c]}, {sizes[c] / 1e6:.2f}M params)" for c in ranked) or "none"


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's repeated blocks: what ``policy="auto"`` checkpoints.

    Among ``nn.ModuleList``/``nn.Sequential`` containers whose children (each with submodules,
    not containers themselves) share one class, the block class is that of the container holding the most
    parameters; the children of *every* such container of that class are returned, in module
    order. So a ResNet yields the Bottlenecks of all of ``layer1..layer4``, a GPT-2
    ``transformer.h.*``, a LLaMA ``model.layers.*``, a BERT ``encoder.layer.*``. The root module
    itself is never returned.

    Example:
        >>> from memwrap.models import build_preset
        >>> [n for n, _ in find_blocks(build_preset("gpt2-tiny"))][:2]
        ['transformer.h.0', 'transformer.h.1']

    Raises:
        ValueError: no repeated blocks; the message lists candidate classes for an explicit policy.
    """
    containers = _repeated_containers(model)
    if not containers:
        raise ValueError(
            f"checkpoint='auto' found no repeated blocks in {type(model).__name__}: no nn.ModuleList or "
            f"nn.Sequential holds composite submodules all of one class. Name the blocks explicitly, e.g. "
            f"checkpoint={{'MyBlock'}} or a callable (name, module) -> bool. Candidate classes: "
            f"{_candidate_classes(model)}")
    best = max(containers, key=lambda c: (_numel(c[1]), len(c[1])))[2]
    blocks = []
    for cname, cont, cls in containers:
        if cls is best:
            prefix = f"{cname}." if cname else ""
            blocks += [(prefix + n, m) for n, m in cont.named_children()]
    return _outermost(blocks)


def _outermost(selected: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    # A module inside an already-checkpointed one is recomputed anyway; checkpointing it too
    # would only recompute it twice.
    out: list[tuple[str, nn.Module]] = []
    for name, mod in selected:
        if not any(name.startswith(kept + ".") for kept, _ in out):
            out.append((name, mod))
    return out


def _class_matcher(classes: Iterable, model: nn.Module) -> Callable[[str, nn.Module], bool]:
    types, names = set(), set()
    for c in classes:
        if isinstance(c, type) and issubclass(c, nn.Module):
            types.add(c)
        elif isinstance(c, str):
            names.add(c)
        else:
            raise TypeError(f"checkpoint policy set holds {c!r} ({type(c).__name__}); put nn.Module subclasses "
                            f"or class-name strings in it, e.g. {{GPTBlock}} or {{'GPTBlock'}}")
    present = {type(m).__name__ for m in model.modules()} | {
        f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}
    for n in sorted(names - present):
        raise ValueError(f"checkpoint policy names class {n!r}, which no module of {type(model).__name__} has."
                         f"{closest_hint(n, present)} Classes present: "
                         f"{', '.join(sorted(p for p in present if '.' not in p))}")
    return lambda _, m: isinstance(m, tuple(types)) or type(m).__name__ in names \
        or f"{type(m).__module__}.{type(m).__qualname__}" in names


def select_modules(model: nn.Module, policy) -> list[tuple[str, nn.Module]]:
    """Qualified names and modules chosen by ``policy`` (outermost only, never the root).

    Example: ``select_modules(model, {"GPTBlock"})`` or ``select_modules(model, lambda n, m: n.endswith("mlp"))``.
    """
    if policy is True or policy == "auto":
        return find_blocks(model)
    if isinstance(policy, type):
        policy = {policy}
    if isinstance(policy, (set, frozenset, list, tuple)):
        if not policy:
            raise ValueError("checkpoint policy is an empty set; name at least one module class, or use 'auto'")
        match = _class_matcher(policy, model)
    elif callable(policy):
        match = policy
    else:
        raise TypeError(f"checkpoint policy {policy!r} is not valid; use 'auto', a set of module classes or "
                        f"class names, a callable (qualified_name, module) -> bool, or a plugin policy name")
    chosen = _outermost([(n, m) for n, m in model.named_modules() if n and match(n, m)])
    if not chosen:
        raise ValueError(f"checkpoint policy {policy!r} selected no module of {type(model).__name__} "
                         f"(the root is never checkpointed). Candidate classes: {_candidate_classes(model)}")
    return chosen


# ------------------------------------------------------------------ selective checkpointing

def _save_ops() -> frozenset:
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


#: Ops whose outputs selective checkpointing keeps: matmul-class work that is costly to redo.
SAVE_OPS = _save_ops()


def selective_policy(ctx, op, *args, **kwargs):
    """Policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Saves outputs of :data:`SAVE_OPS` (matmuls, convolutions, attention kernels) and recomputes
    the rest (norms, activations, dropout, adds), which are cheap in FLOPs but large in bytes.
    """
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# ------------------------------------------------------------------ plugin policies

def _is_builtin_form(name: str) -> bool:
    return name in ("auto", "full", "selective", "offload") or re.fullmatch(r"every-\d+", name) is not None


def _policy_table(result) -> dict:
    result = {} if result is None else result
    if not isinstance(result, dict):
        raise PluginContractError(f"must return a dict name -> policy, got {type(result).__name__}")
    clash = [n for n in result if not isinstance(n, str) or _is_builtin_form(n)]
    if clash:
        raise PluginContractError(f"registers checkpoint policy {clash[0]!r}, which is not a name a plugin may "
                                  f"take (a string other than the built-in forms {', '.join(_SHORTHANDS)})")
    return result


def _collect_policies() -> tuple[dict[str, object], dict[str, list[str]]]:
    """(unambiguous name -> policy, contested name -> origins of the plugins that claim it)."""
    try:
        from memwrap.plugin.calls import call_hook
    except ImportError:  # plugin system not installed: only the built-in forms exist
        return {}, {}
    merged: dict[str, object] = {}
    owners: dict[str, list[str]] = {}
    for res in call_hook("memwrap_checkpoint_policies", validate=_policy_table,
                         consequence="Its checkpoint policies are unavailable."):
        for name, pol in res.result.items():
            owners.setdefault(name, []).append(res.origin)
            merged[name] = pol
    contested = {n: o for n, o in owners.items() if len(o) > 1}
    return {n: p for n, p in merged.items() if n not in contested}, contested


def plugin_policies() -> dict[str, object]:
    """Named policies from the ``memwrap_checkpoint_policies`` plugin hook (empty without a plugin system).

    A plugin whose hook fails is left out (and reported once, see :func:`memwrap.plugin.manager.plugin_errors`);
    a name two plugins define is left out too (:func:`check_policy_name` says which plugins), so every
    other policy keeps working.

    Example: a plugin returning ``{"mlp-only": lambda n, m: n.endswith(".mlp")}`` makes
    ``wrap(model, checkpoint="mlp-only")`` work.
    """
    return _collect_policies()[0]


def check_policy_name(name: str) -> None:
    """Raise ``ValueError`` naming both plugins when two plugins define the checkpoint policy ``name``.

    Example: ``check_policy_name("mlp-only")`` returns None unless two plugins register ``"mlp-only"``.
    """
    contested = _collect_policies()[1].get(name)
    if contested:
        raise ValueError(f"checkpoint policy {name!r} is defined by two plugins: {' and '.join(contested)}. "
                         f"Uninstall one, or block one with MEMWRAP_BLOCK_PLUGINS=<plugin name>.")


# ------------------------------------------------------------------ option parsing

def _validate_kwargs(d: dict, source: str) -> dict:
    for key in d:
        if key not in _KWARGS:
            raise ValueError(f"{source}: unknown key {key!r}.{closest_hint(key, _KWARGS)} "
                             f"Valid keys: {', '.join(_KWARGS)}")
    out = {"policy": "auto", **d}
    every, mode, offload = out.get("every", 1), out.get("mode", "full"), out.get("offload", False)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"{source}: every={every!r} is not valid; use an int >= 1 (1 = every block, "
                         f"2 = every other block)")
    if mode not in MODES:
        raise ValueError(f"{source}: mode={mode!r} is not valid.{closest_hint(mode, MODES)} "
                         f"Use one of {', '.join(map(repr, MODES))}")
    if not isinstance(offload, bool):
        raise ValueError(f"{source}: offload={offload!r} is not valid; use True or False")
    pol = out["policy"]
    if isinstance(pol, str) and pol not in ("auto",):
        resolved = _parse_string(pol)  # validates plugin names; a string policy carries no extra kwargs
        if resolved.get("policy") != pol:
            raise ValueError(f"{source}: policy={pol!r} is a shorthand, not a policy; write it as "
                             f"checkpoint={pol!r} or spell out the keys, e.g. {resolved}")
    elif not (pol is True or pol == "auto" or isinstance(pol, (set, frozenset, list, tuple, type))
              or callable(pol)):
        raise TypeError(f"{source}: policy={pol!r} is not valid; use 'auto', a set of module classes or class "
                        f"names, a callable (qualified_name, module) -> bool, or a plugin policy name")
    if isinstance(pol, (set, frozenset, list, tuple)):
        for c in pol:
            if not (isinstance(c, str) or (isinstance(c, type) and issubclass(c, nn.Module))):
                raise TypeError(f"{source}: the policy set holds {c!r}; use nn.Module subclasses or class names")
    return out


def _parse_string(value: str) -> dict:
    if "+" in value:  # "selective+offload", "every-2+offload"
        merged: dict = {}
        for part in value.split("+"):
            parsed = _parse_string(part.strip())
            if parsed.get("policy") != "auto" and len(value.split("+")) > 1:
                merged["policy"] = parsed["policy"]
            merged.update({k: v for k, v in parsed.items() if k != "policy"})
        return _validate_kwargs(merged, f"checkpoint={value!r}")
    if value in ("auto", "full"):
        return {"policy": "auto"}
    if value == "selective":
        return {"policy": "auto", "mode": "selective"}
    if value == "offload":
        return {"policy": "auto", "offload": True}
    m = re.fullmatch(r"every-(\d+)", value)
    if m:
        return _validate_kwargs({"every": int(m.group(1))}, f"checkpoint={value!r}")
    named, contested = _collect_policies()
    if value in contested:
        check_policy_name(value)
    if value in named:
        pol = named[value]
        return _validate_kwargs(dict(pol), f"plugin policy {value!r}") if isinstance(pol, dict) \
            else {"policy": value}
    valid = list(_SHORTHANDS) + sorted(named)
    raise ValueError(f"checkpoint={value!r} is not a known policy.{closest_hint(value, valid + ['every-2'])} "
                     f"Valid strings: {', '.join(valid)} (combine with '+', e.g. 'selective+offload'); "
                     f"or pass True, a set of module classes or class names, a callable "
                     f"(qualified_name, module) -> bool, or a dict of apply_checkpointing arguments")


def parse_checkpoint_option(value) -> dict | None:
    """Turn ``wrap(checkpoint=value)`` into keyword arguments of :func:`apply_checkpointing`, or None.

    Examples:
        >>> parse_checkpoint_option(True)
        {'policy': 'auto'}
        >>> parse_checkpoint_option("every-2")
        {'policy': 'auto', 'every': 2}
        >>> parse_checkpoint_option({"mode": "selective", "offload": True})
        {'policy': 'auto', 'mode': 'selective', 'offload': True}
    """
    if value is None or value is False:
        return None
    if value is True:
        return {"policy": "auto"}
    if isinstance(value, str):
        return _parse_string(value)
    if isinstance(value, dict):
        return _validate_kwargs(value, "checkpoint=dict")
    if isinstance(value, (set, frozenset, list, tuple)) or (isinstance(value, type) and issubclass(value, nn.Module)):
        return _validate_kwargs({"policy": value}, "checkpoint")
    if callable(value) and not isinstance(value, nn.Module):
        return {"policy": value}
    raise TypeError(f"checkpoint={value!r} ({type(value).__name__}) is not valid; use None/False, True, one of "
                    f"{', '.join(_SHORTHANDS)}, a set of module classes or class names, a callable "
                    f"(qualified_name, module) -> bool, or a dict of apply_checkpointing arguments")
