"""Precision modes are plugins: this module holds their neutral base class and the registry.

A precision plugin decides these things (the shape follows Lightning Fabric's precision plugins:
every method of the base class has a neutral body, each mode overrides only what differs):

* the dtype parameters (and so gradients) are stored in: :attr:`Precision.param_dtype`,
  applied by :meth:`Precision.convert_module`;
* the forward context: :meth:`Precision.autocast`, and what the inputs become (:meth:`Precision.convert_input`:
  bf16-true casts floating inputs to bf16);
* loss scaling: :meth:`Precision.make_scaler` (a disabled ``GradScaler`` when none is needed);
* what it requires of the optimizer so that updates stay accurate: :meth:`Precision.check_optimizer`
  (validation, before anything changes) and :meth:`Precision.convert_optimizer` (the action);

plus process-wide settings (:meth:`Precision.enable`/:meth:`Precision.restore`, e.g. TF32) and its
memory effect for the planner (:meth:`Precision.memory_per_param`).

The built-in modes (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``bf16-true``) live in ``plugins/``
and are registered through the ``memwrap_precisions`` hook, like a third party's.

Example:
    >>> p = get_precision("BF16-mixed")  # names are case-insensitive; Lightning's names are aliases
    >>> p.name, p.autocast_dtype
    ('bf16', torch.bfloat16)
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memwrap.errors import closest_hint
from memwrap.plugin.name_index import PluginCache, conflict_message, index_names
from memwrap.runtime.outputs import map_outputs
from memwrap.plugin.calls import call_hook
from memwrap.plugin.manager import PluginContractError

__all__ = [
    "Precision", "AutocastPrecision", "PrecisionRow", "PrecisionConflictError", "UnknownPrecisionError",
    "get_precision", "get_precision_class", "resolve_precision", "precision_names", "precisions",
    "normalize_precision_name", "PRECISIONS", "convert_model", "cast_floating",
]


class UnknownPrecisionError(ValueError):
    """No precision plugin registers this name or alias."""


class PrecisionConflictError(ValueError):
    """Two precision plugins claim the same name or alias."""


class Precision:
    """The neutral precision: fp32 storage, no autocast, no loss scaling, any optimizer.

    Subclass it (or :class:`AutocastPrecision`) and override only what differs. Class attributes
    describe the mode; a fresh instance is made per ``wrap()`` call, so instance state (a saved
    global setting) belongs to one wrapped model.

    Attributes:
        name: canonical name, lower case with ``-`` separators (``"bf16-true"``).
        aliases: other accepted names; matching is case-insensitive and ``_``/``-`` blind.
        param_dtype: dtype floating parameters (hence gradients) are stored in; None keeps the model's.
        autocast_dtype: dtype of the forward's autocast region, or None.
        uses_scaler: whether the loss is scaled (fp16): gradients are unscaled before clipping/stepping.
        optimizer_requirement: one line saying what the optimizer must do; "" when anything goes.
        compensations: values the ``compensation=`` wrap option may take with this mode (empty: the
            option must stay unset).
        description: one line for :func:`precisions`.
        memory_like: the name of another mode whose training step takes exactly the same memory (``tf32``
            is ``fp32`` with other matmul kernels; ``fp16`` is ``bf16`` plus a GradScaler's two scalars), or
            None. The planner traces such a mode once, as that one, and ranks both with their own speed;
            ``tests/test_plan.py`` checks each built-in claim against two real traces.

    Example:
        >>> Precision().memory_per_param(torch.empty(10, device="meta"))
        {'weights': 40, 'grads': 40}
    """

    name = "fp32"
    aliases: tuple[str, ...] = ()
    param_dtype: torch.dtype | None = None
    autocast_dtype: torch.dtype | None = None
    uses_scaler = False
    optimizer_requirement = ""
    compensations: tuple[str, ...] = ()
    description = "fp32 weights and maths; no autocast, no loss scaling."
    memory_like: str | None = None

    def __init__(self, compensation: str | None = None):
        if compensation is not None and compensation not in self.compensations:
            if not self.compensations:
                raise ValueError(f"compensation={compensation!r} only applies to precisions whose optimizer updates need "
                                 f"compensating (e.g. 'bf16-true'); precision={self.name!r} has none. Fix: drop compensation=.")
            raise ValueError(f"compensation={compensation!r} is not known to precision={self.name!r}; valid: "
                             f"{', '.join(self.compensations)}.{closest_hint(compensation, self.compensations)}")
        self.compensation = compensation

    # -- validation (before anything changes) -----------------------------------------------
    def check(self, device_type: str) -> None:
        """Raise if this mode cannot run on ``device_type``; the neutral mode runs anywhere."""

    def check_optimizer(self, optimizer: torch.optim.Optimizer) -> bool:
        """Raise (naming the fix) if ``optimizer`` cannot meet :attr:`optimizer_requirement`. Changes nothing.

        ``optimizer`` is the one that would step (after ``optim=`` conversion). Returns True when
        :meth:`convert_optimizer` will replace it (so ``wrap()`` can refuse, before anything
        changes, a scheduler still driving the old one).
        """
        return False

    # -- actions, in the order wrap() calls them ------------------------------------------------
    def enable(self) -> None:
        """Switch on process-wide settings this mode needs; undone by :meth:`restore`."""

    def restore(self) -> None:
        """Undo :meth:`enable` (called by ``unwrap`` and by a ``wrap`` that fails later). Idempotent."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Store the parameters in :attr:`param_dtype` (in place: parameter objects and keys stay)."""
        return module

    def convert_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *,
                          step_in_backward: bool = False) -> torch.optim.Optimizer:
        """Return the optimizer to step (the same one, or a compensated equivalent built from it).

        ``step_in_backward``: a replacement must be able to step one parameter at a time
        (see :mod:`memwrap.techniques.step_in_backward`).
        """
        return optimizer

    # -- the training path -------------------------------------------------------------------
    def convert_input(self, data: Any) -> Any:
        """The forward's arguments as the converted parameters need them (Lightning Fabric's ``convert_input``).

        ``data`` is the ``(args, kwargs)`` of one call. The neutral mode passes them as given; a mode that stores the
        parameters in a low-precision dtype returns :func:`cast_floating` of them (bf16-true), since a LayerNorm,
        BatchNorm or GroupNorm with bf16 weights refuses an fp32 input and autocast does not cast it for them.
        """
        return data

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """The forward's context (``torch.autocast`` or nothing)."""
        return contextlib.nullcontext()

    def make_scaler(self, device_type: str) -> torch.amp.GradScaler:
        # A disabled scaler turns every GradScaler call into a no-op, so callers keep one code path.
        return torch.amp.GradScaler(_scaler_device(device_type), enabled=False)

    # -- memory effect (the planner) ----------------------------------------------------------
    def memory_per_param(self, param: torch.Tensor) -> dict[str, int]:
        """Bytes this mode stores for ``param`` once wrapped: its weights and its gradient.

        Works on meta and fake tensors. Optimizer state follows the stored dtype (the optimizer's
        ``state_bytes`` on a parameter of that dtype), so it is not counted here.
        """
        size = (self.param_dtype.itemsize if self.param_dtype is not None and param.is_floating_point()
                else param.element_size())
        return {"weights": param.numel() * size, "grads": param.numel() * size}

    def __repr__(self) -> str:
        extra = f"compensation={self.compensation!r}" if self.compensation is not None else ""
        return f"{type(self).__name__}({extra})"


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """Every floating tensor nested in ``data`` (tuples, lists, dicts, namedtuples, dataclasses) cast to ``dtype``.

    What a precision that stores parameters in ``dtype`` does to the forward's inputs, as Lightning's
    ``bf16-true`` does. Integer tensors (token ids, labels) stay. ``data`` itself is returned when nothing needs
    casting, so a model that fills in a dict or list it was given still fills in the caller's object.

    Example:
        >>> args, kwargs = cast_floating(((torch.ones(1), torch.ones(1, dtype=torch.long)), {}), torch.bfloat16)
        >>> args[0].dtype, args[1].dtype
        (torch.bfloat16, torch.int64)
    """
    if not any(_castable(t, dtype) for t in _tensors(data)):
        return data
    return map_outputs(data, lambda t: t.to(dtype) if _castable(t, dtype) else t)


