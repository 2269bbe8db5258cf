"""memwrap_trainer_kwargs and wrap_options against Trainer's own meaning of TrainingArguments (CPU, tiny LLaMA)."""
from __future__ import annotations

import importlib.util
import warnings
from types import SimpleNamespace

import pytest
import torch

import memwrap
from memwrap.checkpointing.apply import is_checkpointed
from memwrap.plugin.registry import ConversionWarning

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")


from tests.hf_helpers import hf_args  # noqa: E402
from tests.hf_helpers import tiny_llama as _tiny_llama  # noqa: E402


def tiny_llama():
    return _tiny_llama(hidden=32)


def train(tmp_path, use_memwrap: bool, **args_kw):
    """Three Trainer steps; with memwrap, its kwargs come from args alone (checkpoint='auto', no optim=)."""
    from transformers import Trainer

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model, args = tiny_llama(), hf_args(tmp_path, **args_kw)
    extra = memwrap_trainer_kwargs(model, args, checkpoint="auto") if use_memwrap else {}
    ids = torch.randint(0, 128, (12, 8), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids], **extra)
    trainer.train()
    return model, getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it


def memwrap_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "memwrap" in str(w.message) or issubclass(w.category, ConversionWarning)]


# --- args.optim: taken over only where memwrap builds exactly Trainer's optimizer ---------------

@pytest.mark.parametrize("optim", [
    "adafactor",  # transformers.Adafactor(relative_step=False) in both (memwrap's plugin wraps transformers' class)
    pytest.param("lion_8bit", marks=needs_bnb),  # Trainer passes adam_beta1/2 as Lion's betas
    "sgd",
    "adamw_torch_fused",
])
def test_args_optim_trains_exactly_like_plain_trainer(tmp_path, optim):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the "Trainer keeps its own optimizer" note is checked below
        ours, ours_opt = train(tmp_path / "a", True, optim=optim)
    theirs, theirs_opt = train(tmp_path / "b", False, optim=optim)
    # Trainer's Lion(optim_bits=8) is memwrap's Lion8bit; every other class is the very same.
    assert type(ours_opt).__name__.removesuffix("8bit") == type(theirs_opt).__name__
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
    assert [n for n, m in ours.named_modules() if is_checkpointed(m)] == ["model.layers.0", "model.layers.1"]


@pytest.mark.parametrize("optim", ["adamw_anyprecision"])  # every other Trainer name is taken over (test_hf_optimizers)
def test_other_args_optim_keeps_trainers_optimizer_and_says_so(tmp_path, optim):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = tiny_llama()
    with pytest.warns(UserWarning, match=f"Trainer keeps its own optimizer for TrainingArguments\\(optim='{optim}'\\) "
                                         "and memwrap only applies checkpointing"):
        assert memwrap_trainer_kwargs(model, hf_args(tmp_path, optim=optim), checkpoint="auto") == {}
    assert is_checkpointed(model.model.layers[0])


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", pytest.param("adamw_bnb_8bit", marks=needs_bnb),
                                   pytest.param("paged_adamw_8bit", marks=needs_bnb),
                                   pytest.param("lion_8bit", marks=needs_bnb)])
