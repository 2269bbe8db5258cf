"""torch.compile with memwrap: every order docs/compile.md calls working, against a plain reference.

The references are the plain PyTorch loop (one big batch) or, for options whose maths differs from fp32 (precision,
the step in backward), the same wrapped model run eagerly. Compiling uses the ``aot_eager`` backend: it runs
TorchDynamo and AOTAutograd as inductor does, without generating C++ (minutes on two cores); the checkpointing
refusals are tested in test_wrap_validation.py and test_wrap.py.
"""
import copy
import warnings

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import memwrap
from memwrap.techniques.loss_head import LossHeadError
from memwrap.models import GPT, GPTConfig

from conftest import max_rel_err, rel_err

BACKEND = CompileCounterWithBackend("aot_eager")  # counts the frames it compiles: a test sees that it compiled


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    BACKEND.clear()
    yield
    torch._dynamo.reset()


def _compiled_something():
    return BACKEND.frame_count >= 1


class _MLP(nn.Module):
    # A class of its own: TorchDynamo skips torch.nn's own frames, so nn.Sequential(...).compile() compiles nothing.
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(nn.functional.gelu(self.a(x)))


def _mlp():
    torch.manual_seed(0)
    return _MLP()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, 8, generator=g) for _ in range(4)]  # two windows of two


def _big_batch_reference(net, batches, accumulate=2):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for start in range(0, len(batches), accumulate):
        net(torch.cat(batches[start:start + accumulate])).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return net


def _train(model, opt, batches):
    for x in batches:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt.updates


@pytest.mark.parametrize("how", ["torch.compile(wrapped)", "wrapped.compile()"])
def test_compile_after_wrap_equals_the_big_batch(how):
    net = _mlp()
    ref = _big_batch_reference(copy.deepcopy(net), _batches())
    wrapped, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
    if how == "torch.compile(wrapped)":
        model = torch.compile(wrapped, backend=BACKEND)
    else:
        wrapped.compile(backend=BACKEND)
        model = wrapped
    assert _train(model, opt, _batches()) == 2
    assert _compiled_something()
    assert max_rel_err(net.parameters(), ref.parameters()) < 1e-6


@pytest.mark.parametrize("how", ["torch.compile(net)", "net.compile()"])
def test_compile_before_wrap_equals_the_big_batch(how):
    net = _mlp()
    ref = _big_batch_reference(copy.deepcopy(net), _batches())
    if how == "torch.compile(net)":
        compiled = torch.compile(net, backend=BACKEND)
    else:
        net.compile(backend=BACKEND)
        compiled = net
    model, opt = memwrap.wrap(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), accumulate=2)
    assert _train(model, opt, _batches()) == 2
    assert _compiled_something()
    assert max_rel_err(net.parameters(), ref.parameters()) < 1e-6


@pytest.mark.parametrize("options", [dict(step_in_backward=True), dict(precision="bf16-true", compensation="none"),
                                     dict(precision="bf16", accumulate=2), dict(precision="fp16", accumulate=2)],
                         ids=["step_in_backward", "bf16-true", "bf16", "fp16"])
def test_compile_after_wrap_keeps_each_techniques_result(options):
    """The compiled wrapped model ends where the same wrapped model run eagerly ends (bitwise on CPU)."""
    eager_net, net = _mlp(), _mlp()
    eager, eager_opt = memwrap.wrap(eager_net, torch.optim.SGD(eager_net.parameters(), lr=0.1), **options)
    wrapped, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), **options)
    assert _train(torch.compile(wrapped, backend=BACKEND), opt, _batches()) == _train(eager, eager_opt, _batches()) > 0
    assert _compiled_something()
    assert max_rel_err(net.parameters(), eager_net.parameters()) < 1e-6


# ----------------------------------------------------------------------------- chunked_loss

def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))


def _ids():
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 64, (2, 16), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100
    return ids, labels


def _assert_chunked_equals_plain(net, model):
    ref = copy.deepcopy(net)
    ids, labels = _ids()
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    assert out.logits is None
    assert rel_err(out.loss, want.loss) < 2e-6
    out.loss.backward()
    want.loss.backward()
    assert max_rel_err([p.grad for p in net.parameters()], [p.grad for p in ref.parameters()]) < 2e-6
    assert _compiled_something()


def _assert_a_later_head_hook_is_refused(net, model):
    """TorchDynamo does not guard on module hooks: the head check runs eagerly, so the next forward sees the hook."""
    ids, labels = _ids()
    handle = net.lm_head.register_forward_hook(lambda m, i, o: o * 0.5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # dynamo's recompilation notices
            with pytest.raises(LossHeadError, match="at this forward: the LM head GPT.lm_head .*forward hook"):
                model(ids, labels=labels)
    finally:
        handle.remove()


@pytest.mark.slow  # ~10 s: the body's graphs and the loss's graph breaks
def test_chunked_loss_compiled_after_wrap_equals_plain():
    net = _gpt()
    model = torch.compile(memwrap.wrap(net, chunked_loss=8), backend=BACKEND)
    _assert_chunked_equals_plain(net, model)
    _assert_a_later_head_hook_is_refused(net, model)


@pytest.mark.slow
def test_chunked_loss_compiled_before_wrap_is_looked_through_and_equals_plain():
    """Once refused ('no loss-head adapter recognizes OptimizedModule'): the adapter now runs on _orig_mod under
    the user's own compile context, and a call without labels runs the compiled model."""
    net = _gpt()
    model = memwrap.wrap(torch.compile(net, backend=BACKEND), chunked_loss=8)
    _assert_chunked_equals_plain(net, model)
    assert model._loss_head.calls == {"chunked": 1, "plain": 0}
    ids, _ = _ids()
    with torch.no_grad():
        assert torch.allclose(model(ids), net(ids), atol=1e-6)
    _assert_a_later_head_hook_is_refused(net, model)


def test_chunked_loss_on_a_model_compiled_in_place_is_refused_naming_the_fix():
    """net.compile() compiles only net(...) calls; the chunked loss runs the body itself, which would run eagerly."""
    net = _gpt()
    net.compile(backend=BACKEND)
    with pytest.raises(LossHeadError, match=r"GPT.compile\(\) \(in place\).*compile after wrap\(\).*docs/compile.md"):
        memwrap.wrap(net, chunked_loss=8)


def test_chunked_loss_with_fullgraph_is_refused_at_wrap():
    """fullgraph=True cannot hold the chunked loss (its head check and autograd.Function run eagerly): once the first
    forward failed deep in TorchDynamo ('Skip inlining torch.compiler.disable()d function')."""
    with pytest.raises(LossHeadError, match=r"torch.compile\(GPT, fullgraph=True\).*Fix: torch.compile\(model\) "
                                            "without fullgraph=True"):
        memwrap.wrap(torch.compile(_gpt(), backend=BACKEND, fullgraph=True), chunked_loss=8)


def test_fullgraph_compiled_before_wrap_equals_the_big_batch():
    """memwrap's wrapper stays outside the user's graph: the model compiles as one graph (torch.compile(wrapped,
    fullgraph=True) fails instead, memwrap's per-micro-batch bookkeeping runs eagerly by design)."""
    net = _mlp()
    ref = _big_batch_reference(copy.deepcopy(net), _batches())
    compiled = torch.compile(net, backend=BACKEND, fullgraph=True)
    model, opt = memwrap.wrap(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1), accumulate=2)
    assert _train(model, opt, _batches()) == 2
    assert BACKEND.frame_count == 1
    assert max_rel_err(net.parameters(), ref.parameters()) < 1e-6
