"""The optimizer registry: specs contributed by plugins, lookup by name or Hugging Face alias,
creation, listing, and conversion of an optimizer the user already built.

Example:
    >>> import torch, memwrap
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = memwrap.create_optimizer("adamw_torch", model.parameters(), lr=1e-3)
    >>> type(opt).__name__
    'AdamW'
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memwrap.errors import closest_hint, require_name
from memwrap.plugin.name_index import PluginCache, conflict_message, index_names
from memwrap.plugin.calls import FieldRule, call_hook, guard_fields
from memwrap.plugin.manager import PluginContractError, PluginError, plugin_errors
from memwrap.plugin.optimizer_args import check_hyperparameters, typed_optim_args

__all__ = [
    "OptimizerSpec", "OptimizerRow", "OptimizerUnavailableError", "OptimizerConflictError",
    "UnknownOptimizerError", "ConversionWarning", "get_optimizer_spec", "create_optimizer",
    "optimizers", "convert_optimizer", "conversion_hyperparameters", "spec_plugin", "optimizer_on",
]

# Where an optimizer's state can live (OptimizerSpec.state_location), for the planner's memory categories.
STATE_LOCATIONS = ("device", "paged", "host")
# Group keys that choose a kernel, not the maths: dropped silently on conversion.
_IMPLEMENTATION_FLAGS = frozenset({"foreach", "fused", "capturable", "differentiable", "decoupled_weight_decay"})
# Values at which a hyperparameter does nothing, so dropping it changes nothing worth a warning.
_NEUTRAL = {"amsgrad": False, "maximize": False, "nesterov": False, "momentum": 0, "dampening": 0,
            "centered": False, "weight_decay": 0, "lr_decay": 0, "initial_accumulator_value": 0}


class OptimizerUnavailableError(ImportError):
    """The optimizer's backend is missing; the message carries the install command."""


class UnknownOptimizerError(ValueError):
    """No plugin registers this optimizer name or alias."""


class OptimizerConflictError(ValueError):
    """Two plugins claim the same optimizer name or alias."""


class ConversionWarning(UserWarning):
    """Some hyperparameters of the user's optimizer could not be carried to the new one."""


def _always_available() -> tuple[bool, str]:
    return True, ""


def _normalize(name: str) -> str:
    return name.strip().lower().replace("-", "_")


