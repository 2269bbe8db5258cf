"""The norm pass: step_in_backward=True with max_grad_norm or fp16 equals the ordinary clipped / loss-scaled step.

References: the plain torch loop (loss / accumulate summed by autograd, ``clip_grad_norm_``, ``step``; for fp16
torch AMP's ``scaler.scale(loss).backward(); unscale_; clip_grad_norm_; scaler.step; scaler.update``) and memwrap's
own ordinary step (which the rest of the suite holds to the plain loop), bit for bit where the op order is the same.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

import memwrap
from memwrap.techniques.norm_pass import NormPass
from memwrap.testing import RegressionModel, regression_batch

CLIP = 0.05  # below every window's norm in these runs: the clip coefficient acts on each update (asserted)


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # 8-bit optimizers on CPU, conversion notices
        return fn(*args, **kwargs)


def make(name, params):
    params = list(params)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    if name == "torch_adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    if name == "adamw_8bit":
        bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
        # bitsandbytes keeps per-parameter overrides in one process-wide manager keyed by id(param) and position;
        # an earlier test's (Trainer registers 32-bit state for embeddings) would reach a parameter of this one that
        # reuses its id, in one run and not the other. Start from a clean manager (memwrap's plugin uses its own).
        bnb.optim.GlobalOptimManager.get_instance().initialize()
        return _quiet(bnb.optim.AdamW8bit, params, lr=1e-2, min_8bit_size=16)
    raise AssertionError(name)


def plain_loop(name, accumulate, updates=4, seed=0):
    """No memwrap: the micro-batches' losses / accumulate summed by autograd, then clip_grad_norm_ and step."""
    torch.manual_seed(seed)
    model = RegressionModel()
    opt = make(name, model.parameters())
    ids, y = regression_batch(n=24 * accumulate, seed=seed)
    norms = []
    for _ in range(updates):
        for ids_mb, y_mb in zip(ids.chunk(accumulate), y.chunk(accumulate)):
            (F.mse_loss(model(ids_mb), y_mb) / accumulate).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        _quiet(opt.step)
        opt.zero_grad()
    return model, norms


def wrapped_loop(name, accumulate, step_in_backward, updates=4, seed=0, **options):
    torch.manual_seed(seed)
    model = RegressionModel()
    m, o = _quiet(memwrap.wrap, model, make(name, model.parameters()), accumulate=accumulate,
                  step_in_backward=step_in_backward, max_grad_norm=CLIP, **options)
    ids, y = regression_batch(n=24 * accumulate, seed=seed)
    norms = []
    for _ in range(updates):
        for ids_mb, y_mb in zip(ids.chunk(accumulate), y.chunk(accumulate)):
            F.mse_loss(m(ids_mb), y_mb).backward()
            _quiet(o.step)
            o.zero_grad()
        norms.append(o.last_grad_norm)
    return model, o, norms


@pytest.mark.parametrize("accumulate", [1, 4])
@pytest.mark.parametrize("name", ["adamw", "sgd_momentum", "torch_adafactor", "adamw_8bit"])
def test_clipped_step_in_backward_equals_clip_grad_norm_then_step(name, accumulate):
    ref, ref_norms = plain_loop(name, accumulate)
    ordinary, _, ordinary_norms = wrapped_loop(name, accumulate, False)
    got, o, norms = wrapped_loop(name, accumulate, True)
    assert min(ref_norms) > CLIP  # clipping acted on every update
    assert o.updates == 4 and o.skipped == 0
    assert o.step_in_backward.norm.first_passes == 4  # each update's norm came from a first pass inside backward
    # memwrap's ordinary clipped step: the same ops in the same order, so the same bits.
    assert norms == ordinary_norms
    for (pname, a), b in zip(ordinary.named_parameters(), got.parameters()):
        assert torch.equal(a, b), (name, accumulate, pname, (a - b).abs().max().item())
    # The plain loop weights the loss, memwrap the outputs' gradient: equal up to rounding of that product.
    assert norms == pytest.approx(ref_norms, rel=1e-6)
    for (pname, a), b in zip(ref.named_parameters(), got.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=f"{name} {accumulate} {pname}")


