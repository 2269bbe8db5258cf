"""An example third-party memwrap plugin: SGD with momentum, registered as ``sgd_momentum``.

Installed, it is found through its entry point (group ``memwrap``) with no change to memwrap:

    import memwrap
    opt = memwrap.create_optimizer("sgd_momentum", model.parameters(), lr=0.05)
"""
import torch

import memwrap
from memwrap.plugin.registry import OptimizerSpec


def make_sgd(params, **hyperparameters):
    return torch.optim.SGD(params, **hyperparameters)


def sgd_state_bytes(param, module=None, *, momentum=0.0, **hyperparameters):
    # One momentum buffer like the parameter, created at the first step; none without momentum.
    return param.numel() * param.element_size() if momentum else 0


@memwrap.hookimpl
def memwrap_optimizers():
    return [
        OptimizerSpec(
            name="sgd_momentum",
            aliases=("sgd_example",),
            factory=make_sgd,
            state_bytes=sgd_state_bytes,
            defaults={"lr": 0.05, "momentum": 0.9},
            carries=frozenset({"lr", "weight_decay", "maximize"}),
            runs_on_fake=True,
            description="torch.optim.SGD with momentum 0.9 (4 bytes/param of state in fp32)",
        )
    ]