@dataclass(frozen=True)
class OptimizerSpec:
    """One optimizer a plugin provides.

    Attributes:
        name: canonical name (lower case, ``_`` separated), e.g. ``"adamw_8bit"``.
        factory: ``factory(params, **hyperparameters) -> torch.optim.Optimizer``; ``params`` may be
            tensors or param-group dicts, like any torch optimizer.
        state_bytes: ``state_bytes(param, module=None, **hyperparameters) -> int``: the exact bytes
            of optimizer state this parameter will hold after the first step. ``module`` is the
            module owning ``param`` (or None); must work on meta and fake tensors (the planner).
        aliases: other accepted names, e.g. Hugging Face ``optim=`` strings.
        available: ``() -> (ok, install_hint)``; must not import the backend when cheap to avoid.
        defaults: hyperparameters passed to ``factory`` unless the caller overrides them.
        carries: param-group keys that keep their meaning when converting from AdamW-style groups; the kernel
            flags ``fused``/``foreach`` listed here are passed on when the source optimizer set them explicitly.
        group_keys: ``(carried: dict) -> dict`` rewrites the carried hyperparameters of one converted param group
            into the keys this optimizer's param groups read, where they differ from torch's (torch-optimi reads
            ``beta1``/``beta2``, not ``betas``; bitsandbytes' RMSprop reads ``betas=(alpha, momentum)``). None: the
            same keys. Every key a conversion puts in a group must be one the optimizer reads (one of its
            ``defaults``), or the conversion warns that it has no effect.
        optim_args: the keys of Hugging Face's ``optim_args`` (``"k1=v1,k2=v2"`` or a dict) this optimizer takes,
            each with its parser (``{"rank": int}``): read by ``trainer_kwargs`` and by ``wrap(optim_args=...)``.
        takes_target_modules: builds low-rank projections for chosen ``nn.Linear`` layers and takes
            ``target_modules`` (Trainer's ``optim_target_modules``), as GaLore and APOLLO do.
        check_hyperparameters: ``(hyperparameters) -> None`` raises ``ValueError`` naming a value this optimizer
            cannot take and the fix (GaLore's ``rank=0``), before anything is built; memwrap itself checks ``lr``,
            ``betas``, ``eps``, ``weight_decay``, ``momentum`` and ``dampening`` for every optimizer.
        fused, paged: capability flags (a fused kernel where supported; paged state on CUDA).
        state_location: where the optimizer state lives, for the planner: ``"device"`` (ordinary device memory),
            ``"paged"`` (CUDA unified memory: it uses device memory left free and spills to host RAM under
            pressure, as bitsandbytes' paged optimizers do; the default when ``paged=True``) or ``"host"`` (host
            RAM, stepped on the CPU or streamed, e.g. torchao's ``CPUOffloadOptimizer``). The planner reports
            paged and host state in their own categories, not as device memory.
        scaler_ok: works with ``torch.amp.GradScaler`` (fp16).
        devices: device types the kernels support.
        runs_on_fake: ``step()`` works on FakeTensors, so the planner can trace it.
        shared_state_bytes: ``(pairs, **hyperparameters) -> int`` for state shared by all parameters
            (e.g. quantization maps), ``pairs`` being ``(param, module)``; None means none.
        bind_model: ``(optimizer, model) -> None`` applies per-module settings that need the model
            (e.g. 32-bit state for embeddings); called by create/convert when a model is given.
        conversion_note: appended to the conversion warning when the meaning of a carried value
            differs (e.g. Adafactor's learning rate).
        needs_model: the factory needs the model itself (GaLore/APOLLO pick target modules, LOMO hooks
            every parameter): it is called as ``factory(params, model=model, **hyperparameters)`` and
            building it without a model is refused.
        updates_in_backward: parameters are updated during ``backward()`` (LOMO, layer-wise GaLore):
            gradients cannot be accumulated, clipped or loss-scaled before the update, so ``wrap()``
            refuses ``accumulate > 1``, ``max_grad_norm`` and fp16 with it.
        trainer_kwargs: ``(hf_name, training_args) -> hyperparameters``: what Hugging Face ``Trainer``
            passes to this optimizer for ``TrainingArguments(optim=hf_name)`` (learning rate, betas,
            parsed ``optim_args``, ``optim_target_modules``), read duck-typed; raises ``ValueError``
            naming ``optim_args`` keys that do not apply. None: not a Trainer optimizer.
        approximates: the registry name of the optimizer whose update this one computes, up to how its state
            is stored (quantized to 8 or 4 bits, paged): ``"adamw"`` for the 8-bit, 4-bit and paged AdamWs. When
            the user's optimizer fits nowhere, the planner ranks the candidates that approximate it before those
            with other maths. None: its own maths.
    """

    name: str
    factory: Callable[..., torch.optim.Optimizer]
    state_bytes: Callable[..., int]
    aliases: tuple[str, ...] = ()
    available: Callable[[], tuple[bool, str]] = _always_available
    defaults: Mapping[str, Any] = field(default_factory=dict)
    carries: frozenset[str] = frozenset({"lr", "weight_decay"})
    group_keys: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    optim_args: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    takes_target_modules: bool = False
    check_hyperparameters: Callable[[dict[str, Any]], None] | None = None
    fused: bool = False
    paged: bool = False
    scaler_ok: bool = True
    devices: tuple[str, ...] = ("cpu", "cuda")
    runs_on_fake: bool = True
    shared_state_bytes: Callable[..., int] | None = None
    bind_model: Callable[[torch.optim.Optimizer, nn.Module], None] | None = None
    conversion_note: str = ""
    description: str = ""
    needs_model: bool = False
    updates_in_backward: bool = False
    trainer_kwargs: Callable[[str, Any], dict[str, Any]] | None = None
    state_location: str | None = None  # None: "paged" when paged=True, else "device"
    approximates: str | None = None

    def __post_init__(self) -> None:
        location = self.state_location if self.state_location is not None else ("paged" if self.paged else "device")
        if location not in STATE_LOCATIONS:
            raise ValueError(f"OptimizerSpec {self.name!r}: state_location must be one of {', '.join(STATE_LOCATIONS)}, "
                             f"got {self.state_location!r}.")
        object.__setattr__(self, "state_location", location)
        if self.approximates is not None:
            if not isinstance(self.approximates, str) or not self.approximates:
                raise TypeError(f"OptimizerSpec {self.name!r}: approximates must be an optimizer name or None, got "
                                f"{self.approximates!r}")
            object.__setattr__(self, "approximates", _normalize(self.approximates))
        if not isinstance(self.name, str) or not self.name or _normalize(self.name) != self.name:
            raise ValueError(f"OptimizerSpec name must be lower case with '_' separators, got {self.name!r}"
                             + (f"; use {_normalize(self.name)!r}" if isinstance(self.name, str) else ""))
        aliases = (self.aliases,) if isinstance(self.aliases, str) else tuple(self.aliases)
        object.__setattr__(self, "aliases", tuple(_normalize(a) for a in aliases))
        object.__setattr__(self, "carries", frozenset(self.carries))
        object.__setattr__(self, "devices", tuple(self.devices))
        for attr in ("factory", "state_bytes", "available"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"OptimizerSpec {self.name!r}: {attr} must be callable, got {getattr(self, attr)!r}")
        try:
            inspect.signature(self.state_bytes).bind(torch.empty(0, device="meta"), module=None)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"OptimizerSpec {self.name!r}: state_bytes must accept (param, module=None, "
                            f"**hyperparameters): {exc}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def convert_group(self, group: Mapping[str, Any], source_defaults: Mapping[str, Any]) -> tuple[dict, dict]:
        """Translate one AdamW-style param group: ``(new_group, {dropped_key: description})``.

        Example:
            >>> spec.convert_group({"params": [], "lr": 0.1, "amsgrad": True}, {"lr": 1, "amsgrad": False})
            ({'params': [], 'lr': 0.1}, {'amsgrad': 'amsgrad=True'})
        """
        new, dropped, carried = {"params": group["params"]}, {}, {}
        for key, value in group.items():
            if key == "params" or key in _IMPLEMENTATION_FLAGS:
                continue
            if key in self.carries:
                carried[key] = value
            elif key not in source_defaults:
                new[key] = value  # user metadata ("name", scheduler's "initial_lr"): keep it
            elif key not in _NEUTRAL or value != _NEUTRAL[key]:
                dropped[key] = f"{key}={value!r}"
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay") and "weight_decay" in self.carries:
            dropped["weight_decay"] = (f"weight_decay={group['weight_decay']!r} (coupled L2 in the source, decoupled "
                                       f"in {self.name}: value carried, meaning changed)")
        new.update(self.group_keys(dict(carried)) if self.group_keys is not None and carried else carried)
        return new, dropped


