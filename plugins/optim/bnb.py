"""Built-in plugin: bitsandbytes' optimizers under every Hugging Face name Trainer builds with it.

AdamW (``adamw_8bit``/``adamw_bnb_8bit``, ``paged_adamw_8bit``, ``paged_adamw_32bit``), AdEMAMix
(``ademamix``, ``ademamix_8bit``, ``paged_ademamix_32bit``, ``paged_ademamix_8bit``), Lion (``lion_8bit``,
``lion_32bit``, ``paged_lion_8bit``, ``paged_lion_32bit``) and RMSprop (``rmsprop_bnb``/``rmsprop_bnb_32bit``,
``rmsprop_bnb_8bit``). 32-bit variants keep float32 state whatever the parameter's dtype.

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

from memwrap.plugin.manager import hookimpl
from memwrap.quiet import quiet_loggers
from memwrap.plugin.registry import OptimizerSpec, OptimizerUnavailableError

from ._common import adam_kwargs, strtobool, typed_optim_args

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
        # Its CPU backend logs a missing optional kernel package at import: memwrap's import, not the user's.
        with quiet_loggers("bitsandbytes"):
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


def _state_bytes(n_states: int, bits: int = 8):
    def state_bytes(param: torch.Tensor, module=None, *, min_8bit_size: int = 4096, **hp) -> int:
        n = param.numel()
        if bits == 32 or not _is_8bit(param, module, min_8bit_size):
            return n_states * 4 * n  # float32 state whatever the parameter's dtype
        blocks = -(-n // BLOCKSIZE)
        return n_states * (n + 4 * blocks)

    state_bytes.__doc__ = (f"{n_states} state value(s) per parameter: "
                           + ("float32." if bits == 32 else "block-wise 8-bit, 32-bit for small tensors and embeddings."))
    return state_bytes


def _shared_bytes(n_maps: int):
    def shared(pairs, *, min_8bit_size: int = 4096, **hp) -> int:
        return n_maps * QMAP_BYTES if any(_is_8bit(p, m, min_8bit_size) for p, m in pairs) else 0

    return shared


def _refuse_cpu_paging(class_name: str, params) -> None:
    # bitsandbytes' paged AdEMAMix allocates its double state buffer with CUDA paging for tensors of 1e5+ values
    # without the CPU fallback its other paged optimizers have (bitsandbytes 0.50), and fails there; Trainer's
    # paged_ademamix_* fails the same way on CPU.
    from ._common import tensors_of

    if any(t.device.type == "cpu" and t.numel() >= 100_000 for t in tensors_of(params)):
        raise ValueError(f"bitsandbytes' {class_name} cannot page its state on CPU (tensors of 100000+ values fail: no "
                         "CPU fallback in bitsandbytes 0.50). Fix: run it on a CUDA GPU, or use ademamix (32-bit) or "
                         "ademamix_8bit on CPU (the same maths; paging only exists on CUDA anyway).")


def _factory(class_name: str, fixed: dict | None = None):
    """``bitsandbytes.optim.<class_name>(params, **fixed, **hp)``: ``fixed`` are the constructor arguments Trainer
    passes for that name (``optim_bits``, ``is_paged``), so the very class and settings Trainer builds are built."""
    fixed = dict(fixed or {})
    paged_ademamix = "AdEMAMix" in class_name and bool(fixed.get("is_paged") or class_name.startswith("Paged"))
    label = f"{class_name}({', '.join(f'{k}={v}' for k, v in fixed.items())})" if fixed else class_name

    def factory(params, **hp) -> torch.optim.Optimizer:
        bnb = _bnb()
        if "AdEMAMix" in class_name and "beta3" in hp:
            # optim_args' beta3 (the slow EMA) completes the betas, in the constructor and in converted groups alike
            beta3 = hp.pop("beta3")
            hp["betas"] = (*hp.get("betas", (0.9, 0.999))[:2], beta3)
            params = [{**g, "betas": (*g["betas"][:2], beta3)} if isinstance(g, dict) and "betas" in g else g
                      for g in params]
        if paged_ademamix:
            params = list(params)
            _refuse_cpu_paging(label, params)
        optimizer = getattr(bnb.optim, class_name)(params, **{**fixed, **hp})
        optimizer.mng = _private_manager(bnb)
        return optimizer

    factory.__name__ = f"make_{class_name}"
    factory.__doc__ = f"bitsandbytes.optim.{label}(params, **hp), importing bitsandbytes now."
    return factory


# -- what Trainer passes (transformers.trainer_optimizer._get_bitsandbytes_optimizer) ----------------------------

def _adamw_kwargs(name: str, args) -> dict:
    typed_optim_args(args, name, {})
    return {"lr": args.learning_rate, **adam_kwargs(args)}


def _lion_kwargs(name: str, args) -> dict:
    typed_optim_args(args, name, {})
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}


_RMSPROP_ARGS = {"alpha": float, "eps": float, "weight_decay": float, "momentum": float, "centered": strtobool}
_ADEMAMIX_ARGS = {"beta1": float, "beta2": float, "beta3": float, "alpha": float, "eps": float, "t_alpha": int,
                  "t_beta3": int}


def _rmsprop_kwargs(name: str, args) -> dict:
    # Trainer hands these strings to bitsandbytes unconverted (a float option then fails inside bitsandbytes);
    # memwrap converts them as torch's rmsprop does.
    typed = typed_optim_args(args, name, _RMSPROP_ARGS)
    return {"lr": args.learning_rate, **typed}


def rmsprop_group_keys(carried: dict) -> dict:
    """bitsandbytes' RMSprop keeps ``(alpha, momentum)`` as its groups' ``betas`` (its constructor packs them)."""
    if "alpha" in carried:
        carried["betas"] = (carried.pop("alpha"), 0)
    return carried


def check_rmsprop(hp: dict) -> None:
    """bitsandbytes' RMSprop kernels keep one state (the square average) and never read ``momentum``."""
    if hp.get("momentum"):
        raise ValueError(f"optimizer 'rmsprop_bnb': momentum={hp['momentum']!r} would be ignored: bitsandbytes' RMSprop "
                         "kernels have no momentum buffer (one state, the square average; Trainer passes it on and it "
                         "is dropped there). Fix: momentum=0, or optim='rmsprop' (torch's RMSprop has momentum).")


