"""Built-in plugin: ``adafactor``, ``torch.optim.Adafactor`` (factored second moment, no momentum).

State: for a matrix of shape ``(..., r, c)`` only a row and a column factor (``r + c`` values per
matrix), for vectors a full second moment, plus a ``step`` scalar: far below 1 byte per parameter
for large layers.

Learning rate: torch's ``lr`` is not a step size. Each update is
``max(eps[1], RMS(param)) * min(lr, 1/sqrt(t))`` times the clipped normalized gradient, so ``lr``
caps a *relative* step that shrinks as ``1/sqrt(t)`` and is scaled by the parameter's size
(default 1e-2, the paper's constant). Hugging Face's ``transformers.Adafactor`` as the Trainer uses
it (``optim="adafactor"``: ``scale_parameter=False, relative_step=False``) takes ``lr`` as an
absolute step size. See docs/optimizers.md.

Example:
    >>> opt = memwrap.create_optimizer("adafactor", model.parameters(), lr=1e-2)  # doctest: +SKIP
"""
from __future__ import annotations

import math

import torch

from memwrap.plugins import hookimpl
from memwrap.registry import OptimizerSpec, scalar_step_bytes


def make_adafactor(params, **hp) -> torch.optim.Adafactor:
    """``torch.optim.Adafactor(params, **hp)``."""
    return torch.optim.Adafactor(params, **hp)


def adafactor_state_bytes(param: torch.Tensor, module=None, **hp) -> int:
    """Row and column factors for tensors with 2+ dims, a full second moment for vectors, plus ``step``."""
    shape, size = tuple(param.shape), param.element_size()
    if len(shape) > 1:
        rows, cols = math.prod(shape[:-1]), math.prod(shape[:-2] + shape[-1:])
        return (rows + cols) * size + scalar_step_bytes()
    return param.numel() * size + scalar_step_bytes()


ADAFACTOR = OptimizerSpec(
    name="adafactor",
    aliases=("torch_adafactor", "adafactor_torch"),
    factory=make_adafactor,
    state_bytes=adafactor_state_bytes,
    carries=frozenset({"lr", "weight_decay", "maximize"}),
    fused=False,
    runs_on_fake=False,  # its step calls .item() (relative step, parameter RMS): no values on FakeTensors
    devices=("cpu", "cuda", "mps", "xpu"),
    conversion_note="torch.optim.Adafactor's lr caps a relative step scaled by each parameter's RMS "
                    "(default 1e-2), unlike AdamW's absolute step: an AdamW lr usually needs raising "
                    "(see docs/optimizers.md).",
    description="torch.optim.Adafactor: factored second moment, no momentum (well under 1 byte/param).",
)


@hookimpl
def memwrap_optimizers():
    return [ADAFACTOR]