@dataclass(frozen=True)
class OptimizerRow:
    """One line of :func:`optimizers`."""

    name: str
    aliases: tuple[str, ...]
    available: bool
    state_bytes_per_param: float
    install_hint: str
    plugin: str
    fused: bool
    paged: bool

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# -- the merged view of all plugins -------------------------------------------------------------

@dataclass
class _Registry:
    by_name: dict[str, tuple[OptimizerSpec, str]]
    conflicts: dict[str, list[tuple[OptimizerSpec, str]]]
    entries: list[tuple[OptimizerSpec, str]]
    plugins: dict[int, str] = field(default_factory=dict)  # id(spec) -> name of the plugin that provides it


def _registry() -> _Registry:
    return _CACHE.get()


def _specs_only(result) -> list[OptimizerSpec]:
    specs = list(result or [])
    bad = [s for s in specs if not isinstance(s, OptimizerSpec)]
    if bad:
        raise PluginContractError(f"must return a list of OptimizerSpec objects, got {bad[0]!r}")
    return specs


def _describe(value) -> str:
    return "None" if value is None else f"{type(value).__module__}.{type(value).__qualname__} {value!r:.60}"


def _check_available(result) -> str | None:
    if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], bool) \
            and isinstance(result[1], str):
        return None
    return f"returned {_describe(result)}; available() must return (ok: bool, install_hint: str)"


