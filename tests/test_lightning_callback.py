"""MemwrapCallback against plain Lightning runs (same seed, same data, no callback), on CPU.

Each test fits a tiny module for a few steps with and without the callback and compares what Lightning
saw: the LR of every param group at every step, the trained parameters, the blocks' forward calls.
"""
from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import lightning as L  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from memwrap.integrations.lightning.callback import MemwrapCallback  # noqa: E402

needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")
lr_scheduler = torch.optim.lr_scheduler


def fit(module, callbacks=(), steps=6, **trainer_kw):
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", callbacks=list(callbacks), enable_progress_bar=False,
                        logger=False, enable_model_summary=False, enable_checkpointing=False, **trainer_kw)
    g = torch.Generator().manual_seed(0)
    data = list(zip(torch.randn(2 * steps, 8, generator=g), torch.randn(2 * steps, 1, generator=g)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(data, batch_size=2))
    module.warned = [str(w.message) for w in caught]
    return trainer


def max_diff(a, b) -> float:
    return max((p.detach() - q.detach()).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


class Regressor(L.LightningModule):
    """Two param groups with different LRs; records every group's LR at every step."""

    def __init__(self, scheduler=None, fused=True, fail=False):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.make_scheduler, self.fused, self.fail = scheduler, fused, fail
        self.lrs: list[list[float]] = []

    def training_step(self, batch, batch_idx):
        if self.fail:
            raise RuntimeError("boom")
        self.lrs.append([group["lr"] for group in self.trainer.optimizers[0].param_groups])
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        # fused=True on both sides: the converted AdamW runs the same kernel, so parameters match bit for bit.
        groups = [{"params": self.net[0].parameters()}, {"params": self.net[2].parameters(), "lr": 5e-3}]
        optimizer = torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.0, fused=self.fused)
        if self.make_scheduler is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.make_scheduler(optimizer), "interval": "step"}}


SCHEDULERS = {
    "LinearLR": lambda o: lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=4),
    "ConstantLR": lambda o: lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
    "SequentialLR": lambda o: lr_scheduler.SequentialLR(
        o, [lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=2), lr_scheduler.CosineAnnealingLR(o, T_max=4)],
        milestones=[2]),
    "ChainedScheduler": lambda o: lr_scheduler.ChainedScheduler(
        [lr_scheduler.ExponentialLR(o, gamma=0.9), lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2)]),
    "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step),
    "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=10),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_schedulers_drive_the_converted_optimizer_exactly_as_plain_lightning(name):
    plain, ours = Regressor(SCHEDULERS[name]), Regressor(SCHEDULERS[name])
    fit(plain)
    trainer = fit(ours, [MemwrapCallback(optim="adamw")])
    assert ours.lrs == plain.lrs  # every group, every step: no factor applied twice, no frozen schedule
    assert max_diff(ours, plain) == 0.0
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    inner = getattr(scheduler, "_schedulers", [])
    assert all(s.optimizer is trainer.optimizers[0] for s in [scheduler, *inner])
    # The scheduler's step-order check still sees the new optimizer's step() (no "overridden" warning).
    assert not [w for w in ours.warned if "optimizer.step()" in w], ours.warned


@needs_bnb
def test_warmup_then_cosine_reaches_an_8bit_optimizer_unchanged():
    plain, ours = Regressor(SCHEDULERS["SequentialLR"]), Regressor(SCHEDULERS["SequentialLR"])
    fit(plain)
    trainer = fit(ours, [MemwrapCallback(optim="adamw_8bit")])
    assert type(trainer.optimizers[0]).__name__ == "AdamW8bit"
    assert ours.lrs == plain.lrs


# --- networks built in configure_model() or setup() -----------------------------------------

class GPT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = None
        self.build()

    def build(self):
        from memwrap.models import build_preset

        if self.net is None:  # Lightning may call the building hook more than once
            torch.manual_seed(0)
            self.net = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32)

    def training_step(self, tokens, batch_idx):
        from memwrap.models import lm_loss

        return lm_loss(self.net(tokens[:, :-1]), tokens[:, 1:])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class InConfigureModel(GPT):
    def __init__(self):
        L.LightningModule.__init__(self)
        self.net = None

    def configure_model(self):
        self.build()


class InSetup(InConfigureModel):
    def configure_model(self):
        pass  # overridden but empty: the network comes from setup()

    def setup(self, stage):
        self.build()


class InSetupOnly(GPT):
    def __init__(self):
        L.LightningModule.__init__(self)
        self.net = None

    def setup(self, stage):
        self.build()


class CountBlockForwards(L.Callback):
    def __init__(self):
        self.calls = 0

    def on_train_start(self, trainer, pl_module):
        pl_module.net.transformer.h[0].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1


def fit_gpt(module, callbacks, steps=2):
    counter = CountBlockForwards()
    trainer = L.Trainer(fast_dev_run=steps, accelerator="cpu", callbacks=[*callbacks, counter],
                        enable_progress_bar=False, logger=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(torch.randint(0, 256, (2 * steps, 33), generator=torch.Generator().manual_seed(0)),
                                   batch_size=2))
    return counter.calls


