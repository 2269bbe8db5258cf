"""Issue 12 items 5-6: paged/host optimizer state as its own category, the planner searching every technique the
plugins register, and each technique traced for real on fake tensors (predicted vs the CPU allocator's peak).

The 7B/8B targets take minutes on 2 cores; they live in benchmarks/ladder.py and `memwrap plan` (docs/planner.md),
these tests check the mechanism on small models.
"""
from __future__ import annotations


import pytest
import torch

import memwrap
from memwrap.memory import measure_peak
from memwrap.memory.search.planner import plan
from memwrap.models import Llama, LlamaConfig, build_preset, get_preset, preset_batch
from memwrap.precision.base import Precision
from memwrap.plugin.registry import OptimizerSpec, get_optimizer_spec
from memwrap.plugin.state_size import predict_state_bytes
from plugin_registration import registered

pytestmark = pytest.mark.filterwarnings("ignore")


def _llama(vocab=512, layers=2, hidden=64):
    def build():
        torch.manual_seed(0)
        return Llama(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=128))
    return build


def _batch(vocab=512, b=2, t=64):
    ids = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


# ----------------------------------------------------------------------------- item 5: where the state lives

def test_paged_optimizer_state_is_its_own_category_not_device_memory():
    assert get_optimizer_spec("paged_adamw_8bit").state_location == "paged"
    assert get_optimizer_spec("adamw_8bit").state_location == "device"
    build, batch = _llama(), _batch()
    paged = memwrap.estimate(build, batch, optim="paged_adamw_8bit")
    plain = memwrap.estimate(build, batch, optim="adamw_8bit")  # the same state, in device memory
    state = predict_state_bytes("adamw_8bit", build())
    assert plain.breakdown["optimizer_state"] == state and plain.paged_state == 0
    assert paged.paged_state == state and paged.breakdown["optimizer_state"] == 0
    assert paged.peak == plain.peak - state  # the same trace, the state moved out of the device peak
    assert paged.host == state  # worst case: all of it spilled to host RAM
    assert "paged optimizer state" in str(paged) and "spills to host RAM" in str(paged)


def test_host_state_location_from_a_plugin_counts_as_host_memory():
    spec = get_optimizer_spec("adamw")
    offloaded = OptimizerSpec("k_offload_adamw", factory=spec.factory, state_bytes=spec.state_bytes,
                              runs_on_fake=False, state_location="host")
    with registered("k_offload_plugin", memwrap_optimizers=lambda: [offloaded]):
        build, batch = _llama(), _batch()
        est = memwrap.estimate(build, batch, optim="k_offload_adamw")
        ref = memwrap.estimate(build, batch, optim="adamw")
    assert est.host_state == ref.breakdown["optimizer_state"] and est.breakdown["optimizer_state"] == 0
    assert est.paged_state == 0 and est.host == est.host_state


def test_a_bad_state_location_is_refused_naming_the_choices():
    spec = get_optimizer_spec("adamw")
    with pytest.raises(ValueError, match="state_location must be one of device, paged, host"):
        OptimizerSpec("k_bad", factory=spec.factory, state_bytes=spec.state_bytes, state_location="disk")


# ----------------------------------------------------------------------------- item 6: each technique traced

@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(precision="fp32"),
    dict(precision="bf16-true"),  # optimi's Kahan AdamW: bf16 weights, gradients, state + a bf16 Kahan buffer
    dict(precision="bf16-true", checkpoint="full"),
    dict(precision="bf16-true", checkpoint="full", step_in_backward=True),
    dict(precision="bf16-true", checkpoint="full", step_in_backward=True, chunked_loss=32),
])
def test_estimate_of_each_ladder_row_matches_the_measured_cpu_peak(options):
    build, batch = _llama(vocab=1024), _batch(vocab=1024)
    est = memwrap.estimate(build, batch, **options)
    measured = measure_peak(build, batch, **options)["peak"]
    assert abs(est.peak - measured) / measured < 0.05, (options, est.peak, measured)


def test_each_technique_changes_what_the_trace_sees():
    build, batch = _llama(vocab=1024, hidden=64), _batch(vocab=1024, t=64)
    fp32 = memwrap.estimate(build, batch)
    true = memwrap.estimate(build, batch, precision="bf16-true")
    n = sum(p.numel() for p in build().parameters())
    assert fp32.breakdown["parameters"] == 4 * n and true.breakdown["parameters"] == 2 * n  # bf16 storage
    assert true.state["optimizer_state"] == 6 * n  # optimi AdamW: bf16 m, v and Kahan buffer
    sib = memwrap.estimate(build, batch, precision="bf16-true", step_in_backward=True)
    assert sib.state["gradients"] < true.state["gradients"]  # gradients freed one by one inside backward
    chunked = memwrap.estimate(build, batch, precision="bf16-true", chunked_loss=32)
    assert chunked.peak < true.peak  # no whole [tokens, vocab] logits