def _check_bytes(result) -> str | None:
    try:
        whole = not isinstance(result, bool) and int(result) == result and result >= 0
    except (TypeError, ValueError, OverflowError):
        whole = False
    return None if whole else f"returned {_describe(result)}; it must return a whole number of bytes >= 0"


def _check_optimizer(result) -> str | None:
    if isinstance(result, torch.optim.Optimizer):
        return None
    return (f"returned {_describe(result)}, not a torch.optim.Optimizer: a factory must build the optimizer and "
            "return it")


# How the callables of a spec are guarded (memwrap.plugin.calls): a callable field not named here (one added
# to OptimizerSpec later, or by a subclass) is guarded too, with the default rule (a failure is the plugin's).
_FIELD_RULES = {
    "available": FieldRule(check=_check_available, fallback=lambda failure: (False, failure.error)),
    "state_bytes": FieldRule(check=_check_bytes),
    "shared_state_bytes": FieldRule(check=_check_bytes),
    # Both receive the caller's arguments (hyperparameters, the model): an exception may be the caller's.
    "factory": FieldRule(check=_check_optimizer, caller_errors=True),
    "bind_model": FieldRule(caller_errors=True),
    "trainer_kwargs": FieldRule(caller_errors=True),  # its ValueError names the user's optim_args
    "check_hyperparameters": FieldRule(caller_errors=True),  # its ValueError names the caller's bad value
    "group_keys": FieldRule(),
}


def _collect() -> _Registry:
    entries: list[tuple[OptimizerSpec, str]] = []
    plugins: dict[int, str] = {}
    for res in call_hook("memwrap_optimizers", validate=_specs_only, consequence="Its optimizers are unavailable."):
        for spec in res.result:
            guarded = guard_fields(spec, res.plugin, spec.name, _FIELD_RULES)
            plugins[id(guarded)] = res.plugin
            entries.append((guarded, res.origin))
    by_name, conflicts = index_names(entries, lambda spec: spec.names)
    return _Registry(by_name, conflicts, entries, plugins)


_CACHE = PluginCache(_collect)  # rebuilt when the set of registered plugins changes


def spec_plugin(spec: OptimizerSpec | str) -> str | None:
    """The name of the plugin that provides ``spec`` (a spec from the registry, or a name), or None.

    Example:
        >>> spec_plugin("adamw")
        'torch_optim'
    """
    spec = get_optimizer_spec(spec) if isinstance(spec, str) else spec
    return _registry().plugins.get(id(spec))


def get_optimizer_spec(name: str) -> OptimizerSpec:
    """Look up an optimizer by name or alias (case-insensitive; Hugging Face ``optim=`` strings work).

    Example:
        >>> get_optimizer_spec("adamw_bnb_8bit").name
        'adamw_8bit'
    """
    require_name(name, "the optimizer name", "create_optimizer({0}, params) or wrap(..., optim={0})", "adamw")
    reg = _registry()
    key = _normalize(name)
    if key in reg.conflicts:
        raise OptimizerConflictError(conflict_message(
            "optimizer", name, (f"{origin} (optimizer {spec.name!r})" for spec, origin in reg.conflicts[key])))
    if key not in reg.by_name:
        listing = ", ".join(sorted(spec.name + (f" ({', '.join(spec.aliases)})" if spec.aliases else "")
                                   for spec, _ in {id(e[0]): e for e in reg.by_name.values()}.values()))
        failed = "; ".join(f"{e.origin} failed ({e.hook})" for e in plugin_errors())
        raise UnknownOptimizerError(f"unknown optimizer {name!r}.{closest_hint(key, reg.by_name)} "
                                    f"Available: {listing or 'none (no optimizer plugin loaded)'}."
                                    + (f" Plugins that failed, which may be why: {failed} (see "
                                       "memwrap.plugin.manager.plugin_errors())." if failed else ""))
    return reg.by_name[key][0]


