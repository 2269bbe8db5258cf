"""Accumulated micro-batches through an unchanged loop equal one big batch."""
import copy

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwrap
from memwrap.runtime.gate import AccumulationGate
from memwrap.runtime.loader import WrappedLoader
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


# --- a pass over the wrapped loader inside the training pass (issue 11, item 5) ---------------------------------

def _train_with_evaluation(loader_kind, where, count_items, eval_over_wrapped, eval_batches, epochs=2, n=8, accumulate=3):
    """Evaluation every 2 batches over the training data, through the wrapped loader or an unwrapped copy."""
    batches = padded_batches(11, n)
    torch.manual_seed(0)
    model = TinyLM().double()
    data = _Reiterable(batches) if loader_kind == "no-len" else list(batches)
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), data,
                            accumulate=accumulate, count_items=count_items)
    evaluation = ld if eval_over_wrapped else list(batches)

    def evaluate():
        with torch.no_grad():
            for j, batch in enumerate(evaluation):
                m(batch["tokens"])
                if j + 1 == eval_batches:  # a partial evaluation pass, left by break
                    break

    for _ in range(epochs):
        for i, batch in enumerate(ld):
            if where == "before-forward" and i % 2 == 0:
                evaluate()
            token_mean_loss(m(batch["tokens"]), batch["labels"]).backward()
            o.step()
            if where == "after-step" and i % 2 == 0:
                evaluate()
            o.zero_grad()
    return model, o


@pytest.mark.parametrize("loader_kind", ["len", "no-len"])
@pytest.mark.parametrize("where", ["before-forward", "after-step"])
@pytest.mark.parametrize("items", [False, True])
@pytest.mark.parametrize("eval_batches", [3, None])
def test_evaluation_pass_over_the_wrapped_loader_leaves_training_unchanged(loader_kind, where, items, eval_batches):
    count_items = (lambda b: int((b["labels"] != -100).sum())) if items else None
    got, got_opt = _train_with_evaluation(loader_kind, where, count_items, True, eval_batches)
    want, want_opt = _train_with_evaluation(loader_kind, where, count_items, False, eval_batches)
    assert got_opt.updates == want_opt.updates == 2 * 3
    assert got_opt.gate.micro_step == 0
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.equal(a, b)


def test_a_second_open_pass_that_is_trained_on_is_refused():
    model = torch.nn.Linear(2, 1)
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.ones(1, 2)] * 4, accumulate=2)
    stale = iter(ld)
    next(stale)  # an earlier pass left open: it owns the window plan
    with pytest.raises(RuntimeError, match="still open"):
        for x in ld:
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    stale.close()
    for x in ld:  # once it is closed, a pass trains normally
        m(x).sum().backward()
        o.step()
        o.zero_grad()
    assert o.gate.micro_step == 0


# --- count_items values and wrong len() (issue 11, item 8) ----------------------------------------------------

@pytest.mark.parametrize("bad", [1.5, -1, None, True, "3", torch.tensor(2.5), torch.tensor([1, 2]), float("nan")])
def test_count_items_refuses_values_that_are_not_whole_counts(bad):
    batches = padded_batches(2, 4)
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5), batches, accumulate=2,
                            count_items=lambda b: bad if b is batches[3] else 2)
    with pytest.raises(ValueError, match=r"for batch 3 of this epoch") as info:
        for batch in ld:
            token_mean_loss(m(batch["tokens"]), batch["labels"]).backward()
            o.step()
            o.zero_grad()
    assert repr(bad if not isinstance(bad, torch.Tensor) or bad.dim() else bad.item()) in str(info.value)
    assert o.updates == 1  # the first window (batches 0, 1) only; nothing of the refused window was applied
    assert not torch.equal(before[0], model.emb.weight)


