"""chunked_loss: the loss and every gradient equal the plain computation, without whole logits.

References are the models' own plain loss (Hugging Face ``ForCausalLMLoss``, the zoo's ``causal_lm_loss``),
computed on a deep copy of the same model.
"""
import copy
import warnings

import pytest
import torch
from torch import nn

import memwrap
from memwrap.techniques.loss_head import LossHeadError, LossHeadSpec, default_chunk_size, linear_cross_entropy
from memwrap.memory.measure import allocator_growth
from memwrap.models import GPT, GPTConfig, Llama, LlamaConfig, causal_lm_loss

from conftest import rel_err

TOL = 2e-6  # fp32: only the summation order differs


def _ids(vocab, b=2, t=40, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    if ignore:  # a prompt that adds no loss, and padding at the end
        labels[0, :7] = -100
        labels[-1, -5:] = -100
    return ids, labels


def _zoo(kind):
    torch.manual_seed(0)
    if kind == "gpt":  # lm_head tied to the token embedding
        return GPT(GPTConfig(vocab_size=300, block_size=64, n_layer=2, n_head=2, n_embd=32))
    return Llama(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))


def _assert_same(model, ref, out, ref_out, tol=TOL):
    assert out.logits is None  # never materialized
    assert rel_err(out.loss, ref_out.loss) < tol, (float(out.loss), float(ref_out.loss))
    out.loss.backward()
    ref_out.loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel_err(p.grad, q.grad) < tol, (name, rel_err(p.grad, q.grad))


# ----------------------------------------------------------------------------- the loss itself

@pytest.mark.parametrize("impl", ["recompute", "checkpoint"])
@pytest.mark.parametrize("chunk", [3, 7, 80, None])
def test_linear_cross_entropy_equals_plain(chunk, impl):
    torch.manual_seed(0)
    h = torch.randn(2, 40, 16, requires_grad=True)
    w = torch.randn(50, 16, requires_grad=True)
    b = torch.randn(50, requires_grad=True)
    _, y = _ids(50)
    got = linear_cross_entropy(h, w, y, bias=b, shift=True, chunk_size=chunk, impl=impl)
    want = causal_lm_loss(nn.functional.linear(h, w, b), y)
    assert rel_err(got, want) < TOL
    g = torch.autograd.grad(got, (h, w, b))
    r = torch.autograd.grad(want, (h, w, b))
    assert all(rel_err(x, z) < TOL for x, z in zip(g, r))


def test_transform_and_frozen_inputs():
    """A logit transform (softcapping) goes through; a frozen head or a frozen body gets no gradient."""
    torch.manual_seed(0)
    h0, w0 = torch.randn(2, 40, 16), torch.randn(50, 16)
    _, y = _ids(50)
    cap = lambda z: (z / 3.0).tanh() * 3.0  # noqa: E731
    for h_grad, w_grad in ((True, True), (True, False), (False, True)):
        h, w = h0.clone().requires_grad_(h_grad), w0.clone().requires_grad_(w_grad)
        got = linear_cross_entropy(h, w, y, transform=cap, shift=True, chunk_size=9)
        want = causal_lm_loss(cap(h @ w.T), y)
        assert rel_err(got, want) < TOL
        inputs = [t for t in (h, w) if t.requires_grad]
        for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
            assert rel_err(a, b) < TOL


def _allocator_peak(fn) -> int:
    return allocator_growth(fn)


def test_recompute_accumulates_the_weight_gradient_in_place():
    """Through autograd (impl='checkpoint') every chunk hands the engine a fresh [vocab, hidden] gradient to add:
    one weight-sized tensor more at the peak than the default, which adds each chunk's into one buffer."""
    torch.manual_seed(0)
    vocab, hidden = 4096, 256
    h = torch.randn(512, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).requires_grad_()
    y = torch.randint(0, vocab, (512,))

    def step(impl):
        h.grad = w.grad = None
        linear_cross_entropy(h, w, y, chunk_size=32, impl=impl).backward()

    peaks = {impl: _allocator_peak(lambda: step(impl)) for impl in ("recompute", "checkpoint")}
    weight = vocab * hidden * 4
    assert peaks["recompute"] < peaks["checkpoint"] - weight // 2, peaks
    plain = _allocator_peak(lambda: nn.functional.cross_entropy(h @ w.T, y).backward())
    assert peaks["recompute"] < plain - 2 * 512 * vocab * 4 + weight // 4, (peaks, plain)