def _require_available(spec: OptimizerSpec) -> None:
    ok, hint = spec.available()
    if not ok:
        # When available() itself failed, chain its failure so that callers can tell the plugin is at fault.
        failure = next((e for e in plugin_errors() if e.hook == f"{spec.name}.available" and e.error == hint), None)
        cause = PluginError(failure) if failure is not None else None
        raise OptimizerUnavailableError(f"optimizer {spec.name!r} is not available: {hint}") from cause


def _split_model(params, model):
    if isinstance(params, nn.Module):
        return params.parameters(), model if model is not None else params
    return params, model


def _known_keywords(spec: OptimizerSpec) -> set[str]:
    return {*spec.carries, *spec.defaults, *spec.optim_args, *(("target_modules",) if spec.takes_target_modules else ())}


def _validate(spec: OptimizerSpec, params, hyperparameters: Mapping[str, Any]) -> None:
    """Every check that needs no model and builds nothing: memwrap's own, then the plugin's."""

    check_hyperparameters(spec.name, hyperparameters)
    if not isinstance(params, (nn.Module, torch.Tensor)) and isinstance(params, (list, tuple)):
        for i, group in enumerate(params):
            if isinstance(group, Mapping):
                check_hyperparameters(spec.name, group, f" (param group {i})")
    if spec.check_hyperparameters is not None:
        spec.check_hyperparameters(dict(hyperparameters))


def _build(spec: OptimizerSpec, params, model: nn.Module | None, hyperparameters: dict) -> torch.optim.Optimizer:
    if spec.needs_model and model is None:
        raise ValueError(f"optimizer {spec.name!r} needs the model, not only its parameters (it picks modules or hooks "
                         f"parameters). Fix: memwrap.create_optimizer({spec.name!r}, model, ...) or pass model=model.")
    try:
        if not spec.needs_model:
            return spec.factory(params, **hyperparameters)
        return spec.factory(params, model=model, **hyperparameters)
    except TypeError as exc:
        # A misspelt keyword reaches the backend's constructor, which refuses it before doing anything: name it
        # with the closest hyperparameter this optimizer takes.
        found = re.search(r"unexpected keyword argument '(\w+)'", str(exc))
        if found is None or found.group(1) not in hyperparameters:
            raise
        key = found.group(1)
        raise TypeError(f"optimizer {spec.name!r} takes no hyperparameter {key!r}."
                        f"{closest_hint(key, _known_keywords(spec))} Fix: remove it or correct its name (the "
                        f"backend said: {exc}).") from exc


