"""Inputs the real step does not pass on because of their values (memwrap/memory/tracing/unread_inputs.py and the
built-in plugins/trace_inputs/hf.py): an all-ones attention_mask of a Hugging Face SDPA model is traced as the real
step runs it (no mask), measured against the allocator's peak of the real step; everything else keeps its mask."""
from __future__ import annotations

import pytest
import torch

import memwrap
from memwrap.memory.measure import measure_peak
from memwrap.memory.tracing.unread_inputs import TraceInputSpec, adapt_batch
from memwrap.plugin.manager import get_plugin_manager, hookimpl, plugin_errors

pytestmark = pytest.mark.filterwarnings("ignore")
transformers = pytest.importorskip("transformers")

B, T, V = 4, 64, 256


def _llama(attn="sdpa"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * T,
                                   attn_implementation=attn)
    return transformers.LlamaForCausalLM(cfg)


def _batch(mask=None, **extra):
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    out = {"input_ids": ids, "labels": ids.clone(), **extra}
    if mask is not None:
        out["attention_mask"] = mask
    return out


def _close(est, factory, batch, **opts):
    got = measure_peak(factory, batch, **opts)["peak"]
    return abs(est.peak - got) / got


@pytest.mark.parametrize("options", [{}, {"accumulate": 2}, {"precision": "bf16"},
                                     {"precision": "bf16", "checkpoint": "full"}])
def test_an_all_ones_mask_is_traced_as_transformers_runs_it_under_sdpa(options):
    ones = torch.ones(B, T, dtype=torch.long)
    est = memwrap.estimate(_llama, _batch(ones), **options)
    none = memwrap.estimate(_llama, _batch(), **options)
    # The same step as no mask, with the mask itself still held by the batch; and so is the real step.
    assert est.peak == none.peak + ones.nbytes
    assert "attention_mask not passed to the traced model: all ones" in str(est) and "hf-sdpa-mask" in est.method
    real = measure_peak(_llama, _batch(ones), **options)["peak"]
    # (within 8 bytes: one full-suite run under -n 2 measured the bf16 step 4 bytes apart, 2044 for the mask's 2048;
    # alone it is exact, run after run)
    assert abs(real - measure_peak(_llama, _batch(), **options)["peak"] - ones.nbytes) <= 8
    if not options.get("precision"):  # (this small Llama's bf16 step is -0.8% either way; checkpointed +2.3%)
        assert abs(est.peak - real) / real < 1e-4  # was +4.3%: a float mask per layer kept for backward


def test_a_padded_mask_is_kept_and_the_estimate_still_matches():
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, T // 2:] = 0  # padding: the real step builds the 4-D mask too
    est = memwrap.estimate(_llama, _batch(mask))
    assert "not passed" not in str(est)
    assert est.peak > memwrap.estimate(_llama, _batch()).peak + mask.nbytes
    assert _close(est, _llama, _batch(mask)) < 1e-3


def test_eager_attention_and_position_ids_keep_the_mask():
    ones = torch.ones(B, T, dtype=torch.long)
    eager = memwrap.estimate(lambda: _llama("eager"), _batch(ones))  # eager attention always applies its mask
    assert "not passed" not in str(eager)
    assert _close(eager, lambda: _llama("eager"), _batch(ones)) < 1e-3
    pos = torch.arange(T).expand(B, T)
    kept = adapt_batch(_llama(), _batch(ones, position_ids=pos))
    assert kept[1:] == ([], ()) and isinstance(kept[0], dict)


