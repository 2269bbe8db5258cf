"""Activation checkpointing: gradients equal the plain ones, selection, option parsing, memory and FLOPs."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

import memwrap
from memwrap import checkpointing as ckpt
from memwrap.checkpointing.policies import find_blocks, parse_checkpoint_option, select_modules
from memwrap.checkpointing.apply import apply_checkpointing, remove_checkpointing
from memwrap.models import (GPT, Bert, BertConfig, Bottleneck, GPTBlock, GPTConfig, Llama, LlamaConfig, ResNet,
                            ResNetConfig, lm_loss)

VOCAB = 128


def tiny_gpt(dropout=0.0, n_layer=4, d=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=n_layer, n_head=4, n_embd=d, dropout=dropout))


def batch(b=2, t=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g)


def grads(model, x, y, seed=123):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # same dropout masks in both runs
    lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(ref, got):
    assert ref.keys() == got.keys()
    for n in ref:
        err = (got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)
        assert err <= 1e-5, f"{n}: relative error {err:.2e}"


POLICIES = [
    dict(), dict(policy=True), dict(policy={GPTBlock}), dict(policy={"GPTBlock"}),
    dict(policy=lambda name, m: isinstance(m, GPTBlock)), dict(every=2), dict(mode="selective"),
    dict(offload=True), dict(mode="selective", offload=True, every=3),
    dict(policy=lambda name, m: name.endswith(".mlp") or name.endswith(".attn")),
]


@pytest.mark.parametrize("kw", POLICIES, ids=lambda kw: ",".join(f"{k}={getattr(v, '__name__', v)}" for k, v in kw.items()) or "default")
def test_gradients_match_plain_with_dropout(kw):
    ref_model = tiny_gpt(0.2)
    model = copy.deepcopy(ref_model)
    x, y = batch()
    ref = grads(ref_model, x, y)
    report = apply_checkpointing(model, **kw)
    assert report.modules
    assert_same_grads(ref, grads(model, x, y))
    # a second step too: hooks stay balanced across iterations
    assert_same_grads(grads(ref_model, x, y, seed=7), grads(model, x, y, seed=7))


def test_gradients_match_plain_without_dropout():
    ref_model = tiny_gpt(0.0)
    model = copy.deepcopy(ref_model)
    apply_checkpointing(model, mode="selective", every=2)
    x, y = batch()
    assert_same_grads(grads(ref_model, x, y), grads(model, x, y))


def test_dropout_really_differs_between_seeds():
    """Guards the dropout case above: without the fixed seed the gradients would differ."""
    model = tiny_gpt(0.2)
    x, y = batch()
    a, b = grads(model, x, y, seed=1), grads(model, x, y, seed=2)
    assert any((a[n] - b[n]).norm() > 1e-3 * a[n].norm() for n in a)


def test_autocast_bf16_inside_checkpointed_region():
    ref_model = tiny_gpt()
    model = copy.deepcopy(ref_model)
    apply_checkpointing(model)
    x, y = batch()
    out = {}
    for name, m in (("ref", ref_model), ("ckpt", model)):
        m.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(x)
        assert logits.dtype == torch.bfloat16
        lm_loss(logits, y).backward()
        out[name] = {n: p.grad for n, p in m.named_parameters()}
    # recompute ran under the same autocast state, so the bf16 results agree bit for bit
    for n in out["ref"]:
        torch.testing.assert_close(out["ckpt"][n], out["ref"][n], rtol=0, atol=0)


def test_frozen_embeddings_still_give_block_gradients():
    ref_model, model = tiny_gpt(), tiny_gpt()
    apply_checkpointing(model)
    x, y = batch()
    for m in (ref_model, model):
        m.transformer.wte.weight.requires_grad_(False)  # also the tied head
        m.transformer.wpe.weight.requires_grad_(False)
    ref, got = grads(ref_model, x, y), grads(model, x, y)
    assert any(k.startswith("transformer.h.0.") for k in got)
    assert_same_grads(ref, got)


def test_kwargs_forwarded_and_llama_grads():
    torch.manual_seed(0)
    ref_model = Llama(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    model = copy.deepcopy(ref_model)
    report = apply_checkpointing(model, mode="selective")
    assert report.modules == ["model.layers.0", "model.layers.1", "model.layers.2"]
    x, y = batch()
    assert_same_grads(grads(ref_model, x, y), grads(model, x, y))  # layers take position_embeddings=...


@pytest.mark.parametrize("kw", [{}, {"mode": "selective"}, {"every": 2, "offload": True}])
def test_resnet_batchnorm_stats_counted_once(kw):
    """A recomputed train-mode BatchNorm would update its running stats a second time."""
    torch.manual_seed(0)
    ref_model = ResNet(ResNetConfig(layers=(1, 2, 1, 1), width=8, num_classes=10))
    model = copy.deepcopy(ref_model)
    report = apply_checkpointing(model, **kw)
    assert report.classes == {"Bottleneck": 5 if not kw.get("every") else 3}
    x = torch.randn(2, 3, 32, 32)
    for _ in range(2):
        for m in (model, ref_model):
            m.zero_grad()
            F.cross_entropy(m(x), torch.tensor([1, 7])).backward()
    for (n, a), b in zip(model.named_buffers(), ref_model.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)
    assert_same_grads({n: p.grad for n, p in ref_model.named_parameters()},
                      {n: p.grad for n, p in model.named_parameters()})


def test_names_and_state_dict_unchanged_idempotent_and_removable():
    model = tiny_gpt()
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    r1 = apply_checkpointing(model, every=2)
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    n_hooks = len(model.transformer.h[0]._forward_pre_hooks)
    r2 = apply_checkpointing(model, every=2)
    assert r2 == r1 and len(model.transformer.h[0]._forward_pre_hooks) == n_hooks
    # different options: replaced, not stacked
    r3 = apply_checkpointing(model)
    assert r3.modules == [f"transformer.h.{i}" for i in range(4)]
    assert len(model.transformer.h[0]._forward_pre_hooks) == n_hooks
    assert remove_checkpointing(model) is model
    assert not any(ckpt.is_checkpointed(m) for m in model.modules())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    x, y = batch()
    with FlopCounterMode(display=False) as plain:
        lm_loss(model(x), y).backward()
    fresh = tiny_gpt()
    with FlopCounterMode(display=False) as ref:
        lm_loss(fresh(x), y).backward()
    assert plain.get_total_flops() == ref.get_total_flops()  # no recompute left
    apply_checkpointing(model)  # can be applied again after removal
    assert model.state_dict().keys() == fresh.state_dict().keys()
    model.load_state_dict(fresh.state_dict())


def test_report_str_and_fields():
    model = tiny_gpt(n_layer=8)
    r = apply_checkpointing(model, policy={"GPTBlock"}, every=2, mode="selective", offload=True)
    assert r.modules == ["transformer.h.0", "transformer.h.2", "transformer.h.4", "transformer.h.6"]
    assert (r.policy, r.mode, r.every, r.offload) == ("{GPTBlock}", "selective", 2, True)
    assert "GPTBlock x4" in str(r) and "transformer.h.6" in str(r)


# ----------------------------------------------------------------------------- auto detection

def test_auto_finds_blocks_in_each_family():
    gpt = tiny_gpt()
    assert [n for n, _ in find_blocks(gpt)] == [f"transformer.h.{i}" for i in range(4)]
    llama = Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=16))
    assert [n for n, _ in find_blocks(llama)] == ["model.layers.0", "model.layers.1"]
    bert = Bert(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=16))
    assert [n for n, _ in find_blocks(bert)] == ["encoder.layer.0", "encoder.layer.1", "encoder.layer.2"]
    with torch.device("meta"):
        resnet = ResNet(ResNetConfig())
    blocks = find_blocks(resnet)
    assert len(blocks) == 16 and all(isinstance(m, Bottleneck) for _, m in blocks)
    assert blocks[0][0] == "layer1.0" and blocks[-1][0] == "layer4.2"


def test_auto_on_bare_sequential_and_never_root():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3)])
    # children are Sequentials themselves: not accepted as blocks (would only nest the search)
    with pytest.raises(ValueError, match="no repeated blocks"):
        find_blocks(model)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    model = nn.Sequential(*[Block() for _ in range(3)])
    assert [n for n, _ in find_blocks(model)] == ["0", "1", "2"]
    ref = copy.deepcopy(model)
    apply_checkpointing(model)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_auto_error_lists_candidates():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
            self.head = Head()

    with pytest.raises(ValueError, match=r"no repeated blocks.*Candidate classes: .*Head"):
        apply_checkpointing(Net())


def test_class_name_and_callable_selection_errors():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="Did you mean 'GPTBlock'"):
        apply_checkpointing(model, {"GPTBlok"})
    with pytest.raises(ValueError, match="selected no module"):
        apply_checkpointing(model, lambda n, m: False)
    with pytest.raises(ValueError, match="empty set"):
        select_modules(model, set())
    with pytest.raises(TypeError, match="class-name strings"):
        select_modules(model, {3})
    # nested selections keep only the outermost module
    chosen = select_modules(model, {"GPTBlock", "GPTMLP"})
    assert [n for n, _ in chosen] == [f"transformer.h.{i}" for i in range(4)]
    # qualified class names work too
    assert len(select_modules(model, {"memwrap.models.gpt.GPTBlock"})) == 4


def test_apply_argument_errors():
    model = tiny_gpt()
    with pytest.raises(ValueError, match="Did you mean 'selective'"):
        apply_checkpointing(model, mode="selectve")
    with pytest.raises(ValueError, match="every=0"):
        apply_checkpointing(model, every=0)
    with pytest.raises(ValueError, match="not known.*Valid names: auto"):
        apply_checkpointing(model, "autoo")
    with pytest.raises(TypeError, match="nn.Module"):
        apply_checkpointing("model")
    assert not any(ckpt.is_checkpointed(m) for m in model.modules())  # errors leave the model untouched


# ----------------------------------------------------------------------------- option parsing

class _Marker(nn.Module):
    pass


@pytest.mark.parametrize("value,expected", [
    (None, None), (False, None), (True, {"policy": "auto"}), ("auto", {"policy": "auto"}),
    ("full", {"policy": "auto"}), ("selective", {"policy": "auto", "mode": "selective"}),
    ("offload", {"policy": "auto", "offload": True}), ("every-2", {"policy": "auto", "every": 2}),
    ("every-13", {"policy": "auto", "every": 13}),
    ("selective+offload", {"policy": "auto", "mode": "selective", "offload": True}),
    ("every-2+offload", {"policy": "auto", "every": 2, "offload": True}),
    ({"GPTBlock"}, {"policy": {"GPTBlock"}}), ({_Marker, "X"}, {"policy": {_Marker, "X"}}),
    (_Marker, {"policy": _Marker}),
    ({"every": 3, "mode": "selective"}, {"policy": "auto", "every": 3, "mode": "selective"}),
    ({"policy": {"GPTBlock"}, "offload": True}, {"policy": {"GPTBlock"}, "offload": True}),
])
def test_parse_checkpoint_option(value, expected):
    assert parse_checkpoint_option(value) == expected


def test_parse_callable_passes_through():
    fn = lambda name, m: False  # noqa: E731
    assert parse_checkpoint_option(fn) == {"policy": fn}
    assert parse_checkpoint_option({"policy": fn})["policy"] is fn


@pytest.mark.parametrize("value,error,match", [
    ("selectiv", ValueError, "Did you mean 'selective'"),
    ("every-0", ValueError, "int >= 1"),
    ("every-x", ValueError, "not a known policy"),
    ("", ValueError, "not a known policy"),
    ({"mode": "fast"}, ValueError, "mode='fast'.*'full', 'selective'"),
    ({"every": 1.5}, ValueError, "every=1.5"),
    ({"every": True}, ValueError, "every=True"),
    ({"offload": "yes"}, ValueError, "True or False"),
    ({"polcy": "auto"}, ValueError, "Did you mean 'policy'"),
    ({"policy": "selective"}, ValueError, "shorthand"),
    ({"policy": 5}, TypeError, "not valid"),
    ({"policy": {1.0}}, TypeError, "nn.Module subclasses"),
    ({1, 2}, TypeError, "nn.Module subclasses"),
    (3, TypeError, "checkpoint=3"),
    (nn.Linear(2, 2), TypeError, "not valid"),
])
def test_parse_checkpoint_option_errors(value, error, match):
    with pytest.raises(error, match=match):
        parse_checkpoint_option(value)


def test_plugin_named_policy():
    plugins = pytest.importorskip("memwrap.plugin.manager")
    from memwrap import hookimpl

    class P:
        @hookimpl
        def memwrap_checkpoint_policies(self):
            return {"mlp-only": lambda name, m: name.endswith(".mlp"),
                    "light": {"every": 2, "mode": "selective"}}

    pm = plugins.get_plugin_manager()
    obj = P()
    pm.register(obj)
    try:
        assert parse_checkpoint_option("mlp-only") == {"policy": "mlp-only"}
        assert parse_checkpoint_option("light") == {"policy": "auto", "every": 2, "mode": "selective"}
        model = tiny_gpt()
        r = apply_checkpointing(model, "mlp-only")
        assert r.modules == [f"transformer.h.{i}.mlp" for i in range(4)] and r.policy == "mlp-only"
        r = apply_checkpointing(model, "light")
        assert (r.every, r.mode, len(r.modules)) == (2, "selective", 2)
        with pytest.raises(ValueError, match="Did you mean 'mlp-only'"):
            parse_checkpoint_option("mlp-onyl")
    finally:
        pm.unregister(obj)
    with pytest.raises(ValueError, match="not a known policy"):
        parse_checkpoint_option("mlp-only")


# ----------------------------------------------------------------------------- DDP

def test_ddp_single_process_gloo():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ref_model = tiny_gpt()
        model = copy.deepcopy(ref_model)
        apply_checkpointing(model)
        for m in (model, ref_model):  # frozen embeddings + unused params is where reentrant mode broke DDP
            m.transformer.wpe.weight.requires_grad_(False)
        ddp = DDP(model, find_unused_parameters=True)
        x, y = batch()
        for _ in range(2):  # "marked ready twice" would surface on the first backward
            got = {n.removeprefix("module."): g for n, g in grads(ddp, x, y).items()}
            assert_same_grads(grads(ref_model, x, y), got)
    finally:
        dist.destroy_process_group()


@settings(max_examples=25, deadline=None)
@given(n_layer=st.integers(1, 7), every=st.integers(1, 9), mode=st.sampled_from(["full", "selective"]),
       offload=st.booleans())
def test_every_k_selects_blocks_0_k_2k(n_layer, every, mode, offload):
    model = GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=n_layer, n_head=1, n_embd=4))
    r = apply_checkpointing(model, every=every, mode=mode, offload=offload)
    assert r.modules == [f"transformer.h.{i}" for i in range(0, n_layer, every)]
    assert [n for n, m in model.named_modules() if ckpt.is_checkpointed(m)] == r.modules
    assert parse_checkpoint_option(f"every-{every}") == {"policy": "auto", "every": every}
    assert apply_checkpointing(model, every=every, mode=mode, offload=offload) is r
    remove_checkpointing(model)
    assert not any(ckpt.is_checkpointed(m) for m in model.modules())


# ----------------------------------------------------------------------------- memory and FLOPs

def _activations(model, x, y):
    """Bytes alive after the forward (all activations, via MemTracker) and the step's peak total."""
    mt = MemTracker()
    mt.track_external(model, x, y)

    def total(kind):
        return sum(s["Total"] for s in mt.get_tracker_snapshot(kind).values())

    with mt:
        before = total("current")
        out = model(x)
        alive = total("current") - before  # no gradients exist yet: the growth is activations
        lm_loss(out, y).backward()
    return alive, total("peak")


