"""A loss that reaches the model's parameters other than through its outputs is refused where the output hooks would
get it wrong (accumulation's weighting, fp16's loss scale, the norm pass's norm), before any gradient is accumulated;
every loss built from the outputs alone goes on, exactly as before. memwrap.backward is the fix and is exact."""
from __future__ import annotations

import contextlib
import copy
import threading

import pytest
import torch
import torch.nn.functional as F

import memwrap
from memwrap.runtime.loss_graph import backward_roots, bypassing, walk
from memwrap.testing.optimizer import RegressionModel, regression_batch

CLIP = 0.05


def net(seed=0, out=2):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, out))


def _penalty(mod):
    return 1e-2 * sum(p.square().sum() for p in mod.parameters())


class Kept(torch.nn.Module):
    """Keeps a hidden tensor on itself (an auxiliary loss a model stores instead of returning it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        self.aux = h.square().mean()
        return self.b(h)


BYPASSES = {
    # name: (model factory, loss of (wrapped model, inner model, x)), the parameter the message names first
    "penalty on every parameter": (net, lambda m, inner, x: m(x).square().mean() + _penalty(inner), None),
    "head applied outside the model": (net, lambda m, inner, x: (m(x) @ inner[2].weight).square().mean(), "2.weight"),
    "a kept tensor": (Kept, lambda m, inner, x: m(x).square().mean() + inner.aux, None),
}


def _grads(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("case", sorted(BYPASSES))
@pytest.mark.parametrize("options", [dict(accumulate=2), dict(precision="fp16")],
                         ids=["accumulate", "fp16"])
def test_a_loss_around_the_outputs_is_refused_before_any_gradient_and_memwrap_backward_is_exact(case, options):
    build, loss_of, first = BYPASSES[case]
    model = build()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), **options)
    chunks = x.split(4) if options.get("accumulate", 1) > 1 else (x,)
    before = _grads(model)
    with pytest.raises(RuntimeError, match=r"This backward reaches parameter .* other than through the wrapped "
                                           r"model's outputs.*Nothing was accumulated.*Fix: finish this loss with "
                                           r"memwrap.backward\(loss, model\)"):
        loss_of(m, model, chunks[0]).backward()
    assert _grads(model) == before  # nothing accumulated (all None)
    if first is not None:
        with pytest.raises(RuntimeError, match=f"parameter {first!r}"):
            loss_of(m, model, chunks[0]).backward()

    # The fix: memwrap.backward weights (and scales) the whole loss once; the big-batch gradient, exactly. (Its fp16
    # equivalence with torch AMP is proved in test_loop_shapes.)
    for c in chunks:
        memwrap.backward(loss_of(m, model, c), m)
    if "fp16" in options.values():
        assert all(p.grad is not None for p in model.parameters())  # scaled; an overflow is the scaler's to skip
        return
    model.zero_grad(set_to_none=True)
    sum(loss_of(ref, ref, c) / len(chunks) for c in chunks).backward()
    for c in chunks:
        memwrap.backward(loss_of(m, model, c), m)
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7)


LEGITIMATE = {
    "loss from the outputs": lambda m, x: F.mse_loss(m(x), torch.ones(len(x), 4)),
    "two calls of the model": lambda m, x: (m(x[:2]) - m(x[2:])).square().mean(),
    "the output fed back in": lambda m, x: m(m(x)).square().mean(),
    "unweighted gradient penalty": None,
}


@pytest.mark.parametrize("case", sorted(LEGITIMATE))
def test_losses_built_from_the_outputs_alone_go_on_exactly(case):
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2), requires_grad=case.startswith("unweighted"))
    model = net(out=4)  # square, so that an output can be fed back in unchanged
    ref = copy.deepcopy(model)
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)

    def loss(mod, inputs, unweighted):
        if case.startswith("unweighted"):  # torch.autograd.grad through the model, then an ordinary backward
            with unweighted():
                (g,) = torch.autograd.grad(mod(inputs).sum(), inputs, create_graph=True)
            return mod(inputs).square().mean() + g.square().sum()
        return LEGITIMATE[case](mod, inputs)

    (loss(ref, x, contextlib.nullcontext) / 2).backward()
    if case.startswith("unweighted"):
        memwrap.backward(loss(m, x, m.unweighted), m)
    else:
        loss(m, x, m.unweighted).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)


def test_a_bypass_is_harmless_without_weighting_and_goes_on():
    """accumulate=1 in fp32: the output hooks change nothing, so a penalty's gradient is already exact."""
    model = net()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 4)
    m, _ = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp32")
    (m(x).square().mean() + _penalty(model)).backward()
    (ref(x).square().mean() + _penalty(ref)).backward()
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, r.grad)


# --- the norm pass: a penalty on a parameter that the outputs also reach (was clipped with the outputs' norm) -----