def ademamix_group_keys(carried: dict) -> dict:
    """AdamW's two betas are AdEMAMix's first two (fast EMA, second moment); the slow EMA's beta3 keeps its default
    (0.9999), as Trainer's ``optim="ademamix"`` does with ``adam_beta1/2``."""
    betas = carried.get("betas")
    if betas is not None and len(betas) == 2:
        carried["betas"] = (*betas, 0.9999)
    return carried


def _ademamix_kwargs(name: str, args) -> dict:
    given = typed_optim_args(args, name, _ADEMAMIX_ARGS)
    found = {"lr": args.learning_rate,
             "betas": (given.get("beta1", args.adam_beta1), given.get("beta2", args.adam_beta2), given.get("beta3", 0.9999)),
             "alpha": given.get("alpha", 5.0), "eps": given.get("eps", args.adam_epsilon)}
    found.update({k: given[k] for k in ("t_alpha", "t_beta3") if k in given})
    return found


_COMMON = dict(available=available, bind_model=bind_embeddings_32bit, devices=_8BIT_DEVICES,
               runs_on_fake=False, scaler_ok=True)
_ADAM_CARRIES = frozenset({"lr", "weight_decay", "betas", "eps"})
_PAGED_NOTE = ("state in CUDA unified memory, evicted to CPU under pressure (on CPU bitsandbytes falls back to "
               "ordinary state with a warning)")
_LION_NOTE = ("Lion usually wants a learning rate 3-10x smaller and a weight decay 3-10x larger than AdamW; its betas "
              "mean something else, so they take Lion's defaults (0.9, 0.99).")


def _spec(name: str, cls: str, n_states: int, n_maps: int, bits: int, trainer_kwargs, *, aliases=(), paged=False,
          carries=_ADAM_CARRIES, note: str = "", what: str = "", approximates: str | None = None,
          fixed: dict | None = None, **extra) -> OptimizerSpec:
    per = f"about {n_states} byte(s)/param" if bits == 8 else f"{4 * n_states} bytes/param"
    shown = f"{cls}({', '.join(f'{k}={v}' for k, v in fixed.items())})" if fixed else cls
    return OptimizerSpec(
        name=name, aliases=aliases, factory=_factory(cls, fixed), state_bytes=_state_bytes(n_states, bits),
        shared_state_bytes=_shared_bytes(n_maps) if bits == 8 else None, paged=paged, carries=carries,
        trainer_kwargs=trainer_kwargs, conversion_note=note, approximates=approximates,
        description=f"bitsandbytes {shown}: {what}{per} of state" + (f"; {_PAGED_NOTE}." if paged else "."),
        **{**_COMMON, **extra})


# AdamW's update with its two moments stored in 8 bits (block-wise) or paged: the planner's closest stand-ins for AdamW.
ADAMW_8BIT = _spec("adamw_8bit", "AdamW8bit", 2, 2, 8, _adamw_kwargs, aliases=("adamw_bnb_8bit", "bnb_adamw_8bit"),
                   approximates="adamw")