def test_args_optim_taken_over_silently_with_trainers_hyperparameters(tmp_path, optim):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    args = hf_args(tmp_path, optim=optim, learning_rate=2e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _, hyperparameters = memwrap_trainer_kwargs(tiny_llama(), args)["optimizer_cls_and_kwargs"]
    assert not memwrap_warnings(record)
    expected = {"lr": 2e-4, "betas": (0.8, 0.95)}  # what transformers.trainer_optimizer passes for these names
    if optim != "lion_8bit":
        expected["eps"] = 1e-6
    if optim == "adamw_torch_fused":
        expected["fused"] = True
    assert hyperparameters == expected


def test_explicit_optim_with_other_lr_meaning_warns(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    with pytest.warns(ConversionWarning, match=r"(?s)transformers\.Adafactor.*lr caps a relative step"):
        kwargs = memwrap_trainer_kwargs(tiny_llama(), hf_args(tmp_path), optim="torch_adafactor")
    cls, hyperparameters = kwargs["optimizer_cls_and_kwargs"]
    assert type(cls(torch.nn.Linear(2, 2).parameters(), **hyperparameters)) is torch.optim.Adafactor  # as asked


def test_optimizer_kwargs_for_an_optimizer_not_built_raise(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = tiny_llama()
    with pytest.raises(TypeError, match="momentum.*Trainer keeps its own optimizer"):
        memwrap_trainer_kwargs(model, hf_args(tmp_path, optim="adamw_anyprecision"), checkpoint="auto", momentum=0.9)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_args_are_required(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = tiny_llama()
    for kwargs in ({"optim": "adamw"}, {"optim": "adamw", "checkpoint": "auto"}, {"checkpoint": "auto"}):
        # Without args the optimizer would train at the backend's lr (1e-3), not the run's learning_rate.
        with pytest.raises(TypeError, match=r"needs the TrainingArguments.*memwrap_trainer_kwargs\(model, args"):
            memwrap_trainer_kwargs(model, **kwargs)
    assert not any(is_checkpointed(m) for m in model.modules())


def test_wrapped_model_is_refused(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = tiny_llama()
    wrapped, _ = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), accumulate=2)
    with pytest.raises(TypeError, match=r"wrap\(\)'ped.*memwrap\.unwrap\(model\)"):
        memwrap_trainer_kwargs(wrapped, hf_args(tmp_path), checkpoint="auto")


# --- wrap_options: every unapplied field named, overrides win --------------------------------

def test_wrap_options_names_every_field_wrap_does_not_apply(tmp_path):
    from memwrap.integrations.transformers.trainer import wrap_options

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # gradient_checkpointing_kwargs is deprecated in v5
        template = hf_args(tmp_path, gradient_accumulation_steps=8, optim="adamw_bnb_8bit", learning_rate=2e-4,
                           adam_beta2=0.95, adam_epsilon=1e-6, lr_scheduler_type="cosine", warmup_steps=10,
                           gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.warns(UserWarning) as record:
        options = wrap_options(template)
    assert options["gradient_accumulation_steps"] == 8 and options["optim"] == "adamw_bnb_8bit"
    (message,) = [str(w.message) for w in record if "wrap() does not apply" in str(w.message)]
    for field in ("learning_rate=0.0002", "weight_decay=0.1", "adam_beta2=0.95", "adam_epsilon=1e-06",
                  "lr_scheduler_type='cosine'", "warmup_steps=10", "max_steps=3", "per_device_train_batch_size=2",
                  "activation_checkpointing_kwargs={'use_reentrant': True}", "seed=0"):
        assert field in message, field
    for name in ("output_dir", "gradient_checkpointing_kwargs", "gradient_accumulation_steps", "optim=", "adam_beta1"):
        assert name not in message, name  # output_dir, a mirrored alias, fields wrap() reads, defaults


def test_wrap_options_is_silent_for_a_default_template(tmp_path):
    from transformers import TrainingArguments

    from memwrap.integrations.transformers.trainer import wrap_options

    template = TrainingArguments(output_dir=str(tmp_path), gradient_accumulation_steps=4)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert wrap_options(template)["gradient_accumulation_steps"] == 4
    assert not [w for w in record if "wrap() does not apply" in str(w.message)]
    with pytest.warns(UserWarning, match="learning_rate=0.001"):  # duck-typed: the known HF defaults
        wrap_options(SimpleNamespace(gradient_accumulation_steps=2, learning_rate=1e-3, weight_decay=0.0))


@pytest.mark.parametrize("name", ["gradient_checkpointing", "activation_checkpointing"])
@pytest.mark.parametrize("override", [False, None, "selective"])
def test_wrap_options_checkpoint_override_wins_over_either_hf_name(name, override):
    from memwrap.integrations.transformers.trainer import wrap_options

    assert wrap_options(SimpleNamespace(**{name: True}), checkpoint=override) == {"checkpoint": override}


# --- accumulation counted outside memwrap: a real accelerate loop against the big batch -------------------------

X = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
Y = torch.randn(8, 1, generator=torch.Generator().manual_seed(2))


def _net():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def big_batch_update(max_grad_norm=None):
    """The weights after one SGD update on all 8 samples, the plain way."""
    net = _net()
    torch.nn.functional.mse_loss(net(X), Y).backward()
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm)
    torch.optim.SGD(net.parameters(), lr=0.1).step()
    return net


def accelerate_loop(acc_steps, accumulate, order, **wrap_kw):
    """Accelerator(gradient_accumulation_steps=acc_steps), memwrap accumulate=; 8 samples in acc_steps x accumulate
    micro-batches, through accelerate's own loop (accumulate(), backward(), step(), zero_grad())."""
    from accelerate import Accelerator

    net = _net()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=acc_steps)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if order == "prepare, then wrap":
        model, opt = memwrap.wrap(*acc.prepare(net, opt), accumulate=accumulate, **wrap_kw)
    else:
        model, opt = acc.prepare(*memwrap.wrap(net, opt, accumulate=accumulate, **wrap_kw))
    n = acc_steps * accumulate
    for x, y in zip(X.chunk(n), Y.chunk(n)):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    return net


def assert_same_weights(got, want):
    for p, q in zip(got.parameters(), want.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("acc_steps, accumulate, order, wrap_kw", [
    (1, 4, "prepare, then wrap", {}),  # memwrap accumulates
    (2, 1, "prepare, then wrap", {}),  # accelerate accumulates; memwrap passes each step() on
    (2, 1, "wrap, then prepare", {}),
    (2, 1, "wrap, then prepare", {"max_grad_norm": 0.1}),  # memwrap clips the whole window accelerate closes
    (1, 2, "wrap, then prepare", {"max_grad_norm": 0.1}),
])
def test_one_accumulation_in_an_accelerate_loop_equals_the_big_batch(acc_steps, accumulate, order, wrap_kw):
    pytest.importorskip("accelerate")
    got = accelerate_loop(acc_steps, accumulate, order, **wrap_kw)
    assert_same_weights(got, big_batch_update(wrap_kw.get("max_grad_norm")))


@pytest.mark.parametrize("wrap_kw, named", [
    ({"accumulate": 2}, "accumulate=2"),  # was: 0.5x the big batch's update, no error
    ({"max_grad_norm": 0.1}, "max_grad_norm=0.1"),  # was: each partial gradient clipped
    ({"optim": "adamw"}, "optim='adamw'"),  # was: the converted optimizer stepped every micro-batch
])
def test_memwrap_window_work_on_a_prepared_accumulating_optimizer_is_refused_at_wrap(wrap_kw, named):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    net = _net()
    model, opt = Accelerator(cpu=True, gradient_accumulation_steps=2).prepare(net, torch.optim.SGD(net.parameters(),
                                                                                                    lr=0.1))
    with pytest.raises(ValueError, match=rf"AcceleratedOptimizer \(around SGD\) of an Accelerator\(gradient_"
                                         rf"accumulation_steps=2\).*{named}.*Fix: .*wrap\(\) before accelerator"):
        memwrap.wrap(model, opt, **wrap_kw)
    assert memwrap.wrap(model, opt) is not None  # the refused call left nothing behind


def test_accumulation_in_memwrap_inside_a_prepared_wrapper_is_refused_at_the_first_step():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    net, before = _net(), _net()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(*memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2))
    with acc.accumulate(model):  # accelerate's first micro-batch: its wrapper does not call memwrap's step()
        acc.backward(model(X[:4]).pow(2).mean())
        opt.step()
        opt.zero_grad()
    with acc.accumulate(model):  # accelerate's window closes: memwrap's first step() sees the wrapper
        acc.backward(model(X[4:]).pow(2).mean())
        with pytest.raises(ValueError, match="accumulate=2 and accelerate's gradient_accumulation_steps=2 are both"):
            opt.step()
    assert_same_weights(net, before)  # nothing was applied


def test_a_plain_loop_after_an_accelerate_run_is_not_refused():
    # accelerate's gradient state is process-wide and outlives a run: it is read only through an object that wraps
    # this very optimizer.
    pytest.importorskip("accelerate")
    accelerate_loop(2, 1, "wrap, then prepare")
    net = _net()
    model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
    for x, y in zip(X.chunk(2), Y.chunk(2)):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert_same_weights(net, big_batch_update())


def test_the_first_step_keeps_none_of_its_callers_locals_alive():
    # The old check read the callers' frames (f_locals), whose snapshot kept a deleted model alive.
    import gc
    import weakref

    def train():
        net = torch.nn.Linear(4, 1)
        model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
        model(X).sum().backward()
        opt.step()
        dropped = weakref.ref(net)
        del net, model, opt
        gc.collect()
        return dropped() is None  # asked while this frame still runs

    assert train()


def test_a_wrapped_pair_handed_to_trainer_with_its_own_accumulation_is_refused(tmp_path):
    from transformers import Trainer

    model = tiny_llama()
    wm, wo = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), accumulate=2)
    ids = torch.randint(0, 128, (12, 8), generator=torch.Generator().manual_seed(0))
    trainer = Trainer(model=wm, args=hf_args(tmp_path, remove_unused_columns=False), optimizers=(wo, None),
                      train_dataset=[{"input_ids": x, "labels": x} for x in ids])
    with pytest.raises(ValueError, match="accumulate=2 and the Trainer's gradient_accumulation_steps=2"):
        trainer.train()