def test_llama_3_8b_preset_has_the_real_parameter_count_and_labels_batches():
    with torch.device("meta"):
        model = build_preset("llama-3-8b")
    assert sum(p.numel() for p in model.parameters()) == get_preset("llama-3-8b").params == 8_030_261_248
    assert model.config.num_key_value_heads == 8 and model.config.vocab_size == 128256
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    batch = preset_batch("llama-tiny", 2, 16, labels=True)
    assert set(batch) == {"input_ids", "labels"} and batch["labels"] is batch["input_ids"]


# ----------------------------------------------------------------------------- item 6: the search space

@pytest.mark.slow
def test_planner_searches_every_technique_and_finds_the_fitting_ladder_config():
    build = _llama(vocab=1024, hidden=64)
    make = lambda mb: _batch(vocab=1024, b=mb, t=64)  # noqa: E731
    full = memwrap.estimate(build, make(2))
    p = plan(build, make, budget=f"{int(0.6 * full.peak)}B", global_batch=2, micro_batches=(2,),
             precisions=("fp16", "bf16-true"), checkpoints=("full",), optimizers=("adamw", "paged_adamw_8bit"),
             margin=(0, 0))
    seen = {(c.precision, bool(c.extra.get("step_in_backward")), bool(c.extra.get("chunked_loss")), c.optim)
            for c in p.candidates}
    # step in backward and the chunked loss are searched by default (a loss-head plugin knows Llama, the batch
    # has labels)
    assert ("bf16-true", True, True, "paged_adamw_8bit") in seen and ("bf16-true", False, False, "adamw") in seen
    assert ("fp16", False, True, "adamw") in seen
    assert ("fp16", True, False, "adamw") in seen  # fp16 + step_in_backward: the norm pass (techniques/norm_pass.py)
    assert p.best is not None and p.best.precision == "bf16-true"
    paged = [c for c in p.candidates if c.optim == "paged_adamw_8bit" and c.precision == "bf16-true"]
    assert all(c.extra.get("compensation") == "none" and any("uncompensated" in x for x in c.changes) for c in paged)
    # the pasted options are wrap()'s: they run
    opts = dict(p.best.options)
    optim = opts.pop("optim")
    model = build()
    wrapped, opt = memwrap.wrap(model, memwrap.create_optimizer(optim, model), **opts)
    batch = make(2)
    wrapped(**batch).loss.backward()
    opt.step()
    opt.zero_grad()


class _Fp32Twin(Precision):
    """A third-party precision (fp32 under another name): the planner must search it without any edit."""

    name = "k-fp32-twin"
    description = "fp32 under a plugin's name"


def test_a_precision_plugin_is_searched_by_the_planner():
    with registered("k_precision_plugin", memwrap_precisions=lambda: [_Fp32Twin]):
        from memwrap.memory.search.techniques import default_precisions

        assert "k-fp32-twin" in default_precisions()
        build = _llama()
        p = plan(build, lambda mb: _batch(b=mb), budget="1GiB", global_batch=2, micro_batches=(2,),
                 checkpoints=(None,), optimizers=("adamw",), step_in_backward=(False,), chunked_loss=(False,),
                 keep_precision=None)  # any precision: every registered one is searched
        twin = [c for c in p.candidates if c.precision == "k-fp32-twin"]
        fp32 = [c for c in p.candidates if c.precision == "fp32"]
        assert len(twin) == 1 and twin[0].estimate.peak == fp32[0].estimate.peak


def test_groups_whose_weights_alone_exceed_the_budget_are_not_traced_and_say_why():
    build = _llama()
    n = sum(p.numel() for p in build().parameters())
    # room for bf16 weights (2 bytes/param) and more, not for fp32 weights (4 bytes/param)
    p = plan(build, lambda mb: _batch(b=mb), budget=f"{3 * n}B", global_batch=2, micro_batches=(2,), checkpoints=(None,),
             optimizers=("adamw",), step_in_backward=(False,), chunked_loss=(False,), margin=(0, 0),
             precisions=("fp32", "bf16-true"))
    assert {c.precision for c in p.candidates} == {"bf16-true"}
    assert any("weights alone take" in why and "fp32" in why for _, why in p.skipped)


def test_cli_plans_a_preset_with_labels_and_the_technique_flags(capsys):
    import argparse
    import json

    from memwrap.memory.cli import register

    parser = argparse.ArgumentParser(prog="memwrap")
    register(parser.add_subparsers(dest="command"))
    argv = ["plan", "--preset", "llama-tiny", "--batch", "2", "--seq", "32", "--budget", "4GiB", "--precisions",
            "bf16-true", "--checkpoints", "none", "--optimizers", "paged_adamw_8bit", "--micro-batches", "2",
            "--step-in-backward", "yes", "--chunked-loss", "both", "--quiet", "--json"]
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    labels = sorted(c["label"] for c in doc["candidates"])
    assert labels == ["2x1 bf16-true no-ckpt paged_adamw_8bit +sib +chunked uncompensated",
                      "2x1 bf16-true no-ckpt paged_adamw_8bit +sib uncompensated"]
    best = doc["best"]
    assert best["estimate"]["paged_state"] > 0 and best["estimate"]["breakdown"]["optimizer_state"] == 0
    assert "step_in_backward=True" in doc["code"] and "compensation='none'" in doc["code"]