PAGED_ADAMW_8BIT = _spec("paged_adamw_8bit", "PagedAdamW8bit", 2, 2, 8, _adamw_kwargs, paged=True, approximates="adamw")
PAGED_ADAMW_32BIT = _spec("paged_adamw_32bit", "PagedAdamW32bit", 2, 0, 32, _adamw_kwargs, paged=True,
                          approximates="adamw")

# AdEMAMix keeps two EMAs of the gradient (fast and slow) and one of its square: three values per parameter.
_ADEMAMIX = dict(carries=frozenset({"lr", "weight_decay", "betas", "eps"}), group_keys=ademamix_group_keys,
                 optim_args=_ADEMAMIX_ARGS,
                 note="AdEMAMix's betas are three: your two become its fast EMA's and second moment's, the slow EMA's "
                      "beta3 and its alpha take AdEMAMix's defaults (0.9999, 5.0; optim_args='beta3=...,alpha=...' "
                      "sets them).",
                 what="two gradient EMAs and a second moment, ")
# Trainer builds bnb.optim.AdEMAMix(optim_bits=32, is_paged=...) for both 32-bit names: that class keeps its two EMAs in
# one (2, *shape) buffer and steps on CPU; bitsandbytes' AdEMAMix32bit / PagedAdEMAMix32bit allocate a single-EMA
# buffer and fail on every shape (bitsandbytes 0.50), so they are not used.
ADEMAMIX = _spec("ademamix", "AdEMAMix", 3, 0, 32, _ademamix_kwargs, aliases=("ademamix_32bit",),
                 fixed={"optim_bits": 32, "is_paged": False}, **_ADEMAMIX)
ADEMAMIX_8BIT = _spec("ademamix_8bit", "AdEMAMix8bit", 3, 2, 8, _ademamix_kwargs, **_ADEMAMIX)
PAGED_ADEMAMIX_32BIT = _spec("paged_ademamix_32bit", "AdEMAMix", 3, 0, 32, _ademamix_kwargs, paged=True,
                             fixed={"optim_bits": 32, "is_paged": True}, **_ADEMAMIX)
PAGED_ADEMAMIX_8BIT = _spec("paged_ademamix_8bit", "PagedAdEMAMix8bit", 3, 2, 8, _ademamix_kwargs, paged=True,
                            **_ADEMAMIX)

_LION = dict(carries=frozenset({"lr", "weight_decay"}), note=_LION_NOTE, what="one momentum, ")
LION_8BIT = _spec("lion_8bit", "Lion8bit", 1, 1, 8, _lion_kwargs, aliases=("bnb_lion_8bit",), **_LION)
LION_32BIT = _spec("lion_32bit", "Lion32bit", 1, 0, 32, _lion_kwargs, **_LION)
PAGED_LION_8BIT = _spec("paged_lion_8bit", "PagedLion8bit", 1, 1, 8, _lion_kwargs, paged=True, **_LION)
PAGED_LION_32BIT = _spec("paged_lion_32bit", "PagedLion32bit", 1, 0, 32, _lion_kwargs, paged=True, **_LION)

# bitsandbytes has no centered RMSprop (it raises for centered=True) and no momentum (its kernels never read it):
# neither is carried, so a conversion names them.
_RMSPROP = dict(carries=frozenset({"lr", "weight_decay", "eps", "alpha"}), group_keys=rmsprop_group_keys,
                optim_args=_RMSPROP_ARGS, check_hyperparameters=check_rmsprop, what="one square average, ")
RMSPROP_BNB = _spec("rmsprop_bnb", "RMSprop32bit", 1, 0, 32, _rmsprop_kwargs, aliases=("rmsprop_bnb_32bit",),
                    **_RMSPROP)
RMSPROP_BNB_8BIT = _spec("rmsprop_bnb_8bit", "RMSprop8bit", 1, 1, 8, _rmsprop_kwargs, **_RMSPROP)

ALL = [ADAMW_8BIT, PAGED_ADAMW_8BIT, PAGED_ADAMW_32BIT, ADEMAMIX, ADEMAMIX_8BIT, PAGED_ADEMAMIX_32BIT,
       PAGED_ADEMAMIX_8BIT, LION_8BIT, LION_32BIT, PAGED_LION_8BIT, PAGED_LION_32BIT, RMSPROP_BNB, RMSPROP_BNB_8BIT]


@hookimpl
def memwrap_optimizers():
    return list(ALL)