@pytest.mark.parametrize("accumulate", [1, 4])
def test_optimi_kahan_adamw_under_bf16_true_is_exact(accumulate):
    optimi = pytest.importorskip("optimi", reason="torch-optimi is not installed")
    results = []
    for sib in (False, True):
        torch.manual_seed(0)
        model = RegressionModel()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        m, o = _quiet(memwrap.wrap, model, opt, precision="bf16-true", step_in_backward=sib, max_grad_norm=CLIP,
                      accumulate=accumulate)
        assert isinstance(o.optimizer, optimi.AdamW) and o.optimizer.defaults["kahan_sum"]
        ids, y = regression_batch(n=24 * accumulate)
        for _ in range(3):
            for ids_mb, y_mb in zip(ids.chunk(accumulate), y.chunk(accumulate)):
                F.mse_loss(m(ids_mb), y_mb).backward()
                o.step()
                o.zero_grad()
        results.append((model, o.last_grad_norm))
    (a_model, a_norm), (b_model, b_norm) = results
    assert a_norm == b_norm and a_norm > CLIP
    for a, b in zip(a_model.parameters(), b_model.parameters()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


@pytest.mark.parametrize("checkpoint", [None, "full"])
def test_tied_weights_and_checkpointed_blocks_are_exact(checkpoint):
    # GPT ties its embedding to the LM head (one parameter, two uses); checkpointing recomputes each block in both
    # passes. Reference: the plain loop (loss / 2 summed, clip_grad_norm_, step).
    from memwrap.models import build_preset

    def gpt():
        torch.manual_seed(0)
        return build_preset("gpt2-tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16)

    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    ref = gpt()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        for xb in x.chunk(2):
            (F.cross_entropy(ref(xb).flatten(0, 1), xb.flatten()) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    results = []
    for sib in (False, True):
        model = gpt()
        m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), checkpoint=checkpoint,
                            accumulate=2, step_in_backward=sib, max_grad_norm=0.5)
        for _ in range(2):
            for xb in x.chunk(2):
                F.cross_entropy(m(xb).flatten(0, 1), xb.flatten()).backward()
                o.step()
                o.zero_grad()
        results.append(model)
    assert results[1].lm_head.weight is results[1].transformer.wte.weight  # tied
    for a, b in zip(*(r.parameters() for r in results)):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), results[1].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{"max_grad_norm": 1.0}, {"precision": "fp16"}])
