"""Built-in plugin: the schedulefree package's ``schedule_free_adamw``, ``schedule_free_radam``, ``schedule_free_sgd``.

Schedule-free optimizers train on one sequence of weights (``y``) and evaluate on another (``x``); the
optimizer swaps them with ``optimizer.train()`` / ``optimizer.eval()``, and ``step()`` refuses to run in
eval mode. memwrap switches them with the model: given the model (``wrap()``, ``memwrap_trainer_kwargs``
and ``create_optimizer(name, model)`` do), a forward pre-hook puts the optimizer in the model's mode
before each forward, so ``model.train()`` / ``model.eval()`` in an unchanged loop is all it takes. Call
``optimizer.eval()`` yourself before saving weights for inference outside a forward pass.

Hyperparameters as Trainer passes them: lr, Adam betas/eps (AdamW, RAdam), ``weight_decay``,
``warmup_steps`` (AdamW, SGD) and ``weight_lr_power`` / ``r`` from ``optim_args``.

Example:
    >>> opt = memwrap.create_optimizer("schedule_free_adamw", model, lr=1e-3, warmup_steps=100)  # doctest: +SKIP
"""
from __future__ import annotations

import weakref

import torch
from torch import nn

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import adam_kwargs, import_backend, module_available, typed_optim_args

_AVAILABLE = module_available("schedulefree", "schedulefree", "schedulefree")


def _factory(class_name: str):
    def factory(params, **hp) -> torch.optim.Optimizer:
        return getattr(import_backend("schedulefree", "schedulefree", "schedulefree"), class_name)(params, **hp)

    factory.__name__ = f"make_{class_name}"
    factory.__doc__ = f"schedulefree.{class_name}(params, **hp), importing schedulefree now."
    return factory


def follow_model_mode(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Before each forward of ``model``, put ``optimizer`` in the model's mode (train/eval)."""
    optimizer_ref, model_ref = weakref.ref(optimizer), weakref.ref(model)

    def sync(module: nn.Module, args) -> None:
        opt = optimizer_ref()
        if opt is None or module is not model_ref():  # a deep copy of the model carries this hook along
            return
        training = opt.param_groups[0].get("train_mode")
        if module.training and not training:
            opt.train()
        elif not module.training and training:
            opt.eval()

    optimizer.memwrap_mode_hook = model.register_forward_pre_hook(sync)


def _moments(n: int):
    def state_bytes(param: torch.Tensor, module=None, **hp) -> int:
        return n * param.numel() * param.element_size()

    state_bytes.__doc__ = ("z (the averaged iterate)" + (" and exp_avg_sq" if n == 2 else "")
                           + " in the parameter's dtype.")
    return state_bytes


_ARGS = {"weight_lr_power": float, "r": float}


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_schedule_free_optimizer``."""
    given = typed_optim_args(args, name, _ARGS)
    found = {"lr": args.learning_rate}
    if name != "schedule_free_sgd":
        found.update(adam_kwargs(args))
    found["weight_decay"] = args.weight_decay
    if name != "schedule_free_radam":
        found["warmup_steps"] = args.warmup_steps
    found.update({"weight_lr_power": given.get("weight_lr_power", 2.0), "r": given.get("r", 0.0)})
    return found


def _spec(name: str, class_name: str, moments: int, carries: frozenset) -> OptimizerSpec:
    return OptimizerSpec(
        name=name, factory=_factory(class_name), state_bytes=_moments(moments), available=_AVAILABLE,
        bind_model=follow_model_mode, trainer_kwargs=_trainer_kwargs, optim_args=_ARGS, carries=carries, runs_on_fake=True,
        devices=("cpu", "cuda", "mps", "xpu"),
        description=f"schedulefree {class_name}: no LR schedule needed; train/eval weights switched with the model.")


_ADAM = frozenset({"lr", "weight_decay", "betas", "eps"})
SCHEDULE_FREE = [
    _spec("schedule_free_adamw", "AdamWScheduleFree", 2, _ADAM),
    _spec("schedule_free_radam", "RAdamScheduleFree", 2, _ADAM),
    _spec("schedule_free_sgd", "SGDScheduleFree", 1, frozenset({"lr", "weight_decay", "momentum"})),
]


@hookimpl
def memwrap_optimizers():
    return list(SCHEDULE_FREE)