@pytest.mark.parametrize("cls", [InConfigureModel, InSetup, InSetupOnly])
def test_network_built_in_configure_model_or_setup_is_checkpointed(cls):
    plain = GPT()
    assert fit_gpt(plain, []) == 2  # one forward per step
    module, callback = cls(), MemwrapCallback(checkpoint="auto")
    assert fit_gpt(module, [callback]) == 2 * 2  # each step's forward recomputed in backward
    assert callback.report.modules == ["net.transformer.h.0", "net.transformer.h.1"]
    assert max_diff(module, plain) == 0.0  # checkpointing changes memory, not the numbers
    assert not {"setup", "configure_model", "configure_optimizers"} & set(module.__dict__)  # hooks restored


class BuiltTooLate(InConfigureModel):
    def configure_model(self):
        pass

    def on_fit_start(self):
        self.build()


def test_no_blocks_error_names_the_hooks_to_build_in():
    module = BuiltTooLate()
    with pytest.raises(ValueError, match=r"right after BuiltTooLate\.configure_model\(\).*configure_model\(\)"):
        fit_gpt(module, [MemwrapCallback(checkpoint="auto")])
    assert "configure_model" not in module.__dict__  # cleaned up by on_exception


# --- reuse after a failed fit ----------------------------------------------------------------

def test_callback_still_converts_after_a_fit_that_raised():
    callback = MemwrapCallback(optim="adamw")
    failed = Regressor(fail=True)
    with pytest.raises(RuntimeError, match="boom"):
        fit(failed, [callback], steps=1)
    assert "configure_optimizers" not in failed.__dict__  # on_exception restored the module
    plain, ours = Regressor(), Regressor()
    fit(plain, steps=2)
    trainer = fit(ours, [callback], steps=2)
    assert callback.optimizers == trainer.optimizers  # converted, not the module's own AdamW
    assert max_diff(ours, plain) == 0.0
    # The module that failed can be fitted again too, and is converted again.
    failed.fail = False
    trainer = fit(failed, [callback], steps=2)
    assert callback.optimizers == trainer.optimizers and max_diff(failed, plain) == 0.0


# --- a missing backend fails when the callback is built --------------------------------------

def test_unavailable_backend_fails_at_construction_like_create_optimizer(monkeypatch):
    import memwrap
    from memwrap.plugin.registry import OptimizerUnavailableError

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed
    with pytest.raises(OptimizerUnavailableError) as expected:
        memwrap.create_optimizer("adamw_8bit", torch.nn.Linear(2, 2).parameters())
    with pytest.raises(OptimizerUnavailableError) as raised:
        MemwrapCallback(optim="adamw_bnb_8bit")
    assert str(raised.value) == str(expected.value) and "pip install" in str(raised.value)


# --- clipping under mixed precision ----------------------------------------------------------

def test_adamw_under_amp_with_clipping_trains_like_plain_lightning():
    # Lightning refuses to clip a fused optimizer under its mixed-precision plugin; the module's AdamW is not
    # fused, so the converted one must not be either.
    amp = {"precision": "bf16-mixed", "gradient_clip_val": 0.5}
    plain, ours = Regressor(fused=None), Regressor(fused=None)
    fit(plain, steps=3, **amp)
    trainer = fit(ours, [callback := MemwrapCallback(optim="adamw")], steps=3, **amp)
    assert callback.optimizers == trainer.optimizers and not trainer.optimizers[0].defaults["fused"]
    assert max_diff(ours, plain) == 0.0


def test_explicitly_fused_adamw_under_amp_with_clipping_says_how_to_fix():
    with pytest.raises(RuntimeError, match="fused=False"):
        fit(Regressor(fused=True), [MemwrapCallback(optim="adamw")], steps=1, precision="bf16-mixed",
            gradient_clip_val=0.5)


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM inside a LightningModule, which has no ``.config`` of its own."""

    def __init__(self):
        super().__init__()
        from tests.hf_helpers import tiny_llama

        self.lm = tiny_llama(hidden=32)

    def training_step(self, batch, batch_idx):
        return self.lm(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("checkpoint", ["selective", "auto"])
def test_hugging_face_lm_inside_a_lightning_module_checkpoints_with_its_cache_off(checkpoint):
    # use_cache was turned off only on the checkpointed root, and a LightningModule has no config: the inner LM
    # built its key/value cache in the forward and again in the recompute ("aten.slice.Tensor ... not found in
    # storage" in the first backward under selective checkpointing).
    pytest.importorskip("transformers")

    def run(callbacks):
        module = HFCausalLM()
        trainer = L.Trainer(max_steps=2, accelerator="cpu", callbacks=callbacks, enable_progress_bar=False,
                            logger=False, enable_model_summary=False, enable_checkpointing=False)
        data = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
        trainer.fit(module, DataLoader(data, batch_size=2))
        return module

    plain = run([])
    callback = MemwrapCallback(checkpoint=checkpoint)
    module = run([callback])
    assert callback.report.modules == ["lm.model.layers.0", "lm.model.layers.1"]
    assert module.lm.config.use_cache is False  # while checkpointed
    assert max_diff(module, plain) < 1e-6  # checkpointing changes memory, not the numbers
