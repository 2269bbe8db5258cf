"""Accumulated micro-batches through an unchanged loop equal one big batch."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwrap
from memwrap.accumulation import AccumulationGate, WrappedLoader
from tests.conftest import max_rel_err


def make_model(seed, width, depth):
    torch.manual_seed(seed)
    layers, d = [], 5
    for _ in range(depth):
        layers += [torch.nn.Linear(d, width), torch.nn.Tanh()]
        d = width
    layers.append(torch.nn.Linear(d, 3))
    return torch.nn.Sequential(*layers).double()


def reference(model, xs, ys, windows, lr, opt=None):
    """The plain way: one big batch per window, mean loss."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for start, stop in windows:
        x, y = torch.cat(xs[start:stop]), torch.cat(ys[start:stop])
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def windows_of(n_batches, accumulate):
    return [(s, min(s + accumulate, n_batches)) for s in range(0, n_batches, accumulate)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    width=st.integers(1, 12),
    depth=st.integers(1, 3),
    micro=st.integers(1, 4),
    accumulate=st.integers(1, 6),
    n_batches=st.integers(1, 14),
    epochs=st.integers(1, 2),
    sized=st.booleans(),
)
def test_unchanged_loop_equals_big_batch(seed, width, depth, micro, accumulate, n_batches, epochs, sized):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(micro, 5, generator=gen, dtype=torch.float64) for _ in range(n_batches)]
    ys = [torch.randn(micro, 3, generator=gen, dtype=torch.float64) for _ in range(n_batches)]
    model = make_model(seed, width, depth)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(epochs):
        reference(ref, xs, ys, windows_of(n_batches, accumulate), lr=0.05, opt=ref_opt)
    # Generators have no len(): that path looks one window ahead instead of counting.
    batches = list(zip(xs, ys))
    loader = batches if sized else _Reiterable(batches)

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model_w, opt_w, loader_w = memwrap.wrap(model, opt, loader, accumulate=accumulate)
    for _ in range(epochs):
        for x, y in loader_w:
            loss = torch.nn.functional.mse_loss(model_w(x), y)
            loss.backward()
            opt_w.step()
            opt_w.zero_grad()
    assert opt_w.updates == epochs * len(windows_of(n_batches, accumulate))
    assert max_rel_err(model.parameters(), ref.parameters()) <= 1e-6


class _Reiterable:
    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return (item for item in self.items)


def test_fp32_float32_model_matches_big_batch_to_1e6():
    model = make_model(1, 16, 2).float()
    ref = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(4, 5, generator=gen) for _ in range(10)]
    ys = [torch.randn(4, 3, generator=gen) for _ in range(10)]
    reference(ref, xs, ys, windows_of(10, 4), lr=0.1)
    model_w, opt_w, loader_w = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                            list(zip(xs, ys)), accumulate=4)
    for x, y in loader_w:
        torch.nn.functional.mse_loss(model_w(x), y).backward()
        opt_w.step()
        opt_w.zero_grad()
    assert max_rel_err(model.parameters(), ref.parameters()) <= 1e-6


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.out = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


def padded_batches(seed, n, pad=-100):
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        rows, length = 3, int(torch.randint(2, 9, (1,), generator=gen))
        tokens = torch.randint(0, 11, (rows, length), generator=gen)
        labels = torch.randint(0, 11, (rows, length), generator=gen)
        lengths = torch.randint(1, length + 1, (rows,), generator=gen)
        mask = torch.arange(length)[None, :] >= lengths[:, None]
        labels[mask] = pad
        batches.append({"tokens": tokens, "labels": labels})
    return batches


def token_mean_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("accumulate,n", [(3, 7), (4, 8), (2, 1)])
def test_count_items_gives_token_mean_over_the_window(accumulate, n):
    batches = padded_batches(accumulate * 100 + n, n)
    model = TinyLM().double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for start, stop in windows_of(n, accumulate):
        # The token mean over every non-padding item of the window, computed in one go.
        window = batches[start:stop]
        logits = torch.cat([ref(b["tokens"]).flatten(0, 1) for b in window])
        labels = torch.cat([b["labels"].flatten() for b in window])
        torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100).backward()
        ref_opt.step()
        ref_opt.zero_grad()

    model_w, opt_w, loader_w = memwrap.wrap(
        model, torch.optim.SGD(model.parameters(), lr=0.5), batches, accumulate=accumulate,
        count_items=lambda b: int((b["labels"] != -100).sum()),
    )
    for batch in loader_w:
        token_mean_loss(model_w(batch["tokens"]), batch["labels"]).backward()
        opt_w.step()
        opt_w.zero_grad()
    assert max_rel_err(model.parameters(), ref.parameters()) <= 1e-10


