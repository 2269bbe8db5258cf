"""Built-in plugin: two Adafactors with different maths, each under its own name.

* ``adafactor``: Hugging Face's ``transformers.optimization.Adafactor`` exactly as Trainer builds it for
  ``TrainingArguments(optim="adafactor")``: ``scale_parameter=False, relative_step=False``, so ``lr``
  is an absolute step size. transformers is imported only when the optimizer is built (extra
  ``memwrap[transformers]``): wrapping its class keeps the maths identical by construction, where a
  port would have to be kept in step with every transformers release.
* ``torch_adafactor``: ``torch.optim.Adafactor`` (no transformers needed), described below.

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

from memwrap.plugin.manager import hookimpl
from memwrap.plugin.registry import OptimizerSpec
from memwrap.plugin.state_size import scalar_step_bytes

from ._common import import_backend, module_available, typed_optim_args


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


TORCH_ADAFACTOR = OptimizerSpec(
    name="torch_adafactor",
    aliases=("adafactor_torch",),
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


# -- Hugging Face's Adafactor ------------------------------------------------------------------------------

def make_hf_adafactor(params, **hp) -> torch.optim.Optimizer:
    """``transformers.optimization.Adafactor(params, **hp)``, importing transformers now."""
    return import_backend("transformers.optimization", "transformers", "transformers").Adafactor(params, **hp)


def hf_adafactor_state_bytes(param: torch.Tensor, module=None, *, beta1=None, **hp) -> int:
    """Factored (row + column) or full second moment, ``exp_avg`` with ``beta1``, and the ``RMS`` scalar.

    All in float32 for 16-bit parameters (transformers computes in float32), else in the parameter's dtype;
    ``step`` is a Python int.
    """
    shape = tuple(param.shape)
    size = 4 if param.dtype in (torch.float16, torch.bfloat16) else param.element_size()
    if len(shape) >= 2:
        second = math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])
    else:
        second = param.numel()
    first = param.numel() if beta1 is not None else 0
    return (second + first) * size + size  # RMS: a 0-dim tensor of the parameter's (float32) dtype


def _hf_trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_adafactor``: lr plus ``scale_parameter=False, relative_step=False``."""
    typed_optim_args(args, name, {})
    return {"lr": args.learning_rate, "scale_parameter": False, "relative_step": False}


ADAFACTOR = OptimizerSpec(
    name="adafactor",
    aliases=("hf_adafactor",),
    factory=make_hf_adafactor,
    state_bytes=hf_adafactor_state_bytes,
    available=module_available("transformers", "transformers", "transformers"),
    # What optim="adafactor" means in Trainer; lr=1e-3 (transformers' documented choice for an absolute step) when the
    # caller gives none, as transformers' own default (None) only works with the relative step Trainer turns off.
    defaults={"lr": 1e-3, "scale_parameter": False, "relative_step": False},
    carries=frozenset({"lr", "weight_decay"}),
    trainer_kwargs=_hf_trainer_kwargs,
    runs_on_fake=True,
    devices=("cpu", "cuda", "mps", "xpu"),
    description="transformers.Adafactor as Trainer builds it (absolute lr, no relative step): factored second "
                "moment, no momentum (well under 1 byte/param).",
)


@hookimpl
def memwrap_optimizers():
    return [ADAFACTOR, TORCH_ADAFACTOR]
