"""optimizer.window_loss (the window's mean loss, as Trainer logs it) and where the optimizer's warnings point."""
import math
import warnings

import pytest
import torch

import memwrap


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def batches(n=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


class LossInside(torch.nn.Module):
    """Hugging Face style: the model computes the loss from labels and returns it in its outputs."""

    def __init__(self, kind):
        super().__init__()
        self.net, self.kind = mlp(), kind

    def forward(self, x, labels):
        logits = self.net(x)
        loss = torch.nn.functional.mse_loss(logits, labels)
        if self.kind == "dict":
            return {"loss": loss, "logits": logits}
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=loss, logits=logits)


def test_an_external_loss_is_recorded_with_one_call_and_averaged_over_the_window():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    losses, means = [], []
    for i, (x, y) in enumerate(batches()):
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.record_loss(loss)
        losses.append(loss.item())
        o.step()
        o.zero_grad()
        if i % 3 == 2:
            means.append(o.window_loss)
    assert means == pytest.approx([sum(losses[:3]) / 3, sum(losses[3:]) / 3], rel=1e-12)


@pytest.mark.parametrize("kind", ["dict", "hugging_face"])
def test_a_loss_in_the_outputs_is_recorded_without_any_call(kind):
    if kind == "hugging_face":
        pytest.importorskip("transformers")
    model = LossInside(kind)
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    assert o.window_loss is None
    losses, seen = [], []
    for i, (x, y) in enumerate(batches(4)):
        out = m(x, labels=y)
        out["loss"].backward()
        losses.append(out["loss"].item())
        if i == 0:
            o.record_loss(out["loss"])  # an explicit call for the same micro-batch replaces the automatic record
        o.step()
        o.zero_grad()
        if o.did_update:
            seen.append(o.window_loss)
    assert seen == pytest.approx([(losses[0] + losses[1]) / 2, (losses[2] + losses[3]) / 2], rel=1e-12)


def test_count_items_weights_the_window_loss_by_items_and_the_last_window_by_its_size():
    gen = torch.Generator().manual_seed(1)
    data = []
    for n in (3, 1, 4, 2, 5):  # items per micro-batch; 5 batches, accumulate=2: windows of 2, 2, 1
        data.append((torch.randn(n, 8, generator=gen), torch.randn(n, 1, generator=gen)))
    model = mlp()
    m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), data, accumulate=2,
                                count_items=lambda batch: len(batch[0]))
    losses, seen = [], []
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(m(x), y)  # a mean over the micro-batch's items
        loss.backward()
        o.record_loss(loss)
        losses.append((len(x), loss.item()))
        o.step()
        o.zero_grad()
        if o.did_update:
            seen.append(o.window_loss)
    windows = [losses[0:2], losses[2:4], losses[4:5]]
    expected = [sum(n * v for n, v in w) / sum(n for n, _ in w) for w in windows]
    assert seen == pytest.approx(expected, rel=1e-12)


def test_the_window_loss_survives_a_mid_window_resume():
    data = batches(4)

    def run(stop_after=None, state=None):
        model = mlp()
        m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
        if state is not None:
            m.load_state_dict(state["model"])
            o.load_state_dict(state["optimizer"])
        start = 0 if state is None else stop_after
        for i, (x, y) in enumerate(data[start:], start):
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.record_loss(loss)
            o.step()
            o.zero_grad()
            if state is None and stop_after is not None and i + 1 == stop_after:
                return {"model": m.state_dict(), "optimizer": o.state_dict()}
        return o.window_loss

    assert run(state=run(stop_after=2), stop_after=2) == pytest.approx(run(), rel=1e-12)


def test_record_loss_refuses_a_non_scalar():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"scalar loss.*shape \(4, 1\).*\.mean\(\)"):
        o.record_loss(torch.ones(4, 1))


def test_a_nan_window_is_logged_as_nan():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = batches(1)[0]
    loss = torch.nn.functional.mse_loss(m(x), y) * float("nan")
    loss.backward()
    o.record_loss(loss)
    o.step()
    assert o.step_was_skipped and math.isnan(o.window_loss)


def _lr_warnings(caught):
    return [w for w in caught if "learning rate changed inside an accumulation window" in str(w.message)]


def test_the_lr_change_warning_points_at_the_users_line_not_into_torch():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    # Built on the wrapped optimizer and not wrapped: torch replaces o.step with a wrapper in lr_scheduler.py.
    scheduler = torch.optim.lr_scheduler.StepLR(o, step_size=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in batches(4):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            scheduler.step()
            o.zero_grad()
    (warning,) = _lr_warnings(caught)
    assert warning.filename == __file__


def test_the_missing_backward_warning_points_at_the_users_line_too():
    model = mlp()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    torch.optim.lr_scheduler.StepLR(o, step_size=1)  # its wrapper sits between the user and step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = batches(1)[0]
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.step()  # twice for one batch
    (warning,) = [w for w in caught if "without a backward pass" in str(w.message)]
    assert warning.filename == __file__


def test_records_of_a_window_that_never_closed_do_not_leak_into_the_next():
    from memwrap.runtime.gate import AccumulationGate
    from memwrap.runtime.window_loss import WindowLoss

    gate = AccumulationGate(3)
    log = WindowLoss(gate)
    log.record(10.0)
    gate.tick()
    log.record(20.0)
    gate.tick()
    gate.micro_step = 0  # the loader ended this window (zero items) without an update, as end_epoch() does
    gate.plan_window([1.0])  # the next window holds one micro-batch (an epoch's last, partial window)
    log.record(5.0)
    assert gate.tick()
    log.close()
    assert log.value == 5.0