@pytest.mark.parametrize("applied_before", [False, True])
def test_selective_checkpointing_is_refused_at_wrap_with_the_norm_pass(options, applied_before):
    # torch's selective checkpoint allows one backward per region, and the norm pass runs two.
    from memwrap.models import build_preset

    model = build_preset("gpt2-tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16)
    wrap_options = {"step_in_backward": True, **options}
    if applied_before:
        memwrap.apply_checkpointing(model, "auto", mode="selective")
    else:
        wrap_options["checkpoint"] = "selective"
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    with pytest.raises(ValueError, match=r"checkpoint mode 'selective' with step_in_backward=True.*only one backward "
                                         r"per checkpointed region.*Fix: checkpoint='full'"):
        memwrap.wrap(model, torch.optim.AdamW(model.parameters()), **wrap_options)
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == hooks
    assert memwrap.checkpointing.is_checkpointed(model.transformer.h[0]) == applied_before
    # Without the norm pass, selective checkpointing with step_in_backward stays allowed.
    memwrap.wrap(model, torch.optim.AdamW(model.parameters()), step_in_backward=True,
                 **({} if applied_before else {"checkpoint": "selective"}))


def test_memwrap_checkpointing_survives_a_second_backward_over_a_retained_graph():
    # The norm pass backpropagates the last micro-batch twice; torch's composable checkpoint enters a one-use
    # context at each recompute, which memwrap's checkpointing replaces (memwrap/checkpointing/apply.py).
    from memwrap.models import build_preset

    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_preset("gpt2-tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16)
        if checkpointed:
            assert memwrap.apply_checkpointing(model, "auto").modules
        x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm = torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class _NormBlocks(torch.nn.Module):
    """Two repeated blocks with a train-mode BatchNorm: checkpoint="auto" checkpoints both, and the recompute guards
    the running statistics (a context entered once per backward pass: twice here, once per pass)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


@pytest.mark.parametrize("accumulate", [1, 4])
def test_checkpointed_batchnorm_blocks_are_exact_and_count_their_statistics_once(accumulate):
    x = torch.randn(16 * accumulate, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randn(16 * accumulate, generator=torch.Generator().manual_seed(3))

    def build():
        torch.manual_seed(0)
        return _NormBlocks()

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        for xb, yb in zip(x.chunk(accumulate), y.chunk(accumulate)):
            (F.mse_loss(ref(xb), yb) / accumulate).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
    model = build()
    m, o = _quiet(memwrap.wrap, model, torch.optim.AdamW(model.parameters(), lr=1e-2), checkpoint="auto",
                  accumulate=accumulate, step_in_backward=True, max_grad_norm=CLIP)  # BatchNorm + accumulate: warned
    assert len(m.checkpoint_report.modules) == 2
    for _ in range(3):
        for xb, yb in zip(x.chunk(accumulate), y.chunk(accumulate)):
            F.mse_loss(m(xb), yb).backward()
            o.step()
            o.zero_grad()
    assert o.step_in_backward.norm.first_passes == 3
    for (name, a), b in zip(ref.state_dict().items(), model.state_dict().values()):
        if a.is_floating_point():
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
        else:  # num_batches_tracked: one count per forward, not per recompute
            assert torch.equal(a, b), name


# --- fp16: the same skipped updates and the same scale sequence as torch AMP's GradScaler loop ---------------------

SCALER = {"init_scale": 2.0 ** 10, "growth_interval": 3}
OVERFLOWS = {2, 3, 9, 17, 18, 19, 25}  # updates whose last micro-batch's loss is multiplied by inf


def _steps(opt):
    """AdamW's step count as a number: its state holds one tensor, counted up in place (compare copies, not it)."""
    step = opt.state[next(iter(opt.param_groups[0]["params"]))].get("step")
    return None if step is None else int(step)


def amp_loop(updates, accumulate, clip):
    torch.manual_seed(0)
    model = RegressionModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    ids, y = regression_batch(n=24 * accumulate)
    skipped, scales = [], []
    for update in range(updates):
        for i, (ids_mb, y_mb) in enumerate(zip(ids.chunk(accumulate), y.chunk(accumulate))):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(ids_mb)
            loss = F.mse_loss(out.float(), y_mb) / accumulate
            if update in OVERFLOWS and i == accumulate - 1:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        steps_before = _steps(opt)
        scaler.step(opt)
        skipped.append(_steps(opt) == steps_before)
        scaler.update()
        opt.zero_grad()
    return model, skipped, scales


def memwrap_fp16_loop(updates, accumulate, clip, step_in_backward):
    torch.manual_seed(0)
    model = RegressionModel()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), precision="fp16", scaler=SCALER,
                        accumulate=accumulate, max_grad_norm=clip, step_in_backward=step_in_backward)
    ids, y = regression_batch(n=24 * accumulate)
    skipped, scales = [], []
    for update in range(updates):
        for i, (ids_mb, y_mb) in enumerate(zip(ids.chunk(accumulate), y.chunk(accumulate))):
            loss = F.mse_loss(m(ids_mb), y_mb)
            if update in OVERFLOWS and i == accumulate - 1:
                loss = loss * float("inf")
            loss.backward()
            if i == accumulate - 1:
                scales.append(o.scaler.get_scale())
            o.step()
            o.zero_grad()
        skipped.append(o.step_was_skipped)
    return model, o, skipped, scales