def _memory_model():
    return tiny_gpt(n_layer=4, d=128)


@pytest.fixture(scope="module")
def memory_results():
    """name -> (activation bytes of the blocks, peak total bytes, step FLOPs)."""
    x, y = batch(b=4, t=64)
    outside = _activations(tiny_gpt(n_layer=0, d=128), x, y)[0]  # embeddings, ln_f, head
    out = {}
    for name, kw in {"none": None, "full": {}, "selective": {"mode": "selective"}, "every-2": {"every": 2}}.items():
        model = _memory_model()
        if kw is not None:
            apply_checkpointing(model, **kw)
        alive, peak = _activations(model, x, y)
        with FlopCounterMode(display=False) as fc:
            lm_loss(model(x), y).backward()
        out[name] = (alive - outside, peak, fc.get_total_flops())
    return out


def test_full_checkpointing_removes_80pct_of_block_activations(memory_results):
    none, full = memory_results["none"][0], memory_results["full"][0]
    assert none > 0
    assert full <= 0.2 * none, f"full keeps {full / none:.1%} of block activations"
    # what full keeps is exactly each block's output hidden state [B, T, d] in fp32
    assert full == 4 * (4 * 64 * 128 * 4)
    assert memory_results["full"][1] < memory_results["none"][1]  # the step's peak drops too


