"""Hugging Face Trainer and Lightning integrations, and the single-process examples (CPU)."""
from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import memwrap
from memwrap.checkpointing.apply import is_checkpointed

ROOT = Path(__file__).resolve().parents[1]
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
needs_pl = pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning not installed")
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed")


def run_example(name: str, *args: str, capsys: pytest.CaptureFixture) -> str:
    """Run examples/<name> as __main__ in this process (the frameworks are imported once per session)."""
    argv = sys.argv
    sys.argv = [name, *args]
    try:
        runpy.run_path(str(ROOT / "examples" / name), run_name="__main__")
    finally:
        sys.argv = argv
    return capsys.readouterr().out


class PreHookCounter:
    """Counts a module's forward calls, recomputations included (pre-hooks fire before early stop can)."""

    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1


def test_integrations_import_their_framework_lazily():
    code = ("import sys, memwrap.integrations.transformers.trainer, memwrap.integrations.lightning.callback; "
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'bitsandbytes') if m in sys.modules]; "
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# --- Hugging Face Trainer --------------------------------------------------------------------

from tests.hf_helpers import hf_args, tiny_llama  # noqa: E402


def hf_dataset():
    ids = torch.randint(0, 128, (12, 16), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def train_hf(tmp_path, memwrap_kwargs=None, **args_kw):
    from transformers import Trainer

    model = tiny_llama()
    args = hf_args(tmp_path, **args_kw)
    counter = PreHookCounter(model.model.layers[0].input_layernorm)
    extra = {}
    if memwrap_kwargs is not None:
        from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

        extra = memwrap_trainer_kwargs(model, args, **memwrap_kwargs)
    trainer = Trainer(model=model, args=args, train_dataset=hf_dataset(), **extra)
    trainer.train()
    return trainer, model, counter


@needs_hf
@needs_bnb
def test_trainer_uses_memwrap_8bit_adam_and_checkpointing(tmp_path):
    import bitsandbytes as bnb

    # memwrap's name here; the HF string "adamw_bnb_8bit" is read from TrainingArguments in the next test.
    trainer, model, counter = train_hf(tmp_path, {"optim": "adamw_8bit", "checkpoint": "auto"}, optim="adamw_torch")
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    assert type(inner) is bnb.optim.AdamW8bit
    assert trainer.state.global_step == 3
    # Trainer's own weight-decay grouping is kept; the learning rate comes from TrainingArguments.
    assert sorted(g["weight_decay"] for g in inner.param_groups) == [0.0, 0.1]
    assert {g["initial_lr"] for g in inner.param_groups} == {1e-3}
    # 8-bit state where bitsandbytes uses it (large non-embedding weights), 32-bit for the embedding.
    q_proj = model.model.layers[0].mlp.gate_proj.weight
    assert inner.state[q_proj]["state1"].dtype == torch.uint8
    assert inner.state[model.model.embed_tokens.weight]["state1"].dtype == torch.float32
    # Checkpointing applied: the decoder layers are checkpointed and really recomputed in backward.
    assert [n for n, m in model.named_modules() if is_checkpointed(m)] == ["model.layers.0", "model.layers.1"]
    micro_batches = 3 * 2
    assert counter.calls == 2 * micro_batches


@needs_hf
@needs_bnb
def test_trainer_with_memwrap_matches_trainer_with_its_own_8bit_adam(tmp_path):
    # Same optimizer maths, and checkpointing changes no number: the runs agree, so memwrap adds no second
    # accumulation or scaling on top of Trainer's.
    ours, ours_model, ours_calls = train_hf(tmp_path / "a", {"checkpoint": "auto"}, optim="adamw_bnb_8bit")
    theirs, theirs_model, theirs_calls = train_hf(tmp_path / "b", None, optim="adamw_bnb_8bit")
    import bitsandbytes as bnb

    # optim defaults to args.optim: the HF string "adamw_bnb_8bit" resolves to memwrap's adamw_8bit.
    assert type(getattr(ours.optimizer, "optimizer", ours.optimizer)) is bnb.optim.AdamW8bit
    assert ours_calls.calls == 2 * theirs_calls.calls
    for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert any((p != tiny_llama().state_dict()[n]).any() for n, p in ours_model.state_dict().items())


@needs_hf
def test_trainer_kwargs_refuse_double_checkpointing_and_unknown_names(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs
    from memwrap.plugin.registry import UnknownOptimizerError

    model = tiny_llama()
    with pytest.raises(ValueError, match="checkpointing=False"):
        memwrap_trainer_kwargs(model, hf_args(tmp_path, gradient_checkpointing=True), checkpoint="auto")
    assert not any(is_checkpointed(m) for m in model.modules())
    with pytest.raises(UnknownOptimizerError, match="adamw_8bit"):
        memwrap_trainer_kwargs(model, hf_args(tmp_path), optim="adamw_8bits")


@needs_hf
@needs_bnb
def test_seed_template_becomes_wrap_options_for_a_plain_loop(tmp_path):
    import bitsandbytes as bnb

    from memwrap.integrations.transformers.trainer import wrap_options

    # The seeds' recommended TrainingArguments template (torch_compile & data-loader fields included).
    template = hf_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8, gradient_checkpointing=True,
                       fp16=True, optim="adamw_bnb_8bit", torch_compile=True, dataloader_pin_memory=True,
                       dataloader_num_workers=4)
    with pytest.warns(UserWarning, match="dataloader_num_workers=4.*torch_compile=True"):
        options = wrap_options(template, precision="bf16")  # fp16 overridden: CPU autocast prefers bf16
    assert options == {"gradient_accumulation_steps": 8, "gradient_checkpointing": True, "optim": "adamw_bnb_8bit",
                       "max_grad_norm": 1.0, "precision": "bf16"}
    model = tiny_llama()
    calls = PreHookCounter(model.model.layers[0].input_layernorm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the conversion warning of AdamW -> adamw_8bit
        model, optimizer = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **options)
    assert type(memwrap.unwrap(optimizer)) is bnb.optim.AdamW8bit
    for batch in hf_dataset()[:8]:
        ids = batch["input_ids"][None]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.updates == 1 and model.checkpoint_report.modules == ["model.layers.0", "model.layers.1"]
    assert calls.calls == 2 * 8


@needs_hf
def test_options_from_names_every_field_it_leaves_to_the_loop_with_how_to_apply_it(tmp_path):
    # options_from(args) returned its options and said nothing about torch_compile, dataloader_num_workers or
    # per_device_train_batch_size, which wrap_options(args) named: one function, one behaviour.
    from memwrap.integrations.transformers.trainer import wrap_options

    template = hf_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8, gradient_checkpointing=True,
                       fp16=True, optim="adamw_bnb_8bit", torch_compile=True, dataloader_pin_memory=False,
                       dataloader_num_workers=4)
    with pytest.warns(UserWarning) as direct:
        options = memwrap.options_from(template)
    (message,) = [str(w.message) for w in direct if "does not apply" in str(w.message)]
    assert direct[0].filename == __file__  # points at the caller's line
    for named in ("per_device_train_batch_size=2 -> DataLoader(batch_size=2)",
                  "dataloader_num_workers=4 -> DataLoader(num_workers=4)",
                  "dataloader_pin_memory=False -> DataLoader(pin_memory=False)",
                  "torch_compile=True -> model = torch.compile(model) after wrap()",
                  "learning_rate=0.001 -> AdamW(params, lr=0.001)", "max_steps=3 -> your loop's number of updates",
                  "seed=0 -> torch.manual_seed(0)"):
        assert named in message
    for read, value in options.items():  # what wrap() applies is not listed as left to the loop
        assert f"{read}={getattr(value, 'value', value)!r}" not in message
    with pytest.warns(UserWarning) as through_wrap_options:
        assert wrap_options(template) == options
    assert [str(w.message) for w in through_wrap_options] == [message]
    assert through_wrap_options[0].filename == __file__


