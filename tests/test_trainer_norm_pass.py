"""``max_grad_norm`` inside ``transformers.Trainer`` for optimizers that update inside backward (issue 21 item 4).

Trainer clips after its backward, when LOMO / layer-wise GaLore / APOLLO have already updated every parameter and
freed its gradient (its own versions of them train unclipped). With memwrap's optimizer
(``memwrap_trainer_kwargs``) the run is clipped by memwrap's norm pass inside Trainer's one backward: the parameters
must equal the ordinary clipped step (every gradient, ``clip_grad_norm_``, then the optimizer's own update; the
reference of tests/test_norm_pass_in_backward.py) on the very batches Trainer fed, bit for bit, and the norms must be
``clip_grad_norm_``'s. What cannot be exact in a Trainer run is refused before anything changes.
"""
import copy
import importlib.util
import warnings

import pytest
import torch
import torch.nn.functional as F

from memwrap.checkpointing.apply import current_report
from memwrap.testing import RegressionModel, regression_batch
import tests.test_norm_pass_in_backward as plain_loop
from memwrap.plugin.registry import create_optimizer
from tests.test_norm_pass_in_backward import BITES, LAYERWISE, LOOSE, LR, NAMES, WD, base_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
from tests.hf_helpers import hf_args  # noqa: E402

STEPS, BATCH = 3, 8


class Regression(RegressionModel):
    """RegressionModel with Trainer's calling convention: keyword inputs, the loss in the outputs."""

    def forward(self, ids, target=None):
        out = super().forward(ids)
        return {"loss": F.mse_loss(out, target), "prediction": out}


def _same_hyperparameters(name):
    # What tests/test_norm_pass_in_backward.build() gives the optimizer, over Trainer's: the reference's.
    low_rank = dict(target_modules="all-linear", rank=4, update_proj_gap=2) if name in LAYERWISE else {}
    return dict(weight_decay=WD, **low_rank)


def _data():
    ids, y = regression_batch(n=STEPS * BATCH, seed=3)
    return [{"ids": i, "target": t} for i, t in zip(ids, y)]


def _trainer(tmp_path, name, model, clip, checkpoint=None, taken_over=False, **args_kw):
    """A Trainer with memwrap's ``name``: given as ``optim=`` (``args.optim`` another), or ``taken_over`` from
    ``args.optim`` (then Trainer itself treats it as its LOMO: accelerate's ``fused_backward``, a no-op ``step()``)."""
    from transformers import Trainer, TrainerCallback

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    if taken_over and name in LAYERWISE:
        args_kw.update(optim_target_modules="all-linear", optim_args="rank=4,update_proj_gap=2")
    args = hf_args(tmp_path, optim=name if taken_over else "adamw_torch", learning_rate=LR, per_device_train_batch_size=BATCH,
                   gradient_accumulation_steps=1, max_steps=STEPS, lr_scheduler_type="constant", max_grad_norm=clip,
                   **args_kw)
    norms = []

    class Norms(TrainerCallback):  # memwrap's norm of each update, as Trainer's loop goes
        def on_step_end(self, args, state, control, optimizer=None, **kw):
            norms.append(optimizer.optimizer.memwrap_norm_pass.last_grad_norm)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # galore-torch's and transformers' deprecation notices
        kwargs = memwrap_trainer_kwargs(model, args, optim=None if taken_over else name, checkpoint=checkpoint,
                                        **_same_hyperparameters(name))
        trainer = Trainer(model=model, args=args, train_dataset=_data(), callbacks=[Norms()], **kwargs)
    return trainer, norms


