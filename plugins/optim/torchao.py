"""Built-in plugin: torchao's low-bit AdamW, ``adamw_torch_8bit`` and ``adamw_torch_4bit`` (Trainer's names).

torchao quantizes each moment block-wise (codes + one float32 scale per ``block_size`` values + a small
lookup table) for tensors of at least 4096 values whose size divides into blocks; smaller tensors keep
moments in the parameter's dtype. Its step is compiled with ``torch.compile`` (the first step of each
new parameter shape pays the compilation, tens of seconds on CPU), and the learning rate lives in a
tensor: schedulers must update it in place (torch's LR schedulers do).

Example:
    >>> opt = memwrap.create_optimizer("adamw_torch_4bit", model, lr=1e-3)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from memwrap.plugin.manager import hookimpl
from memwrap.quiet import quiet_loggers
from memwrap.plugin.registry import OptimizerSpec

from ._common import adam_kwargs, import_backend, module_available, strtobool, typed_optim_args

_EXTRA = ("torchao", "torchao", "torchao")  # module, package, memwrap extra
MIN_QUANTIZED = 4096  # torchao follows bitsandbytes: smaller tensors keep full-precision moments


def _factory(class_name: str):
    def factory(params, **hp) -> torch.optim.Optimizer:
        # torchao's import logs kernels it could not load and torch's pytree deprecations: memwrap's import (e.g.
        # the planner's), not the user's, so those records are dropped (memwrap.quiet).
        with quiet_loggers("torchao", "torch.utils._pytree"):
            backend = import_backend("torchao.optim", "torchao", "torchao")
        return getattr(backend, class_name)(params, **hp)

    factory.__name__ = f"make_{class_name}"
    factory.__doc__ = f"torchao.optim.{class_name}(params, **hp), importing torchao now."
    return factory


def _state_bytes(bits: int, default_block: int):
    levels = 2 ** bits

    def state_bytes(param: torch.Tensor, module=None, *, block_size: int = default_block, amsgrad: bool = False,
                    **hp) -> int:
        n, moments = param.numel(), 3 if amsgrad else 2
        if n >= MIN_QUANTIZED and n % block_size == 0:
            # codes (bits per value, packed), one float32 scale per block, and each state's own lookup table
            per_moment = n * bits // 8 + 4 * (n // block_size) + 4 * levels
        else:
            per_moment = n * param.element_size()
        return moments * per_moment + 4  # + the float32 step counter

    state_bytes.__doc__ = f"Two {bits}-bit block-wise moments (full precision below {MIN_QUANTIZED} values) + step."
    return state_bytes


_ARGS = {"block_size": int, "bf16_stochastic_round": strtobool}


def _trainer_kwargs(name: str, args) -> dict:
    """transformers' ``_get_torchao_optimizer``: lr, betas, eps, ``block_size`` (256) and ``bf16_stochastic_round``."""
    given = typed_optim_args(args, name, _ARGS)
    return {"lr": args.learning_rate, "block_size": given.get("block_size", 256),
            "bf16_stochastic_round": given.get("bf16_stochastic_round", False), **adam_kwargs(args)}


_COMMON = dict(available=module_available(*_EXTRA), runs_on_fake=False, trainer_kwargs=_trainer_kwargs, optim_args=_ARGS,
               carries=frozenset({"lr", "weight_decay", "betas", "eps", "amsgrad"}), devices=("cpu", "cuda", "xpu"),
               scaler_ok=True)

ADAMW_TORCH_8BIT = OptimizerSpec(
    name="adamw_torch_8bit", aliases=("torchao_adamw_8bit",), factory=_factory("AdamW8bit"),
    approximates="adamw", state_bytes=_state_bytes(8, 256), description="torchao AdamW8bit: 8-bit block-wise moments (about 2 bytes/param).",
    **_COMMON)

ADAMW_TORCH_4BIT = OptimizerSpec(
    name="adamw_torch_4bit", aliases=("torchao_adamw_4bit",), factory=_factory("AdamW4bit"),
    approximates="adamw", state_bytes=_state_bytes(4, 128), description="torchao AdamW4bit: 4-bit block-wise moments (about 1 byte/param).",
    **_COMMON)


@hookimpl
def memwrap_optimizers():
    return [ADAMW_TORCH_8BIT, ADAMW_TORCH_4BIT]