def test_selective_and_every2_land_in_between(memory_results):
    none, full = memory_results["none"][0], memory_results["full"][0]
    for name in ("selective", "every-2"):
        assert full < memory_results[name][0] < none, name
        assert memory_results["full"][1] < memory_results[name][1] < memory_results["none"][1], name


def test_recompute_flops(memory_results):
    """Full recompute costs one more forward of the blocks, less each block's last matmul (checkpoint's
    early stop: that output is not saved by anything); selective keeps all matmuls so recomputes none."""
    model = _memory_model()
    x, _ = batch(b=4, t=64)
    with FlopCounterMode(display=False) as fc:
        h = model.transformer.wte(x) + model.transformer.wpe(torch.arange(x.shape[1]))
        for blk in model.transformer.h:
            h = blk(h)
    block_fwd = fc.get_total_flops()
    base = memory_results["none"][2]
    b, t, d = 4, 64, 128
    last_mm = 2 * b * t * (4 * d) * d  # mlp.c_proj forward FLOPs of one block
    assert memory_results["full"][2] - base == block_fwd - 4 * last_mm
    assert memory_results["every-2"][2] - base == (block_fwd - 4 * last_mm) // 2
    assert memory_results["selective"][2] == base  # FlopCounter counts matmul-class ops; all are saved


