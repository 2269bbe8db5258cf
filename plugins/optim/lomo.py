"""Built-in plugin: lomo-optim's ``lomo`` and ``adalomo``, which update each parameter inside ``backward()``.

LOMO fuses the update into the backward pass: a hook on every parameter applies the update as soon
as the next gradient is computed and frees the gradient, so no optimizer state (LOMO) or only a
factored second moment (AdaLomo) and never a full set of gradients is held. Trainer drives it with
``optimizer.fused_backward(loss, lr)``; memwrap keeps the ordinary loop instead:

    loss.backward()        # updates every parameter but the last ones to receive their gradient
    optimizer.step()       # updates those (what fused_backward does after its backward)
    optimizer.zero_grad()

``fused_backward`` still works and is what Trainer calls. The learning rate is the param group's, so LR
schedulers work.

Clipping by the global norm works through ``wrap(model, optimizer, max_grad_norm=...)``: memwrap's norm pass
(:mod:`memwrap.techniques.updates_in_backward`) runs, inside the same ``loss.backward()``, a first pass that takes
the norm as ``clip_grad_norm_`` does while lomo-optim's hooks stand aside (``updates_deferred``), then each
gradient is clipped and handed to lomo-optim's own update (``update_in_backward``): the parameters equal
``clip_grad_norm_`` followed by LOMO's update, and one gradient is alive at a time, as without clipping. (lomo-optim's
own ``clip_grad_norm=`` needs its two-call ``grad_norm(loss)`` + ``fused_backward``, which a plain loop does not make;
it is refused with that fix.) fp16 (``precision="fp16"``) works the same way: the first pass unscales each gradient
with GradScaler's kernel and sees any overflow before anything is updated, so an overflowing window updates nothing
and the scale backs off as torch AMP's does. What cannot work, and is refused by ``wrap()`` (the spec says
``updates_in_backward``): accumulating gradients over micro-batches (the hooks keep no gradient between them). A raw
``torch.amp.GradScaler`` around LOMO without memwrap cannot skip an update (``scaler_ok=False``).

AdaLomo allocates its state with ``.cuda()``, so it needs a GPU; on a CPU run it is refused with the
fix. memwrap keeps AdaLomo's state in ``optimizer.state`` too, so ``state_dict()`` saves and restores it
(lomo-optim's own class would lose it on resume).

Example:
    >>> opt = memwrap.create_optimizer("lomo", model, lr=1e-3)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import math

import torch
from torch import nn

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import import_backend, module_available, tensors_of, typed_optim_args

_AVAILABLE = module_available("lomo_optim", "lomo-optim", "lomo")


def _group_property(key: str):
    # lomo-optim reads ``self.lr`` / ``self.weight_decay`` inside its hooks (and sets lr in fused_backward()); keeping
    # them in the param group lets torch's LR schedulers (which write param_groups) drive lr, and makes the group hold
    # the values the hooks use (Lomo's own groups have no weight_decay).
    initial = f"_initial_{key}"

    def get(self):
        groups = self.__dict__.get("param_groups")
        return groups[0].get(key, self.__dict__.get(initial)) if groups else self.__dict__[initial]

    def set_(self, value):
        groups = self.__dict__.get("param_groups")
        if groups:
            for group in groups:
                group[key] = value
        else:
            self.__dict__[initial] = value

    return property(get, set_)


def _lr_property():
    return _group_property("lr")


def _hold_weight_decay(optimizer) -> None:
    """Put the weight decay given to the constructor into the groups and defaults, where conversion and schedulers
    look for it; ``do_weight_decay`` then follows the group's value."""
    value = optimizer.__dict__.get("_initial_weight_decay", 0.0)
    optimizer.defaults.setdefault("weight_decay", value)
    for group in optimizer.param_groups:
        group.setdefault("weight_decay", value)


def _deferrable(optimizer, update):
    """lomo-optim's hook function, standing aside while memwrap's norm pass drives the updates.

    lomo-optim registers ``grad_func`` as a hook on every parameter; when the next gradient arrives it updates every
    parameter holding a ``.grad``. With clipping the first pass must update nothing and the second must see each
    gradient clipped first, so then only :func:`_drive` (called after the gradient is clipped) runs the update.
    """

    def func(x):
        if optimizer.updates_deferred and not optimizer._driving:
            return x
        return update(x)

    return func


