"""Conformance kit for optimizer plugins: run :func:`check_optimizer` in your plugin's tests.

Example (a whole test file of a third-party plugin)::

    from memwrap.testing import check_optimizer

    def test_my_optimizer_conforms():
        check_optimizer("my_sgd", lr=0.05)

Each check raises ``AssertionError`` with a message naming the optimizer, the check and the fix.
"""
from __future__ import annotations

import copy
import io
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memwrap.plugin.calls import plugin_failure_of
from memwrap.plugin.manager import plugin_errors
from memwrap.plugin.registry import OptimizerUnavailableError, create_optimizer, get_optimizer_spec, spec_plugin
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes


__all__ = ["check_optimizer", "RegressionModel", "regression_batch", "CHECKS"]

CHECKS = ("spec", "loss", "state_dict", "state_bytes", "fake", "grad_scaler", "wrap")
# Not selectable: whatever checks run, a failure of the plugin itself (a spec method that raised or broke its
# contract, recorded in memwrap.plugin.manager.plugin_errors(), before or during the checks) fails as [plugin].
PLUGIN_CHECK = "plugin"


class RegressionModel(nn.Module):
    """A small regression with an embedding (so per-module settings such as 32-bit embedding state
    are exercised) and weights above bitsandbytes' 8-bit threshold of 4096 values."""

    def __init__(self, vocab: int = 32, dim: int = 128, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.embed(ids)))).squeeze(-1)


def regression_batch(n: int = 64, vocab: int = 32, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a fixed target per token: a problem any working optimizer makes progress on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n,), generator=g)
    table = torch.randn(vocab, generator=g)
    return ids.to(device), table[ids].to(device)


def _fail(name: str, check: str, message: str) -> AssertionError:
    return AssertionError(f"check_optimizer({name!r}) failed [{check}]: {message}")


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _train(model, opt, batch, steps: int) -> list[float]:
    ids, y = batch
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(ids), y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses


def check_optimizer(name: str, *, device: str | torch.device = "cpu", steps: int = 40, seed: int = 0,
                    checks: tuple[str, ...] = CHECKS, model_factory: Callable[[], nn.Module] | None = None,
                    **hyperparameters) -> None:
    """Assert that the optimizer registered as ``name`` behaves as memwrap expects.

    Checks (select with ``checks=``): the spec is available and its aliases resolve; it lowers the
    loss of a small regression; ``state_dict`` round-trips through ``torch.save`` and
    ``torch.load(weights_only=True)`` to bit-identical training; ``state_bytes`` predicts the
    measured state after the first step within 1%; the step runs on FakeTensors when the spec
    says so; with fp16 ``GradScaler`` an inf gradient skips the update and finite ones apply it
    (when ``scaler_ok``); behind ``memwrap.wrap(accumulate=2, precision="fp16")`` the
    parameters change only at window ends. A failure of the plugin inside a check (``state_bytes``
    raising, a factory returning no optimizer, ...) fails that check naming the plugin; a failure of
    one of the spec's methods recorded in :func:`memwrap.plugin.manager.plugin_errors` (even one swallowed
    elsewhere, e.g. ``available`` raising while ``memwrap.optimizers()`` listed it) fails ``[plugin]``.

    Example:
        >>> check_optimizer("adamw", lr=1e-2)
    """

    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise ValueError(f"unknown checks {sorted(unknown)}; valid: {', '.join(CHECKS)}")
    spec = get_optimizer_spec(name)
    device = torch.device(device)
    factory = model_factory or RegressionModel

    def fresh(move: bool = True) -> nn.Module:
        torch.manual_seed(seed)
        model = factory()
        return model.to(device) if move else model

    ok, hint = spec.available()
    _check_plugin_failures(name, spec)
    if not ok:
        raise OptimizerUnavailableError(f"check_optimizer({name!r}): optimizer not available: {hint}")
    if device.type not in spec.devices:
        raise _fail(name, "spec", f"device {device.type!r} is not in the spec's devices {spec.devices}")
    ctx = dict(name=name, spec=spec, device=device, steps=steps, seed=seed, fresh=fresh, hp=hyperparameters)
    for check in CHECKS:
        if check in checks:
            try:
                _CHECK_FUNCS[check](**ctx)
            except AssertionError:
                raise
            except Exception as exc:
                failure = plugin_failure_of(exc)
                if failure is None:
                    raise
                raise _fail(name, check, failure.error) from exc
    _check_plugin_failures(name, spec)


def _check_plugin_failures(name, spec) -> None:
    plugin = spec_plugin(spec)
    mine = [e for e in plugin_errors() if e.name == plugin and (e.hook or "").startswith(f"{spec.name}.")]
    if mine:
        raise _fail(name, PLUGIN_CHECK, "the plugin failed: " + " | ".join(e.error for e in mine))


def _create(name, model, hp):
    return create_optimizer(name, model.parameters(), model=model, **hp)


def _check_spec(name, spec, **_):
    for alias in spec.names:
        if get_optimizer_spec(alias) is not spec:
            raise _fail(name, "spec", f"alias {alias!r} resolves to another spec")


def _check_loss(name, spec, device, steps, seed, fresh, hp):
    model = fresh()
    losses = _train(model, _create(name, model, hp), regression_batch(seed=seed, device=device), steps)
    first, last = losses[0], min(losses[-5:])
    if not all(torch.isfinite(torch.tensor(losses))):
        raise _fail(name, "loss", f"non-finite loss during training: {losses}")
    if not last < 0.9 * first:
        raise _fail(name, "loss", f"loss did not drop by 10% in {steps} steps ({first:.4g} -> {last:.4g}) with "
                                  f"hyperparameters {hp}; raise lr or steps, or fix the update rule")