def test_offload_packs_exactly_the_block_inputs_to_cpu(monkeypatch):
    packed = []
    real = torch.autograd.graph.save_on_cpu

    class Counting(real):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            inner = self.pack_hook

            def pack(t):
                out = inner(t)
                packed.append((tuple(t.shape), out[1].device.type))
                return out
            self.pack_hook = pack

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    ref_model = tiny_gpt()
    model = copy.deepcopy(ref_model)
    apply_checkpointing(model, offload=True)
    x, y = batch()
    got = grads(model, x, y)
    # one saved tensor per block: its input hidden state [B, T, d]; nothing from inside the region.
    # Some torch versions (2.11) also save an empty placeholder per region; it holds no bytes.
    assert [p for p in packed if p[0] != (0,)] == [((2, 16, 64), "cpu")] * 4
    assert_same_grads(grads(ref_model, x, y), got)
    packed.clear()
    with torch.no_grad():
        model(x)
    assert packed == []  # no autograd, nothing saved


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload's device effect needs CUDA")
def test_offload_lowers_cuda_activation_memory():
    x, y = (t.cuda() for t in batch(b=8, t=64))
    peaks = {}
    for off in (False, True):
        model = _memory_model().cuda()
        apply_checkpointing(model, offload=off)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = model(x)
        peaks[off] = torch.cuda.memory_allocated() - base
        lm_loss(out, y).backward()
    assert peaks[True] < peaks[False]