def create_optimizer(name: str, params, *, model: nn.Module | None = None, **hyperparameters) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name`` over ``params`` (tensors, groups, or a module).

    Pass ``model`` (or the module itself as ``params``) so the optimizer can apply per-module
    settings such as 32-bit state for embeddings in ``adamw_8bit``.

    Example:
        >>> opt = create_optimizer("adamw_8bit", model, lr=2e-4)  # doctest: +SKIP
    """
    spec = get_optimizer_spec(name)
    _require_available(spec)
    params, model = _split_model(params, model)
    if not isinstance(params, (list, tuple, torch.Tensor)):
        params = list(params)  # a generator, read once here for the checks and once by the optimizer
    hyperparameters = {**spec.defaults, **hyperparameters}
    _validate(spec, params, hyperparameters)
    optimizer = _build(spec, params, model, hyperparameters)
    if model is not None and spec.bind_model is not None:
        spec.bind_model(optimizer, model)
    return optimizer


def conversion_hyperparameters(name: str, *, optim_args: Any = None, target_modules: Any = None) -> dict[str, Any]:
    """The hyperparameters ``wrap(optim=name, optim_args=..., optim_target_modules=...)`` adds to a conversion.

    ``optim_args`` (Trainer's ``"k1=v1,k2=v2"`` or a dict) are parsed as Trainer parses them for ``name``; keys
    the optimizer does not take, and keys your optimizer already sets (``lr``, ``betas``, ... carry over from
    it), raise ``ValueError``. ``target_modules`` is for GaLore/APOLLO only. Checks every value; builds nothing.

    Example:
        >>> conversion_hyperparameters("galore_adamw", optim_args="rank=4", target_modules=["q_proj"])
        {'rank': 4, 'target_modules': ['q_proj']}
    """

    spec = get_optimizer_spec(name)
    found = typed_optim_args(optim_args, spec.name, spec.optim_args)
    mine = sorted(k for k in found if k in spec.carries or (k in ("beta1", "beta2") and "betas" in spec.carries))
    if mine:
        raise ValueError(f"optim_args {mine} for optim={spec.name!r} are hyperparameters of the optimizer you pass to "
                         "wrap(), which carry over to the converted one. Fix: set them on that optimizer (e.g. "
                         "torch.optim.AdamW(params, lr=..., betas=(b1, b2))) and drop them from optim_args.")
    if target_modules is not None:
        if not spec.takes_target_modules:
            raise ValueError(f"optim_target_modules={target_modules!r} is for the low-rank optimizers (GaLore, APOLLO), "
                             f"not optim={spec.name!r}. Fix: drop it, or choose e.g. optim='galore_adamw'.")
        if not isinstance(target_modules, (list, tuple, str)) or (
                not isinstance(target_modules, str) and not all(isinstance(t, str) for t in target_modules)):
            raise TypeError(f"optim_target_modules must be a list of module names or regexes, a regex string or "
                            f"'all-linear', got {target_modules!r}.")
        found["target_modules"] = target_modules
    _validate(spec, [], {**spec.defaults, **found})
    return found


def _has_stepped(state: Mapping[str, Any]) -> bool:
    """Whether one parameter's optimizer state comes from a step. torch's Adagrad fills its state in the constructor
    (``sum`` at ``initial_accumulator_value``, ``step`` 0): that holds nothing a conversion would lose."""
    if not state:
        return False
    step = state.get("step")
    return step is None or float(step) != 0


def option_hyperparameters(options: Any) -> dict[str, Any]:
    """:func:`conversion_hyperparameters` of ``wrap()``'s validated options (``optim``, ``optim_args``,
    ``optim_target_modules``), for :func:`convert_optimizer`.

    Example:
        >>> option_hyperparameters(memwrap.config.options.parse_options(optim="sgd"))  # doctest: +SKIP
        {}
    """
    spec = get_optimizer_spec(options.optim)
    if spec.takes_target_modules and options.optim_target_modules is None:
        raise ValueError(f"optim={options.optim!r} needs target modules: the nn.Linear layers whose gradients get "
                         f"low-rank projections. Fix: memwrap.wrap(model, optimizer, optim={options.optim!r}, "
                         "optim_target_modules=['attn', 'mlp']) (module names or regexes, or 'all-linear'), as "
                         "TrainingArguments(optim_target_modules=...) in Trainer.")
    optim_args = options.optim_args
    return conversion_hyperparameters(options.optim, optim_args=dict(optim_args) if isinstance(optim_args, tuple)
                                      else optim_args, target_modules=options.optim_target_modules)


def convert_optimizer(optimizer: torch.optim.Optimizer, name: str, *, model: nn.Module | None = None,
                      **hyperparameters: Any) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` as the registered optimizer ``name``, before any step.

    Param groups keep their own lr and weight_decay (and betas/eps, momentum, ... where the target takes them,
    under the keys the target reads); every hyperparameter that does not carry over is named in one
    :class:`ConversionWarning`. ``hyperparameters`` are the new optimizer's own settings that your optimizer has
    no counterpart for (GaLore's ``target_modules`` and ``rank``, see :func:`conversion_hyperparameters`).

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> opt = convert_optimizer(opt, "adamw_8bit", model=model)  # doctest: +SKIP
    """
    spec = get_optimizer_spec(name)
    holding = [s for s in optimizer.state.values() if _has_stepped(s)]
    if holding:
        raise ValueError(
            f"cannot convert {type(optimizer).__name__} to {spec.name!r}: it already holds state for {len(holding)} "
            f"parameter(s) (it has stepped), and that state cannot be translated into {spec.name}'s. Convert right "
            "after building the optimizer, before the first optimizer.step().")
    _require_available(spec)
    groups, dropped, carried = [], {}, set()
    for group in optimizer.param_groups:
        new, lost = spec.convert_group(group, optimizer.defaults)
        groups.append(new)
        # The keys this conversion wrote for the target to read (not the user's own metadata such as "name").
        carried |= {k for k in new if k != "params" and (k in spec.carries or k not in group)}
        for key, text in lost.items():
            dropped.setdefault(key, text)
    # A kernel choice the user made explicitly (fused=False, say, because Lightning refuses to clip with a
    # fused AdamW under mixed precision) survives when the target takes that flag.
    chosen = {k: optimizer.defaults[k] for k in ("fused", "foreach")
              if k in spec.carries and optimizer.defaults.get(k) is not None}
    construction = {**spec.defaults, **chosen, **hyperparameters}
    _validate(spec, groups, construction)  # before the warning and the build: a refused conversion says only why
    if dropped or spec.conversion_note:
        parts = [f"converting {type(optimizer).__name__} to {spec.name!r}:"]
        if dropped:
            parts.append(f"these hyperparameters do not carry over and take {spec.name}'s defaults: "
                         f"{', '.join(dropped.values())}.")
        if spec.conversion_note:
            parts.append(spec.conversion_note)
        warnings.warn(" ".join(parts), ConversionWarning, stacklevel=2)
    new_optimizer = _build(spec, groups, model, construction)
    # A carried value under a key the new optimizer never reads would be dropped without a word (torch keeps any
    # key in a param group): name it.
    unread = sorted(k for k in carried if k not in new_optimizer.defaults)
    if unread:
        warnings.warn(f"converting {type(optimizer).__name__} to {spec.name!r}: {type(new_optimizer).__name__} does not "
                      f"read the param-group key(s) {unread}, so those values have no effect (a plugin defect: its "
                      "OptimizerSpec.group_keys should translate them). Fix: build the optimizer with "
                      f"memwrap.create_optimizer({spec.name!r}, ...) and its own keyword names.",
                      ConversionWarning, stacklevel=2)
    if model is not None and spec.bind_model is not None:
        spec.bind_model(new_optimizer, model)
    return new_optimizer