def test_num_items_and_all_ignored():
    h, w = torch.randn(1, 6, 4), torch.randn(9, 4)
    y = torch.randint(0, 9, (1, 6))
    total = nn.functional.cross_entropy((h @ w.T)[0, :-1], y[0, 1:], reduction="sum")
    assert torch.allclose(linear_cross_entropy(h, w, y, shift=True, num_items=11, chunk_size=2), total / 11)
    # No valid label: 0/0, like torch's mean over nothing (a count_items window weights it by 0).
    assert linear_cross_entropy(h, w, torch.full((1, 6), -100), chunk_size=2).isnan()


def test_default_chunk_size():
    assert default_chunk_size(4096, 4096, 128256) == 256  # floor: MIN_CHUNK
    assert default_chunk_size(65536, 4096, 32000) == 8389  # a chunk's logits ~ the hidden states
    assert default_chunk_size(100, 4096, 32000) == 100  # never more than the tokens


def test_bad_labels_shape_names_the_fix():
    with pytest.raises(ValueError, match="one label per input token"):
        linear_cross_entropy(torch.randn(2, 5, 4), torch.randn(9, 4), torch.zeros(2, 4, dtype=torch.long))


# ----------------------------------------------------------------------------- memwrap's zoo

@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("chunk", [True, 13])
def test_zoo_loss_and_gradients_equal_plain(kind, chunk):
    net = _zoo(kind)
    ref = copy.deepcopy(net)
    ids, labels = _ids(300)
    model = memwrap.wrap(net, chunked_loss=chunk)
    _assert_same(net, ref, model(ids, labels=labels), ref(ids, labels=labels))


def test_zoo_num_items_in_batch():
    net = _zoo("llama")
    ref = copy.deepcopy(net)
    ids, labels = _ids(300)
    model = memwrap.wrap(net, chunked_loss=16)
    _assert_same(net, ref, model(ids, labels=labels, num_items_in_batch=123),
                 ref(ids, labels=labels, num_items_in_batch=123))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_accumulate_with_count_items_equals_big_batch(kind):
    """Micro-batches with different numbers of valid tokens, weighted by count_items: one update equals the
    big batch's (the token mean over the whole window)."""
    net = _zoo(kind)
    ref = copy.deepcopy(net)
    batches = []
    for i, ignored in enumerate((3, 20, 9)):
        ids, labels = _ids(300, b=1, t=32, seed=i, ignore=False)
        labels[0, :ignored] = -100
        batches.append({"ids": ids, "labels": labels})
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    big_ids = torch.cat([b["ids"] for b in batches])
    big_labels = torch.cat([b["labels"] for b in batches])
    ref(big_ids, labels=big_labels).loss.backward()
    ref_opt.step()

    model, opt, loader = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.5), batches, accumulate=3,
                                      chunked_loss=10, count_items=lambda b: int((b["labels"][:, 1:] != -100).sum()))
    for batch in loader:
        out = model(batch["ids"], labels=batch["labels"])
        assert out.logits is None
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert opt.updates == 1
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert rel_err(p, q) < 1e-6


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_bf16_autocast_matches_plain_bf16(kind):
    """Under precision='bf16' the chunks run the head under autocast as lm_head does, then upcast."""
    net = _zoo(kind)
    ref = copy.deepcopy(net)
    ids, labels = _ids(300)
    out = memwrap.wrap(net, precision="bf16", chunked_loss=16)(ids, labels=labels)
    ref_out = memwrap.wrap(ref, precision="bf16")(ids, labels=labels)
    assert out.loss.dtype == torch.float32
    assert rel_err(out.loss, ref_out.loss) < 1e-3
    out.loss.backward()
    ref_out.loss.backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 2e-2, name  # bf16 rounding of the chunk vs whole matmuls


