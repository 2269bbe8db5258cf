"""Clipping with optimizers that update inside backward (LOMO, AdaLomo, layer-wise GaLore/APOLLO): the norm pass.

``wrap(model, optimizer, max_grad_norm=c)`` with such an optimizer and the unchanged loop (``loss.backward();
optimizer.step(); optimizer.zero_grad()``) must give the parameters of the ordinary clipped step: every gradient of
the model, ``torch.nn.utils.clip_grad_norm_``, then the optimizer's own math for each parameter. References:

* layer-wise GaLore/APOLLO: the same optimizer built on a copy of the model with its hooks removed
  (``remove_hooks()``), a plain backward, ``clip_grad_norm_``, then each parameter's own optimizer stepped, as its
  hook would (the real galore-torch / apollo-torch steps);
* LOMO: the same update written out (``p <- p * (1 - lr * wd) - lr * g`` in float32, what lomo-optim's hook does)
  after ``clip_grad_norm_``, bit for bit; and lomo-optim's own two-pass clipping (``grad_norm(loss)`` then
  ``fused_backward``), which forms the norm with ``torch.norm`` instead of ``clip_grad_norm_``'s kernels: equal up
  to rounding.
"""
import copy
import importlib.util
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import memwrap
from memwrap.plugin.registry import create_optimizer
from memwrap.techniques.norm_pass import NormPass
from memwrap.testing import RegressionModel, regression_batch

BITES, LOOSE = 0.05, 1e3  # below every norm in these runs (the coefficient acts) / above every one (it does not)
LR, WD = 1e-2, 0.1
LAYERWISE = {"galore_adamw_layerwise": "galore_torch", "galore_adafactor_layerwise": "galore_torch",
             "apollo_adamw_layerwise": "apollo_torch"}
NAMES = [pytest.param(n, marks=pytest.mark.skipif(importlib.util.find_spec(mod) is None, reason=f"{mod} missing"))
         for n, mod in {"lomo": "lomo_optim", **LAYERWISE}.items()]


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # galore-torch's and transformers' deprecation notices
        return fn(*args, **kwargs)


def build(name, model):
    if name in ("lomo", "adalomo"):
        return create_optimizer(name, model, lr=LR, weight_decay=WD)
    return _quiet(create_optimizer, name, model, lr=LR, weight_decay=WD, target_modules="all-linear", rank=4,
                  update_proj_gap=2)


def base_model():
    torch.manual_seed(0)
    return RegressionModel()


def batches(updates, n=24):
    return [regression_batch(n=n, seed=k) for k in range(updates)]


def mse(model, batch):
    ids, y = batch
    return F.mse_loss(model(ids), y)


def reference(name, base, data, clip, loss_fn=mse):
    """The ordinary clipped step: all gradients, clip_grad_norm_ over the optimizer's parameters, the update."""
    model = copy.deepcopy(base)
    if name in LAYERWISE:
        opt = build(name, model)
        opt.remove_hooks()  # no update inside backward: the gradients of the whole model first
        params = [p for g in opt.param_groups for p in g["params"]]
    else:  # no optimizer at all (lomo-optim's hooks could not be removed); LOMO's one group is model.parameters()
        params = list(model.parameters())
    norms = []
    for batch in data:
        loss_fn(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        with torch.no_grad():
            if name in LAYERWISE:
                for p, inner in opt._inner.items():  # the optimizer each parameter's hook would step
                    if p.grad is not None:
                        _quiet(inner.step)
                        inner.zero_grad(set_to_none=True)
            else:  # lomo-optim's update, written out (its fuse_update, fp32, without clip_coef)
                for p in params:
                    g = p.grad.to(torch.float32)
                    w = p.data.to(torch.float32)
                    w.mul_(1.0 - LR * WD)
                    w.add_(g, alpha=-LR)
                    p.data.copy_(w)
                    p.grad = None
    return model, norms


def wrapped(name, base, data, clip, loss_fn=mse, backward=None, **options):
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=clip, **options)
    norms = []
    for batch in data:
        loss = loss_fn(m, batch)
        loss.backward() if backward is None else backward(loss, m)
        _quiet(o.step)
        o.zero_grad()
        norms.append(o.last_grad_norm)
    return model, o, norms