def optimizers() -> list[OptimizerRow]:
    """List the registered optimizers: availability, install hint, state bytes per fp32 parameter.

    A spec whose plugin fails (``available`` or ``state_bytes`` raises or breaks its contract) is listed as
    unavailable, with what failed as its hint; the failure is in :func:`memwrap.plugin.manager.plugin_errors`.

    The state figure is for one fp32 1024x1024 weight matrix (block-wise quantization scales
    included), so it reads as bytes per parameter of a large layer.

    Example:
        >>> [r.name for r in optimizers()]  # doctest: +SKIP
        ['adafactor', 'adamw', 'adamw_8bit', 'lion_8bit', 'paged_adamw_8bit']
    """
    reg = _registry()
    probe = torch.empty(1024, 1024, device="meta")
    rows = []
    for spec, origin in reg.entries:
        ok, hint = spec.available()  # a plugin failure here reads (False, what failed)
        conflict = [n for n in spec.names if n in reg.conflicts]
        if conflict:
            ok, hint = False, f"name conflict on {', '.join(conflict)}: see get_optimizer_spec({conflict[0]!r})"
        try:
            per_param = spec.state_bytes(probe, module=None, **spec.defaults) / probe.numel()
        except PluginError as exc:  # recorded and warned once; the listing goes on
            ok, hint, per_param = False, str(exc), math.nan
        rows.append(OptimizerRow(spec.name, spec.aliases, ok, per_param, "" if ok else hint, origin, spec.fused, spec.paged))
    return sorted(rows, key=lambda r: r.name)


def optimizer_on(name: str, module: Any):
    """The registry's optimizer ``name`` over ``module``, with a learning rate where its factory needs one (optimi's
    StableAdamW): any, a step's memory and time are the same (the probes of the step's temporaries and its time).

    Example:
        >>> type(optimizer_on("adamw", torch.nn.Linear(2, 2))).__name__
        'AdamW'
    """
    try:
        return create_optimizer(name, module.parameters(), model=module)
    except TypeError:
        return create_optimizer(name, module.parameters(), model=module, lr=1e-3)