def _train_recording(trainer, model):
    """Train, and return the batches the model saw in training, in order (what the reference replays)."""
    fed = []
    handle = model.register_forward_pre_hook(
        lambda m, a, kw: fed.append((kw["ids"].clone(), kw["target"].clone())) if m.training else None,
        with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    handle.remove()
    return fed


def _plain(base):
    model = Regression()
    model.load_state_dict(base.state_dict())
    return model


def reference(monkeypatch, trainer, name, base, fed, clip):
    """tests/test_norm_pass_in_backward.reference (every gradient, clip_grad_norm_, the optimizer's own update) on the
    batches Trainer fed, with the hyperparameters Trainer gave the optimizer (Trainer's adam_epsilon, APOLLO's
    scale_type, ...): the ordinary clipped step of this very run."""
    from memwrap.integrations.transformers.trainer import trainer_hyperparameters

    hyperparameters = {**trainer_hyperparameters(trainer.args, name), **_same_hyperparameters(name)}
    monkeypatch.setattr(plain_loop, "build", lambda n, model: plain_loop._quiet(create_optimizer, n, model,
                                                                                **hyperparameters))
    return plain_loop.reference(name, _plain(base), fed, clip, loss_fn=_mse)


def _mse(model, batch):
    ids, y = batch
    return F.mse_loss(RegressionModel.forward(model, ids), y)


@pytest.mark.parametrize("taken_over", [False, True], ids=["optim=", "args.optim"])
@pytest.mark.parametrize("clip", [BITES, LOOSE], ids=["clip-bites", "clip-loose"])
@pytest.mark.parametrize("name", NAMES)
def test_a_trainer_run_is_clipped_exactly_as_the_ordinary_clipped_step(tmp_path, monkeypatch, name, clip, taken_over):
    base = base_model()
    model = _plain(base)
    trainer, norms = _trainer(tmp_path, name, model, clip, taken_over=taken_over)
    fed = _train_recording(trainer, model)
    assert len(fed) == STEPS
    ref, ref_norms = reference(monkeypatch, trainer, name, base, fed, clip)
    if clip == BITES:
        assert min(ref_norms) > clip  # the clip acts on every update
    else:
        assert max(ref_norms) < clip
    assert norms == ref_norms
    norm_pass = trainer.optimizer.optimizer.memwrap_norm_pass
    assert (norm_pass.updates, norm_pass.skipped) == (STEPS, 0)
    assert norm_pass.wrapped.norm_in_backward.norm.first_passes == STEPS  # each norm from a first pass in backward
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), (name, pname, (a - b).abs().max().item())
    assert all(p.grad is None for p in model.parameters())
    assert list(model.state_dict()) == list(base.state_dict())  # the user's keys, not a wrapper's


@pytest.mark.parametrize("name", NAMES)
def test_checkpointing_applied_by_memwrap_trainer_kwargs_keeps_the_clip_exact(tmp_path, monkeypatch, name):
    base = base_model()
    model = _plain(base)
    trainer, norms = _trainer(tmp_path, name, model, BITES, checkpoint={"Linear"})
    assert current_report(model).modules  # the Linears are checkpointed: recomputed in both passes
    fed = _train_recording(trainer, model)
    ref, ref_norms = reference(monkeypatch, trainer, name, base, fed, BITES)
    assert norms == ref_norms
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), (name, pname)


def test_lomo_in_trainer_equals_lomo_optims_own_two_pass_clipping(tmp_path):
    """An independent reference: lomo-optim's own clipping (``grad_norm(loss)``, then ``fused_backward``), which Trainer
    never calls; it forms the norm with ``torch.norm``, so equal up to rounding."""
    lomo_optim = pytest.importorskip("lomo_optim")
    base = base_model()
    model = _plain(base)
    trainer, _ = _trainer(tmp_path, "lomo", model, BITES)
    fed = _train_recording(trainer, model)
    _equals_lomo_optims_own(lomo_optim.Lomo, _plain(base), model, fed, rtol=1e-6, atol=1e-7)


def _equals_lomo_optims_own(cls, theirs, model, fed, **tolerance):
    """lomo-optim's own two-pass clipping on ``theirs`` over the batches Trainer fed, against the Trainer run."""
    ref = cls(theirs, lr=LR, clip_grad_norm=BITES, weight_decay=WD)
    for batch in fed:
        ref.grad_norm(_mse(theirs, batch))  # its first backward: the norm
        ref.fused_backward(_mse(theirs, batch), LR)  # its second: the clipped updates
    for (pname, a), b in zip(theirs.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=pname, **tolerance)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="AdaLomo needs CUDA (see benchmarks/gpu_check.py)")
def test_adalomo_in_trainer_equals_lomo_optims_own_two_pass_clipping_on_cuda(tmp_path):
    """accelerate calls AdaLomo's fused_backward, which scales the loss by its loss_scale; with the norm pass attached
    it must not (the norm is of the true gradients), and the clip must equal lomo-optim's own."""
    lomo_optim = pytest.importorskip("lomo_optim")
    base = base_model()
    model = _plain(base).cuda()
    trainer, _ = _trainer(tmp_path, "adalomo", model, BITES, use_cpu=False)
    fed = _train_recording(trainer, model)
    _equals_lomo_optims_own(lomo_optim.AdaLomo, _plain(base).cuda(), model, fed, rtol=1e-5, atol=1e-6)


# --- refused before anything changes -----------------------------------------------------------------------------