class Masked(torch.nn.Module):
    """Not a Hugging Face model: it applies the mask it is given, ones or not (as the real step does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = torch.nn.Embedding(V, 64), torch.nn.Linear(64, V)

    def forward(self, input_ids, attention_mask, labels):
        h = self.emb(input_ids).unflatten(-1, (4, 16)).transpose(1, 2)
        mask = attention_mask.bool()[:, None, None, :].expand(-1, 1, T, -1)
        h = torch.nn.functional.scaled_dot_product_attention(h, h, h, attn_mask=mask)
        logits = self.out(h.transpose(1, 2).flatten(-2))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_model_that_is_not_hugging_faces_keeps_its_mask():
    batch = _batch(torch.ones(B, T, dtype=torch.long))
    assert adapt_batch(Masked(), batch) == (batch, [], ())
    est = memwrap.estimate(Masked, batch)
    assert "not passed" not in str(est)
    assert _close(est, Masked, batch) < 1e-3


def test_a_batch_holding_one_tensor_twice_counts_it_once():
    ids = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(0))
    shared = memwrap.estimate(_llama, {"input_ids": ids, "labels": ids})
    apart = memwrap.estimate(_llama, {"input_ids": ids, "labels": ids.clone()})
    assert apart.peak - shared.peak == ids.nbytes
    assert _close(shared, _llama, {"input_ids": ids, "labels": ids}) < 1e-4


def test_a_failing_adapter_is_warned_about_and_leaves_nothing_out():
    class Broken:
        @hookimpl
        def memwrap_trace_inputs(self):
            return [TraceInputSpec("broken", lambda model, kwargs: 1 / 0)]

    pm = get_plugin_manager()
    pm.register(Broken(), name="test_broken_trace_inputs")
    try:
        batch = _batch(torch.ones(B, T, dtype=torch.long))
        with pytest.warns(Warning, match="broken"):
            call, notes, adjust = adapt_batch(_llama(), batch)
        # the built-in adapter still works: the mask left out, and the fake copy run without a mask
        assert list(call.kwargs) == ["input_ids", "labels"] and len(notes) == 2 and adjust == ("hf-sdpa-mask",)
        assert any(e.name == "test_broken_trace_inputs" for e in plugin_errors())
    finally:
        pm.unregister(name="test_broken_trace_inputs")


def test_budget_plans_a_step_with_an_all_ones_mask_as_the_real_step_runs_it(monkeypatch):
    # budget= plans on the loop's first real batch, so the all-ones mask is decided on its values: the step it budgets
    # is the one that runs. With the adapter off (the mask traced) each layer keeps a float mask.
    ones = torch.ones(B, T, dtype=torch.long)

    def budgeted():
        model = _llama()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        wmodel, wopt, loader = memwrap.wrap(model, opt, [_batch(ones) for _ in range(2)], budget="4GiB")
        batch = next(iter(loader))
        wmodel(**batch).loss.backward()
        wopt.step()
        wopt.zero_grad()
        assert wopt.did_update
        return wopt.budget_plan.current

    choice = budgeted()
    assert (choice.micro_batch, choice.accumulate, choice.precision, choice.checkpoint) == (B, 1, "fp32", None)
    real = measure_peak(_llama, _batch(ones))["peak"]
    assert abs(choice.peak - real) / real < 1e-3, (choice.peak, real)
    adapter = get_plugin_manager().get_plugin("trace_inputs_hf")  # the built-in adapter module
    monkeypatch.setattr(adapter, "_sdpa_model", lambda model: False)
    masked = budgeted()
    assert masked.peak > choice.peak + ones.nbytes  # the masks the real step never builds


@pytest.mark.parametrize("family", ["Qwen3", "Phi3", "Olmo2", "Starcoder2"])
def test_the_families_added_to_the_maskless_path_are_exact_checkpointed(family):
    # bf16 + checkpointing at 512 tokens: with the mask traced, these over-predicted by 2.4-2.7%.
    def factory():
        torch.manual_seed(0)
        cfg = getattr(transformers, f"{family}Config")(
            vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, attn_implementation="sdpa")
        return getattr(transformers, f"{family}ForCausalLM")(cfg)

    # (Two sequences: at one, every family here, Llama included, is 2% under, 86 KiB of a 4 MiB step, not yet
    # explained; the mask is not the cause, it is the same without one.)
    ids = torch.randint(0, V, (2, 512), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    opts = {"precision": "bf16", "checkpoint": "auto"}
    est = memwrap.estimate(factory, batch, **opts)
    assert "memwrap_trace_sdpa" in est.method or "no padding" in str(est), est.method
    assert _close(est, factory, batch, **opts) < 3e-3