def test_wrap_options_reads_duck_typed_arguments():
    from memwrap.integrations.transformers.trainer import wrap_options

    args = SimpleNamespace(gradient_accumulation_steps=4, bf16=True, optim="adafactor", max_grad_norm=0)
    assert wrap_options(args, checkpoint="selective") == {
        "gradient_accumulation_steps": 4, "bf16": True, "optim": "adafactor", "max_grad_norm": 0,
        "checkpoint": "selective"}
    with pytest.raises(ValueError, match="accumulate"):
        wrap_options(SimpleNamespace(gradient_accumulation_steps=0))


# --- Lightning -------------------------------------------------------------------------------

def lit_module():
    import lightning as L

    from memwrap.models import build_preset, lm_loss

    class TinyGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = build_preset("gpt2-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32)

        def training_step(self, tokens, batch_idx):
            return lm_loss(self.net(tokens[:, :-1]), tokens[:, 1:])

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return TinyGPT()


def fit_lightning(callbacks, steps=3, **trainer_kw):
    import lightning as L
    from torch.utils.data import DataLoader

    module = lit_module()
    counter = PreHookCounter(module.net.transformer.h[0].ln_1)
    trainer = L.Trainer(fast_dev_run=steps, accelerator="cpu", callbacks=callbacks, enable_progress_bar=False,
                        logger=False, enable_model_summary=False, **trainer_kw)
    data = torch.randint(0, 256, (steps * 2, 33), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(data, batch_size=2))
    return trainer, module, counter


@needs_pl
@needs_bnb
def test_lightning_callback_converts_optimizer_and_checkpoints():
    import bitsandbytes as bnb

    from memwrap.integrations.lightning.callback import MemwrapCallback

    callback = MemwrapCallback(checkpoint="auto", optim="adamw_bnb_8bit")
    trainer, module, counter = fit_lightning([callback])
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is bnb.optim.AdamW8bit and callback.optimizers == [optimizer]
    assert optimizer.param_groups[0]["weight_decay"] == 0.1  # carried over from the module's AdamW
    # The scheduler now drives the new optimizer and has stepped it: 1e-3 * 0.5**3 after 3 steps.
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** 3)
    assert any(s["state1"].dtype == torch.uint8 for s in optimizer.state.values())
    assert callback.report.modules == ["net.transformer.h.0", "net.transformer.h.1"]
    assert [n for n, m in module.named_modules() if is_checkpointed(m)] == callback.report.modules
    assert counter.calls == 2 * 3  # each block's forward recomputed in backward
    assert "configure_optimizers" not in module.__dict__  # teardown restored the module's own method