@pytest.mark.parametrize("accumulate, clip", [(1, None), (1, CLIP), (2, CLIP), (4, CLIP), (4, None)])
def test_fp16_skips_the_updates_torch_amp_skips_and_the_scale_follows_the_same_sequence(accumulate, clip):
    updates = 30
    ref, ref_skipped, ref_scales = amp_loop(updates, accumulate, clip)
    ordinary, _, ord_skipped, ord_scales = memwrap_fp16_loop(updates, accumulate, clip, False)
    got, o, skipped, scales = memwrap_fp16_loop(updates, accumulate, clip, True)
    assert [i for i, s in enumerate(ref_skipped) if s] == sorted(OVERFLOWS)
    assert skipped == ref_skipped == ord_skipped
    assert scales == ref_scales == ord_scales
    assert len(set(scales)) > 3  # backed off and grew again: the sequence is not constant
    assert o.skipped == len(OVERFLOWS) and o.updates == updates - len(OVERFLOWS)
    for a, b in zip(ordinary.parameters(), got.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), got.parameters()):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


# --- what lives during the first pass ----------------------------------------------------------------------------

@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_first_pass_holds_one_window_gradient_at_a_time(monkeypatch, accumulate):
    """Counted at each contribute() call: how many parameters hold a .grad, and how many window gradients (this
    micro-batch's, not yet folded into the accumulated one) are alive. The accumulated gradients of the earlier
    micro-batches (accumulate > 1) live through the window as they do without the norm pass."""
    accumulated, fresh = [], []
    done: set[int] = set()  # parameters already counted: their .grad is the accumulated gradient, put back
    original = NormPass.contribute

    def counting(self, param):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        # this micro-batch's gradients in .grad (not yet folded into a norm)
        fresh.append(sum(p.grad is not None and id(p) not in done for p in params))
        # the earlier micro-batches' gradients: put back, or set aside
        accumulated.append(sum(p.grad is not None and id(p) in done for p in params) + len(self._stash))
        done.add(id(param))
        original(self, param)

    monkeypatch.setattr(NormPass, "contribute", counting)
    torch.manual_seed(0)
    model = RegressionModel()
    n = len(list(model.parameters()))
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), step_in_backward=True,
                        max_grad_norm=CLIP, accumulate=accumulate)
    after_second_pass = []
    for p in model.parameters():  # after memwrap's hook: its step has run and freed the gradient
        p.register_post_accumulate_grad_hook(
            lambda _: after_second_pass.append(sum(q.grad is not None for q in model.parameters()))
            if not o.step_in_backward.norm.running and o.gate.closes_window() else None)
    ids, y = regression_batch(n=24 * accumulate)
    for ids_mb, y_mb in zip(ids.chunk(accumulate), y.chunk(accumulate)):
        F.mse_loss(m(ids_mb), y_mb).backward()
        o.step()
        o.zero_grad()
    assert len(fresh) == n and max(fresh) == 1  # one parameter's gradient of this micro-batch at a time
    assert max(accumulated) == (0 if accumulate == 1 else n)  # each parameter's accumulated gradient, once
    # Stepped and freed one by one: with accumulate > 1 the parameters not yet stepped still hold their gradients.
    assert after_second_pass == ([0] * n if accumulate == 1 else list(range(n - 1, -1, -1)))
    assert all(p.grad is None for p in model.parameters())


# --- what is refused, and what a refused call leaves ---------------------------------------------------------------

def _snapshot(model):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()])


def _unchanged(model, snap):
    for p, w, g in zip(model.parameters(), *snap):
        assert torch.equal(p, w)
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)


def _wrapped(accumulate=1, **options):
    torch.manual_seed(0)
    model = RegressionModel()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=accumulate,
                        **{"max_grad_norm": CLIP, "step_in_backward": True, **options})
    return model, m, o


@pytest.mark.parametrize("accumulate", [1, 2])
def test_create_graph_is_refused_and_changes_nothing(accumulate):
    model, m, o = _wrapped(accumulate)
    ids, y = regression_batch()
    if accumulate == 2:
        F.mse_loss(m(ids), y).backward()
        o.step()
    snap = _snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on create_graph=True and .grad reference cycles
        with pytest.raises(RuntimeError, match=r"create_graph=True.*Nothing was updated.*Fix: loss.backward\(\) "
                                               r"without create_graph"):
            F.mse_loss(m(ids), y).backward(create_graph=True)
    _unchanged(model, snap)