@pytest.mark.parametrize("clip", [BITES, LOOSE], ids=["clip-bites", "clip-loose"])
@pytest.mark.parametrize("name", NAMES)
def test_clipped_updates_inside_backward_equal_clip_grad_norm_then_the_optimizers_step(name, clip):
    base, data = base_model(), batches(4)
    ref, ref_norms = reference(name, base, data, clip)
    got, o, norms = wrapped(name, base, data, clip)
    if clip == BITES:
        assert min(ref_norms) > clip  # the coefficient is below 1 on every update
    else:
        assert max(ref_norms) < clip
    assert o.updates == 4 and o.skipped == 0
    assert o.norm_in_backward.norm.first_passes == 4  # every norm came from a first pass inside the backward
    assert norms == ref_norms
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), (name, pname, (a - b).abs().max().item())
    assert all(p.grad is None for p in got.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), got.parameters()))  # it trained


def test_lomo_equals_lomo_optims_own_two_pass_clipping():
    lomo_optim = pytest.importorskip("lomo_optim")
    base, data = base_model(), batches(4)
    theirs = copy.deepcopy(base)
    ref = lomo_optim.Lomo(theirs, lr=LR, clip_grad_norm=BITES, weight_decay=WD)
    for batch in data:
        ref.grad_norm(mse(theirs, batch))  # lomo-optim's first backward: the norm
        ref.fused_backward(mse(theirs, batch), LR)  # its second: the clipped updates
    got, o, _ = wrapped("lomo", base, data, BITES)
    for (pname, a), b in zip(theirs.named_parameters(), got.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=pname)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="AdaLomo needs CUDA (lomo-optim allocates its state there)")
def test_adalomo_equals_lomo_optims_own_two_pass_clipping_on_cuda():
    lomo_optim = pytest.importorskip("lomo_optim")
    base = base_model().cuda()
    data = [(i.cuda(), y.cuda()) for i, y in batches(4)]
    theirs = copy.deepcopy(base)
    # loss_scale=None: lomo-optim's default 1024 scales the loss inside fused_backward, which a plain loop does not.
    ref = lomo_optim.AdaLomo(theirs, lr=LR, clip_grad_norm=BITES, loss_scale=None)
    for batch in data:
        ref.grad_norm(mse(theirs, batch))
        ref.fused_backward(mse(theirs, batch), LR)
    model = copy.deepcopy(base)
    m, o = memwrap.wrap(model, create_optimizer("adalomo", model, lr=LR), max_grad_norm=BITES)
    for batch in data:
        mse(m, batch).backward()
        o.step()
        o.zero_grad()
    assert o.updates == 4 and o.optimizer.step_num == ref.step_num == 4
    for (pname, a), b in zip(theirs.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=pname)


@pytest.mark.parametrize("name", NAMES)
def test_one_gradient_is_alive_at_a_time_in_both_passes(monkeypatch, name):
    """Counted when each gradient gives its norm (first pass) and when the optimizer updates (second pass): how many
    parameters hold a .grad. Clipping must not bring back the full set of gradients these optimizers avoid."""
    base, data = base_model(), batches(2)
    model = copy.deepcopy(base)
    opt = build(name, model)
    first, second, handed = [], [], []
    original_contribute, original_update = NormPass.contribute, opt.update_in_backward

    def contribute(self, param):
        first.append(sum(p.grad is not None for p in model.parameters()))
        original_contribute(self, param)

    def update(params):
        second.append(sum(p.grad is not None for p in model.parameters()))
        handed.append(len(params))
        original_update(params)

    monkeypatch.setattr(NormPass, "contribute", contribute)
    opt.update_in_backward = update
    m, o = _quiet(memwrap.wrap, model, opt, max_grad_norm=BITES)
    n = sum(p.requires_grad for p in model.parameters())
    for batch in data:
        mse(m, batch).backward()
        assert all(p.grad is None for p in model.parameters())  # everything updated inside the backward
        o.step()
        o.zero_grad()
    assert len(first) == len(second) == 2 * n
    assert max(first) == 1 and max(second) == 1 and set(handed) == {1}


def _gpt():
    from memwrap.models import build_preset

    torch.manual_seed(0)
    return build_preset("gpt2-tiny", vocab_size=64, n_layer=2, n_embd=32, n_head=2, block_size=16)


def _lm_loss(model, x):
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


