"""Conformance kit for precision plugins: run :func:`check_precision` in your plugin's tests.

Re-exported as ``memwrap.testing.check_precision``.

Example (a whole test file of a third-party precision plugin)::

    from memwrap.testing import check_precision

    def test_my_precision_conforms():
        check_precision("my-fp32")

Each check raises ``AssertionError`` naming the precision, the check and the fix.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memwrap.precision.base import get_precision_class, normalize_precision_name, precisions

__all__ = ["check_precision", "PRECISION_CHECKS"]

PRECISION_CHECKS = ("spec", "train", "memory", "accumulate", "restore")


def _fail(name: str, check: str, message: str) -> AssertionError:
    return AssertionError(f"check_precision({name!r}) failed [{check}]: {message}")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 1))


def _batch(seed: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :1] * 2 - x[:, 1:2]


def check_precision(name: str, *, seed: int = 0, steps: int = 30, checks: tuple[str, ...] = PRECISION_CHECKS,
                    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
                    **wrap_options) -> None:
    """Assert that the precision registered as ``name`` behaves as memwrap expects, on CPU.

    Checks (select with ``checks=``): ``spec``: the class is valid, its name and every alias resolve
    to it and :func:`memwrap.precision.base.precisions` lists it; ``train``: behind ``memwrap.wrap`` a
    small regression learns, outputs come back fp32, parameters are stored in ``param_dtype`` and
    ``state_dict`` keys are unchanged; ``memory``: ``memory_per_param`` matches the bytes of the
    stored weights and gradients; ``accumulate``: with ``accumulate=2`` parameters change only at
    window ends; ``restore``: torch's process-wide matmul precision is back after ``unwrap``.
    ``make_optimizer(model)`` builds the optimizer (default AdamW, lr 1e-2); ``wrap_options`` go
    to ``wrap`` (e.g. ``compensation="none"``).

    Example:
        >>> check_precision("bf16")
    """
    import memwrap

    unknown = set(checks) - set(PRECISION_CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; valid: {', '.join(PRECISION_CHECKS)}")
    cls = get_precision_class(name)
    make_optimizer = make_optimizer or (lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    x, y = _batch(seed)

    def wrapped(accumulate: int = 1):
        model = _model(seed)
        keys = list(model.state_dict())
        wm, wo = memwrap.wrap(model, make_optimizer(model), precision=name, accumulate=accumulate, **wrap_options)
        return model, wm, wo, keys

    if "spec" in checks:
        for alias in (cls.name, *cls.aliases, cls.name.upper()):
            if get_precision_class(alias) is not cls:
                raise _fail(name, "spec", f"{alias!r} resolves to {get_precision_class(alias).__name__}, not {cls.__name__}")
        if cls.name not in {r.name for r in precisions()}:
            raise _fail(name, "spec", "memwrap.precision.base.precisions() does not list it")
        if any(normalize_precision_name(a) != a for a in cls.aliases):
            raise _fail(name, "spec", f"aliases must be lower case with '-' separators: {cls.aliases}")

    before = torch.get_float32_matmul_precision()
    if "train" in checks or "memory" in checks:
        model, wm, wo, keys = wrapped()
        losses = []
        for _ in range(steps):
            out = wm(x)
            if out.dtype != torch.float32:
                raise _fail(name, "train", f"the wrapped model returned {out.dtype}; floating outputs must come back fp32")
            loss = F.mse_loss(out, y)
            losses.append(loss.item())
            loss.backward()
            if "memory" in checks and len(losses) == 1:
                _check_memory(name, cls, wm._precision, model)
            wo.step()
            wo.zero_grad()
        expected = cls.param_dtype or torch.float32
        stored = {p.dtype for p in model.parameters()}
        if "train" in checks:
            if stored != {expected}:
                raise _fail(name, "train", f"parameters are stored in {stored}, param_dtype says {expected}")
            if list(model.state_dict()) != keys or list(wm.state_dict()) != keys:
                raise _fail(name, "train", "wrap() changed the model's state_dict keys; convert_module must work in place")
            if not min(losses[-5:]) < 0.5 * losses[0]:
                raise _fail(name, "train", f"loss did not halve in {steps} steps ({losses[0]:.4g} -> {losses[-1]:.4g})")
        memwrap.unwrap(wm)
    if "accumulate" in checks:
        model, wm, wo, _ = wrapped(accumulate=2)
        for micro in range(4):
            snapshot = [p.detach().clone() for p in model.parameters()]
            F.mse_loss(wm(x[micro::4]), y[micro::4]).backward()
            wo.step()
            wo.zero_grad()
            changed = any(not torch.equal(a, b) for a, b in zip(snapshot, model.parameters()))
            if changed != (micro % 2 == 1 and wo.did_update):
                raise _fail(name, "accumulate", f"micro-batch {micro}: parameters {'changed' if changed else 'kept'} "
                                                f"(did_update={wo.did_update}); they may change only at window ends")
        memwrap.unwrap(wm)
    if "restore" in checks and torch.get_float32_matmul_precision() != before:
        raise _fail(name, "restore", f"float32 matmul precision is {torch.get_float32_matmul_precision()!r} after unwrap, "
                                     f"was {before!r}: restore() must undo enable()")


def _check_memory(name: str, cls: type, precision, model: nn.Module) -> None:
    for pname, p in model.named_parameters():
        predicted = precision.memory_per_param(torch.empty_like(p, dtype=torch.float32, device="meta"))
        measured = {"weights": p.numel() * p.element_size(),
                    "grads": p.grad.numel() * p.grad.element_size() if p.grad is not None else None}
        if predicted["weights"] != measured["weights"] or (measured["grads"] is not None
                                                           and predicted["grads"] != measured["grads"]):
            raise _fail(name, "memory", f"memory_per_param predicts {predicted} for {pname} of the fp32 model, the "
                                        f"wrapped model stores {measured}; fix memory_per_param or param_dtype")

