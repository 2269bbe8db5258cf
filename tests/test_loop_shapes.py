"""Loop shapes beyond the plain one, each against the big-batch (or plain AMP) reference: recurrent use of the
model's own outputs, model.zero_grad(), gradient penalties, empty micro-batches, extra parameter groups,
evaluation passes over the training loader, checkpoints at an epoch's end, and outputs memwrap cannot see into."""
import copy
import warnings

import pytest
import torch

import memwrap
from tests.conftest import max_rel_err


def cell(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())


def unroll(model, x, steps=4):
    h = x
    for _ in range(steps):
        h = model(h)  # the output itself goes back in
    return h


def grads(model):
    return [p.grad for p in model.parameters()]


@pytest.mark.parametrize("precision,accumulate", [("fp32", 2), ("fp32", 4), ("fp16", 1), ("fp16", 2)])
def test_an_output_fed_back_unchanged_is_weighted_once(precision, accumulate):
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    ref, model = cell(), cell()
    torch.nn.functional.mse_loss(unroll(ref, x), y).backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), precision=precision, accumulate=accumulate)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the feedback is recognised
        for xb, yb in zip(x.chunk(accumulate), y.chunk(accumulate)):
            torch.nn.functional.mse_loss(unroll(m, xb), yb).backward()
            if o.gate.micro_step < accumulate - 1:
                o.step()
    if precision == "fp16":  # what step() would do first: unscale
        o.scaler.unscale_(o.optimizer)
    assert max_rel_err(grads(model), grads(ref)) < (1e-5 if precision == "fp32" else 1e-2)


def test_an_input_derived_from_an_output_warns_and_memwrap_backward_is_exact():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ref, model = cell(), cell()

    def run(mod, xb):
        h = xb
        for _ in range(3):
            h = mod(0.5 * h + xb)  # derived from the output: memwrap cannot tell it apart
        return h.square().mean()

    run(ref, x).backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
    with pytest.warns(UserWarning, match=r"input computed from one of its earlier outputs.*memwrap.backward\(loss, model\)"):
        memwrap.backward(run(m, x[:4]), m)
    o.step()
    memwrap.backward(run(m, x[4:]), m)
    assert max_rel_err(grads(model), grads(ref)) < 1e-5


def test_model_zero_grad_keeps_the_window():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    ref, model = cell(), cell()
    ref(x).square().mean().backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=4)
    for i, xb in enumerate(x.chunk(4)):
        m(xb).square().mean().backward()
        if i < 3:
            o.step()
            m.zero_grad()  # mid-window: must not clear
    assert max_rel_err(grads(model), grads(ref)) < 1e-6
    o.step()
    m.zero_grad()  # at the boundary it clears
    assert all(g is None for g in grads(model))


def test_gradient_penalty_with_unweighted_and_memwrap_backward_matches_the_big_batch():
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))

    def loss_of(mod, xb, unweighted):
        xb = xb.clone().requires_grad_(True)
        out = mod(xb)
        with unweighted():  # WGAN-GP style: the gradient of the outputs with respect to the inputs
            (g,) = torch.autograd.grad(out.sum(), xb, create_graph=True)
        return out.square().mean() + (g.norm(dim=1) - 1).square().mean(), g

    ref, model = cell(), cell()
    ref_loss, _ = loss_of(ref, x, torch.enable_grad)
    ref_loss.backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), precision="fp16", accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an input that requires grad: this very case
        for i, xb in enumerate(x.chunk(2)):
            loss, g = loss_of(m, xb, m.unweighted)
            assert torch.isfinite(g).all() and g.abs().max() < 10  # unscaled (fp16 would make it ~65536x)
            memwrap.backward(loss, m)
            if i == 0:
                o.step()
    o.scaler.unscale_(o.optimizer)
    assert max_rel_err(grads(model), grads(ref)) < 1e-2  # fp16 autocast against fp32


def test_a_micro_batch_without_items_adds_nothing_even_with_a_nan_loss():
    torch.manual_seed(0)
    tokens = torch.randn(4, 3, 6)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    batches = [(tokens[i:i + 1], mask[i:i + 1]) for i in range(4)]

    def masked_mean(out, mk):
        return (out.square().mean(-1) * mk).sum() / mk.sum()  # 0/0 = NaN for the empty one

    ref, model = cell(), cell()
    masked_mean(ref(tokens), mask).backward()
    m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, accumulate=4,
                                count_items=lambda b: int(b[1].sum()))
    for i, (tb, mb) in enumerate(loader):
        masked_mean(m(tb), mb).backward()
        if i < 3:
            o.step()
    assert max_rel_err(grads(model), grads(ref)) < 1e-6


def test_add_param_group_refuses_parameters_outside_the_model():
    model, head = cell(), torch.nn.Linear(6, 2)
    m, o = memwrap.wrap(model, torch.optim.SGD(list(model.parameters())[:1], lr=0.1), accumulate=2)
    with pytest.raises(ValueError, match="not in the model passed to wrap"):
        o.add_param_group({"params": head.parameters()})
    o.add_param_group({"params": (p for p in list(model.parameters())[1:])})  # a generator of model parameters
    assert len(o.param_groups[1]["params"]) == 1
    assert copy.deepcopy(o).param_groups[0]["lr"] == 0.1  # the model is not copied with the optimizer


def test_only_one_loader_may_be_wrapped():
    model = cell()
    with pytest.raises(TypeError, match="only the training loader"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), [1, 2], [3], accumulate=2)