@pytest.mark.parametrize("checkpoint", [None, "full"])
@pytest.mark.parametrize("name", [n for n in NAMES if n.values[0] in ("lomo", "galore_adamw_layerwise")])
def test_tied_weights_and_checkpointed_blocks_are_exact(name, checkpoint):
    # GPT ties its embedding to the LM head (one parameter, two uses: one gradient, one update); full checkpointing
    # recomputes each block in both passes. Reference: the plain model, no checkpointing.
    base = _gpt()
    data = [torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(k)) for k in range(3)]
    ref, ref_norms = reference(name, base, data, 0.5, _lm_loss)
    got, o, norms = wrapped(name, base, data, 0.5, _lm_loss, checkpoint=checkpoint)
    assert got.lm_head.weight is got.transformer.wte.weight
    assert min(ref_norms) > 0.5 and o.norm_in_backward.norm.first_passes == 3
    assert norms == ref_norms
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), (pname, (a - b).abs().max().item())


@pytest.mark.parametrize("name", NAMES)
def test_a_non_finite_norm_skips_the_whole_update(name):
    base, data = base_model(), batches(3)
    poisoned = lambda model, batch: mse(model, batch) * (float("inf") if batch is data[1] else 1.0)  # noqa: E731
    ref, _ = reference(name, base, [data[0], data[2]], BITES)  # the poisoned update never happened
    got, o, norms = wrapped(name, base, data, BITES, poisoned)
    assert o.updates == 2 and o.skipped == 1 and not math.isfinite(norms[1])
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), pname
        assert torch.isfinite(b).all()


def _with_temperature(base):
    model = copy.deepcopy(base)
    model.temperature = torch.nn.Parameter(torch.tensor(1.5))  # used by the loss only: not through the outputs
    return model


def _tempered(model, batch):
    return mse(model, batch) / model.temperature + model.temperature.square()


@pytest.mark.parametrize("name", NAMES)
def test_a_parameter_reached_around_the_outputs_is_refused_before_any_update_and_memwrap_backward_is_exact(name):
    base, data = base_model(), batches(2)
    model = _with_temperature(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"parameter 'temperature'.*other than through the model's outputs.*"
                                           r"Nothing was updated.*Fix: finish this loss with memwrap.backward"):
        _tempered(m, data[0]).backward()
    for p, w in zip(model.parameters(), before):
        assert torch.equal(p, w)

    tempered = _with_temperature(base)
    ref, ref_norms = reference(name, tempered, data, BITES, _tempered)
    got, o, norms = wrapped(name, tempered, data, BITES, _tempered, backward=memwrap.backward)
    assert norms == ref_norms and o.norm_in_backward.norm.first_passes == 2
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), pname


@pytest.mark.parametrize("name", NAMES)
def test_a_backward_that_reaches_no_output_gets_the_ordinary_clipped_step_at_step(name):
    # A loss on the parameters alone starts no first pass: the gradients wait for step(), which takes their norm,
    # clips and updates them (all gradients are then alive at once, as the loss itself made them).
    base = base_model()
    penalty = lambda model, batch: 10 * sum(p.square().sum() for p in model.parameters())  # noqa: E731
    ref, ref_norms = reference(name, base, [None, None], BITES, penalty)
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    for _ in range(2):
        penalty(model, None).backward()
        assert sum(p.grad is not None for p in model.parameters()) == 3 + 2  # held for step()
        _quiet(o.step)
        o.zero_grad()
    assert o.updates == 2 and o.last_grad_norm == ref_norms[-1]
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), pname


@pytest.mark.parametrize("name", NAMES)
def test_a_second_backward_before_step_is_refused_and_changes_nothing(name):
    base, data = base_model(), batches(1)
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    first, second = mse(m, data[0]), mse(m, data[0])
    first.backward(retain_graph=True)  # retain_graph alone is harmless: both passes of this backward agree
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"second backward pass.*Fix: one backward per micro-batch"):
        second.backward()
    for p, w in zip(model.parameters(), after_first):
        assert torch.equal(p, w)
    with pytest.raises(RuntimeError, match=r"second backward pass.*Fix: one backward per micro-batch"):
        first.backward()  # the retained graph again
    for p, w in zip(model.parameters(), after_first):
        assert torch.equal(p, w)


@pytest.mark.parametrize("name", NAMES)
def test_create_graph_is_refused_before_any_update(name):
    base, data = base_model(), batches(1)
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's note on create_graph=True and .grad reference cycles
        with pytest.raises(RuntimeError, match=r"create_graph=True.*Nothing was updated.*Fix"):
            mse(m, data[0]).backward(create_graph=True)
    for p, w in zip(model.parameters(), base.parameters()):
        assert torch.equal(p, w)


