"""on_nonfinite="raise": a caught error leaves the run clean; fp16 overflows are the scaler's; GradScaler settings."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memwrap


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def data(n=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 8, generator=gen), torch.randn(n, 4, 1, generator=gen)


def test_a_caught_error_leaves_the_next_windows_clean_and_equal_to_a_run_without_that_window():
    xs, ys = data()
    poisoned = 2  # window index (accumulate=2: micro-batches 4 and 5)
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), accumulate=2,
                        on_nonfinite="raise")
    errors = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        loss = torch.nn.functional.mse_loss(m(x), y)
        if i // 2 == poisoned and i % 2 == 0:
            loss = loss * float("nan")
        loss.backward()
        try:
            o.step()
        except FloatingPointError as err:  # the loop goes on; its zero_grad() is skipped, as in a real loop
            errors.append(str(err))
            continue
        o.zero_grad()

    # Reference: a plain torch loop that never saw the poisoned window.
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i // 2 == poisoned:
            continue
        (torch.nn.functional.mse_loss(ref(x), y) / 2).backward()
        if i % 2 == 1:
            ref_opt.step()
            ref_opt.zero_grad()

    assert len(errors) == 1 and o.updates == 5 and o.skipped == 1
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert o.gate.micro_step == 0


@settings(max_examples=8, deadline=None)
@given(accumulate=st.integers(1, 3), windows=st.integers(2, 5), data_=st.data())
def test_raise_and_continue_equals_a_run_without_the_bad_windows(accumulate, windows, data_):
    bad = data_.draw(st.sets(st.integers(0, windows - 1), max_size=windows))
    where = {w: data_.draw(st.integers(0, accumulate - 1)) for w in bad}  # which micro-batch holds the NaN
    xs, ys = data(n=accumulate * windows, seed=windows)
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=accumulate,
                        on_nonfinite="raise")
    raised = 0
    for i, (x, y) in enumerate(zip(xs, ys)):
        w = i // accumulate
        loss = torch.nn.functional.mse_loss(m(x), y) * (float("nan") if where.get(w) == i % accumulate else 1.0)
        loss.backward()
        try:
            o.step()
        except FloatingPointError:
            raised += 1
            continue
        o.zero_grad()
    ref = mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if i // accumulate in bad:
            continue
        (torch.nn.functional.mse_loss(ref(x), y) / accumulate).backward()
        if i % accumulate == accumulate - 1:
            ref_opt.step()
            ref_opt.zero_grad()
    assert raised == o.skipped == len(bad) and o.updates == windows - len(bad)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_message_counts_the_window_that_failed():
    xs, ys = data(n=6)
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), on_nonfinite="raise")
    messages = {}
    for i, (x, y) in enumerate(zip(xs, ys)):
        loss = torch.nn.functional.mse_loss(m(x), y) * (float("inf") if i in (2, 4) else 1.0)
        loss.backward()
        try:
            o.step()
        except FloatingPointError as err:
            messages[i + 1] = str(err)
            continue
        o.zero_grad()
    assert sorted(messages) == [3, 5]
    assert re.search(r"\bwindow 3\b", messages[3]) and "2 updates applied" in messages[3]
    assert re.search(r"\bwindow 5\b", messages[5]) and "3 updates applied" in messages[5]
    assert o.updates == 4 and o.skipped == 2


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def overflowing_run(on_nonfinite, steps=12, scale_loss=16.0, scaler=None, device="cpu"):
    """fp16 where the first windows overflow at the default scale 2**16 (the output gradient is 16 * scale)."""
    xs, ys = (t.to(device) for t in data(n=steps))
    model = mlp().to(device)
    options = {} if scaler is None else {"scaler": scaler}
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16",
                        on_nonfinite=on_nonfinite, **options)
    skipped_at = []
    for x, y in zip(xs, ys):
        (m(x).sum() * scale_loss).backward()
        o.step()
        if o.step_was_skipped:
            skipped_at.append(o.gate.windows)
        o.zero_grad()
    return o, skipped_at, model


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_warm_up_overflows_do_not_raise_and_match_skip_mode(device):
    o_raise, skipped_raise, model_raise = overflowing_run("raise", device=device)
    o_skip, skipped_skip, model_skip = overflowing_run("skip", device=device)
    assert len(skipped_raise) >= 3 and skipped_raise == skipped_skip  # the scaler absorbed them, as with "skip"
    assert o_raise.updates == o_skip.updates > 0
    for a, b in zip(model_raise.parameters(), model_skip.parameters()):
        assert torch.equal(a, b)
    assert o_raise.scaler.get_scale() == o_skip.scaler.get_scale() < 2.0**16


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_raises_once_the_scale_reached_its_floor_and_the_run_can_go_on(device):
    xs, ys = (t.to(device) for t in data(n=8))
    model = mlp().to(device)
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16",
                        on_nonfinite="raise", scaler={"init_scale": 4.0})
    outcomes = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        loss = m(x).sum() * (float("nan") if i < 4 else 1.0)
        loss.backward()
        try:
            o.step()
        except FloatingPointError as err:
            outcomes.append(str(err))
            continue
        outcomes.append("skipped" if o.step_was_skipped else "updated")
        o.zero_grad()
    # Scales 4 and 2 are the scaler's to absorb; at the floor (1.0) a non-finite window is an error, and so is
    # the next one (0.5). Clean windows then update, from a clean gradient.
    assert outcomes[:2] == ["skipped", "skipped"]
    assert "window 3" in outcomes[2] and "loss scale 1" in outcomes[2] and "3 consecutive" in outcomes[2]
    assert "window 4" in outcomes[3]
    assert outcomes[4:] == ["updated"] * 4 and o.updates == 4 and o.skipped == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_scaler_settings_reach_the_grad_scaler():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16",
                        scaler={"init_scale": 2.0**10, "growth_interval": 3, "growth_factor": 4.0, "backoff_factor": 0.25})
    xs, ys = data(n=4)
    scales = []
    for x, y in zip(xs, ys):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()
        scales.append(o.scaler.get_scale())
    assert scales == [2.0**10, 2.0**10, 2.0**12, 2.0**12]  # grows x4 after 3 clean updates
    assert o.scaler.state_dict()["backoff_factor"] == 0.25


@pytest.mark.parametrize("options,match", [
    ({"precision": "bf16", "scaler": {"init_scale": 8.0}}, r"scaler=.*only.*precision='fp16'"),
    ({"scaler": {"init_scale": 8.0}}, r"scaler=.*only.*precision='fp16'"),
    ({"precision": "fp16", "scaler": {"init_scal": 8.0}}, r"unknown GradScaler setting 'init_scal'.*'init_scale'"),
    ({"precision": "fp16", "scaler": {"init_scale": -1.0}}, r"init_scale must be a finite number > 0"),
    ({"precision": "fp16", "scaler": {"growth_factor": 1.0}}, r"growth_factor must be a number > 1"),
    ({"precision": "fp16", "scaler": {"backoff_factor": 1.5}}, r"backoff_factor must be a number in \(0, 1\)"),
    ({"precision": "fp16", "scaler": {"growth_interval": 0}}, r"growth_interval must be an int >= 1"),
    ({"precision": "fp16", "scaler": 1024}, r"scaler must be a dict"),
])
def test_bad_scaler_settings_are_refused_with_the_fix(options, match):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with pytest.raises(ValueError, match=match):
        memwrap.wrap(model, opt, **options)


def test_scaler_settings_with_the_hugging_face_fp16_flag():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), fp16=True, scaler={"init_scale": 8.0})
    assert o.scaler.get_scale() == 8.0


def test_an_error_inside_the_inner_step_leaves_the_scaler_usable():
    # Anything raised by the inner optimizer (a step hook, a kernel, an out-of-memory) must not leave the GradScaler
    # between unscale_() and update(): every later window's unscale_() would then fail.
    xs, ys = data(n=3)
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), precision="fp16",
                        scaler={"init_scale": 1024.0})  # no overflow: every window reaches the inner step
    calls = []

    def fail_once(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")

    o.register_step_pre_hook(fail_once)
    torch.nn.functional.mse_loss(m(xs[0]), ys[0]).backward()
    with pytest.raises(RuntimeError, match="injected"):
        o.step()
    o.zero_grad()
    for x, y in zip(xs[1:], ys[1:]):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()
    assert o.updates == 2 and len(calls) == 3


def test_step_was_skipped_is_about_the_last_step_call_only():
    # accumulate=2; window 2 (micro-batches 2 and 3) is non-finite. The step() of micro-batch 4 closes no window,
    # so it skipped nothing: the documented meaning ("the last step() closed a window whose update was skipped").
    xs, ys = data(n=4)
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    flags = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        loss = torch.nn.functional.mse_loss(m(x), y) * (float("nan") if i == 2 else 1.0)
        loss.backward()
        o.step()
        flags.append(o.step_was_skipped)
        o.zero_grad()
    assert flags == [False, False, False, True]
    m(xs[0]).sum().backward()
    o.step()
    assert o.step_was_skipped is False and o.did_update is False
