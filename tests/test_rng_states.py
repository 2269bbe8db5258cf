"""The RNG states activation checkpointing keeps for each region's recompute are counted where the step runs on the
CPU (memwrap/memory/tracing/rng_states.py): ``torch.get_rng_state()`` makes a 5056-byte tensor
outside the dispatcher, which the fake trace never saw (the residue of every checkpointed CPU zoo cell)."""
from __future__ import annotations

import pytest
import torch

import memwrap
from memwrap.memory import measure_peak
from memwrap.memory.tracing import rng_states
from memwrap.models import build_preset, lm_loss, preset_batch


def _model():
    torch.manual_seed(0)
    return build_preset("gpt2-tiny", n_layer=3)


def _batch():
    return preset_batch("gpt2-tiny", 1, 32)


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _llama_batch():
    ids = torch.randint(0, 256, (1, 512), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("options", [{"precision": "bf16", "checkpoint": "auto"}, {"checkpoint": "full"}],
                         ids=["bf16-auto", "fp32-full"])
def test_a_checkpointed_cpu_step_is_estimated_to_the_byte_with_its_rng_states(options, monkeypatch):
    # A small Llama at one sequence of 512: the backward peak is inside the first layer, whose region's state is
    # still alive there. The estimate was 5064 bytes under (the state and 8 bytes); now 8.
    state = torch.get_rng_state()  # its size: what each checkpointed region keeps
    est = memwrap.estimate(_llama, _llama_batch(), **options)
    real = measure_peak(_llama, _llama_batch(), **options)["peak"]
    assert abs(est.peak - real) <= 64, (est.peak, real)
    assert torch.get_rng_state is rng_states.REAL[0] and torch.set_rng_state is rng_states.REAL[1]
    monkeypatch.setattr(rng_states, "steps_on_cpu", lambda home, option: False)  # as for a GPU: host memory
    without = memwrap.estimate(_llama, _llama_batch(), **options)
    assert est.peak - without.peak == state.numel()


def test_no_rng_state_is_counted_without_checkpointing_or_on_another_device():
    est = memwrap.estimate(_model, _batch, loss_fn=lm_loss)
    real = measure_peak(_model, _batch, lm_loss)["peak"]
    assert abs(est.peak - real) <= 64
    assert rng_states.steps_on_cpu("cpu", None) and rng_states.steps_on_cpu("cpu", "cpu")
    assert not rng_states.steps_on_cpu("cpu", "cuda")  # planned for a GPU: the states are host memory there
    assert not rng_states.steps_on_cpu("cuda", None)
    assert rng_states.steps_on_cpu("meta", None)  # a meta-built model: traced and probed on this machine