@pytest.mark.parametrize("options, match", [
    (dict(accumulate=2), r"accumulate=2 \(it keeps no gradient between micro-batches"),
    (dict(step_in_backward=True), r"step_in_backward=True \(it already steps in backward\)"),
], ids=["accumulate", "step_in_backward"])
@pytest.mark.parametrize("name", NAMES)
def test_what_cannot_be_exact_stays_refused_with_clipping_and_changes_nothing(name, options, match):
    model = base_model()
    opt = build(name, model)
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    with pytest.raises(ValueError, match=rf"updates each parameter inside backward.*{match}.*Fix: .*clipping with "
                                         r"max_grad_norm and fp16 work"):
        memwrap.wrap(model, opt, max_grad_norm=1.0, **options)
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == hooks
    assert not opt.updates_deferred


def test_selective_checkpointing_is_refused_with_clipping_and_an_optimizer_updating_in_backward():
    pytest.importorskip("lomo_optim")
    model = _gpt()
    with pytest.raises(ValueError, match=r"checkpoint mode 'selective' with an optimizer that updates inside "
                                         r"backward and max_grad_norm=1.0.*Fix: checkpoint='full'"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=LR), optim="lomo", max_grad_norm=1.0,
                     checkpoint="selective")
    assert not memwrap.checkpointing.is_checkpointed(model.transformer.h[0])
    memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=LR), optim="lomo", checkpoint="selective")  # no clip


@pytest.mark.parametrize("name", NAMES)
def test_optim_name_conversion_clips_as_the_optimizer_built_by_hand(name):
    base, data = base_model(), batches(3)
    ref, ref_norms = reference(name, base, data, BITES)
    model = copy.deepcopy(base)
    extra = {} if name == "lomo" else dict(optim_target_modules="all-linear", optim_args="rank=4,update_proj_gap=2")
    m, o = _quiet(memwrap.wrap, model, torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD), optim=name,
                  max_grad_norm=BITES, **extra)
    for batch in data:
        mse(m, batch).backward()
        _quiet(o.step)
        o.zero_grad()
    assert o.norm_in_backward.norm.first_passes == 3 and o.last_grad_norm == ref_norms[-1]
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), pname


@pytest.mark.parametrize("options", [dict(max_grad_norm=1.0), dict(precision="fp16")], ids=["clip", "fp16"])
def test_an_optimizer_updating_in_backward_without_the_protocol_is_refused_with_the_norm_pass(options):
    class Updates(torch.optim.SGD):  # a third-party optimizer that updates inside backward by itself
        updates_in_backward = True

    model = base_model()
    with pytest.raises(ValueError, match=r"does not let memwrap's norm pass drive its updates.*cannot be exact.*"
                                         r"Fix: build it with memwrap.create_optimizer"):
        memwrap.wrap(model, Updates(model.parameters(), lr=LR), **options)
    memwrap.wrap(model, Updates(model.parameters(), lr=LR))  # without clipping or fp16, as before


@pytest.mark.parametrize("name", NAMES)
def test_unwrap_gives_the_optimizer_its_own_unclipped_hooks_back(name):
    base, data = base_model(), batches(1)
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    inner = memwrap.unwrap(o)
    assert not inner.updates_deferred
    assert sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters()) == \
        (len(list(model.parameters())) if name in LAYERWISE else 0)  # only the optimizer's own
    with pytest.raises(RuntimeError, match="unwrap"):
        o.step()
    ref = copy.deepcopy(base)
    ref_opt = build(name, ref)  # unclipped, its own hooks
    for model_, opt_ in ((model, inner), (ref, ref_opt)):
        mse(model_, data[0]).backward()
        _quiet(opt_.step)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


# --- fp16: the first pass sees every gradient before any update, so an overflow skips the whole update -------------

SCALER = {"init_scale": 2.0 ** 10, "growth_interval": 3}
OVERFLOWS = {2, 3, 7, 12, 13}  # updates whose loss is multiplied by inf
UPDATES = 16


def _carrier(name, model):
    """The optimizer's math as one ordinary ``step()`` after backward, for GradScaler and memwrap's ordinary step: the
    layer-wise optimizer with its hooks removed stepping each parameter's own optimizer; for LOMO an SGD holding the
    parameters whose step is lomo-optim's update written out."""
    if name in LAYERWISE:
        opt = build(name, model)
        opt.remove_hooks()
        opt.updates_in_backward = False  # stepped after backward here: memwrap's ordinary step

        def step(closure=None):
            for p, inner in opt._inner.items():
                if p.grad is not None:
                    _quiet(inner.step)
            return True
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)

        @torch.no_grad()
        def step(closure=None):
            for p in model.parameters():
                if p.grad is not None:
                    w = p.data.to(torch.float32)
                    w.mul_(1.0 - LR * WD)
                    w.add_(p.grad.to(torch.float32), alpha=-LR)
                    p.data.copy_(w)
            return True
    opt.step = step
    return opt


