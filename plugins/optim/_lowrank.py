"""What GaLore and APOLLO share (not a plugin itself): target modules, param groups, projector state, layer-wise stepping.

* :func:`low_rank_groups` picks the ``nn.Linear`` weights named by ``target_modules`` with Trainer's own
  matching rule (exact name, substring, regex full match, or ``"all-linear"``) and returns Trainer's
  groups: ``[{"params": others}, {"params": targets, **projection}]``.
* :func:`with_projector_state` subclasses a GaLore/APOLLO optimizer so that ``state_dict()`` holds only
  tensors and plain values (their projector objects become dicts; ``torch.load(weights_only=True)``
  reads them) and the projection matrix is a state tensor (so memory measurements see it).
* :class:`LayerwiseOptimizer` gives each parameter its own optimizer, stepped by a post-accumulate-grad
  hook as soon as that gradient is complete (Trainer's ``*_layerwise`` names), while remaining one
  ``torch.optim.Optimizer`` whose ``param_groups`` are the inner optimizers' own (LR schedulers work)
  and whose ``state_dict()`` covers them all. With ``wrap(..., max_grad_norm=...)`` or fp16 memwrap's norm pass
  drives its steps (``updates_deferred``, ``update_in_backward``): clipped exactly as ``clip_grad_norm_`` clips, and
  an fp16 overflow skips the whole update.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ._common import tensors_of

from memwrap.errors import closest_hint
from memwrap.plugin.optimizer_args import is_real

__all__ = ["is_target", "low_rank_groups", "with_projector_state", "LayerwiseOptimizer", "projected_bytes",
           "encode_projectors", "decode_projectors", "attach_projections", "check_projection", "check_keywords"]


def check_projection(optimizer_name: str, hp: Mapping[str, Any], proj_types: tuple[str, ...]) -> None:
    """GaLore's/APOLLO's projection settings, checked before anything is built (the libraries accept ``rank=0`` or
    ``scale=0`` and then never update the target weights, and fail on a bad ``proj_type`` only at the first step).

    Example:
        >>> check_projection("galore_adamw", {"rank": 0}, ("std",))
        Traceback (most recent call last):
        ...
        ValueError: optimizer 'galore_adamw': rank=0 must be a whole number >= 1 (directions each target weight's gradient is projected on). Fix: e.g. rank=128.
    """

    from ._common import check_choice, check_whole

    if "rank" in hp:
        check_whole(optimizer_name, "rank", hp["rank"], 1, "directions each target weight's gradient is projected on",
                    128)
    if "update_proj_gap" in hp:
        check_whole(optimizer_name, "update_proj_gap", hp["update_proj_gap"], 1,
                    "optimizer steps between refreshes of the projection", 200)
    if "scale" in hp and not (is_real(hp["scale"]) and hp["scale"] > 0):
        raise ValueError(f"optimizer {optimizer_name!r}: scale={hp['scale']!r} must be a number > 0 (it multiplies "
                         "every update of the target weights; 0 freezes them). Fix: e.g. scale=0.25.")
    if "proj_type" in hp:
        check_choice(optimizer_name, "proj_type", hp["proj_type"], proj_types)


def check_keywords(optimizer_name: str, hp: Mapping[str, Any], cls: type, own: tuple[str, ...]) -> None:
    """Name a keyword neither the factory (``own``) nor ``cls``'s constructor takes, before it could go unnoticed
    (a misspelt ``target_modulez`` would otherwise surface as "needs target modules")."""
    import inspect

    accepted = set(own) | {n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "params")}
    unknown = sorted(set(hp) - accepted)
    if unknown:
        raise TypeError(f"optimizer {optimizer_name!r} takes no hyperparameter {unknown[0]!r}."
                        f"{closest_hint(unknown[0], accepted)} It takes: {', '.join(sorted(accepted))}. Fix: remove it "
                        "or correct its name.")


def is_target(target_modules: Any, name: str) -> bool:
    """Trainer's ``check_target_module_exists`` rule for one module name."""
    if isinstance(target_modules, str):
        return bool(re.fullmatch(target_modules, name))
    return (name in target_modules or any(t in name for t in target_modules)
            or any(re.fullmatch(t, name) for t in target_modules))


def low_rank_groups(optimizer_name: str, params: Any, model: nn.Module, target_modules: Any,
                    projection: Mapping[str, Any]) -> list[dict]:
    """Split ``params`` (the model, tensors or groups) into non-target and target groups, Trainer's order."""
    if target_modules is None:
        raise ValueError(f"{optimizer_name} needs target modules: the nn.Linear layers whose gradients get low-rank "
                         "projections. Fix: target_modules=['attn', 'mlp'] (module names or regexes) or "
                         f"'all-linear' in memwrap.create_optimizer({optimizer_name!r}, model, target_modules=...); "
                         f"memwrap.wrap(model, optimizer, optim={optimizer_name!r}, optim_target_modules=[...]); "
                         "Trainer: TrainingArguments(optim_target_modules=...).")
    if not isinstance(target_modules, (list, tuple, str)):
        raise TypeError(f"{optimizer_name}: target_modules must be a list of names, a regex string or 'all-linear', "
                        f"got {target_modules!r}")
    all_linear = isinstance(target_modules, str) and target_modules.replace("_", "-") == "all-linear"
    # By name, as Trainer does: a weight tied to an earlier parameter (an LM head tied to the embedding) is listed
    # under that parameter's name by named_parameters(), so it is not a target.
    names = {f"{n}.weight" for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and (all_linear or is_target(target_modules, n))}
    targets = {id(p) for n, p in model.named_parameters() if n in names}
    if not names:
        raise ValueError(f"{optimizer_name}: no nn.Linear layer of the model matches target_modules={target_modules!r}."
                         " Fix: name some of them (see model.named_modules()) or use 'all-linear'.")
    if isinstance(params, nn.Module):
        groups = [{"params": list(params.parameters())}]
    else:
        items = list(params)
        # Bare tensors form one group, as in any torch optimizer; dicts are groups of their own.
        groups = [dict(g) for g in items if isinstance(g, Mapping)]
        bare = [t for t in items if isinstance(t, torch.Tensor)]
        groups = ([{"params": bare}] if bare else []) + groups
    others, projected = [], []
    for group in groups:
        tensors = tensors_of([group])
        rest = {k: v for k, v in group.items() if k != "params"}
        others.append({**rest, "params": [p for p in tensors if id(p) not in targets]})
        projected.append({**rest, "params": [p for p in tensors if id(p) in targets], **projection})
    return [g for g in others + projected if g["params"]]


def projected_bytes(param: torch.Tensor, rank: int, moments: int, cap_rank: bool) -> int:
    """State bytes of a 2-D weight under a ``std`` projection: ``moments`` low-rank moments plus the projection.

    The smaller side of the weight is projected to ``rank`` (capped at that side for GaLore's SVD, not for
    APOLLO's random projection): moments of ``rank x larger side`` values and a ``rank x smaller side`` matrix.
    """
    big, small = max(param.shape[0], param.shape[1]), min(param.shape[0], param.shape[1])
    r = min(rank, small) if cap_rank else rank
    return (moments * r * big + r * small) * param.element_size()


def encode_projectors(found: dict) -> dict:
    """A copy of an optimizer ``state_dict()`` whose projector objects are plain dicts (``weights_only`` loads it)."""
    state = {}
    for key, value in found["state"].items():
        projector = value.get("projector")
        if projector is not None and not isinstance(projector, dict):
            fields = {k: v for k, v in vars(projector).items() if k != "ortho_matrix"}
            cls = type(projector)
            value = {**value, "projector": {"class": f"{cls.__module__}:{cls.__qualname__}", **fields}}
        state[key] = value
    return {**found, "state": state}


def with_projector_state(base: type) -> type:
    """A subclass of ``base`` (a GaLore or APOLLO optimizer) whose state is tensors and plain values only."""

    class WithProjectorState(base):
        __doc__ = f"{base.__module__}.{base.__qualname__} with a weights_only-loadable state_dict."

        def step(self, closure=None):
            loss = super().step(closure)
            for state in self.state.values():
                projector = state.get("projector")
                if projector is not None and not isinstance(projector, dict):
                    state["projection"] = projector.ortho_matrix  # same tensor: counted once, saved once
            return loss

        def state_dict(self):
            return encode_projectors(super().state_dict())

        def load_state_dict(self, state_dict):
            super().load_state_dict(decode_projectors(state_dict))
            attach_projections(self.state)

    WithProjectorState.__name__ = WithProjectorState.__qualname__ = base.__name__
    return WithProjectorState


_PROJECTOR_MODULES = ("galore_torch.", "apollo_torch.")  # only these classes are rebuilt from a state_dict


def decode_projectors(state_dict: Mapping) -> dict:
    """A copy of a saved ``state_dict`` whose projector dicts are GaLore/APOLLO projector objects again.

    Done before ``Optimizer.load_state_dict``, which would otherwise cast every string inside the state
    into a generator; the projection matrix is attached afterwards (:func:`attach_projections`), once
    torch has moved it to the parameter's device.
    """
    state = {}
    for key, value in state_dict["state"].items():
        fields = value.get("projector") if isinstance(value, Mapping) else None
        if isinstance(fields, Mapping):
            fields = dict(fields)
            module, _, qualname = fields.pop("class").partition(":")
            if not module.startswith(_PROJECTOR_MODULES):
                raise ValueError(f"state_dict names projector class {module}:{qualname}, which is not GaLore's or "
                                 "APOLLO's")
            cls = getattr(importlib.import_module(module), qualname)
            projector = cls.__new__(cls)
            vars(projector).update(fields)
            value = {**value, "projector": projector}
        state[key] = value
    return {**state_dict, "state": state}


def attach_projections(states: Mapping) -> None:
    """Point each loaded projector at its (loaded, device-placed) projection matrix."""
    for state in states.values():
        projector = state.get("projector")
        if projector is not None:
            projector.ortho_matrix = state.get("projection")


class LayerwiseOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped inside ``backward()`` by a post-accumulate-grad hook.

    ``step()`` and ``zero_grad()`` have nothing left to do (each gradient is used and freed as soon as
    it is complete); they exist so the ordinary loop runs unchanged. Gradients cannot be accumulated, which
    ``wrap()`` refuses (``updates_in_backward``). Clipping by the global norm and fp16 loss scaling work through
    ``wrap(model, optimizer, max_grad_norm=..., precision="fp16")``: memwrap's norm pass
    (:mod:`memwrap.techniques.updates_in_backward`) sets ``updates_deferred`` (the hooks below then step nothing),
    takes the norm in a first pass inside the same backward, and in the second hands each clipped gradient to
    :meth:`update_in_backward`, which steps that parameter's optimizer: the parameters equal ``clip_grad_norm_``
    followed by each parameter's step, with one gradient alive at a time; an fp16 overflow anywhere skips every step.

    Example:
        >>> opt = LayerwiseOptimizer([{"params": model.parameters()}], lambda g: torch.optim.AdamW(g))  # doctest: +SKIP
    """

    updates_in_backward = True
    updates_deferred = False  # set by memwrap's norm pass (max_grad_norm): its hook decides when each parameter steps

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer]):
        self._inner: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in groups:
            rest = {k: v for k, v in group.items() if k != "params"}
            for p in tensors_of([group]):
                self._inner[p] = make([{**rest, "params": [p]}])
        if not self._inner:
            raise ValueError("a layer-wise optimizer needs at least one parameter")
        first = next(iter(self._inner.values()))
        super().__init__([{"params": [p]} for p in self._inner], dict(first.defaults))
        self._link()
        self._handles = [p.register_post_accumulate_grad_hook(self._step_parameter)
                         for p in self._inner if p.requires_grad]

    def _link(self) -> None:
        # One group and one state dict per parameter, shared with its optimizer: a scheduler writing
        # param_groups and torch's state_dict() both reach the inner optimizers.
        for i, (p, inner) in enumerate(self._inner.items()):
            self.param_groups[i] = inner.param_groups[0]
            self.state[p] = inner.state[p]

    def _step_parameter(self, param: torch.Tensor) -> None:
        if self.updates_deferred:  # memwrap's norm pass updates it (update_in_backward), after the clip
            return
        self.update_in_backward([param])

    def update_in_backward(self, params: list[torch.Tensor]) -> None:
        """Step each of ``params`` with its own optimizer from its final gradient and free the gradient (what the
        hook does; memwrap's norm pass calls it with the clipped gradient, see
        memwrap.techniques.updates_in_backward)."""
        for param in params:
            inner = self._inner[param]
            inner.step()
            inner.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self, closure=None):
        """Nothing to do: every parameter was updated when its gradient was complete."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        return loss

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(decode_projectors(state_dict))
        attach_projections(self.state)
        for i, (p, inner) in enumerate(self._inner.items()):
            inner.param_groups[0] = self.param_groups[i]
            inner.state[p] = self.state[p]

    def state_dict(self):
        return encode_projectors(super().state_dict())

    def remove_hooks(self) -> None:
        """Detach the per-parameter hooks (the model then no longer steps this optimizer)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