def test_without_labels_the_model_runs_unchanged():
    net = _zoo("gpt")
    ids, _ = _ids(300)
    model = memwrap.wrap(net, chunked_loss=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # evaluation/generation without labels: nothing to warn about
        assert torch.equal(model(ids), net(ids))
    with pytest.warns(UserWarning, match="called without labels"):
        logits = model(ids)
    assert logits.shape == (2, 40, 300)
    assert model._loss_head.calls == {"chunked": 0, "plain": 2}


@pytest.mark.slow
def test_measured_peak_below_plain_and_estimated_on_fake_tensors():
    """A training step (forward, backward, AdamW update) of a GPT whose vocabulary dwarfs its width: the
    allocator-measured peak is lower with chunks by more than the fp32 logits, and memwrap.estimate (a fake-tensor
    trace of the same step) predicts the chunked peak within 3%."""
    from memwrap.memory import measure_peak

    def build():
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=8192, block_size=128, n_layer=2, n_head=2, n_embd=32))

    ids, labels = _ids(8192, b=2, t=128)
    batch = {"idx": ids, "labels": labels}
    plain = measure_peak(build, batch)["peak"]
    chunked = measure_peak(build, batch, chunked_loss=32)["peak"]
    assert chunked < plain - 2 * 128 * 8192 * 4, (plain, chunked)
    est = memwrap.estimate(build, batch, chunked_loss=32)
    assert abs(est.peak - chunked) / chunked < 0.03, (est.peak, chunked)
    assert est.peak < memwrap.estimate(build, batch).peak


# ----------------------------------------------------------------------------- Hugging Face

def _hf(family):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    configs = {
        "llama": (transformers.LlamaConfig, {}),
        "mistral": (transformers.MistralConfig, {}),
        "qwen2": (transformers.Qwen2Config, {}),
        "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
        "gemma": (transformers.GemmaConfig, dict(head_dim=16)),
        "gemma3_text": (transformers.Gemma3TextConfig, dict(head_dim=16, final_logit_softcapping=2.0)),
        "phi3": (transformers.Phi3Config, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        "olmo2": (transformers.Olmo2Config, {}),
        "gemma2": (transformers.Gemma2Config, dict(head_dim=16, final_logit_softcapping=2.0)),
        "granite": (transformers.GraniteConfig, dict(logits_scaling=4.0)),
        "cohere": (transformers.CohereConfig, dict(logit_scale=0.5)),
    }
    config_cls, extra = configs[family]
    model = transformers.AutoModelForCausalLM.from_config(config_cls(**common, **extra))
    return model


HF_FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
               "granite", "cohere"]


def test_every_recognized_family_is_tested():
    from memwrap_plugins.loss_heads.hf import FAMILIES

    assert set(FAMILIES) == set(HF_FAMILIES)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_hf_loss_and_gradients_equal_plain(family):
    net = _hf(family)
    ref = copy.deepcopy(net)
    ids, labels = _ids(256)
    model = memwrap.wrap(net, chunked_loss=24)
    out = model(input_ids=ids, labels=labels)
    assert type(out) is type(ref(input_ids=ids[:, :4]))  # an output like the model's
    _assert_same(net, ref, out, ref(input_ids=ids, labels=labels))


def test_hf_num_items_in_batch_attention_mask_and_tied_head():
    net = _hf("gpt2")  # GPT-2's head is tied to wte
    assert net.lm_head.weight is net.transformer.wte.weight
    ref = copy.deepcopy(net)
    ids, labels = _ids(256)
    mask = torch.ones_like(ids)
    mask[-1, -5:] = 0
    kw = dict(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(57))
    _assert_same(net, ref, memwrap.wrap(net, chunked_loss=True)(**kw), ref(**kw))


def test_hf_logits_to_keep_with_labels_is_refused():
    model = memwrap.wrap(_hf("llama"), chunked_loss=True)
    ids, labels = _ids(256)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(input_ids=ids, labels=labels, logits_to_keep=1)


# ----------------------------------------------------------------------------- refusals and plugins

def test_unknown_model_is_refused_at_wrap_naming_the_class():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, num_labels=2)
    for net, name in ((nn.Linear(4, 4), "Linear"),
                      (transformers.LlamaForSequenceClassification(cfg), "LlamaForSequenceClassification")):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        before = copy.deepcopy(net.state_dict())
        with pytest.raises(LossHeadError, match=rf"no loss-head adapter recognizes .*{name}.*drop chunked_loss="):
            memwrap.wrap(net, opt, chunked_loss=True, checkpoint=None)
        assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_mixture_of_experts_family_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    with pytest.raises(LossHeadError, match="MixtralForCausalLM"):
        memwrap.wrap(transformers.MixtralForCausalLM(cfg), chunked_loss=True)


@pytest.mark.parametrize("value", [0, -3, 2.5, "yes"])
def test_bad_option_values(value):
    with pytest.raises(ValueError, match="chunked_loss must be True, False or an int"):
        memwrap.wrap(_zoo("gpt"), chunked_loss=value)