def _fp16_batch(k):
    ids, y = regression_batch(n=24, seed=k)
    return ids, y, (float("inf") if k in OVERFLOWS else 1.0)


def amp_reference(name, base, clip):
    """torch AMP's loop: autocast, scaler.scale(loss).backward(), unscale_, clip_grad_norm_, scaler.step, update."""
    model = copy.deepcopy(base)
    opt = _carrier(name, model)
    params = [p for g in opt.param_groups for p in g["params"]]
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    skipped, scales = [], []
    for k in range(UPDATES):
        ids, y, poison = _fp16_batch(k)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(ids)
        scaler.scale(F.mse_loss(out.float(), y) * poison).backward()
        scales.append(scaler.get_scale())
        scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        skipped.append(scaler.step(opt) is None)  # None: the inf check skipped the step
        scaler.update()
        opt.zero_grad(set_to_none=True)
    return model, skipped, scales


def memwrap_fp16(name, base, clip, ordinary):
    model = copy.deepcopy(base)
    opt = _carrier(name, model) if ordinary else build(name, model)
    m, o = _quiet(memwrap.wrap, model, opt, precision="fp16", scaler=SCALER, max_grad_norm=clip)
    skipped, scales = [], []
    for k in range(UPDATES):
        ids, y, poison = _fp16_batch(k)
        (F.mse_loss(m(ids), y) * poison).backward()
        scales.append(o.scaler.get_scale())
        _quiet(o.step)
        o.zero_grad()
        skipped.append(o.step_was_skipped)
    return model, o, skipped, scales


@pytest.mark.parametrize("clip", [None, BITES], ids=["no-clip", "clip"])
@pytest.mark.parametrize("name", NAMES)
def test_fp16_skips_the_updates_torch_amp_skips_and_the_scale_follows_the_same_sequence(name, clip):
    base = base_model()
    ref, ref_skipped, ref_scales = amp_reference(name, base, clip)
    ordinary, _, ord_skipped, ord_scales = memwrap_fp16(name, base, clip, ordinary=True)
    got, o, skipped, scales = memwrap_fp16(name, base, clip, ordinary=False)
    assert o.norm_in_backward is not None and o.norm_in_backward.norm.first_passes == UPDATES
    assert [k for k, s in enumerate(ref_skipped) if s] == sorted(OVERFLOWS)
    assert skipped == ord_skipped == ref_skipped
    assert scales == ord_scales == ref_scales and len(set(scales)) > 2  # backed off and grew again
    assert o.skipped == len(OVERFLOWS) and o.updates == UPDATES - len(OVERFLOWS)
    # memwrap's ordinary fp16 step (unscale_, clip_grad_norm_, the step after backward): the same ops, the same bits.
    for (pname, a), b in zip(ordinary.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), (pname, (a - b).abs().max().item())
    # torch AMP scales the loss, memwrap the outputs' gradient: equal up to the rounding of that product.
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=pname)


# --- TrainingArguments' defaults (max_grad_norm=1.0) -------------------------------------------------------------

@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
@pytest.mark.parametrize("name", NAMES)
def test_training_arguments_defaults_no_longer_block_them(tmp_path, name):
    """options_from(TrainingArguments(optim=...)) carries Trainer's default max_grad_norm=1.0: wrap() clips."""
    from tests.hf_helpers import hf_args

    extra = {} if name == "lomo" else dict(optim_target_modules="all-linear", optim_args="rank=4,update_proj_gap=2")
    args = hf_args(tmp_path, optim=name, gradient_accumulation_steps=1, learning_rate=LR, weight_decay=WD, **extra)
    assert args.max_grad_norm == 1.0
    options = _quiet(memwrap.options_from, args)  # its note on the fields a plain loop handles itself
    base, data = base_model(), batches(3)
    ref, ref_norms = reference(name, base, data, 1.0)
    model = copy.deepcopy(base)
    # SGD carries lr and weight_decay only (no betas/eps of its own to carry into GaLore's/APOLLO's AdamW).
    m, o = _quiet(memwrap.wrap, model, torch.optim.SGD(model.parameters(), lr=LR, weight_decay=WD), **options)
    for batch in data:
        mse(m, batch).backward()
        _quiet(o.step)
        o.zero_grad()
    assert o.max_grad_norm == 1.0 and min(ref_norms) > 1.0  # the default clip acts here
    assert o.last_grad_norm == ref_norms[-1]
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), pname


