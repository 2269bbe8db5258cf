"""estimate(): category totals and peaks against real CPU runs; extrapolation against full traces."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from memwrap.memory import estimate
from memwrap.memory.tracing import parallel
from memwrap.memory.tracing.depth import checkpoint_layout, extrapolation_depths
from memwrap.memory.tracing.estimator import trace_config
from memwrap.memory.tracing.grad_accumulation import InPlaceAccumulation
from memwrap.memory.tracing.trace import find_stack
from memwrap.memory.measure import measure_peak
from memwrap.runtime.module import WrappedModule
from memwrap.models import GPT, GPTConfig, build_preset, lm_loss, preset_batch
from memwrap.plugin.registry import create_optimizer
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes

pytestmark = pytest.mark.filterwarnings("ignore")


def small_gpt(n_layer=2, n_embd=64, vocab=512, block=64):
    return GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=vocab, block_size=block))


def lm_batch(b, t, vocab):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, t), generator=g), torch.randint(0, vocab, (b, t), generator=g)


def plain_step_state(model, batch):
    """Reference computed the plain way: one real AdamW step, then the bytes of each kind."""
    opt = create_optimizer("adamw", model.parameters(), model=model)
    x, y = batch
    lm_loss(model(x), y).backward()
    params = list(model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    opt.step()
    return {"parameters": sum(p.numel() * p.element_size() for p in params), "gradients": grads,
            "optimizer_state": measure_state_bytes(opt)}


def test_category_totals_match_a_real_step_exactly():
    model = small_gpt()
    batch = lm_batch(2, 32, 512)
    est = estimate(model, batch)
    ref = plain_step_state(small_gpt(), batch)
    assert est.state["parameters"] == ref["parameters"]
    assert est.state["gradients"] == ref["gradients"]
    assert est.state["optimizer_state"] == ref["optimizer_state"]
    assert est.breakdown["parameters"] == ref["parameters"]


@pytest.mark.parametrize("checkpoint", [None, "full"])
def test_frozen_parameters_are_estimated_like_a_real_fine_tuning_step(checkpoint):
    def frozen_gpt():
        m = small_gpt()
        m.transformer.wpe.requires_grad_(False)  # frozen position embeddings
        m.transformer.h[0].requires_grad_(False)  # and a frozen first block, as in fine-tuning
        return m

    batch = lm_batch(2, 32, 512)
    est = estimate(frozen_gpt, batch, checkpoint=checkpoint)
    ref = plain_step_state(frozen_gpt(), batch)
    assert est.state["gradients"] == ref["gradients"] < est.state["parameters"] == ref["parameters"]
    assert est.state["optimizer_state"] == ref["optimizer_state"]
    got = measure_peak(frozen_gpt, batch, lm_loss, checkpoint=checkpoint)
    assert abs(got["peak"] / est.peak - 1) <= 0.05


def test_model_storage_is_never_touched():
    model = small_gpt()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    estimate(model, lm_batch(2, 16, 512), precision="bf16", checkpoint="full")
    for n, p in model.named_parameters():
        assert p.data_ptr() == before[n][0] and torch.equal(p.detach(), before[n][1]) and p.grad is None
    assert not any(isinstance(m, WrappedModule) for m in model.modules())


def test_factory_is_built_on_meta_and_equals_module_input():
    devices = []

    def factory():
        m = small_gpt()
        devices.append(next(m.parameters()).device.type)
        return m

    batch = lm_batch(2, 16, 512)
    a = estimate(factory, batch)
    b = estimate(small_gpt(), lambda: batch)
    assert devices == ["meta"]
    assert a.peak == b.peak and a.breakdown == b.breakdown


# >= 200 MB of training state (parameters + gradients + AdamW state) for the large case.
@pytest.mark.parametrize("cfg,options", [
    (dict(n_layer=6, n_embd=512, vocab=8192, block=128), {}),
    (dict(n_layer=2, n_embd=128, vocab=1024, block=64), {"precision": "bf16", "checkpoint": "full"}),
    (dict(n_layer=2, n_embd=128, vocab=1024, block=64), {"accumulate": 2, "max_grad_norm": 1.0,
                                                         "checkpoint": "selective"}),
    (dict(n_layer=2, n_embd=128, vocab=1024, block=64), {"precision": "fp16"}),
])
def test_peak_within_5_percent_of_the_measured_allocator_peak(cfg, options):
    batch = lm_batch(2, cfg["block"], cfg["vocab"])
    torch.manual_seed(0)
    est = estimate(lambda: small_gpt(**cfg), batch, **options)
    measured = measure_peak(lambda: small_gpt(**cfg), batch, **options)
    if cfg["n_embd"] == 512:
        assert est.state["parameters"] + est.state["gradients"] + est.state["optimizer_state"] >= 200e6
    assert abs(est.peak - measured["peak"]) <= 0.05 * measured["peak"], (est.peak, measured)


# Both steps peak where the engine adds a tensor's two gradients: the tied embedding/head weight (the chunked loss, or
# bf16 + full checkpointing, moves the peak to the embedding's gradient, the last to arrive). Traced under a dispatch
# mode the engine added them out of place (+7.5 % and +8.7 % before the fix; a do-nothing TorchDispatchMode around the
# real step reproduces such predictions to the byte); the trace now adds them in place exactly where the real engine
# does (memwrap/memory/tracing/grad_accumulation.py), and both are exact to a few bytes.
@pytest.mark.parametrize("build,batch,options", [
    (lambda: GPT(GPTConfig(n_layer=1, n_head=8, n_embd=512, vocab_size=4096, block_size=128)),
     {"idx": lm_batch(2, 128, 4096)[0], "labels": lm_batch(2, 128, 4096)[0]}, {"chunked_loss": True}),
    (lambda: small_gpt(n_layer=2, n_embd=256, vocab=4096, block=64), lm_batch(2, 64, 4096),
     {"precision": "bf16", "checkpoint": "full"}),
], ids=["tied-head-chunked-loss", "bf16-full-checkpointing"])
def test_estimate_equals_the_allocator_peak_where_autograd_accumulates_gradients(build, batch, options):
    est = estimate(build, batch, **options)
    measured = measure_peak(build, batch, **options)["peak"]
    assert abs(est.peak / measured - 1) <= 0.01, (est.peak, measured)


_kept = []


def _keep_gradient(y):
    s = y + y.exp()
    s.register_hook(_kept.append)  # a Python hook holds the gradient the engine would accumulate into
    return s.square().sum()


# Graphs in which an intermediate y gets two gradients; the comment says what the real engine does and why.
ACCUMULATIONS = {
    "residual": lambda y: (y + y.sin()).square().sum(),  # in place: the first gradient is the buffer's alone
    "two branches": lambda y: (y.sin() * y.cos()).sum(),  # in place
    "transposed view": lambda y: (y.t() @ torch.ones(y.shape[0], 3)).sum() + y.exp().sum(),  # in place
    "bf16 cast (the tied head under autocast)":
        lambda y: (y.bfloat16() @ torch.ones(y.shape[1], 3, dtype=torch.bfloat16)).float().sum() + y.exp().sum(),
    "expanded gradient": lambda y: (y + y.sin()).sum(),  # out of place: sum()'s gradient is an expanded view
    "one gradient twice": lambda y: (y + y).square().sum(),  # out of place: both slots hold the same tensor
    "gradient held by a hook": _keep_gradient,  # out of place: the hook's list holds it too
    "var_mean's formula adds": lambda y: torch.var_mean(y, dim=1)[0].sum(),  # one gradient: nothing accumulated
}


def _real_accumulates_in_place(graph) -> bool:
    """The real engine (no dispatch mode): is y's accumulated gradient the first-arriving gradient's buffer?"""
    x = torch.randn(64, 32, requires_grad=True)
    y = x * 2
    loss = graph(y)
    arrivals, final, seen, todo = [], [], set(), [loss.grad_fn]
    y.register_hook(lambda g: final.append(g.data_ptr()))
    while todo:  # post-hooks on the nodes whose outputs go to y's buffer record their addresses in arrival order
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        slots = [i for i, (n, _) in enumerate(node.next_functions) if n is y.grad_fn]
        if slots:
            node.register_hook(lambda gi, go, slots=slots: arrivals.extend(gi[i].data_ptr() for i in slots))
        todo.extend(n for n, _ in node.next_functions)
    loss.backward()
    _kept.clear()
    return len(arrivals) >= 2 and final[0] == arrivals[0]


class _Accumulations(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.accumulation = InPlaceAccumulation()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # as the tracker does it (trace.SegmentMixin)
        func = self.accumulation.rewrite(func, args, kwargs)
        res = func(*args, **(kwargs or {}))
        self.accumulation.made(res)
        return res


@pytest.mark.parametrize("name", ACCUMULATIONS)
def test_the_trace_accumulates_in_place_exactly_where_the_real_engine_does(name):
    graph = ACCUMULATIONS[name]
    with FakeTensorMode():
        mode = _Accumulations()
        x = torch.randn(64, 32, requires_grad=True)
        with mode:
            graph(x * 2).backward()
    _kept.clear()
    assert mode.accumulation.rewritten == int(_real_accumulates_in_place(graph))


def test_a_node_adding_into_its_own_output_stays_out_of_place_on_the_safe_side():
    # y * y: one node (MulBackward0) returns both gradients; the real engine adds the second into the first in place,
    # but from inside the dispatch that add cannot be told from one in a node's own formula (var_mean's gv + gm, out of
    # place in the real step too), so the trace keeps it out of place: one gradient-sized over-prediction, never under.
    graph = lambda y: (y * y).square().sum()  # noqa: E731
    with FakeTensorMode():
        mode = _Accumulations()
        x = torch.randn(64, 32, requires_grad=True)
        with mode:
            graph(x * 2).backward()
    assert _real_accumulates_in_place(graph) and mode.accumulation.rewritten == 0


@pytest.mark.parametrize("options", [{}, {"precision": "bf16", "checkpoint": "full"},
                                     {"checkpoint": "every-2", "accumulate": 3}, {"checkpoint": "offload"}])
def test_extrapolation_equals_the_full_trace(options):
    model = small_gpt(n_layer=8, n_embd=64, vocab=256, block=32)
    batch = lm_batch(2, 32, 256)
    full = trace_config(model, lambda: batch, None, options, "adamw", extrapolate=False)
    fast = trace_config(model, lambda: batch, None, options, "adamw", extrapolate=True)
    assert fast.method.startswith("extrapolated") and full.method == "full trace"
    peak_full = max(full.segments.values(), key=lambda s: s.total)
    peak_fast = max(fast.segments.values(), key=lambda s: s.total)
    assert peak_fast.total == peak_full.total
    assert peak_fast.bytes == peak_full.bytes
    assert fast.flops == full.flops and fast.state == full.state
    assert max(s.host for s in fast.segments.values()) == max(s.host for s in full.segments.values())


def first_three_blocks(name, module):
    return name.startswith("transformer.h.") and name.count(".") == 2 and int(name.rsplit(".", 1)[1]) < 3


def odd_blocks(name, module):
    return name.startswith("transformer.h.") and name.count(".") == 2 and int(name.rsplit(".", 1)[1]) % 2 == 1


# Checkpointed sets that are not a period-1 pattern: every-2 on an odd depth (the last block is
# checkpointed in the full model but would not be in an even-depth trace), a position-dependent
# callable (only a full trace is exact) and a periodic one (extrapolated with period 2).
@pytest.mark.parametrize("n_layer,options,method", [
    (9, {"checkpoint": "every-2"}, "extrapolated from traces with 3 and 5 of 9"),
    (13, {"checkpoint": "every-3", "precision": "bf16"}, "extrapolated from traces with 4 and 7 of 13"),
    # 4 + 7 blocks traced one after the other >= 10: one trace of the whole stack costs less (and is exact by
    # definition); traced at once (memwrap.memory.tracing.parallel) they cost 7 < 10 blocks' time: extrapolated.
    (10, {"checkpoint": "every-3", "precision": "bf16"},
     "extrapolated from traces with 4 and 7 of 10" if parallel.enabled() else "full trace"),
    (8, {"checkpoint": first_three_blocks}, "full trace"),
    (8, {"checkpoint": odd_blocks}, "extrapolated from traces with 2 and 4 of 8"),
])
def test_extrapolation_only_where_the_checkpoint_pattern_repeats(n_layer, options, method):
    model = small_gpt(n_layer=n_layer, n_embd=64, vocab=256, block=32)
    batch = lm_batch(2, 32, 256)
    full = trace_config(model, lambda: batch, None, options, "adamw", extrapolate=False)
    auto = trace_config(model, lambda: batch, None, options, "adamw", extrapolate="auto")
    assert auto.method.startswith(method)
    peak_full = max(full.segments.values(), key=lambda s: s.total)
    peak_auto = max(auto.segments.values(), key=lambda s: s.total)
    assert peak_auto.bytes == peak_full.bytes
    assert auto.flops == full.flops and auto.state == full.state


@pytest.mark.parametrize("options", [{"checkpoint": "every-2"}, {"checkpoint": first_three_blocks}])
def test_pattern_dependent_checkpointing_within_5_percent_of_the_measured_peak(options):
    cfg = dict(n_layer=9, n_embd=32, vocab=16, block=256)  # activations dominate: the pattern decides the peak
    batch = lm_batch(4, 256, 16)
    torch.manual_seed(0)
    est = estimate(lambda: small_gpt(**cfg), batch, **options)
    measured = measure_peak(lambda: small_gpt(**cfg), batch, **options)
    assert abs(est.peak - measured["peak"]) <= 0.05 * measured["peak"], (est.peak, measured, est.method)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x):
        return self.lin(x).relu()


@settings(max_examples=40, deadline=None)
@given(length=st.integers(2, 24), every=st.integers(1, 5), checkpointing=st.booleans())
def test_extrapolation_depths_align_with_the_pattern(length, every, checkpointing):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(*[Block() for _ in range(length)]))
    stack = find_stack(model, min_length=2)
    options = {"checkpoint": f"every-{every}"} if checkpointing else {}
    depths = extrapolation_depths(model, stack, options)
    period = min(every, length) if checkpointing else 1  # every-k checkpoints blocks 0, k, 2k, ...
    a0 = max(2 if checkpointing else 1, period)
    if a0 + (length - a0) % period + period >= length:
        assert depths is None
    else:
        a, b = depths
        assert b - a == period and (length - a) % period == 0 and a >= a0 and b < length
    blocks = checkpoint_layout(model, stack, options)[1]
    assert [bool(blk) for blk in blocks] == [checkpointing and i % every == 0 for i in range(length)]


def test_flops_match_flop_counter_on_a_real_step_and_include_recompute():
    model = small_gpt()
    x, y = lm_batch(2, 32, 512)
    # torch's registry has no formula for the CPU flash attention kernel that SDPA runs here (the trace counts it,
    # memwrap.memory.tracing.flop_classes.flop_formulas): the reference gives it torch's own formulas for the CUDA one.
    from torch.utils import flop_counter

    aten = torch.ops.aten
    cpu_flash = {aten._scaled_dot_product_flash_attention_for_cpu:
                 lambda q, k, v, *_, **__: flop_counter.sdpa_flop_count(q, k, v),
                 aten._scaled_dot_product_flash_attention_for_cpu_backward:
                 lambda g, q, k, v, *_, **__: flop_counter.sdpa_backward_flop_count(g, q, k, v)}
    with FlopCounterMode(display=False) as uncounted:
        lm_loss(model(x), y).backward()
    with FlopCounterMode(display=False, custom_mapping=cpu_flash) as counter:
        lm_loss(model(x), y).backward()
    assert counter.get_total_flops() > uncounted.get_total_flops()  # the model's attention runs that kernel
    plain = estimate(small_gpt(), (x, y))
    recompute = estimate(small_gpt(), (x, y), checkpoint="full")
    assert plain.flops_per_micro_batch == counter.get_total_flops()
    assert recompute.flops_per_micro_batch > plain.flops_per_micro_batch
    assert estimate(small_gpt(), (x, y), accumulate=4).flops == 4 * plain.flops


def test_optimizer_that_cannot_run_on_fake_uses_plugin_state_bytes():
    model = small_gpt()
    est = estimate(model, lm_batch(2, 16, 512), optim="adamw_8bit")
    assert est.optimizer == "adamw_8bit"
    assert est.state["optimizer_state"] == predict_state_bytes("adamw_8bit", model)
    assert est.breakdown["optimizer_state"] == predict_state_bytes("adamw_8bit", model)


def test_accumulation_keeps_gradients_alive_during_the_second_micro_batch():
    batch = lm_batch(4, 64, 512)
    one = estimate(small_gpt(), batch)
    acc = estimate(small_gpt(), batch, accumulate=4)
    assert acc.peak > one.peak
    assert acc.peak_micro_batch == 2 and acc.breakdown["gradients"] == acc.state["gradients"]


def test_dict_batches_report_and_serialisation():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

        def forward(self, x, scale=None):
            return self.b(torch.relu(self.a(x)))

    est = estimate(Net(), {"x": torch.randn(16, 32)})
    assert est.peak >= est.breakdown["parameters"] == (32 * 64 + 64 + 64 * 8 + 8) * 4
    text = str(est)
    assert "peak" in text and "parameters" in text and "TFLOP" in text
    d = json.loads(json.dumps(est.to_dict()))
    assert d["peak"] == est.peak and set(d["breakdown"]) >= {"parameters", "gradients", "optimizer_state",
                                                            "activations", "temporaries", "buffers"}


def test_bad_options_fail_like_wrap():
    with pytest.raises(ValueError, match="precision"):
        estimate(small_gpt(), lm_batch(1, 8, 512), precision="bf61")
    with pytest.raises(TypeError, match="factory"):
        estimate(42, lm_batch(1, 8, 512))


def test_llama_preset_extrapolates_on_meta():
    with torch.device("meta"):
        model = build_preset("llama-tiny", num_hidden_layers=6)
    est = estimate(model, lambda: preset_batch("llama-tiny", 1, 32), precision="bf16")
    assert "extrapolated" in est.method
    assert est.breakdown["parameters"] == sum(p.numel() * 4 for p in model.parameters())


def test_value_dependent_forward_gets_a_fix_naming_error():
    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return y * 2 if float(y.sum()) > 0 else y

    with pytest.raises(RuntimeError, match="reads tensor values.*Fix"):
        estimate(Peek(), torch.randn(2, 4))


def test_a_large_preset_is_estimated_without_allocating_it():
    from memwrap.memory.monitor import process_memory, reset_process_peak
    from memwrap.models import PRESETS

    reset_process_peak()
    before = process_memory()["rss"]
    est = estimate(PRESETS["gpt2-xl"].factory, lambda: preset_batch("gpt2-xl", 1, 64))
    grown = process_memory()["peak"] - before
    assert est.state["parameters"] == PRESETS["gpt2-xl"].params * 4  # 6.2 GB of fp32 weights
    assert est.peak > 4 * est.state["parameters"]  # weights, gradients, two AdamW moments
    assert grown < 500 * 2**20, f"process memory grew by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("n", [1, 3])
def test_a_tuple_batch_must_have_two_items(n):
    x, y = lm_batch(1, 8, 512)
    with pytest.raises(TypeError, match=rf"exactly 2 items, \(inputs, targets\); got {n} item"):
        estimate(small_gpt(), (x, y, y)[:n])


# The loop's shape (issue 20 item 3): a loop that holds the model's outputs (outputs = model(**batch);
# outputs.loss.backward()) keeps the logits through backward and the step, and the previous update's through the next
# forward; one that drops them (loss = model(**batch).loss, Trainer) frees them once the loss is computed.
@pytest.mark.parametrize("options", [{}, {"accumulate": 2, "checkpoint": "full"}, {"precision": "bf16"}])
def test_the_loop_shape_is_a_planning_input_and_each_shape_matches_its_measured_peak(options):
    cfg = dict(n_layer=2, n_embd=64, vocab=8192, block=64)  # logits (8 x 64 x 8192 fp32 = 16 MiB) dominate
    batch = lm_batch(8, cfg["block"], cfg["vocab"])
    est = {keep: estimate(lambda: small_gpt(**cfg), batch, keep_outputs=keep, **options) for keep in (True, False)}
    got = {keep: measure_peak(lambda: small_gpt(**cfg), batch, keep_outputs=keep, **options)["peak"]
           for keep in (True, False)}
    for keep in (True, False):
        assert est[keep].keep_outputs is keep and "keep_outputs" not in est[keep].options
        assert abs(est[keep].peak - got[keep]) <= 0.005 * got[keep], (keep, est[keep].peak, got[keep])
    dtype_bytes = 2 if options.get("precision") == "bf16" else 4
    logits = 8 * cfg["block"] * cfg["vocab"] * dtype_bytes
    # The held logits are alive at the peak: the dropped-outputs estimate would be short by more than 5% for this loop.
    assert est[True].peak - est[False].peak >= logits
    assert got[True] - est[False].peak > 0.05 * got[True]
    assert "loop: the model's outputs kept" in str(est[True]) and "outputs dropped" in str(est[False])


def test_the_previous_updates_outputs_count_in_the_first_forward():
    # Exactly one more set of outputs in the forward phase: the previous update's, alive until the new forward returns.
    from memwrap.memory.tracing.trace import output_bytes

    cfg = dict(n_layer=2, n_embd=64, vocab=4096, block=32)
    batch = lm_batch(4, cfg["block"], cfg["vocab"])
    kept, dropped = (estimate(lambda: small_gpt(**cfg), batch, keep_outputs=k) for k in (True, False))
    model = small_gpt(**cfg)
    held = output_bytes(model(batch[0]), model)
    assert held == 4 * cfg["block"] * cfg["vocab"] * 4
    assert kept.phases["forward"] - dropped.phases["forward"] == held


def test_keep_outputs_must_be_a_bool_and_stays_out_of_the_wrap_code():
    import memwrap

    cfg = dict(n_layer=2, n_embd=32, vocab=256, block=16)
    batch = lm_batch(2, cfg["block"], cfg["vocab"])
    with pytest.raises(TypeError, match=r"keep_outputs='no'.*True .*False"):
        estimate(lambda: small_gpt(**cfg), batch, keep_outputs="no")
    with pytest.raises(TypeError, match=r"plan\(keep_outputs=1\)"):
        memwrap.plan(lambda: small_gpt(**cfg), lambda mb: lm_batch(mb, cfg["block"], cfg["vocab"]), budget="1GiB",
                     global_batch=2, keep_outputs=1)
    p = memwrap.plan(lambda: small_gpt(**cfg), lambda mb: lm_batch(mb, cfg["block"], cfg["vocab"]), budget="1GiB",
                     global_batch=2, precisions=["fp32"], checkpoints=[None], optimizers=["adamw"], keep_outputs=False)
    assert "keep_outputs" not in p.code() and all("keep_outputs" not in c.options for c in p.candidates)
    assert all(c.estimate.keep_outputs is False for c in p.candidates)
    assert "drops the model's outputs" in str(p)