def test_option_needs_a_model():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(TypeError, match="chunked_loss=True acts in the model's forward"):
        memwrap.wrap(opt, chunked_loss=True)


def test_root_forward_hooks_are_refused():
    net = _zoo("gpt")
    net.register_forward_hook(lambda *a: None)
    with pytest.raises(LossHeadError, match="forward hooks on its root module"):
        memwrap.wrap(net, chunked_loss=True)


def test_third_party_adapter_and_failing_plugin_are_isolated():
    from memwrap.plugin.manager import get_plugin_manager, hookimpl, plugin_errors

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = nn.Linear(4, 8), nn.Linear(8, 10, bias=False)

        def forward(self, x, labels=None):
            logits = self.head(self.body(x))
            return logits if labels is None else {"loss": causal_lm_loss(logits, labels)}

    def forward(model, args, kwargs, loss):
        if kwargs.get("labels") is None:
            return None
        return {"loss": loss(model.body(args[0]), model.head.weight, kwargs["labels"], shift=True)}

    class Good:
        @hookimpl
        def memwrap_loss_heads(self):
            return [LossHeadSpec("tiny", lambda m: isinstance(m, Tiny), forward, "the Tiny test model")]

    class Broken:
        @hookimpl
        def memwrap_loss_heads(self):
            return [LossHeadSpec("broken", lambda m: 1 / 0, forward)]

    pm = get_plugin_manager()
    pm.register(Good(), name="test_tiny_head")
    pm.register(Broken(), name="test_broken_head")
    try:
        torch.manual_seed(0)
        net = Tiny()
        ref = copy.deepcopy(net)
        x, y = torch.randn(2, 6, 4), torch.randint(0, 10, (2, 6))
        with pytest.warns(Warning, match="broken"):
            model = memwrap.wrap(net, chunked_loss=2)
        got, want = model(x, labels=y)["loss"], ref(x, labels=y)["loss"]
        assert rel_err(got, want) < TOL
        assert any(e.name == "test_broken_head" for e in plugin_errors())
    finally:
        pm.unregister(name="test_tiny_head")
        pm.unregister(name="test_broken_head")


def test_hf_model_is_estimated_on_fake_tensors():
    """The planner traces the chunked step of a Hugging Face model (a dict batch with labels) and finds it smaller."""
    net = _hf("llama")
    ids, labels = _ids(256)
    batch = {"input_ids": ids, "labels": labels}
    chunked = memwrap.estimate(net, batch, chunked_loss=16)
    plain = memwrap.estimate(net, batch)
    assert chunked.peak < plain.peak
    assert all(p.device.type == "cpu" and p.grad is None for p in net.parameters())  # the model was not touched


# ----------------------------------------------------------------------------- the LM head must be reproducible

class _ScaledHead(nn.Linear):
    """An nn.Linear subclass with its own forward and an extra parameter: the chunked loss cannot reproduce it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return super().forward(x) * self.scale


class _PlainSubclass(nn.Linear):
    """A subclass that keeps nn.Linear's forward: exactly a Linear."""


def _head_cases():
    yield "forward hook", lambda head: head.register_forward_hook(lambda m, i, o: o * 0.5), "1 forward hook"
    yield "forward pre-hook", lambda head: head.register_forward_pre_hook(lambda m, i: (i[0] * 2.0,)), "pre-hook"
    yield "backward hook", lambda head: head.register_full_backward_hook(lambda m, gi, go: None), "backward hook"
    yield "global hook", lambda head: nn.modules.module.register_module_forward_hook(lambda m, i, o: None), "global"


def _heads_of(kind):
    if kind == "hf":
        net = _hf("llama")
        return net, lambda: net.lm_head, "LlamaForCausalLM.lm_head"
    net = _zoo(kind)
    return net, lambda: net.lm_head, f"{type(net).__name__}.lm_head"


@pytest.mark.parametrize("kind", ["hf", "llama"])
@pytest.mark.parametrize("case", [c[0] for c in _head_cases()])
def test_head_with_hooks_is_refused_at_wrap_naming_the_head(kind, case):
    """A hook on lm_head changes the plain loss (o * 0.5: 4.5786 vs 4.5700); the chunked loss calls F.linear in
    place of the head and would skip it: refused at wrap(), naming the head and the fix, and nothing changes."""
    net, head, name = _heads_of(kind)
    _, register, why = next(c for c in _head_cases() if c[0] == case)
    handle = register(head())
    try:
        before = copy.deepcopy(net.state_dict())
        with pytest.raises(LossHeadError, match=rf"LM head {name} .*{why}.*chunked_loss=False.*memwrap_loss_heads"):
            memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), chunked_loss=True)
        assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
        assert not any(isinstance(m, memwrap.runtime.module.WrappedModule) for m in net.modules())
    finally:
        handle.remove()
    memwrap.wrap(net, chunked_loss=True)  # without the hook: accepted