def test_a_second_backward_in_the_last_micro_batch_is_refused():
    model, m, o = _wrapped()
    ids, y = regression_batch()
    first, second = F.mse_loss(m(ids), y), F.mse_loss(m(ids), y)
    first.backward(retain_graph=True)  # retain_graph alone is harmless: both passes of this backward agree
    snap = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"second backward pass.*Fix: one backward per micro-batch"):
        second.backward()
    _unchanged(model, snap)


def _with_temperature(accumulate=2, **options):
    """RegressionModel plus a parameter that only the loss uses (a learned temperature): the outputs never reach it."""
    torch.manual_seed(0)
    model = RegressionModel()
    model.temperature = torch.nn.Parameter(torch.tensor(1.5))
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=accumulate,
                        **{"max_grad_norm": CLIP, "step_in_backward": True, **options})
    return model, m, o


@pytest.mark.parametrize("entry", ["loss.backward", "engine"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_a_penalty_bypassing_the_outputs_is_refused_before_any_update_and_memwrap_backward_is_exact(order, entry):
    # "loss.backward": the roots of the user's backward are read (memwrap.runtime.loss_graph) and the loss's paths
    # around the outputs (the temperature, fc1.weight's penalty) are refused at the first output hook, before the
    # first pass. "engine": a backward started on autograd's engine directly, whose roots cannot be read: the norm
    # pass's own checks still refuse a parameter the outputs do not reach (a penalty on one they also reach is then
    # not told apart: docs/options.md). "before": the temperature's gradient arrives before the outputs' (its terms
    # are built after the forward, and autograd runs the newest nodes first); "after": built before the forward, so
    # with "engine" the first pass runs first and finds it missed.
    def loss_of(m, model, ids, y):
        if order == "after":
            inv = 1.0 / model.temperature
            return F.mse_loss(m(ids), y) * inv + 1e-2 * model.fc1.weight.square().sum()
        return (F.mse_loss(m(ids), y) / model.temperature + 1e-2 * model.fc1.weight.square().sum()
                + model.temperature.square())

    def run_backward(loss):
        if entry == "engine":
            torch.autograd.Variable._execution_engine.run_backward(
                (loss,), (torch.ones_like(loss),), False, False, (), True, True)
        else:
            loss.backward()

    model, m, o = _with_temperature(accumulate=2)
    ids, y = regression_batch()
    memwrap.backward(loss_of(m, model, ids, y), m)
    o.step()
    snap = _snapshot(model)
    first_passes = []
    original = NormPass.begin
    with pytest.raises(RuntimeError, match=r"parameter '(temperature|fc1.weight)'.*other than through the "
                                           r"(wrapped )?model's outputs.*Nothing was (updated|accumulated).*Fix: "
                                           r"finish this loss with memwrap.backward\(loss, model\)"):
        NormPass.begin = lambda self: (first_passes.append(1), original(self))[1]
        try:
            run_backward(loss_of(m, model, ids, y))
        finally:
            NormPass.begin = original
    assert len(first_passes) == (1 if (order, entry) == ("after", "engine") else 0)  # each way of meeting it
    names = [n for n, _ in model.named_parameters()]
    for name, p, w, g in zip(names, model.parameters(), *snap):
        assert torch.equal(p, w), name  # no parameter was updated
        if order == "after" or name != "temperature":  # "before": the message names the one gradient that moved
            assert torch.equal(p.grad, g), name

    # Reference: the plain loop (each micro-batch's loss / 2 summed, clip_grad_norm_, step).
    torch.manual_seed(0)
    ref = RegressionModel()
    ref.temperature = torch.nn.Parameter(torch.tensor(1.5))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        for ids_mb, y_mb in zip(ids.chunk(2), y.chunk(2)):
            (loss_of(ref, ref, ids_mb, y_mb) / 2).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
        ref_opt.zero_grad()

    results = []
    for sib in (False, True):
        model, m, o = _with_temperature(accumulate=2, step_in_backward=sib)
        for _ in range(2):
            for ids_mb, y_mb in zip(ids.chunk(2), y.chunk(2)):
                memwrap.backward(loss_of(m, model, ids_mb, y_mb), m)
                o.step()
                o.zero_grad()
        results.append((model, o.last_grad_norm))
    assert results[0][1] == results[1][1] > CLIP
    assert results[1][1] == pytest.approx(ref_norm, rel=1e-6)
    for a, b in zip(results[0][0].parameters(), results[1][0].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(ref.parameters(), results[1][0].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_retain_graph_alone_is_exact_and_a_second_backward_over_the_retained_graph_is_refused():
    results = []
    for sib in (False, True):
        model, m, o = _wrapped(accumulate=2, step_in_backward=sib)
        ids, y = regression_batch(n=48)
        for _ in range(2):
            for ids_mb, y_mb in zip(ids.chunk(2), y.chunk(2)):
                F.mse_loss(m(ids_mb), y_mb).backward(retain_graph=True)  # both passes of this backward agree
                o.step()
                o.zero_grad()
        results.append((model, o.last_grad_norm))
    assert results[0][1] == results[1][1] > CLIP
    for a, b in zip(results[0][0].parameters(), results[1][0].parameters()):
        assert torch.equal(a, b)

    model, m, o = _wrapped()
    loss = F.mse_loss(m(ids), y)
    loss.backward(retain_graph=True)  # the update happened inside this backward
    snap = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"second backward pass.*Fix: one backward per micro-batch"):
        loss.backward()  # the same graph again, before optimizer.step()
    _unchanged(model, snap)


@pytest.mark.parametrize("kwargs", [{"create_graph": True}, {"inputs": "fc1.weight"}])
def test_memwrap_backward_refuses_what_would_make_the_passes_differ_and_runs_nothing(kwargs):
    model, m, o = _wrapped()
    ids, y = regression_batch()
    if kwargs.get("inputs"):
        kwargs = {"inputs": [model.fc1.weight]}
    loss = F.mse_loss(m(ids), y)
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=rf"memwrap.backward\(\.\.\., {next(iter(kwargs))}=\.\.\.\).*Nothing was "
                                         r"run.*Fix: call memwrap.backward\(loss, model\) without it"):
        memwrap.backward(loss, m, **kwargs)
    _unchanged(model, snap)
    memwrap.backward(loss, m)  # the same loss, without it: one ordinary clipped update
    o.step()
    assert o.updates == 1 and o.step_in_backward.norm.first_passes == 1


class _TwoOutputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h)


def _two_output_loss(m, k):
    h, out = m(torch.randn(6, 4, generator=torch.Generator().manual_seed(k)))
    return out.square().mean() + h.square().mean()


def test_a_loss_on_several_outputs_of_one_forward_is_exact():
    torch.manual_seed(0)
    ref = _TwoOutputs()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        for k in range(2):
            (_two_output_loss(ref, k) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
        ref_opt.zero_grad()
    torch.manual_seed(0)
    model = _TwoOutputs()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), step_in_backward=True,
                        max_grad_norm=0.01, accumulate=2)
    for _ in range(2):
        for k in range(2):
            _two_output_loss(m, k).backward()
            o.step()
            o.zero_grad()
    assert o.step_in_backward.norm.first_passes == 2
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_two_forward_calls_in_the_last_micro_batch_are_refused_and_memwrap_backward_is_exact():
    def loss_of(m, k):
        ids, y = regression_batch(seed=k)
        return F.mse_loss(m(ids), y) + F.mse_loss(m(ids.flip(0)), y)  # two calls of the model, one loss

    model, m, o = _wrapped(accumulate=2)
    memwrap.backward(loss_of(m, 0), m)
    o.step()
    snap = _snapshot(model)
    with pytest.raises(RuntimeError, match=r"goes through 2 forward calls of the model.*Nothing was updated.*Fix: "
                                           r"finish this loss with memwrap.backward\(loss, model\)"):
        loss_of(m, 1).backward()
    _unchanged(model, snap)

    torch.manual_seed(0)
    ref = RegressionModel()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(2):
        for k in range(2):
            (loss_of(ref, k) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
    model, m, o = _wrapped(accumulate=2)
    for _ in range(2):
        for k in range(2):
            memwrap.backward(loss_of(m, k), m)
            o.step()
            o.zero_grad()
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_closure_optimizers_stay_refused_with_clipping_and_fp16():
    for options in ({"max_grad_norm": 1.0}, {"precision": "fp16"}):
        model = RegressionModel()
        with pytest.raises(ValueError, match="closure-based optimizer"):
            memwrap.wrap(model, torch.optim.LBFGS(model.parameters()), step_in_backward=True, **options)
        assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == 0


def test_a_backward_that_starts_no_first_pass_still_steps_the_ordinary_clipped_step():
    # A last micro-batch whose gradient does not come through the model's outputs (no output reached: here a loss
    # on a parameter alone) holds its gradients to step(), which clips and steps them as the ordinary step does.
    results = []
    for sib in (False, True):
        model, m, o = _wrapped(accumulate=2, step_in_backward=sib)
        ids, y = regression_batch()
        F.mse_loss(m(ids), y).backward()
        o.step()
        (model.fc2.weight.sum() * 10).backward()
        o.step()
        o.zero_grad()
        results.append((model, o.last_grad_norm))
    assert results[0][1] == results[1][1]
    for a, b in zip(results[0][0].parameters(), results[1][0].parameters()):
        assert torch.equal(a, b)


# --- the planner counts the pass and can choose it ------------------------------------------------------------------

def test_the_planner_plans_the_norm_pass_with_its_memory_and_second_backward():
    from memwrap.models import GPT, GPTConfig

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=512, block_size=32, n_layer=4, n_head=2, n_embd=64))

    def make(mb):
        ids = torch.randint(0, 512, (mb, 32), generator=torch.Generator().manual_seed(0))
        return ids, ids

    p = memwrap.plan(build, make, budget="4GiB", global_batch=4, micro_batches=(2,), precisions=("fp32", "fp16"),
                     checkpoints=("full", "selective"), optimizers=("adamw",), max_grad_norm=1.0,
                     chunked_loss=(False,), margin=(0, 0))
    seen = {(c.precision, c.checkpoint, bool(c.extra.get("step_in_backward"))): c for c in p.candidates}
    # Clipping (and fp16) with the step inside backward are planned: full checkpointing recomputes in both passes;
    # selective checkpointing allows one backward per region, so wrap() refuses it and the plan says why.
    assert ("fp32", "full", True) in seen and ("fp16", "full", True) in seen
    assert ("fp32", "selective", True) not in seen and ("fp32", "selective", False) in seen
    sib, plain = seen[("fp32", "full", True)], seen[("fp32", "full", False)]
    # The second backward of the window's last micro-batch (of 2) is in the FLOPs the cost model reads.
    per_mb = plain.estimate.flops_per_micro_batch
    assert sib.estimate.flops > plain.estimate.flops + 0.4 * per_mb
    # Its memory is traced through the real wrap(): the candidate's peak is what the two passes hold.
    opts = dict(sib.options)
    est = memwrap.estimate(build, make(2), **{k: v for k, v in opts.items() if k != "optim"}, optimizer="adamw")
    assert abs(est.peak - sib.estimate.peak) <= 2048  # the planner's trace of the group and estimate()'s own
    got = memwrap.measure_peak(build, make(2), **{k: v for k, v in opts.items() if k != "optim"})["peak"]
    assert abs(est.peak - got) <= 0.01 * got


def test_a_torch_without_the_engine_queries_is_refused_at_wrap(monkeypatch):
    model = RegressionModel()
    monkeypatch.delattr(torch._C, "_will_engine_execute_node")
    with pytest.raises(ValueError, match=r"norm pass needs torch\._C\._will_engine_execute_node.*Fix:"):
        memwrap.wrap(model, torch.optim.AdamW(model.parameters()), step_in_backward=True, max_grad_norm=1.0)
    monkeypatch.undo()
    memwrap.wrap(model, torch.optim.AdamW(model.parameters()), step_in_backward=True, max_grad_norm=1.0)  # unchanged
