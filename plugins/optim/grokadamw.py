"""Built-in plugin: ``grokadamw``, the grokadamw package's GrokAdamW with Trainer's hyperparameters.

GrokAdamW adds a slow gradient EMA (``grok_ema``) amplified by ``lamb`` to AdamW's moments: three
values per parameter, which the package keeps in CPU memory between steps (moved to the parameter's
device for each update). It stores that state inside its param groups keyed by the parameter tensors,
which does not survive ``state_dict()``/``load_state_dict()`` (the loaded keys are new tensors, so the
state silently restarts); memwrap's subclass keeps it in ``optimizer.state`` as well, so it is saved,
restored and measured like any torch optimizer's state.

Example:
    >>> opt = memwrap.create_optimizer("grokadamw", model.parameters(), lr=1e-3)  # doctest: +SKIP
"""
from __future__ import annotations

import functools

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec

from ._common import import_backend, module_available, typed_optim_args


@functools.cache
def _grok_class() -> type:
    base = import_backend("grokadamw", "grokadamw", "grokadamw").GrokAdamW

    class GrokAdamW(base):
        """grokadamw.GrokAdamW whose state is also ``optimizer.state`` (saved, restored, measured)."""

        def step(self, closure=None):
            loss = super().step(closure)
            for group in self.param_groups:
                for p, state in group.get("state", {}).items():
                    self.state[p] = state  # the very dict GrokAdamW updates in place
            return loss

        def state_dict(self):
            found = super().state_dict()
            for group in found["param_groups"]:
                group.pop("state", None)  # already under found["state"], keyed by index
            return found

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            for group in self.param_groups:
                group["state"] = {p: self.state[p] for p in group["params"] if self.state.get(p)}

    return GrokAdamW


def make_grokadamw(params, **hp) -> torch.optim.Optimizer:
    """``grokadamw.GrokAdamW(params, **hp)`` with its state kept in ``optimizer.state`` too."""
    return _grok_class()(params, **hp)


def grokadamw_state_bytes(param: torch.Tensor, module=None, **hp) -> int:
    """exp_avg, exp_avg_sq and grok_ema in the parameter's dtype (held on the CPU between steps); step is an int."""
    return 3 * param.numel() * param.element_size()


_ARGS = {"alpha_init": float, "lamb": float, "gamma": float, "grokking_signal_decay_rate": float,
         "gradient_clipping": float}


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_grokadamw``: lr and five ``optim_args`` (Adam's betas/eps are not passed)."""
    given = typed_optim_args(args, name, _ARGS)
    defaults = {"alpha_init": 0.98, "lamb": 2.0, "gamma": 0.1, "grokking_signal_decay_rate": 0.1,
                "gradient_clipping": 1.0}
    return {"lr": args.learning_rate, **defaults, **given}


GROKADAMW = OptimizerSpec(
    name="grokadamw", factory=make_grokadamw, state_bytes=grokadamw_state_bytes,
    available=module_available("grokadamw", "grokadamw", "grokadamw"), trainer_kwargs=_trainer_kwargs, optim_args=_ARGS,
    carries=frozenset({"lr", "weight_decay", "betas", "eps"}), runs_on_fake=False, devices=("cpu", "cuda"),
    description="GrokAdamW: AdamW plus an amplified slow gradient EMA (3 values/param, kept on the CPU).")


@hookimpl
def memwrap_optimizers():
    return [GROKADAMW]