def test_checkpointing_turns_a_hugging_face_kv_cache_off_and_unwrap_restores_it():
    # transformers' gradient_checkpointing_enable() does the same: a cache built in every training forward,
    # then written again by the recompute, is memory for nothing.
    from types import SimpleNamespace

    model = tiny_gpt()
    model.config = SimpleNamespace(use_cache=True)
    wrapped = memwrap.wrap(model, checkpoint="auto")
    assert model.config.use_cache is False
    memwrap.unwrap(wrapped)
    assert model.config.use_cache is True
    model.config.use_cache = False  # a user's own choice is left alone, and not "restored" to True
    memwrap.unwrap(memwrap.wrap(model, checkpoint="auto"))
    assert model.config.use_cache is False


def _seq2seq(family):
    """A tiny encoder-decoder model of ``family`` built from its config (no download) and one training batch."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(3, 64, (2, 5), generator=g)
    if family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2, dropout_rate=0.0,
            decoder_start_token_id=0, pad_token_id=0))
        return model, dict(input_ids=torch.randint(3, 64, (2, 6), generator=g), labels=labels)
    if family == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(
            vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))
        return model, dict(input_ids=torch.randint(3, 64, (2, 6), generator=g), labels=labels)
    model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=8,
        max_target_positions=16, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
        decoder_start_token_id=1, eos_token_id=2, bos_token_id=1, suppress_tokens=[], begin_suppress_tokens=[]))
    return model, dict(input_features=torch.randn(2, 8, 16, generator=g), labels=labels)


@pytest.mark.parametrize("family", ["t5", "bart", "whisper"])
def test_encoder_decoder_models_checkpoint_with_every_decoder_cache_off(family):
    # T5's decoder (BART's, Whisper's) reads its own config copy: turning off only the root's use_cache left the
    # decoder building a key/value cache in the forward and again in the recompute (T5: CheckpointError, 56 vs 52
    # saved tensors). Every config the model holds must be turned off, and unwrap() must restore each.
    pytest.importorskip("transformers")
    model, inputs = _seq2seq(family)
    plain = copy.deepcopy(model)
    plain(**inputs).loss.backward()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    before = {k: c.use_cache for k, c in configs.items()}
    if family == "t5":  # BART and Whisper share one config today; T5's decoder keeps a copy with use_cache=True
        assert sum(before.values()) >= 2, "T5 no longer keeps a decoder config of its own: the test is moot"
    wrapped = memwrap.wrap(model, checkpoint="auto")
    assert wrapped.checkpoint_report.modules, "nothing was checkpointed"
    assert not any(c.use_cache for c in configs.values())
    wrapped(**inputs).loss.backward()
    ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert_same_grads(ref, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    memwrap.unwrap(wrapped)
    assert {k: c.use_cache for k, c in configs.items()} == before