def _norm_pass_model(accumulate):
    torch.manual_seed(0)
    model = RegressionModel()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=accumulate,
                        step_in_backward=True, max_grad_norm=CLIP)
    return model, m, o


def _loss(m, model, ids, y):
    return F.mse_loss(m(ids), y) + 1e-2 * model.fc1.weight.square().sum()


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_norm_pass_refuses_a_penalty_the_outputs_also_reach_before_any_update(accumulate):
    model, m, o = _norm_pass_model(accumulate)
    ids, y = regression_batch()
    chunks = list(zip(ids.chunk(accumulate), y.chunk(accumulate)))
    for ids_mb, y_mb in chunks[:-1]:
        memwrap.backward(_loss(m, model, ids_mb, y_mb), m)
        o.step()
    params = [p.detach().clone() for p in model.parameters()]
    grads = _grads(model)
    want = "the norm taken from the outputs would miss" if accumulate == 1 else "would not be weighted"
    with pytest.raises(RuntimeError, match=f"parameter 'fc1.weight'.*other than through the.*outputs.*{want}.*"
                                           r"Fix: finish this loss with memwrap.backward\(loss, model\)"):
        _loss(m, model, *chunks[-1]).backward()
    for p, w, g, g0 in zip(model.parameters(), params, _grads(model), grads):
        assert torch.equal(p, w)  # nothing was updated
        assert (g is None and g0 is None) or torch.equal(g, g0)  # the earlier micro-batches' gradients are as they were

    # Going on with the fix from here: the plain clipped loop's parameters.
    memwrap.backward(_loss(m, model, *chunks[-1]), m)
    o.step()
    torch.manual_seed(0)
    ref = RegressionModel()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for ids_mb, y_mb in chunks:
        (_loss(ref, ref, ids_mb, y_mb) / accumulate).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    ref_opt.step()
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


# --- the pieces ----------------------------------------------------------------------------------------------------

def test_walk_stops_below_the_stop_nodes_and_respects_its_budget():
    w = torch.ones(3, requires_grad=True)
    h = (w * 2).exp()
    loss = (h * w).sum()
    stop = h.grad_fn
    names = [type(n).__name__ for n in walk([loss.grad_fn], stop=lambda n: n.metadata is stop.metadata)]
    assert names.count("AccumulateGrad") == 1 and "MulBackward0" in names and "ExpBackward0" in names
    assert len(names) == 4  # Sum, Mul, Exp (stopped), AccumulateGrad(w) through the second factor only
    assert len(list(walk([loss.grad_fn], stop=lambda n: False, budget=2))) == 2


def test_backward_roots_are_read_from_the_running_call_on_this_thread_and_others():
    seen = {}
    w = torch.ones(2, requires_grad=True)
    y = (w * 3).view_as(w)
    loss = y.sum()

    def hook(grad):
        seen["roots"] = backward_roots()
        seen["found"] = bypassing(torch._C._current_autograd_node(), lambda n: n.metadata is y.grad_fn.metadata,
                                  {id(w): "w"})
        return grad

    y.register_hook(hook)
    (loss + w.sum()).backward()
    assert seen["found"] == ["w"] and len(seen["roots"]) == 1
    assert backward_roots() == []  # outside any backward

    # Another thread waiting inside backward (as the caller does while an accelerator's engine thread runs the hooks).
    inside, release = threading.Event(), threading.Event()

    class Wait(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            inside.set()
            release.wait(10)
            return g

    z = Wait.apply(torch.ones(2, requires_grad=True)).sum()
    thread = threading.Thread(target=z.backward)
    thread.start()
    try:
        assert inside.wait(10)
        roots = backward_roots()
        assert len(roots) == 1 and roots[0][0].metadata is z.grad_fn.metadata
    finally:
        release.set()
        thread.join(10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the hooks run on the engine's device thread")
def test_cuda_a_penalty_is_refused_where_the_hooks_run_on_the_device_thread():
    model = net().cuda()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
    x = torch.randn(4, 4, device="cuda")
    with pytest.raises(RuntimeError, match="other than through the wrapped model's outputs"):
        (m(x).square().mean() + _penalty(model)).backward()
    assert all(p.grad is None for p in model.parameters())
    model, m, o = _norm_pass_model(1)
    model.cuda()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), step_in_backward=True,
                        max_grad_norm=CLIP)
    ids, y = regression_batch(device="cuda")
    with pytest.raises(RuntimeError, match="the norm taken from the outputs would miss"):
        _loss(m, model, ids, y).backward()


def test_reading_the_roots_leaves_no_frame_behind():
    """The frames read must not sit in a reference cycle: they would keep their callers' locals (in an output hook, the
    output's gradient) alive until the garbage collector ran, which the estimate would not see."""
    import gc
    import weakref

    def caller():
        big = torch.ones(10)
        backward_roots()
        return weakref.ref(big)

    gc.disable()
    try:
        assert caller()() is None
    finally:
        gc.enable()