@pytest.mark.parametrize("clip", [None, 1.0])
def test_the_planner_plans_them_with_clipping_as_wrap_runs_them(clip):
    """Their trace's stand-in steps inside backward (and runs the norm pass with clipping), as wrap() runs them: the
    plan's LOMO candidate is the estimate of LOMO, which the real CPU step measures to the bytes, and its options
    are wrap()'s (no step_in_backward, which wrap() refuses with LOMO)."""
    pytest.importorskip("lomo_optim")
    from memwrap.memory import plan
    from memwrap.memory.measure import measure_peak
    from memwrap.models import build_preset, preset_batch

    batch = lambda mb: preset_batch("gpt2-tiny", mb, 32)  # noqa: E731
    kw = {} if clip is None else {"max_grad_norm": clip}
    result = plan(lambda: build_preset("gpt2-tiny"), batch, budget="1GiB", global_batch=2, micro_batches=(2,),
                  precisions=("fp32",), checkpoints=(None,), optimizers=("lomo", "adamw"), margin=(0.0, 0),
                  step_in_backward=(False,), chunked_loss=(False,), **kw)
    (lomo,) = [c for c in result.candidates if c.optim == "lomo"]
    assert "step_in_backward" not in lomo.options and lomo.options.get("max_grad_norm") == clip
    direct = memwrap.estimate(lambda: build_preset("gpt2-tiny"), batch(2), optimizer="lomo", **kw)
    assert lomo.estimate.peak == direct.peak
    measured = measure_peak(lambda: build_preset("gpt2-tiny"), batch(2), optimizer="lomo", **kw)["peak"]
    assert abs(direct.peak - measured) <= 0.01 * measured, (direct.peak, measured)
    assert lomo.options["optim"] == "lomo"
    model = build_preset("gpt2-tiny")  # the options as pasted, with the LOMO the user built
    options = {k: v for k, v in lomo.options.items() if k != "optim"}
    wmodel, wopt = memwrap.wrap(model, memwrap.create_optimizer("lomo", model, lr=1e-3), **options)
    ids, _ = batch(2)
    before = [p.detach().clone() for p in model.parameters()]
    wmodel(ids).float().pow(2).mean().backward()
    wopt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()) if b.requires_grad)


def test_the_optimizer_alone_is_refused_with_clipping():
    # (fp16 without the model is refused before, for every optimizer: the model applies the loss scale.)
    pytest.importorskip("lomo_optim")
    model = base_model()
    opt = build("lomo", model)
    with pytest.raises(ValueError, match=r"starts from the wrapped model's outputs, and no model was passed.*Fix: "
                                         r"model, optimizer = memwrap.wrap\(model, optimizer"):
        memwrap.wrap(opt, max_grad_norm=1.0)
    assert not opt.updates_deferred


@pytest.mark.parametrize("name", NAMES)
def test_a_loss_over_two_forward_calls_is_refused_and_memwrap_backward_is_exact(name):
    two_calls = lambda model, batch: mse(model, batch) + mse(model, (batch[0].flip(0), batch[1]))  # noqa: E731
    base, data = base_model(), batches(2)
    model = copy.deepcopy(base)
    m, o = _quiet(memwrap.wrap, model, build(name, model), max_grad_norm=BITES)
    with pytest.raises(RuntimeError, match=r"goes through 2 forward calls of the model.*Nothing was updated.*Fix: "
                                           r"finish this loss with memwrap.backward\(loss, model\)"):
        two_calls(m, data[0]).backward()
    for p, w in zip(model.parameters(), base.parameters()):
        assert torch.equal(p, w)
    ref, ref_norms = reference(name, base, data, BITES, two_calls)
    got, o, norms = wrapped(name, base, data, BITES, two_calls, backward=memwrap.backward)
    assert norms == ref_norms
    for (pname, a), b in zip(ref.named_parameters(), got.parameters(), strict=True):
        assert torch.equal(a, b), pname


# Inside transformers.Trainer's own loop: tests/test_trainer_norm_pass.py.