def _drive(optimizer) -> None:
    # lomo-optim's own update of every parameter that holds a .grad: the norm pass calls it when exactly the
    # parameters it hands over do (each clipped, all others already updated and freed).
    optimizer._driving = True
    try:
        optimizer.grad_func(0)
    finally:
        optimizer._driving = False


@functools.cache
def _lomo_class():
    base = import_backend("lomo_optim", "lomo-optim", "lomo").Lomo

    class Lomo(base):
        """lomo-optim's Lomo, stepped by ``loss.backward(); optimizer.step()`` (see the plugin docs)."""

        updates_in_backward = True
        updates_deferred = False  # set by memwrap's norm pass (max_grad_norm): its hook decides when to update
        _driving = False
        lr = _lr_property()
        weight_decay = _group_property("weight_decay")
        do_weight_decay = property(lambda self: self.weight_decay > 0, lambda self, value: None)

        def __init__(self, model, **hp):
            super().__init__(model, **hp)
            _hold_weight_decay(self)

        def fuse_update(self):
            return _deferrable(self, super().fuse_update())

        def update_in_backward(self, params):
            """Update ``params`` from their final (clipped) gradients now and free them: memwrap's norm pass calls
            it once each gradient is complete (see memwrap.techniques.updates_in_backward)."""
            _drive(self)

        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            # The hooks update a parameter when the *next* gradient arrives; the last ones wait for this call,
            # as in fused_backward().
            self.grad_func(0)
            return loss

    return Lomo


@functools.cache
def _adalomo_class():
    base = import_backend("lomo_optim", "lomo-optim", "lomo").AdaLomo

    class AdaLomo(base):
        """lomo-optim's AdaLomo, stepped by ``loss.backward(); optimizer.step()``, its state in ``state_dict()``."""

        updates_in_backward = True
        updates_deferred = False  # set by memwrap's norm pass (max_grad_norm): its hook decides when to update
        _driving = False
        lr = _lr_property()
        weight_decay = _group_property("weight_decay")
        do_weight_decay = property(lambda self: self.weight_decay > 0, lambda self, value: None)

        def __init__(self, model, **hp):
            self._counted = False  # whether step_num already counts the backward in progress
            super().__init__(model, **hp)
            # fused_backward() scales the loss by loss_scale and the hooks divide it out; a plain backward has no
            # scaled loss, so the hooks divide only inside fused_backward() (a power of two: exact either way).
            self._fused_scale, self.loss_scale = self.loss_scale, None
            self._link_state()

        def fuse_update(self):
            update = super().fuse_update()

            def func(x):
                if not self._counted:  # fused_backward() counts the step before its backward; a plain one here
                    self._counted = True
                    self.step_num += 1
                return update(x)

            # Deferred (memwrap's norm pass), a hook neither counts nor updates: the step is counted at the first
            # update the norm pass drives, so a skipped (non-finite) window counts none.
            return _deferrable(self, func)

        def update_in_backward(self, params):
            """Update ``params`` from their final (clipped) gradients now and free them (memwrap's norm pass)."""
            _drive(self)

        def fused_backward(self, loss, lr):
            # With memwrap's norm pass driving the updates (accelerate calls this in a Trainer run with clipping), the
            # loss stays unscaled: the first pass takes the norm of the true gradients, as clip_grad_norm_ would.
            self._counted = True
            self.loss_scale = None if self.updates_deferred else self._fused_scale
            try:
                super().fused_backward(loss, lr)
            finally:
                self._counted, self.loss_scale = False, None

        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            if self._counted:  # a backward ran: finish its last parameters
                self.grad_func(0)
            self._counted = False
            return loss

        def _link_state(self):
            for n, p in self.model.named_parameters():
                state = self.state[p]
                for key, table in (("exp_avg_sq", self.exp_avg_sq), ("exp_avg_sq_row", self.exp_avg_sq_row),
                                   ("exp_avg_sq_col", self.exp_avg_sq_col)):
                    if n in table:
                        if key in state:  # restored by load_state_dict: the hooks must use the restored tensor
                            table[n] = state[key]
                        else:
                            state[key] = table[n]

        def state_dict(self):
            found = super().state_dict()
            found["adalomo_step_num"] = self.step_num
            return found

        def load_state_dict(self, state_dict):
            state_dict = dict(state_dict)
            step_num = state_dict.pop("adalomo_step_num", None)
            super().load_state_dict(state_dict)
            if step_num is not None:
                self.step_num = step_num
            self._link_state()

    return AdaLomo