@pytest.mark.parametrize("kind", ["hf", "gpt"])
def test_head_subclass_with_its_own_forward_is_refused_plain_subclass_is_exact(kind):
    net, head, name = _heads_of(kind)
    old = head()
    for cls, refused in ((_ScaledHead, True), (_PlainSubclass, False)):
        new = cls(old.in_features, old.out_features, bias=False)
        new.weight = old.weight  # keeps GPT's tie to the embedding
        net.lm_head = new
        if refused:
            with pytest.raises(LossHeadError, match=rf"LM head {name} \(_ScaledHead\).*overrides nn.Linear.forward"):
                memwrap.wrap(net, chunked_loss=True)
            continue
        ref = copy.deepcopy(net)
        ids, labels = _ids(net.lm_head.out_features)
        kw = dict(labels=labels)
        call = (lambda m: m(input_ids=ids, **kw)) if kind == "hf" else (lambda m: m(ids, **kw))
        _assert_same(net, ref, call(memwrap.wrap(net, chunked_loss=16)), call(ref))


def test_head_bias_is_used_by_the_zoo_adapter():
    """A zoo Llama whose head was given a bias: the chunked loss uses it (it once used the weight alone)."""
    net = _zoo("llama")
    head = nn.Linear(32, 300, bias=True)
    with torch.no_grad():
        head.weight.copy_(net.lm_head.weight)
        head.bias.normal_()
    net.lm_head = head
    ref = copy.deepcopy(net)
    ids, labels = _ids(300)
    _assert_same(net, ref, memwrap.wrap(net, chunked_loss=16)(ids, labels=labels), ref(ids, labels=labels))


def test_head_hook_added_after_wrap_is_refused_at_the_next_labelled_forward():
    net = _zoo("gpt")
    model = memwrap.wrap(net, chunked_loss=16)
    ids, labels = _ids(300)
    model(ids, labels=labels).loss.backward()
    handle = net.lm_head.register_forward_hook(lambda m, i, o: o * 0.5)
    try:
        with pytest.raises(LossHeadError, match="chunked_loss at this forward: the LM head GPT.lm_head .*forward hook"):
            model(ids, labels=labels)
        with torch.no_grad():  # without labels the model runs unchanged, hook included
            assert torch.equal(model(ids), net(ids))
        handle.remove()
        handle = nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
        with pytest.raises(LossHeadError, match="global module forward pre-hook"):
            model(ids, labels=labels)
    finally:
        handle.remove()
    assert model(ids, labels=labels).logits is None


@pytest.mark.parametrize("options", [dict(), dict(output_hidden_states=True), dict(use_cache=False)],
                         ids=["cache", "hidden_states", "no_cache"])
def test_hf_return_dict_false_keeps_the_models_tuple(options):
    """Once (loss,) alone: unpacking broke and the cache was lost. Now the model's own tuple, logits None in place."""
    net = _hf("llama")
    ref = copy.deepcopy(net)
    ids, labels = _ids(256)
    got = memwrap.wrap(net, chunked_loss=24)(input_ids=ids, labels=labels, return_dict=False, **options)
    want = ref(input_ids=ids, labels=labels, return_dict=False, **options)
    assert isinstance(got, tuple) and len(got) == len(want) and got[1] is None
    assert [type(v) for v in got[2:]] == [type(v) for v in want[2:]]
    assert rel_err(got[0], want[0]) < TOL
    for g, w in zip(got[2:], want[2:]):
        if isinstance(w, tuple):  # hidden states: one tensor per layer
            assert all(torch.equal(a, b) for a, b in zip(g, w, strict=True))
        else:  # the KV cache
            assert g.get_seq_length() == w.get_seq_length() == ids.shape[1]
            assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                       for a, b in zip(g.layers, w.layers, strict=True))
    loss, logits, *rest = got  # unpacks as the plain model's tuple
    loss.backward()
    want[0].backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < TOL, name