@needs_pl
def test_lightning_keeps_its_own_precision_and_accumulation():
    from memwrap.integrations.lightning.callback import MemwrapCallback

    callback = MemwrapCallback(checkpoint="selective")
    trainer, module, counter = fit_lightning([callback], steps=4, precision="bf16-mixed", accumulate_grad_batches=2)
    assert trainer.global_step == 2  # Lightning's accumulation: 4 batches, 2 updates
    assert type(trainer.optimizers[0]) is torch.optim.AdamW  # optim=None keeps the module's optimizer
    assert callback.report.mode == "selective"
    assert counter.calls == 2 * 4


@needs_pl
def test_lightning_callback_validates_at_construction():
    from memwrap.integrations.lightning.callback import MemwrapCallback
    from memwrap.plugin.registry import UnknownOptimizerError

    with pytest.raises(UnknownOptimizerError):
        MemwrapCallback(optim="adamw_9bit")
    with pytest.raises((TypeError, ValueError)):
        MemwrapCallback(checkpoint="evry-2")


def _found(value, target) -> bool:
    if value is target:
        return True
    if isinstance(value, dict):
        return any(_found(v, target) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_found(v, target) for v in value)
    return False


def _sched_lrs(scheduler, optimizer, steps=4):
    lrs = []
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("shape", ["optimizer", "list", "tuple_of_lists", "dict", "list_of_dicts"])
def test_converter_handles_every_configure_optimizers_shape(shape):
    from memwrap.integrations.lightning.callback import _Converter

    net = torch.nn.Linear(3, 2)

    def fresh():
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.0)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    opt, sched = fresh()
    returned = {"optimizer": opt, "list": [opt], "tuple_of_lists": ([opt], [sched]),
                "dict": {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}},
                "list_of_dicts": [{"optimizer": opt, "lr_scheduler": sched}]}[shape]
    converter = _Converter("adamw", net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = converter(returned)
    (old, new), = converter.converted.values()
    assert old is opt and new is not opt and isinstance(new, torch.optim.AdamW)
    # The new optimizer replaced the old one wherever it was, in a structure of the same shape.
    assert _found(result, new) and not _found(result, opt) and type(result) is type(returned)
    if shape in ("tuple_of_lists", "dict", "list_of_dicts"):
        assert sched.optimizer is new
        # Re-attached exactly as if built on the new optimizer: same LR sequence as a fresh pair.
        ref_opt, ref_sched = fresh()
        assert _sched_lrs(sched, new) == _sched_lrs(ref_sched, ref_opt) == [0.05, 0.025, 0.0125, 0.00625]
    else:
        assert sched.optimizer is opt  # a scheduler not returned to Lightning is left alone


# --- examples --------------------------------------------------------------------------------

def test_plain_loop_example_runs(capsys):
    out = run_example("plain_loop.py", "--steps", "8", capsys=capsys)
    assert "updates=2" in out and "checkpointed 2 module(s)" in out
    if HAS_BNB:
        assert "optimizer=AdamW8bit" in out


@needs_hf
@needs_bnb
def test_hf_trainer_example_runs(tmp_path, capsys):
    out = run_example("hf_trainer.py", "--steps", "2", "--out", str(tmp_path), capsys=capsys)
    assert "trainer: steps=2" in out and "optimizer=AdamW8bit" in out
    assert "plain loop:" in out and "updates=2" in out  # 4 micro-batches, accumulate 2


@needs_pl
@needs_bnb
def test_lightning_example_runs(capsys):
    out = run_example("lightning_callback.py", "--steps", "4", capsys=capsys)
    assert "optimizer=AdamW8bit global_step=2" in out and "checkpointed 2 module(s)" in out
