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
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memwrap.errors import closest_hint, require_name
from memwrap.name_index import PluginCache, conflict_message, index_names
from memwrap.plugin_calls import FieldRule, call_hook, guard_fields
from memwrap.plugins import PluginContractError, PluginError, plugin_errors
# Sizes of optimizer state (predicted from a spec, measured on an optimizer) live in memwrap.state_size and stay
# importable from here.
from memwrap.state_size import measure_state_bytes, predict_state_bytes, scalar_step_bytes

__all__ = [
    "OptimizerSpec", "OptimizerRow", "OptimizerUnavailableError", "OptimizerConflictError",
    "UnknownOptimizerError", "ConversionWarning", "get_optimizer_spec", "create_optimizer",
    "optimizers", "convert_optimizer", "predict_state_bytes", "measure_state_bytes", "scalar_step_bytes", "spec_plugin",
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
        new, dropped = {"params": group["params"]}, {}
        for key, value in group.items():
            if key == "params" or key in _IMPLEMENTATION_FLAGS:
                continue
            if key in self.carries:
                new[key] = value
            elif key not in source_defaults:
                new[key] = value  # user metadata ("name", scheduler's "initial_lr"): keep it
            elif key not in _NEUTRAL or value != _NEUTRAL[key]:
                dropped[key] = f"{key}={value!r}"
        if group.get("decoupled_weight_decay") is False and group.get("weight_decay") and "weight_decay" in self.carries:
            dropped["weight_decay"] = (f"weight_decay={group['weight_decay']!r} (coupled L2 in the source, decoupled "
                                       f"in {self.name}: value carried, meaning changed)")
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


# How the callables of a spec are guarded (memwrap.plugin_calls): a callable field not named here (one added
# to OptimizerSpec later, or by a subclass) is guarded too, with the default rule (a failure is the plugin's).
_FIELD_RULES = {
    "available": FieldRule(check=_check_available, fallback=lambda failure: (False, failure.error)),
    "state_bytes": FieldRule(check=_check_bytes),
    "shared_state_bytes": FieldRule(check=_check_bytes),
    # Both receive the caller's arguments (hyperparameters, the model): an exception may be the caller's.
    "factory": FieldRule(check=_check_optimizer, caller_errors=True),
    "bind_model": FieldRule(caller_errors=True),
    "trainer_kwargs": FieldRule(caller_errors=True),  # its ValueError names the user's optim_args
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
                                       "memwrap.plugins.plugin_errors())." if failed else ""))
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


def _build(spec: OptimizerSpec, params, model: nn.Module | None, hyperparameters: dict) -> torch.optim.Optimizer:
    if not spec.needs_model:
        return spec.factory(params, **hyperparameters)
    if model is None:
        raise ValueError(f"optimizer {spec.name!r} needs the model, not only its parameters (it picks modules or hooks "
                         f"parameters). Fix: memwrap.create_optimizer({spec.name!r}, model, ...) or pass model=model.")
    return spec.factory(params, model=model, **hyperparameters)


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
    optimizer = _build(spec, params, model, {**spec.defaults, **hyperparameters})
    if model is not None and spec.bind_model is not None:
        spec.bind_model(optimizer, model)
    return optimizer


def convert_optimizer(optimizer: torch.optim.Optimizer, name: str, *, model: nn.Module | None = None) -> torch.optim.Optimizer:
    """Rebuild ``optimizer`` as the registered optimizer ``name``, before any step.

    Param groups keep their own lr and weight_decay (and betas/eps where the target understands
    them); every hyperparameter that does not carry over is named in one :class:`ConversionWarning`.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> opt = convert_optimizer(opt, "adamw_8bit", model=model)  # doctest: +SKIP
    """
    spec = get_optimizer_spec(name)
    holding = [s for s in optimizer.state.values() if s]
    if holding:
        raise ValueError(
            f"cannot convert {type(optimizer).__name__} to {spec.name!r}: it already holds state for {len(holding)} "
            f"parameter(s) (it has stepped), and that state cannot be translated into {spec.name}'s. Convert right "
            "after building the optimizer, before the first optimizer.step().")
    _require_available(spec)
    groups, dropped = [], {}
    for group in optimizer.param_groups:
        new, lost = spec.convert_group(group, optimizer.defaults)
        groups.append(new)
        for key, text in lost.items():
            dropped.setdefault(key, text)
    if dropped or spec.conversion_note:
        parts = [f"converting {type(optimizer).__name__} to {spec.name!r}:"]
        if dropped:
            parts.append(f"these hyperparameters do not carry over and take {spec.name}'s defaults: "
                         f"{', '.join(dropped.values())}.")
        if spec.conversion_note:
            parts.append(spec.conversion_note)
        warnings.warn(" ".join(parts), ConversionWarning, stacklevel=2)
    # A kernel choice the user made explicitly (fused=False, say, because Lightning refuses to clip with a
    # fused AdamW under mixed precision) survives when the target takes that flag.
    chosen = {k: optimizer.defaults[k] for k in ("fused", "foreach")
              if k in spec.carries and optimizer.defaults.get(k) is not None}
    new_optimizer = _build(spec, groups, model, {**spec.defaults, **chosen})
    if model is not None and spec.bind_model is not None:
        spec.bind_model(new_optimizer, model)
    return new_optimizer


def optimizers() -> list[OptimizerRow]:
    """List the registered optimizers: availability, install hint, state bytes per fp32 parameter.

    A spec whose plugin fails (``available`` or ``state_bytes`` raises or breaks its contract) is listed as
    unavailable, with what failed as its hint; the failure is in :func:`memwrap.plugins.plugin_errors`.

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