def test_count_items_differs_from_naive_mean_of_means():
    """Sanity: with unequal item counts, 1/N weighting is a different (wrong) gradient."""
    batches = padded_batches(5, 4)
    counts = [int((b["labels"] != -100).sum()) for b in batches]
    assert len(set(counts)) > 1
    model = TinyLM().double()
    naive = copy.deepcopy(model)
    for target, count_items in ((model, lambda b: int((b["labels"] != -100).sum())), (naive, None)):
        m, o, ld = memwrap.wrap(target, torch.optim.SGD(target.parameters(), lr=0.5), batches, accumulate=4,
                                count_items=count_items)
        for batch in ld:
            token_mean_loss(m(batch["tokens"]), batch["labels"]).backward()
            o.step()
            o.zero_grad()
    assert max_rel_err(model.parameters(), naive.parameters()) > 1e-4


def test_count_items_zero_window_raises():
    batches = [{"tokens": torch.zeros(1, 2, dtype=torch.long), "labels": torch.full((1, 2), -100)}]
    model = TinyLM()
    _, _, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, accumulate=2,
                            count_items=lambda b: int((b["labels"] != -100).sum()))
    with pytest.raises(ValueError, match="no item to learn from"):
        next(iter(ld))


def test_loader_keeps_len_set_epoch_and_batches():
    sampler_calls = []

    class Sampler:
        def set_epoch(self, epoch):
            sampler_calls.append(epoch)

    class Loader(list):
        sampler = Sampler()

    data = Loader([torch.tensor([i]) for i in range(5)])
    model = torch.nn.Linear(1, 1)
    _, _, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), data, accumulate=2)
    assert len(ld) == 5
    ld.set_epoch(3)
    assert sampler_calls == [3]
    assert [int(b) for b in ld] == [0, 1, 2, 3, 4]


def test_loader_without_len_raises_like_original():
    model = torch.nn.Linear(1, 1)
    _, _, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), _Reiterable([1]), accumulate=2)
    with pytest.raises(TypeError):
        len(ld)


def test_step_and_zero_grad_are_gated():
    model = torch.nn.Linear(2, 1)
    before = model.weight.detach().clone()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    for i in range(3):
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        o.zero_grad()
        if i < 2:
            assert not o.did_update and model.weight.grad is not None
            assert torch.equal(model.weight, before)
    assert o.did_update and o.updates == 1 and model.weight.grad is None
    assert not torch.equal(model.weight, before)


def test_eval_and_no_grad_forward_do_not_touch_state():
    model = torch.nn.Linear(2, 1)
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    m(torch.ones(1, 2)).sum().backward()
    o.step()
    state = o.gate.state_dict()
    with torch.no_grad():
        m(torch.ones(1, 2))
    m.eval()
    m(torch.ones(1, 2)).sum().backward()  # an eval forward with grad is not a micro-batch either
    m.train()
    assert o.gate.state_dict() == state
    o.step()
    assert o.did_update


def test_gate_rejects_plan_mid_window():
    gate = AccumulationGate(3)
    gate.tick()
    with pytest.raises(RuntimeError, match="out of step"):
        gate.plan_window([0.5, 0.5])


def test_loader_resume_skips_consumed_batches():
    gate = AccumulationGate(2)
    loader = WrappedLoader(list(range(6)), gate)
    it = iter(loader)
    assert [next(it), next(it), next(it)] == [0, 1, 2]
    state = loader.state_dict()
    resumed = WrappedLoader(list(range(6)), AccumulationGate(2))
    resumed.load_state_dict(state)
    assert list(resumed) == [3, 4, 5]
