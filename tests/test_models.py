"""The model zoo: real parameter counts (on meta, no allocation), module trees, shapes, errors."""

import pytest
import torch
import torch.nn.functional as F

from memwrap import models
from memwrap.models import PRESETS, build_preset, get_preset, preset_batch, preset_names

# Parameter counts of the reference implementations (HF transformers / torchvision).
REAL_COUNTS = {
    "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200,
    "llama-7b": 6_738_415_616, "bert-large": 335_141_888, "resnet50": 25_557_032,
}


def _count(model):
    return sum(p.numel() for p in model.parameters())  # parameters() dedups tied weights


@pytest.mark.parametrize("name", sorted(REAL_COUNTS))
def test_big_preset_param_counts_on_meta(name):
    with torch.device("meta"):
        model = build_preset(name)
    assert all(p.is_meta for p in model.parameters())
    n = _count(model)
    # bert-large's reference count is BertModel without head; ours adds a 2-way classifier.
    assert abs(n - REAL_COUNTS[name]) / REAL_COUNTS[name] <= 0.01
    assert n == PRESETS[name].params


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_tiny_presets_count_matches_spec_and_are_small(name):
    model = build_preset(name)
    assert _count(model) == PRESETS[name].params < 10_000_000


def test_module_trees_mirror_reference_names():
    gpt = build_preset("gpt2-tiny")
    assert isinstance(gpt.transformer.h, torch.nn.ModuleList)
    assert all(isinstance(b, models.GPTBlock) for b in gpt.transformer.h)
    blk = gpt.transformer.h[0]
    for attr in ("ln_1", "attn", "ln_2", "mlp"):
        assert hasattr(blk, attr)
    for attr in ("wte", "wpe", "drop", "ln_f"):
        assert hasattr(gpt.transformer, attr)
    assert gpt.lm_head.weight is gpt.transformer.wte.weight
    assert "lm_head.weight" in gpt.state_dict()

    llama = build_preset("llama-tiny")
    lay = llama.model.layers[0]
    assert isinstance(lay, models.LlamaDecoderLayer)
    for attr in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
        assert hasattr(lay, attr)
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert not any(n.endswith("bias") for n, _ in llama.named_parameters())
    assert not any("inv_freq" in k for k in llama.state_dict())

    bert = build_preset("bert-tiny")
    assert isinstance(bert.encoder.layer[0], models.BertLayer)
    for attr in ("attention", "intermediate", "output"):
        assert hasattr(bert.encoder.layer[0], attr)
    for attr in ("word_embeddings", "position_embeddings", "token_type_embeddings", "LayerNorm", "dropout"):
        assert hasattr(bert.embeddings, attr)

    with torch.device("meta"):
        resnet = build_preset("resnet50")
    assert [len(getattr(resnet, f"layer{i}")) for i in range(1, 5)] == [3, 4, 6, 3]
    assert all(isinstance(b, models.Bottleneck) for i in range(1, 5) for b in getattr(resnet, f"layer{i}"))


@pytest.mark.parametrize("name,out_shape", [
    ("gpt2-tiny", (2, 16, 4096)), ("llama-tiny", (2, 16, 4096)), ("bert-tiny", (2, 2))])
def test_forward_shapes_and_loss_backward(name, out_shape):
    torch.manual_seed(0)
    model = build_preset(name)
    x, y = preset_batch(name, 2, seq_len=16)
    out = model(x)
    assert out.shape == out_shape
    loss = get_preset(name).loss(out, y)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_resnet_small_forward():
    model = build_preset("resnet50", layers=(1, 1, 1, 1), width=8)
    x, y = preset_batch("resnet50", 2, seq_len=32)
    assert x.shape == (2, 3, 32, 32) and y.shape == (2,)
    assert model(x).shape == (2, 1000)


def test_gpt_is_causal():
    """Changing a future token must not change earlier logits (is_causal attention)."""
    torch.manual_seed(0)
    model = build_preset("gpt2-tiny").eval()
    x, _ = preset_batch("gpt2-tiny", 1, seq_len=8)
    x2 = x.clone()
    x2[0, -1] = (x[0, -1] + 1) % 4096
    torch.testing.assert_close(model(x)[:, :-1], model(x2)[:, :-1])
    llama = build_preset("llama-tiny").eval()
    torch.testing.assert_close(llama(x)[:, :-1], llama(x2)[:, :-1])


def test_lm_loss_matches_plain_cross_entropy():
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    ref = F.cross_entropy(logits.reshape(6, 5), targets.reshape(6))
    torch.testing.assert_close(models.lm_loss(logits, targets), ref)


def test_bert_attention_mask_ignores_padding():
    torch.manual_seed(0)
    model = build_preset("bert-tiny").eval()
    x, _ = preset_batch("bert-tiny", 1, seq_len=8)
    mask = torch.ones_like(x)
    mask[0, 6:] = 0
    x2 = x.clone()
    x2[0, 6:] = 7
    torch.testing.assert_close(model(x, attention_mask=mask), model(x2, attention_mask=mask))


def test_bert_mlm_head_tied():
    model = build_preset("bert-tiny", head="mlm")
    assert model.cls.decoder.weight is model.embeddings.word_embeddings.weight
    x, _ = preset_batch("bert-tiny", 2, seq_len=8)
    assert model(x).shape == (2, 8, 4096)


def test_unknown_preset_lists_names_and_closest():
    with pytest.raises(ValueError, match=r"Did you mean 'gpt2-medium'.*gpt2-xl"):
        build_preset("gpt2-meduim")
    with pytest.raises(ValueError, match="Valid presets"):
        preset_batch("nope", 1)


def test_override_errors_and_applies():
    assert len(build_preset("gpt2-tiny", n_layer=2).transformer.h) == 2
    with pytest.raises(TypeError, match="Did you mean 'n_layer'"):
        build_preset("gpt2-tiny", n_layers=2)
    with pytest.raises(ValueError, match="head"):
        build_preset("bert-tiny", head="seq2seq")


def test_preset_batch_validation_and_kinds():
    x, y = preset_batch("gpt2-tiny", 3)
    assert x.shape == y.shape == (3, 256) and x.dtype == torch.long and int(x.max()) < 4096
    x, y = preset_batch("llama-tiny", 1, seq_len=4, device="meta")
    assert x.is_meta
    with pytest.raises(ValueError, match="context length"):
        preset_batch("gpt2-tiny", 1, seq_len=257)
    with pytest.raises(ValueError, match="batch_size"):
        preset_batch("gpt2-tiny", 0)
    with pytest.raises(ValueError, match="exceeds block_size"):
        build_preset("gpt2-tiny")(torch.zeros(1, 300, dtype=torch.long))
    assert set(preset_names()) >= set(REAL_COUNTS) | {"gpt2-tiny", "llama-tiny"}