class NoKwargsLM(torch.nn.Module):
    """A model whose forward names its inputs and takes no **kwargs (Trainer must not pass num_items_in_batch)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) if labels is not None else None
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_trainer_sees_the_wrapped_models_own_signature(tmp_path, remove_unused_columns):
    # WrappedModule.forward(*args, **kwargs) hid the inner signature: Trainer passed num_items_in_batch to a forward
    # without **kwargs (TypeError), and remove_unused_columns=True (the default) kept no column but "labels".
    import inspect

    from transformers import Trainer

    ids = torch.randint(0, 32, (8, 6), generator=torch.Generator().manual_seed(0))
    extra = {"unused": 0} if remove_unused_columns else {}  # Trainer must drop it, and only it
    data = [{"input_ids": x, "labels": x, **extra} for x in ids]

    def train(model):
        args = hf_args(tmp_path, max_steps=2, weight_decay=0.0, remove_unused_columns=remove_unused_columns)
        Trainer(model=model, args=args, train_dataset=data).train()

    wrapped = memwrap.wrap(NoKwargsLM(), checkpoint={"Linear"})
    assert inspect.signature(wrapped.forward) == inspect.signature(wrapped.module.forward)
    plain = NoKwargsLM()
    train(plain)
    train(wrapped)
    for p, q in zip(plain.parameters(), wrapped.module.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=0)


# --- step_in_backward and accelerate (issue 22 item 32) ----------------------------------------------------------

def test_step_in_backward_on_a_prepared_optimizer_names_accelerate_and_the_order_that_works():
    # Was: "use torch.optim.AdamW", although the user's optimizer is AdamW inside accelerate's wrapper.
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    net = _net()
    model, opt = Accelerator(cpu=True).prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    with pytest.raises(ValueError, match=r"AcceleratedOptimizer around AdamW.*Fix: wrap\(\) before "
                                         r"accelerator.prepare\(\)"):
        memwrap.wrap(model, opt, step_in_backward=True)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_step_in_backward_wrapped_before_prepare_trains_like_plain_adamw(accumulate):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    plain = _net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x, y in zip(X.chunk(2), Y.chunk(2)):  # two updates
        torch.nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    net = _net()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=1)
    model, opt = acc.prepare(*memwrap.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2), accumulate=accumulate,
                                           step_in_backward=True))
    for x, y in zip(X.chunk(2 * accumulate), Y.chunk(2 * accumulate)):
        with acc.accumulate(model):
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    assert_same_weights(net, plain)


@pytest.mark.parametrize("accumulate, match", [
    # memwrap's step() is not called on accelerate's first micro-batch: the second backward is refused at once
    (1, "a second backward pass through the wrapped model's outputs"),
    (2, r"step_in_backward=True inside a loop that accumulates \(accelerate's gradient_accumulation_steps=2\)"),
])
def test_step_in_backward_inside_an_accumulating_accelerate_loop_is_refused(accumulate, match):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    net = _net()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, opt = acc.prepare(*memwrap.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-2), accumulate=accumulate,
                                           step_in_backward=True))
    with pytest.raises(ValueError if accumulate > 1 else RuntimeError, match=match):
        for x, y in zip(X.chunk(4), Y.chunk(4)):
            with acc.accumulate(model):
                acc.backward(torch.nn.functional.mse_loss(model(x), y))
                opt.step()
                opt.zero_grad()