def _tensors(data: Any) -> list:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(data)[0] if isinstance(t, torch.Tensor)]


def _castable(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.is_floating_point() and t.dtype != dtype


def convert_model(precision: Precision, module: nn.Module,
                  optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """Run ``precision.convert_module(module)`` all or nothing, give the optimizer's existing state the new dtype,
    and return the undo (``wrap()`` calls it if a later change fails).

    All or nothing: every parameter's and buffer's storage and gradient (and each submodule's parameter and buffer
    entries) is recorded first; if ``convert_module`` raises part-way, all of it is put back, bit for bit, and the
    error propagates; the returned undo does the same after a success. The record holds the old storage while the
    undo lives (``wrap()`` drops it when the call succeeds), so ``wrap()`` briefly holds both copies of a converted
    tensor on the CPU (an fp32 model converted to bf16: 1.5x its fp32 weights). On an accelerator the old storage of
    a tensor the conversion may change is copied to host memory instead, so the device frees each fp32 tensor as
    it is converted, as a plain ``model.to(torch.bfloat16)`` does. A model converted before ``wrap()``
    (``model.to(torch.bfloat16)``) is not converted again and costs nothing here.

    Optimizer state: state that exists before the first step (``torch.optim.Adagrad`` creates its ``sum`` in its
    constructor; an optimizer that already stepped holds its moments) was made in the parameters' old dtype. Each
    floating state tensor in a parameter's old dtype is cast to its new dtype, as ``Optimizer.load_state_dict``
    casts state to the parameters' dtype (``"step"`` is kept as it is), so that bf16-true stores bf16 state whatever
    the optimizer.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> opt = torch.optim.Adagrad(net.parameters())
        >>> undo = convert_model(get_precision("bf16-true", compensation="none"), net, opt)
        >>> net.weight.dtype, opt.state[net.weight]["sum"].dtype
        (torch.bfloat16, torch.bfloat16)
        >>> undo(); net.weight.dtype, opt.state[net.weight]["sum"].dtype
        (torch.float32, torch.float32)
    """
    modules = list(module.modules())
    entries = [(m, dict(m._parameters), dict(m._buffers)) for m in modules]
    tensors = {id(t): t for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None}
    saved = [(t, _kept(t.data, precision.param_dtype), t.grad, t.dtype) for t in tensors.values()]
    old_state: dict[int, tuple[dict, dict]] = {}

    def undo() -> None:
        with torch.no_grad():
            for m, params, buffers in entries:
                m._parameters.clear()
                m._parameters.update(params)
                m._buffers.clear()
                m._buffers.update(buffers)
            for t, (data, device), grad, _ in saved:
                t.data = data if device is None else data.to(device)
                t.grad = grad
        for state, values in old_state.values():
            state.clear()
            state.update(values)

    try:
        precision.convert_module(module)
        if optimizer is not None:
            old_dtype = {id(t): dtype for t, _, _, dtype in saved}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state, before = optimizer.state.get(p), old_dtype.get(id(p))
                    if not state or before is None or p.dtype == before:
                        continue
                    old_state.setdefault(id(p), (state, dict(state)))
                    for key, value in list(state.items()):
                        if key != "step" and isinstance(value, torch.Tensor) and value.dtype == before:
                            state[key] = value.to(p.dtype)
    except BaseException:
        undo()
        raise
    return undo


def _kept(data: torch.Tensor, target: torch.dtype | None) -> tuple[torch.Tensor, torch.device | None]:
    """What :func:`convert_model` keeps of a tensor's old storage to restore it: the storage itself, or, for a floating
    tensor on an accelerator that the conversion may change, a host copy and the device to copy it back to."""
    if data.device.type in ("cpu", "meta") or not data.is_floating_point() or data.dtype == target:
        return data, None
    return data.to("cpu", copy=True), data.device


def _scaler_device(device_type: str) -> str:
    # GradScaler only knows real backends; "meta"/fake devices never scale anything.
    return device_type if device_type in ("cpu", "cuda", "xpu", "mps", "hpu", "xla") else "cpu"


class AutocastPrecision(Precision):
    """Shared body of the autocast modes: run the forward under ``torch.autocast(autocast_dtype)``."""

    def check(self, device_type: str) -> None:
        if not torch.amp.autocast_mode.is_autocast_available(device_type):
            raise ValueError(
                f"precision={self.name!r} needs autocast, which torch does not support on device "
                f"type {device_type!r}. Fix: move the model to a device with autocast support "
                f"(cuda, cpu, xpu, mps) or use precision='fp32'."
            )
        if device_type == "cuda" and self.autocast_dtype is torch.bfloat16 and torch.cuda.is_available():
            if not torch.cuda.is_bf16_supported():
                raise ValueError(
                    f"precision={self.name!r} needs a GPU with bfloat16 support (Ampere or newer); this "
                    "one has none. Fix: use precision='fp16' (with loss scaling) or 'fp32'."
                )

    def autocast(self, device_type: str):
        return torch.autocast(device_type=device_type, dtype=self.autocast_dtype)


# -- the registry: what the memwrap_precisions hook contributes ----------------------------------

def normalize_precision_name(name: str) -> str:
    """``" BF16_Mixed "`` -> ``"bf16-mixed"``: lower case, ``-`` separators.

    Example:
        >>> normalize_precision_name("Pure_BF16")
        'pure-bf16'
    """
    return name.strip().lower().replace("_", "-")


@dataclasses.dataclass
class _Registry:
    by_name: dict[str, tuple[type[Precision], str]]
    conflicts: dict[str, list[tuple[type[Precision], str]]]
    entries: list[tuple[type[Precision], str]]


def _registry() -> _Registry:
    return _CACHE.get()


def _validate_result(result: Any) -> list[type[Precision]]:
    """A hook result as a list of valid Precision subclasses; raises PluginContractError otherwise."""

    classes = list(result or [])
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, Precision)):
            raise PluginContractError(f"memwrap_precisions() must return Precision subclasses, got {cls!r}")
        if not isinstance(cls.name, str) or not cls.name or normalize_precision_name(cls.name) != cls.name:
            raise PluginContractError(f"{cls.__name__}.name must be lower case with '-' separators, got {cls.name!r}")
        for attr in ("param_dtype", "autocast_dtype"):
            value = getattr(cls, attr)
            if value is not None and not isinstance(value, torch.dtype):
                raise PluginContractError(f"{cls.__name__}.{attr} must be a torch.dtype or None, got {value!r}")
    return classes