def _check_state_dict(name, spec, device, steps, seed, fresh, hp):
    batch = regression_batch(seed=seed, device=device)
    model = fresh()
    opt = _create(name, model, hp)
    _train(model, opt, batch, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    try:
        loaded = torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise _fail(name, "state_dict", f"torch.load(weights_only=True) cannot read the state_dict: {exc}") from exc
    twin = copy.deepcopy(model)
    twin_opt = _create(name, twin, hp)
    twin_opt.load_state_dict(loaded)
    _train(model, opt, batch, 3)
    _train(twin, twin_opt, batch, 3)
    for (pname, a), b in zip(model.named_parameters(), twin.parameters()):
        if not torch.equal(a, b):
            diff = (a - b).abs().max().item()
            raise _fail(name, "state_dict", f"after load_state_dict, training diverges from the original on "
                                            f"{pname} (max abs diff {diff:.3g}): some state is not saved or restored")


def _check_state_bytes(name, spec, device, steps, seed, fresh, hp):
    model = fresh()
    predicted = predict_state_bytes(name, model, **hp)
    opt = _create(name, model, hp)
    _train(model, opt, regression_batch(seed=seed, device=device), 1)
    measured = measure_state_bytes(opt)
    if abs(measured - predicted) > 0.01 * max(measured, 1):
        raise _fail(name, "state_bytes", f"state_bytes predicts {predicted} bytes, the optimizer holds {measured} "
                                         "bytes after the first step (unique storages); fix the spec's state_bytes "
                                         "(or shared_state_bytes)")


def _check_fake(name, spec, device, steps, seed, fresh, hp):
    if not spec.runs_on_fake:
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = fresh(move=False)  # FakeTensorMode cannot swap parameters in place
            opt = _create(name, model, hp)
            ids, y = regression_batch(seed=seed)
            F.mse_loss(model(ids), y).backward()  # no .item(): fake tensors have no values
            opt.step()
            held = {id(t): t.numel() * t.element_size()
                    for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)}
            predicted = predict_state_bytes(name, model, **hp)
    except Exception as exc:
        raise _fail(name, "fake", f"spec says runs_on_fake=True but a step on FakeTensors failed: "
                                  f"{type(exc).__name__}: {exc}. Set runs_on_fake=False") from exc
    if abs(sum(held.values()) - predicted) > 0.01 * max(predicted, 1):
        raise _fail(name, "fake", f"on FakeTensors the state holds {sum(held.values())} bytes, state_bytes predicts "
                                  f"{predicted}")


def _check_grad_scaler(name, spec, device, steps, seed, fresh, hp):
    if not spec.scaler_ok:
        return
    model = fresh()
    opt = _create(name, model, hp)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 10)
    ids, y = regression_batch(seed=seed, device=device)
    for step in range(4):
        before = _params(model)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.mse_loss(model(ids).float(), y)
        scaler.scale(loss).backward()
        if step == 3:
            next(model.parameters()).grad.fill_(float("inf"))
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        finite = all(torch.isfinite(p).all() for p in model.parameters())
        if not finite:
            raise _fail(name, "grad_scaler", f"non-finite parameters after GradScaler step {step}")
        if step == 3 and (changed or scaler.get_scale() >= scale):
            raise _fail(name, "grad_scaler", "an inf gradient did not skip the update (the optimizer must leave "
                                             "parameters alone when GradScaler finds inf); set scaler_ok=False")
        if step < 3 and not changed and scaler.get_scale() >= scale:
            raise _fail(name, "grad_scaler", f"finite gradients at step {step} did not update the parameters")


def _check_wrap(name, spec, device, steps, seed, fresh, hp):
    import memwrap

    model = fresh()
    opt = _create(name, model, hp)
    precision = "fp16" if spec.scaler_ok else "fp32"
    # An optimizer that updates inside backward cannot accumulate (wrap() refuses it): then each batch is a window.
    micro_batches = (slice(0, 64),) if spec.updates_in_backward else (slice(0, 32), slice(32, 64))
    last = len(micro_batches) - 1
    wmodel, wopt = memwrap.wrap(model, opt, accumulate=len(micro_batches), precision=precision)
    ids, y = regression_batch(n=64, seed=seed, device=device)
    windows, losses = 12, []
    for window in range(windows):
        for micro, sl in enumerate(micro_batches):
            before = _params(model)
            loss = F.mse_loss(wmodel(ids[sl]).float(), y[sl])
            losses.append(loss.item())
            loss.backward()
            wopt.step()
            wopt.zero_grad()
            changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
            if micro < last and changed:
                raise _fail(name, "wrap", f"parameters changed in the middle of accumulation window {window}")
            if micro == last and changed != bool(wopt.did_update):
                raise _fail(name, "wrap", f"window {window}: did_update={wopt.did_update} but parameters "
                                          f"{'changed' if changed else 'did not change'}")
    if wopt.updates + wopt.skipped != windows or wopt.updates < windows // 2:
        raise _fail(name, "wrap", f"{wopt.updates} updates and {wopt.skipped} skipped in {windows} windows")
    if not min(losses[-4:]) < losses[0]:
        raise _fail(name, "wrap", f"loss did not drop behind memwrap.wrap ({losses[0]:.4g} -> {losses[-1]:.4g})")


_CHECK_FUNCS = {"spec": _check_spec, "loss": _check_loss, "state_dict": _check_state_dict,
                "state_bytes": _check_state_bytes, "fake": _check_fake, "grad_scaler": _check_grad_scaler,
                "wrap": _check_wrap}
