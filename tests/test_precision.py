"""Mixed precision on CPU: bf16 and fp16 (with GradScaler) learn; non-finite updates are skipped."""
import copy
import math

import pytest
import torch

import memwrap
from tests.conftest import max_rel_err


def regression_task(seed=0, n=256):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    w = torch.randn(8, 1, generator=gen)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=gen)


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32", "fp32"])
def test_precision_learns_small_task(precision):
    x, y = regression_task()
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match="tf32") if precision == "tf32" else _nothing():
        m, o = memwrap.wrap(model, opt, precision=precision, accumulate=2)
    first = last = None
    for epoch in range(20):
        for xb, yb in zip(x.split(32), y.split(32)):
            out = m(xb)
            assert out.dtype == torch.float32
            loss = torch.nn.functional.mse_loss(out, yb)
            loss.backward()
            o.step()
            o.zero_grad()
            first = first if first is not None else loss.item()
            last = loss.item()
    assert last < 0.1 * first, (first, last)
    assert o.skipped <= 3  # fp16 may skip a few while the scale calibrates downward
    memwrap.unwrap(m)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bf16_forward_runs_under_autocast():
    seen = []

    class Probe(torch.nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            seen.append(out.dtype)
            return out

    model = Probe(4, 4)
    m = memwrap.wrap(model, precision="bf16")
    assert m(torch.randn(2, 4)).dtype == torch.float32
    assert seen == [torch.bfloat16]


def test_fp16_gradients_carry_the_loss_scale_and_unscale_to_big_batch():
    x, y = regression_task(n=8)
    model = mlp()
    ref = copy.deepcopy(model)
    # Small loss, so that 2**16 x gradient stays inside fp16's range (no overflow-skip here).
    (torch.nn.functional.mse_loss(ref(x), y) * 1e-3).backward()

    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp16", accumulate=2)
    for xb, yb in zip(x.split(4), y.split(4)):
        (torch.nn.functional.mse_loss(m(xb), yb) * 1e-3).backward()
    scale = o.scaler.get_scale()
    assert scale == 2.0**16
    grads = [p.grad / scale for p in model.parameters()]
    # fp16 matmuls: agreement to fp16 precision, not bitwise.
    assert max_rel_err(grads, [p.grad for p in ref.parameters()]) < 2e-2


def test_injected_inf_under_fp16_skips_update_and_scheduler():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    m, o, s = memwrap.wrap(model, opt, sched, precision="fp16", accumulate=2)
    before = [p.detach().clone() for p in model.parameters()]
    scale = o.scaler.get_scale() if o.scaler._scale is not None else 2.0**16
    for i in range(2):
        out = m(torch.randn(4, 8))
        loss = out.mean() * (float("inf") if i == 1 else 1.0)
        loss.backward()
        o.step()
        s.step()
        o.zero_grad()
    assert o.step_was_skipped and not o.did_update and o.skipped == 1 and o.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert opt.param_groups[0]["lr"] == 0.1 and sched.last_epoch == 0
    assert o.scaler.get_scale() < scale  # the scaler backed off
    # The next clean window updates and the scheduler moves.
    for _ in range(2):
        m(torch.randn(4, 8)).mean().backward()
        o.step()
        s.step()
        o.zero_grad()
    assert o.did_update and o.updates == 1 and sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_skips_in_every_precision_and_can_raise(precision):
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision)
    before = [p.detach().clone() for p in model.parameters()]
    (m(torch.randn(2, 8)).sum() * float("nan")).backward()
    o.step()
    assert o.step_was_skipped and o.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    model2 = mlp()
    m2, o2 = memwrap.wrap(model2, torch.optim.SGD(model2.parameters(), lr=0.1), precision=precision, on_nonfinite="raise")
    (m2(torch.randn(2, 8)).sum() * float("inf")).backward()
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        o2.step()


def test_clipping_uses_unscaled_gradients_under_fp16():
    x, y = regression_task(n=8)
    model = mlp()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    (torch.nn.functional.mse_loss(ref(x), y) * 1e-3).backward()
    norm = float(torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()]))
    max_norm = norm / 3  # clipping must actually bite
    torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_opt.step()

    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", max_grad_norm=max_norm)
    (torch.nn.functional.mse_loss(m(x), y) * 1e-3).backward()
    o.step()
    assert o.did_update
    assert math.isclose(o.last_grad_norm, norm, rel_tol=2e-2)
    assert max_rel_err(model.parameters(), ref.parameters()) < 1e-3


def test_unsupported_autocast_device_is_a_clear_error():
    model = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(ValueError, match="needs autocast.*precision='fp32'"):
        memwrap.wrap(model, precision="bf16")


def test_tf32_is_restored_by_unwrap():
    before = torch.get_float32_matmul_precision()
    with pytest.warns(UserWarning, match="plain fp32"):
        m = memwrap.wrap(torch.nn.Linear(2, 2), precision="tf32")
    assert torch.get_float32_matmul_precision() == "high"
    memwrap.unwrap(m)
    assert torch.get_float32_matmul_precision() == before