def _collect() -> _Registry:
    # Each implementation is called on its own (memwrap.plugin.calls), so one failing plugin does not hide the others.
    entries = [(cls, r.origin) for r in call_hook("memwrap_precisions", validate=_validate_result,
                                                  consequence="Its precisions are unavailable.")
               for cls in r.result]
    by_name, conflicts = index_names(entries, lambda cls: [cls.name, *(normalize_precision_name(a) for a in cls.aliases)])
    return _Registry(by_name, conflicts, entries)


_CACHE = PluginCache(_collect)  # rebuilt when the set of registered plugins changes


def precision_names() -> list[str]:
    """Canonical names of the registered precisions (aliases not included).

    Example:
        >>> precision_names()  # doctest: +SKIP
        ['bf16', 'bf16-true', 'fp16', 'fp32', 'tf32']
    """
    return sorted({cls.name for cls, _ in _registry().entries})


def get_precision_class(name: Any) -> type[Precision]:
    """The precision class registered as ``name`` or one of its aliases (case-insensitive).

    Raises :class:`UnknownPrecisionError` (a ``ValueError``) naming the valid choices and the
    closest one; a non-string (``["bf16"]``) is refused with the same error, not a ``TypeError``.

    Example:
        >>> get_precision_class("16-mixed").name
        'fp16'
    """
    reg = _registry()
    if not isinstance(name, str):
        raise UnknownPrecisionError(
            f"precision must be a string such as 'bf16', got {type(name).__name__} {name!r}. "
            f"Valid: {_listing(reg)}.")
    key = normalize_precision_name(name)
    if key in reg.conflicts:
        raise PrecisionConflictError(conflict_message(
            "precision", name, (f"{origin} ({cls.__name__})" for cls, origin in reg.conflicts[key])))
    if key not in reg.by_name:
        raise UnknownPrecisionError(f"unknown precision {name!r}.{closest_hint(key, reg.by_name)} Valid: {_listing(reg)}.")
    return reg.by_name[key][0]