def test_count_items_accepts_integral_floats_tensors_and_numpy_ints():
    np = pytest.importorskip("numpy")
    batches = padded_batches(3, 5)
    exact = lambda b: int((b["labels"] != -100).sum())  # noqa: E731
    forms = [lambda b: float(exact(b)), lambda b: (b["labels"] != -100).sum(), lambda b: np.int64(exact(b)),
             lambda b: torch.tensor(float(exact(b)))]
    results = []
    for count_items in [exact, *forms]:
        torch.manual_seed(0)
        model = TinyLM().double()
        m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5), batches, accumulate=2,
                                count_items=count_items)
        for batch in ld:
            token_mean_loss(m(batch["tokens"]), batch["labels"]).backward()
            o.step()
            o.zero_grad()
        results.append([p.detach() for p in model.parameters()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


class _WrongLen(list):
    def __init__(self, items, length):
        super().__init__(items)
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        return iter(self[:])  # list slicing ignores the false __len__

    def __getitem__(self, index):
        return list.__getitem__(self, index)


@pytest.mark.parametrize("said,windows", [
    # len() too small: the window at len()'s end was planned short; the rest by looking ahead; next epoch all by look-ahead
    (8, [[(0, 3), (3, 6), (6, 8), (8, 10)], [(0, 3), (3, 6), (6, 9), (9, 10)]]),
    # len() too large: the last window is stepped by its true size when the loader runs dry
    (12, [[(0, 3), (3, 6), (6, 9), (9, 10)], [(0, 3), (3, 6), (6, 9), (9, 10)]]),
    (13, [[(0, 3), (3, 6), (6, 9), (9, 10)], [(0, 3), (3, 6), (6, 9), (9, 10)]]),
])
def test_a_wrong_len_loses_no_batch_and_no_gradient(said, windows):
    gen = torch.Generator().manual_seed(said)
    xs = [torch.randn(2, 5, generator=gen, dtype=torch.float64) for _ in range(10)]
    ys = [torch.randn(2, 3, generator=gen, dtype=torch.float64) for _ in range(10)]
    model = make_model(4, 6, 1)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for epoch_windows in windows:
        reference(ref, xs, ys, epoch_windows, lr=0.05, opt=ref_opt)
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                            _WrongLen(list(zip(xs, ys)), said), accumulate=3)
    with pytest.warns(UserWarning, match="len"):
        for _ in range(2):
            for x, y in ld:
                torch.nn.functional.mse_loss(m(x), y).backward()
                o.step()
                o.zero_grad()
    assert o.updates == 8 and o.gate.micro_step == 0
    assert all(p.grad is None for p in model.parameters())
    assert max_rel_err(model.parameters(), ref.parameters()) <= 1e-12


# --- loop control: sync_gradients, end_of_dataloader, end_epoch() (issue 11, item 13) ---------------------------

@pytest.mark.parametrize("kind", ["len", "no-len", "count_items"])
def test_sync_gradients_and_end_of_dataloader_flags(kind):
    data = [torch.ones(1, 2)] * 7
    model = torch.nn.Linear(2, 1)
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            _Reiterable(data) if kind == "no-len" else data, accumulate=3,
                            count_items=(lambda b: 1) if kind == "count_items" else None)
    seen = []
    for _ in range(2):
        for x in ld:
            before = (ld.sync_gradients, o.sync_gradients, ld.end_of_dataloader)
            m(x).sum().backward()
            o.step()
            seen.append((*before, o.sync_gradients, o.did_update))
            o.zero_grad()
        assert ld.end_of_dataloader
    expected = [(i in (2, 5, 6),) * 2 + (i == 6,) + (i in (2, 5, 6),) * 2 for i in range(7)] * 2
    assert seen == expected


@pytest.mark.parametrize("items", [False, True])
def test_end_epoch_after_break_steps_the_partial_window_like_the_big_batch(items):
    batches, limit, accumulate = padded_batches(21, 10), 6, 4
    model = TinyLM().double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for _ in range(2):
        for start, stop in windows_of(limit, accumulate):  # each epoch: windows of batches [0, 4) and [4, 6)
            window = batches[start:stop]
            if items:
                logits = torch.cat([ref(b["tokens"]).flatten(0, 1) for b in window])
                labels = torch.cat([b["labels"].flatten() for b in window])
                torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100).backward()
            else:
                sum(token_mean_loss(ref(b["tokens"]), b["labels"]) for b in window).div(len(window)).backward()
            ref_opt.step()
            ref_opt.zero_grad()

    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), batches,
                            accumulate=accumulate, count_items=(lambda b: int((b["labels"] != -100).sum())) if items else None)
    for _ in range(2):
        for i, batch in enumerate(ld):
            if i == limit:  # as Lightning's limit_train_batches
                break
            token_mean_loss(m(batch["tokens"]), batch["labels"]).backward()
            o.step()
            o.zero_grad()
        assert ld.end_epoch() is True
        assert ld.position == 0 and o.gate.micro_step == 0 and all(p.grad is None for p in model.parameters())
    assert o.updates == 4
    assert max_rel_err(model.parameters(), ref.parameters()) <= 1e-12
    assert ld.end_epoch() is False  # nothing open: nothing to step


def test_end_epoch_inside_the_loop_ends_the_pass():
    model = torch.nn.Linear(2, 1)
    m, o, ld = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), [torch.ones(1, 2)] * 9, accumulate=4)
    seen = 0
    for x in ld:
        m(x).sum().backward()
        o.step()
        o.zero_grad()
        seen += 1
        if seen == 5:
            assert ld.end_epoch()  # the window of batch 4 alone is stepped; the loop ends at its next request
    assert seen == 5 and o.updates == 2 and ld.position == 0


def test_loader_state_saved_again_before_iterating_keeps_the_replay_states():
    data = torch.utils.data.DataLoader(list(range(12)), batch_size=2, shuffle=True)
    first = WrappedLoader(data, AccumulationGate(2))
    it = iter(first)
    consumed = [next(it), next(it)]
    state = first.state_dict()
    it.close()
    second = WrappedLoader(data, AccumulationGate(2))
    second.load_state_dict(state)
    again = second.state_dict()  # a checkpoint written right after loading, before training resumed
    assert again["position"] == 2 and torch.equal(again["pass_rng"]["torch"], state["pass_rng"]["torch"])
    third = WrappedLoader(data, AccumulationGate(2))
    third.load_state_dict(again)
    rest = list(third)
    assert sorted(torch.cat(consumed + rest).tolist()) == list(range(12))  # the same epoch order, resumed after 2