def _refused(tmp_path, monkeypatch, name, match, checkpoint=None, world_size=None, set_after=None, **args_kw):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = _plain(base_model())
    before = copy.deepcopy(model.state_dict())
    hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    args = hf_args(tmp_path, optim="adamw_torch", learning_rate=LR, max_grad_norm=1.0,
                   **{"gradient_accumulation_steps": 1, **args_kw})
    if world_size is not None:
        monkeypatch.setattr(type(args), "world_size", property(lambda self: world_size))
    for field, value in (set_after or {}).items():  # what TrainingArguments itself refuses on a CPU-only machine
        setattr(args, field, value)
    with pytest.raises(ValueError, match=match):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            memwrap_trainer_kwargs(model, args, optim=name, checkpoint=checkpoint, **_same_hyperparameters(name))
    assert current_report(model) is None  # no checkpointing applied
    assert hooks == [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]
    assert all(torch.equal(a, b) for a, b in zip(before.values(), model.state_dict().values()))
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_gradient_accumulation_is_refused_with_the_fix(tmp_path, monkeypatch, name):
    match = "cannot accumulate|gradient_accumulation_steps=2.*Fix"
    _refused(tmp_path, monkeypatch, name, match, gradient_accumulation_steps=2)


@pytest.mark.parametrize("name", NAMES)
def test_several_processes_are_refused_with_the_fix(tmp_path, monkeypatch, name):
    _refused(tmp_path, monkeypatch, name, "2 processes.*drift apart.*Fix", world_size=2)


@pytest.mark.parametrize("name", NAMES)
def test_fp16_is_refused_with_the_fix(tmp_path, monkeypatch, name):
    # TrainingArguments refuses fp16 on a CPU-only run itself; memwrap's check reads the field, as a GPU run sets it.
    _refused(tmp_path, monkeypatch, name, r"fp16=True.*scaled gradient.*Fix: bf16=True", set_after={"fp16": True})


@pytest.mark.parametrize("name", NAMES)
def test_selective_checkpointing_with_the_clip_is_refused_with_the_fix(tmp_path, monkeypatch, name):
    _refused(tmp_path, monkeypatch, name, "selective.*Fix: checkpoint='full'", checkpoint="selective")


def test_without_max_grad_norm_nothing_is_attached(tmp_path):
    pytest.importorskip("lomo_optim")
    model = _plain(base_model())
    trainer, _ = _trainer(tmp_path, "lomo", model, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = trainer.create_optimizer()
    assert getattr(opt, "memwrap_norm_pass", None) is None and not opt.updates_deferred
    assert not model._forward_hooks


@pytest.mark.parametrize("name", NAMES)
def test_trainers_bf16_autocast_keeps_the_clip_exact(tmp_path, monkeypatch, name):
    """TrainingArguments(bf16=True): accelerate runs the forward under CPU autocast; the reference's forward too."""
    base = base_model()
    model = _plain(base)
    trainer, norms = _trainer(tmp_path, name, model, BITES, bf16=True)
    fed = _train_recording(trainer, model)

    def autocast_mse(m, batch):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return _mse(m, batch)

    from memwrap.integrations.transformers.trainer import trainer_hyperparameters

    hyperparameters = {**trainer_hyperparameters(trainer.args, name), **_same_hyperparameters(name)}
    monkeypatch.setattr(plain_loop, "build", lambda n, m: plain_loop._quiet(create_optimizer, n, m, **hyperparameters))
    ref, ref_norms = plain_loop.reference(name, _plain(base), fed, BITES, loss_fn=autocast_mse)
    assert norms == ref_norms
    for (pname, a), b in zip(ref.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), (name, pname)
    _, fp32_norms = plain_loop.reference(name, _plain(base), fed, BITES, loss_fn=_mse)
    assert fp32_norms != ref_norms  # autocast did act: the comparison is of the bf16 run


def test_remove_gives_the_optimizer_its_own_unclipped_hooks_back(tmp_path):
    pytest.importorskip("lomo_optim")
    model = _plain(base_model())
    trainer, _ = _trainer(tmp_path, "lomo", model, BITES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner = trainer.create_optimizer()  # before accelerate's prepare(): the optimizer memwrap built
    assert inner.updates_deferred and model._forward_hooks
    inner.memwrap_norm_pass.remove()
    assert not inner.updates_deferred and not model._forward_hooks
    before = [p.detach().clone() for p in model.parameters()]
    ids, y = regression_batch(n=BATCH, seed=9)
    model(ids=ids, target=y)["loss"].backward()  # LOMO's own hooks update again, inside this backward
    inner.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