def _listing(reg: _Registry) -> str:
    classes = {cls.name: cls for cls, _ in reg.entries}
    return ", ".join(f"{n} ({', '.join(classes[n].aliases)})" if classes[n].aliases else n
                     for n in sorted(classes)) or "none (no precision plugin loaded)"


def resolve_precision(name: Any) -> str:
    """The canonical name of a precision given by name or alias.

    Example:
        >>> resolve_precision("bf16-mixed")
        'bf16'
    """
    return get_precision_class(name).name


def get_precision(name: Any, **settings: Any) -> Precision:
    """A fresh precision mode by name or alias; ``settings`` (e.g. ``compensation``) go to its constructor.

    Example:
        >>> get_precision("fp16").uses_scaler
        True
    """
    return get_precision_class(name)(**settings)


@dataclasses.dataclass(frozen=True)
class PrecisionRow:
    """One line of :func:`precisions`; byte figures are per parameter of an fp32 model."""

    name: str
    aliases: tuple[str, ...]
    param_dtype: str
    autocast_dtype: str | None
    loss_scaling: bool
    optimizer_requirement: str
    weight_bytes: float
    grad_bytes: float
    compensations: tuple[str, ...]
    plugin: str
    description: str

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def precisions() -> list[PrecisionRow]:
    """List the registered precision modes: dtypes, loss scaling, what they require of the optimizer,
    and bytes per parameter for weights and gradients (what the planner reads).

    Example:
        >>> [(r.name, r.weight_bytes) for r in precisions()]  # doctest: +SKIP
        [('bf16', 4.0), ('bf16-true', 2.0), ('fp16', 4.0), ('fp32', 4.0), ('tf32', 4.0)]
    """
    probe = torch.empty(1024, device="meta")
    rows = []
    for cls, origin in _registry().entries:
        mem = cls.memory_per_param(cls.__new__(cls), probe)
        rows.append(PrecisionRow(
            cls.name, tuple(cls.aliases), str(cls.param_dtype or torch.float32).replace("torch.", ""),
            str(cls.autocast_dtype).replace("torch.", "") if cls.autocast_dtype is not None else None,
            bool(cls.uses_scaler), cls.optimizer_requirement, mem["weights"] / probe.numel(),
            mem["grads"] / probe.numel(), tuple(cls.compensations), origin, cls.description))
    return sorted(rows, key=lambda r: r.name)


