"""A refused load_state_dict changes nothing: every check runs before the first piece of state is loaded."""
import copy

import pytest
import torch

import memwrap

try:
    import bitsandbytes as bnb
except Exception:  # not installed, or no usable backend
    bnb = None


def mlp(seed=0, width=16):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


def train(m, o, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()


def snapshot(obj):
    return copy.deepcopy(obj.state_dict())


def assert_same(a, b, path="state"):
    """Bit-identical nested state: tensors with torch.equal, everything else with ==."""
    assert type(a) is type(b), path
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def setup(optimizer="adamw", accumulate=2, precision="fp32", width=16, steps=3, seed=0):
    model = mlp(seed, width)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = memwrap.create_optimizer(optimizer, model.parameters(), lr=1e-2)
    m, o = memwrap.wrap(model, opt, accumulate=accumulate, precision=precision)
    train(m, o, steps, seed=seed + 1)
    return m, o


def refused(o, state, match, *, model=None):
    before = snapshot(o)
    params = [p.detach().clone() for g in o.param_groups for p in g["params"]]
    grads = [None if p.grad is None else p.grad.clone() for g in o.param_groups for p in g["params"]]
    with pytest.raises(ValueError, match=match):
        o.load_state_dict(state)
    assert_same(snapshot(o), before)
    after = [p for g in o.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(params, after))
    assert all((g is None and p.grad is None) or torch.equal(g, p.grad) for g, p in zip(grads, after))


def test_a_different_accumulate_is_refused_before_the_inner_optimizer_is_touched():
    _, saved = setup(accumulate=2, steps=4)
    _, o = setup(accumulate=4, steps=5, seed=3)  # mid-window (micro-step 1): partial gradients too
    assert o.gate.micro_step == 1
    refused(o, saved.state_dict(), r"accumulate=2.*accumulate=4")


def test_adamw_state_into_sgd_is_refused_naming_both():
    _, saved = setup("adamw")
    _, o = setup("sgd", seed=3)
    refused(o, saved.state_dict(), r"AdamW.*SGD")


def test_a_checkpoint_without_the_class_record_is_still_checked_by_its_state_keys():
    _, saved = setup("adamw")
    _, o = setup("sgd", seed=3)
    state = saved.state_dict()
    del state["optimizer_class"]  # a checkpoint from before the record existed
    refused(o, state, r"exp_avg.*momentum_buffer")


@pytest.mark.skipif(bnb is None, reason="bitsandbytes not installed")
def test_8bit_state_into_adamw_is_refused():
    _, saved = setup("adamw_8bit")
    _, o = setup("adamw", seed=3)
    refused(o, saved.state_dict(), r"AdamW8bit.*AdamW")


def test_a_different_model_shape_is_refused_before_anything_is_loaded():
    _, saved = setup("sgd", width=16, steps=3)  # mid-window: accumulated gradients saved
    _, o = setup("sgd", width=12, steps=3, seed=3)
    refused(o, saved.state_dict(), r"shape")


def test_partial_gradients_that_do_not_fit_are_refused():
    _, saved = setup("sgd", width=16, steps=3)
    state = saved.state_dict()
    assert state["accumulated_grads"] is not None
    state["accumulated_grads"] = state["accumulated_grads"][:-1]
    _, o = setup("sgd", width=16, steps=2, seed=3)
    refused(o, state, r"4 parameters.*3 gradients|gradients for 3 parameters")


def test_a_broken_scaler_state_is_refused_before_the_optimizer_is_loaded():
    _, saved = setup("sgd", precision="fp16")
    state = saved.state_dict()
    del state["scaler"]["growth_interval"]
    _, o = setup("sgd", precision="fp16", seed=3)
    refused(o, state, r"scaler.*growth_interval")


def test_a_good_state_still_loads_exactly():
    m1, saved = setup("adamw", steps=5)
    state = copy.deepcopy(saved.state_dict())
    _, o = setup("adamw", steps=3, seed=3)
    o.load_state_dict(state)
    assert_same(snapshot(o), snapshot(saved))


def test_the_scheduler_refuses_another_schedulers_state_and_changes_nothing():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    m, o, s = memwrap.wrap(model, opt, step_lr, accumulate=2)
    train(m, o, 4)
    s.step()

    model2 = mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    m2, o2, s2 = memwrap.wrap(model2, opt2, cosine, accumulate=2)
    for state, match in [(s.state_dict(), r"StepLR.*CosineAnnealingLR"), (step_lr.state_dict(), r"step_size.*T_max")]:
        before = snapshot(s2)
        with pytest.raises(ValueError, match=match):
            s2.load_state_dict(state)
        assert_same(snapshot(s2), before)
    # The matching scheduler's state (wrapped or plain) loads.
    s2_ok = memwrap.wrap(torch.optim.lr_scheduler.StepLR(o2, step_size=5))
    s2_ok.load_state_dict(s.state_dict())
    assert s2_ok.step_size == 2


def test_the_scheduler_refuses_a_state_for_another_number_of_param_groups():
    model = mlp()
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1)
    m, o, s = memwrap.wrap(model, opt, torch.optim.lr_scheduler.StepLR(opt, 2))
    model2 = mlp()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    m2, o2, s2 = memwrap.wrap(model2, opt2, torch.optim.lr_scheduler.StepLR(opt2, 2))
    before = snapshot(s2)
    with pytest.raises(ValueError, match=r"2 parameter groups.*1"):
        s2.load_state_dict(s.state_dict())
    assert_same(snapshot(s2), before)