def _check_params(name: str, params, model: nn.Module, hp: dict) -> None:
    given = ({id(t) for t in tensors_of(params) if t.requires_grad} if not isinstance(params, nn.Module) else None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if given is not None and given != {id(p) for p in trainable}:
        raise ValueError(f"{name} updates every trainable parameter of the model inside backward, but the optimizer "
                         f"covers {len(given)} parameter(s) of the model's {len(trainable)} trainable ones. Fix: "
                         "freeze the others (requires_grad_(False)) or build it over the whole model.")
    if hp.get("clip_grad_norm") is not None:
        raise ValueError(f"{name}: clip_grad_norm needs lomo-optim's two-pass optimizer.grad_norm(loss) before "
                         "fused_backward(), which an ordinary loop does not make. Fix: clip with memwrap instead, "
                         "memwrap.wrap(model, optimizer, max_grad_norm=...) (the same clipping, inside one "
                         "loss.backward()); or call optimizer.grad_norm(loss) and optimizer.fused_backward(loss, lr) "
                         "yourself.")


def _one_group_value(params, key: str):
    values = {g[key] for g in params if isinstance(g, dict) and key in g} if not isinstance(params, nn.Module) else set()
    if len(values) > 1:
        raise ValueError(f"LOMO has one {key} for the whole model; the optimizer's groups have {sorted(values)}. "
                         f"Fix: give every group the same {key}.")
    return values.pop() if values else None


def _factory(kind: str):
    def factory(params, *, model: nn.Module, **hp) -> torch.optim.Optimizer:
        params = params if isinstance(params, nn.Module) else list(params)
        _check_params(kind, params, model, hp)
        for key in ("lr", "weight_decay"):
            value = _one_group_value(params, key)
            if value is not None and key not in hp:
                hp[key] = value
        if kind == "adalomo":
            devices = {p.device.type for p in model.parameters()}
            if devices != {"cuda"} or not torch.cuda.is_available():
                raise ValueError(
                    f"adalomo needs a CUDA GPU: lomo-optim allocates its state with .cuda(), and this model is on "
                    f"{sorted(devices)}{'' if torch.cuda.is_available() else ' with no CUDA device present'}. Fix: "
                    "model.cuda() before building it on a GPU machine, or on CPU use optim='lomo' (no state) or "
                    "'adafactor' (the factored second moment AdaLomo is built on).")
            return _adalomo_class()(model, **hp)
        return _lomo_class()(model, **hp)

    factory.__name__ = f"make_{kind}"
    factory.__doc__ = f"lomo-optim's {kind} over ``model`` (updates inside backward; see the plugin docs)."
    return factory


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_lomo_optimizer``: only lr (and the model, which memwrap passes itself)."""
    typed_optim_args(args, name, {})
    return {"lr": args.learning_rate}


def lomo_state_bytes(param: torch.Tensor, module=None, **hp) -> int:
    """LOMO keeps no optimizer state."""
    return 0


def adalomo_state_bytes(param: torch.Tensor, module=None, **hp) -> int:
    """float32 row and column second moments for matrices (first dim, second dim), a full one for vectors."""
    shape = tuple(param.shape)
    return 4 * (shape[0] + shape[1] if len(shape) > 1 else math.prod(shape))


_COMMON = dict(available=_AVAILABLE, needs_model=True, updates_in_backward=True, scaler_ok=False,
               trainer_kwargs=_trainer_kwargs, carries=frozenset({"lr", "weight_decay"}))

LOMO = OptimizerSpec(
    name="lomo", factory=_factory("lomo"), state_bytes=lomo_state_bytes, runs_on_fake=False,
    devices=("cpu", "cuda"), description="lomo-optim LOMO: SGD fused into backward, no state, gradients freed as "
                                         "they are used.", **_COMMON)

ADALOMO = OptimizerSpec(
    name="adalomo", factory=_factory("adalomo"), state_bytes=adalomo_state_bytes, runs_on_fake=False,
    devices=("cuda",), description="lomo-optim AdaLomo: Adafactor-style factored second moment, update fused into "
                                   "backward (GPU only).", **_COMMON)


@hookimpl
def memwrap_optimizers():
    return [LOMO, ADALOMO]