class _PrecisionClasses(dict):
    """Read-only ``{canonical name: class}`` view of the registry, looked up afresh on every access.

    Kept for code that indexed the old fixed dict (``PRECISIONS["fp16"].uses_scaler``); aliases
    resolve too.
    """

    def __getitem__(self, name: str) -> type[Precision]:
        try:
            return get_precision_class(name)
        except UnknownPrecisionError:
            raise KeyError(name) from None

    def __contains__(self, name: object) -> bool:
        try:
            get_precision_class(name)
        except UnknownPrecisionError:
            return False
        return True

    def __iter__(self):
        return iter(precision_names())

    def __len__(self) -> int:
        return len(precision_names())

    def keys(self):
        return precision_names()

    def items(self):
        return [(n, get_precision_class(n)) for n in precision_names()]

    def values(self):
        return [get_precision_class(n) for n in precision_names()]

    def get(self, name, default=None):
        return self[name] if name in self else default

    def __repr__(self) -> str:
        return f"PRECISIONS({precision_names()})"


PRECISIONS = _PrecisionClasses()


def __getattr__(name: str) -> Any:
    # The former fixed modes, now plugin classes: ``from memwrap.precision.base import TF32`` keeps working.
    if name in ("TF32", "BF16", "FP16"):
        return get_precision_class(name.lower())
    raise AttributeError(f"module 'memwrap.precision.base' has no attribute {name!r}")