def test_an_evaluation_pass_over_the_training_loader_leaves_no_window_plan():
    data = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    ref, model = cell(), cell()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), data, accumulate=2)
    for epoch in range(2):
        for i in range(0, 5, 2):  # windows of 2, 2, 1
            window = torch.cat(data[i:i + 2])
            ref(window).square().mean().backward()
            ref_opt.step()
            ref_opt.zero_grad()
        for xb in loader:
            m(xb).square().mean().backward()
            o.step()
            o.zero_grad()
        with torch.no_grad():  # an evaluation pass over the same loader, no step
            sum(float(m(xb).sum()) for xb in loader)
        assert not o.gate.planned
    assert max_rel_err(model.parameters(), ref.parameters()) < 1e-6


def test_a_checkpoint_at_the_end_of_an_epoch_resumes_at_the_next_epoch():
    data = [torch.randn(1, 6, generator=torch.Generator().manual_seed(i)) for i in range(5)]

    def train(model, epochs, state=None):
        m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), data, accumulate=2)
        if state is not None:
            o.load_state_dict(state["opt"])
            loader.load_state_dict(state["loader"])
        for _ in range(epochs):
            for xb in loader:
                m(xb).square().mean().backward()
                o.step()
                o.zero_grad()
        return {"opt": o.state_dict(), "loader": loader.state_dict()}, o.updates

    straight = cell()
    train(straight, 2)
    first, second = cell(), None
    state, _ = train(first, 1)
    assert state["loader"]["position"] == 0  # the epoch is complete
    second = cell()
    second.load_state_dict(first.state_dict())
    _, updates = train(second, 1, state)
    assert updates == 3 + 3  # the counters carry over; the resumed epoch ran all its windows
    assert max_rel_err(second.parameters(), straight.parameters()) < 1e-6


def test_an_output_memwrap_cannot_see_into_warns():
    class Out:
        def __init__(self, logits):
            self.logits = logits

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x):
            return Out(self.lin(x))

    model = Model()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    with pytest.warns(UserWarning, match=r"returned a Out in which memwrap found no tensor") as record:
        m(torch.randn(2, 6)).logits.sum().backward()
    assert record[0].filename == __file__  # it points at the model(...) call
    with pytest.warns(UserWarning, match="without a backward pass through the wrapped model's outputs"):
        o.step()


def test_fp16_without_accumulation_notices_a_backward_that_bypassed_the_hooks():
    model = cell()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")
    out = m(torch.randn(2, 6))
    out.div_(2.0)  # an in-place edit of the output: its hook is never reached
    out.sum().backward()
    with pytest.warns(UserWarning, match="modified in place"):
        o.step()


def test_a_one_batch_window_does_not_trip_the_lr_warning():
    data = [torch.randn(1, 6) for _ in range(7)]
    model = cell()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    m, o, s, loader = memwrap.wrap(model, opt, sched, data, accumulate=3)  # windows of 3, 3, 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            for xb in loader:
                m(xb).sum().backward()
                o.step()
                s.step()
                o.zero_grad()
    assert o.updates == 6


def test_the_model_fills_in_the_callers_own_containers():
    class Collecting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x, cache, feats):
            y = self.lin(x)
            cache["y"] = y
            feats.append(y)
            return y

    model = Collecting()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", accumulate=2)
    cache, feats = {}, []
    m(torch.randn(2, 6), cache, feats=feats).sum().backward()
    assert list(cache) == ["y"] and len(feats) == 1  # as without memwrap


def test_inputs_that_require_grad_for_other_reasons_do_not_warn():
    class Embedded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(10, 6)
            self.body = torch.nn.Linear(6, 6)

        def forward(self, ids=None, inputs_embeds=None):
            return self.body(self.embed(ids) if inputs_embeds is None else inputs_embeds)

    model = Embedded()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        emb = model.embed(torch.tensor([1, 2, 3])) * 1.5  # soft prompts / NEFTune: from the embedding, not an output
        m(inputs_embeds=emb).sum().backward()
        x = torch.randn(3, 6, requires_grad=True)  # input gradients (adversarial training)
        m(inputs_embeds=x).sum().backward()
        model.requires_grad_(False)  # a frozen phase run in grad mode: plain tensors, nothing to weight
        m(torch.tensor([1, 2]))


def test_memwrap_backward_keeps_an_enclosing_unweighted_block():
    model = cell()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    x = torch.randn(3, 6, requires_grad=True)
    with m.unweighted():
        memwrap.backward(m(torch.randn(3, 6)).sum(), m)
        (g,) = torch.autograd.grad(m(x).sum(), x)
    (plain,) = torch.autograd.grad(model(x).sum(), x)
    assert torch.allclose(g, plain)  # still unweighted after memwrap.backward inside the block


def test_memwrap_backward_of_an_empty_micro_batch_adds_nothing():
    tokens = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)

    def masked_mean(out, mk):
        return (out.square().mean(-1) * mk).sum() / mk.sum()

    ref, model = cell(), cell()
    masked_mean(ref(tokens), mask).backward()
    batches = [(tokens[i:i + 1], mask[i:i + 1]) for i in range(4)]
    m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), batches, accumulate=4,
                                count_items=lambda b: int(b[1].sum()))
    for i, (tb, mb) in enumerate(loader):
        memwrap.backward(masked_mean(m(tb), mb), m)
        if i < 3:
            o.step()
    assert max_rel_err(grads(model), grads(ref)) < 1e-6
    o.step()
    assert o.updates == 1 and o.skipped == 0
