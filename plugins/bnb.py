"""Built-in plugin: bitsandbytes' 8-bit optimizers ``adamw_8bit``, ``paged_adamw_8bit``, ``lion_8bit``.

bitsandbytes is imported only when one of these optimizers is built, never by ``import memwrap``.
Block-wise 8-bit state: one byte per state value plus one float32 scale per 256 values; tensors
smaller than ``min_8bit_size`` (4096) and embedding weights keep 32-bit state, as bitsandbytes
advises for embeddings (``GlobalOptimManager.register_module_override``; pass ``model=`` to
``create_optimizer``/``convert_optimizer``, which ``memwrap.wrap`` does).

Example:
    >>> opt = memwrap.create_optimizer("adamw_8bit", model, lr=2e-4)  # doctest: +SKIP
"""
from __future__ import annotations

import importlib.util
import sys

import torch
from torch import nn

from memwrap.plugins import hookimpl
from memwrap.registry import OptimizerSpec, OptimizerUnavailableError

INSTALL_HINT = 'bitsandbytes is not installed: pip install bitsandbytes  (or: pip install "memwrap[bnb]")'
BLOCKSIZE = 256  # bitsandbytes' block-wise quantization: one float32 absmax per 256 values
QMAP_BYTES = 256 * 4  # one float32 quantization map of 256 entries, shared by all parameters
_8BIT_DEVICES = ("cuda", "cpu", "xpu")


def available() -> tuple[bool, str]:
    """Whether bitsandbytes can be imported, checked without importing it."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"] is not None, INSTALL_HINT
    try:
        return importlib.util.find_spec("bitsandbytes") is not None, INSTALL_HINT
    except (ImportError, ValueError):
        return False, INSTALL_HINT


def _bnb():
    try:
        import bitsandbytes
    except ImportError as exc:
        raise OptimizerUnavailableError(f"{INSTALL_HINT} ({exc})") from exc
    return bitsandbytes


def _private_manager(bnb):
    # bitsandbytes keeps overrides in one process-wide GlobalOptimManager, keyed by id(param) and by
    # (group index, param index); an override made for one optimizer then leaks into every later
    # optimizer whose parameter sits at the same position. Each memwrap-built optimizer therefore
    # gets its own manager instance (same class, same API: ``optimizer.mng.override_config(...)``).
    manager = bnb.optim.GlobalOptimManager.__new__(bnb.optim.GlobalOptimManager)
    manager.initialize()
    return manager


def bind_embeddings_32bit(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Keep 32-bit optimizer state for every ``nn.Embedding`` weight the optimizer updates."""
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    manager = optimizer.mng
    for module in model.modules():
        if isinstance(module, nn.Embedding) and id(module.weight) in owned:
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def _is_8bit(param: torch.Tensor, module, min_8bit_size: int) -> bool:
    embedding = isinstance(module, nn.Embedding) and module.weight is param
    return not embedding and param.numel() >= min_8bit_size


def _state_bytes(n_states: int):
    def state_bytes(param: torch.Tensor, module=None, *, min_8bit_size: int = 4096, **hp) -> int:
        n = param.numel()
        if not _is_8bit(param, module, min_8bit_size):
            return n_states * 4 * n  # float32 state whatever the parameter's dtype
        blocks = -(-n // BLOCKSIZE)
        return n_states * (n + 4 * blocks)

    state_bytes.__doc__ = f"{n_states} block-wise 8-bit state(s) per parameter, 32-bit for small tensors and embeddings."
    return state_bytes


def _shared_bytes(n_states: int):
    def shared(pairs, *, min_8bit_size: int = 4096, **hp) -> int:
        return n_states * QMAP_BYTES if any(_is_8bit(p, m, min_8bit_size) for p, m in pairs) else 0

    return shared


def _factory(class_name: str):
    def factory(params, **hp) -> torch.optim.Optimizer:
        bnb = _bnb()
        optimizer = getattr(bnb.optim, class_name)(params, **hp)
        optimizer.mng = _private_manager(bnb)
        return optimizer

    factory.__name__ = f"make_{class_name}"
    factory.__doc__ = f"bitsandbytes.optim.{class_name}(params, **hp), importing bitsandbytes now."
    return factory


_COMMON = dict(available=available, bind_model=bind_embeddings_32bit, devices=_8BIT_DEVICES,
               runs_on_fake=False, scaler_ok=True)

ADAMW_8BIT = OptimizerSpec(
    name="adamw_8bit", aliases=("adamw_bnb_8bit", "bnb_adamw_8bit"), factory=_factory("AdamW8bit"),
    state_bytes=_state_bytes(2), shared_state_bytes=_shared_bytes(2),
    carries=frozenset({"lr", "weight_decay", "betas", "eps"}),
    description="bitsandbytes AdamW8bit: about 2 bytes/param of state.", **_COMMON)

PAGED_ADAMW_8BIT = OptimizerSpec(
    name="paged_adamw_8bit", factory=_factory("PagedAdamW8bit"),
    state_bytes=_state_bytes(2), shared_state_bytes=_shared_bytes(2), paged=True,
    carries=frozenset({"lr", "weight_decay", "betas", "eps"}),
    description="bitsandbytes PagedAdamW8bit: state in CUDA unified memory, evicted to CPU under pressure "
                "(on CPU bitsandbytes falls back to ordinary state with a warning).", **_COMMON)

LION_8BIT = OptimizerSpec(
    name="lion_8bit", aliases=("bnb_lion_8bit",), factory=_factory("Lion8bit"),
    state_bytes=_state_bytes(1), shared_state_bytes=_shared_bytes(1),
    carries=frozenset({"lr", "weight_decay"}),
    conversion_note="Lion usually wants a learning rate 3-10x smaller and a weight decay 3-10x larger than "
                    "AdamW; its betas mean something else, so they take Lion's defaults (0.9, 0.99).",
    description="bitsandbytes Lion8bit: one momentum, about 1 byte/param of state.", **_COMMON)


@hookimpl
def memwrap_optimizers():
    return [ADAMW_8BIT, PAGED_ADAMW_8BIT, LION_8BIT]
