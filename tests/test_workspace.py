"""Kernel workspaces (memwrap/memory/tracing/workspace.py): oneDNN convolution and RNN buffers the fake trace cannot
see, measured with small real calls, fitted, cached on disk and added to the trace.

The reference is the project's real measurement (memwrap.memory.measure.measure_peak: the CPU allocator's events
through a real training step), independent of the fits.
"""
import json

import pytest
import torch
from torch import nn

import memwrap
from memwrap.memory.measure import allocator_growth, measure_peak
from memwrap.memory.tracing import workspace as W

TOL = 0.05


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Each test starts with an empty cache of its own (never the user's) and the workspace model on."""
    monkeypatch.setenv("MEMWRAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MEMWRAP_WORKSPACE", raising=False)
    return tmp_path / "cache"


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                               nn.Conv2d(32, 64, 3, padding=1, stride=2), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))

    def forward(self, x):
        return self.f(x)


class LSTMNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(64, 128, num_layers=2, batch_first=True)
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def ce(out, y):
    return nn.functional.cross_entropy(out, y)


def conv_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def lstm_batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 50, 64, generator=g), torch.randint(0, 10, (16,), generator=g)


@pytest.mark.parametrize("build,batch,ops", [
    (ConvNet, conv_batch, {"aten.convolution.default", "aten.convolution_backward.default"}),
    (LSTMNet, lstm_batch, {"aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default"}),
], ids=["conv-batchnorm", "lstm"])
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="the gap this closes is oneDNN's")
def test_measured_peak_within_tolerance_only_with_workspace(build, batch, ops):
    b = batch()
    without = memwrap.estimate(build, b, loss_fn=ce, workspace=False)
    with_ws = memwrap.estimate(build, b, loss_fn=ce)
    measured = measure_peak(build, b, ce)["peak"]
    gap_without = measured / without.peak - 1
    gap_with = measured / with_ws.peak - 1
    assert gap_without > TOL, (without.peak, measured)  # the fake trace alone misses the kernels' buffers
    assert abs(gap_with) <= TOL, (with_ws.peak, measured, with_ws.workspace)
    assert without.workspace == {} and set(with_ws.workspace) == ops
    assert all(row["kind"] == "fit" and row["calls"] > 0 for row in with_ws.workspace.values())
    text = str(with_ws)
    assert all(f"kernel workspace {op}" in text for op in ops)


def test_lstm_workspace_kept_for_backward_is_the_real_one():
    # The meta kernel returns mkldnn's RNN workspace empty; the trace gives it the size the real kernel returns.
    rnn = nn.LSTM(64, 128, batch_first=True)
    x = torch.randn(16, 50, 64, requires_grad=True)
    seen = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.mkldnn_rnn_layer.default:
                seen.append(out[3].untyped_storage().nbytes())
            return out

    with Record():
        rnn(x)
    est = memwrap.estimate(lambda: nn.LSTM(64, 128, batch_first=True), x, loss_fn=lambda out, _: out[0].sum())
    kept = est.workspace["aten.mkldnn_rnn_layer.default"]["kept"]
    # oneDNN pads the workspace's parts to alignment, so its size is linear in the batch only up to that padding
    # (fitted from 2, 4, 6: 6 285 995 bytes predicted at 16 against 6 279 168 real).
    assert seen[0] > 0 and abs(kept / seen[0] - 1) <= 0.005, (kept, seen)


def test_conv_fit_predicts_a_larger_batch_measured_directly():
    # The fit comes from batch sizes 2, 4 (checked at 6); batch 12 is measured here the plain way.
    x, w, bias = torch.randn(12, 32, 16, 16), torch.randn(64, 32, 3, 3), torch.randn(64)
    args = (x, w, bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    ws = W.Workspace(torch.device("cpu"))
    fit, n = ws.fit_for(torch.ops.aten.convolution.default, args)
    held = []
    peak = allocator_growth(lambda: held.append(torch.ops.aten.convolution.default(*args)))
    real = peak - held[0].untyped_storage().nbytes()
    a, b = fit["scratch"]
    assert n == 12 and fit["kind"] == "fit"
    assert abs(a + b * n - real) <= max(0.1 * real, 16 << 10), (fit, real)


def test_cache_is_written_and_reused(cache):
    b = conv_batch()
    before = W.probe_count()
    first = memwrap.estimate(ConvNet, b, loss_fn=ce)
    probed = W.probe_count() - before
    files = list(cache.glob("workspace-*.json"))
    assert probed == 6 and len(files) == 1  # 3 convolutions x (forward, backward)
    data = json.loads(files[0].read_text())
    assert data["torch"] == torch.__version__ and len(data["fits"]) == 6
    second = memwrap.estimate(ConvNet, b, loss_fn=ce)
    assert W.probe_count() - before == probed  # nothing probed again
    assert second.peak == first.peak and second.workspace == first.workspace


def test_corrupt_cache_is_ignored_with_a_warning_and_reprobed(cache):
    b = conv_batch()
    reference = memwrap.estimate(ConvNet, b, loss_fn=ce)
    path, = cache.glob("workspace-*.json")
    path.write_text("{not json")
    before = W.probe_count()
    with pytest.warns(RuntimeWarning, match="ignoring the workspace cache"):
        again = memwrap.estimate(ConvNet, b, loss_fn=ce)
    assert W.probe_count() - before == 6
    assert json.loads(path.read_text())["fits"]  # rewritten, valid
    assert again.peak == reference.peak


def test_turned_off_by_env_probes_nothing(monkeypatch):
    monkeypatch.setenv("MEMWRAP_WORKSPACE", "0")
    b = conv_batch()
    before = W.probe_count()
    est = memwrap.estimate(ConvNet, b, loss_fn=ce)
    assert W.probe_count() == before and est.workspace == {}
    assert est.peak == memwrap.estimate(ConvNet, b, loss_fn=ce, workspace=False).peak
    assert "kernel workspace" not in str(est)


def test_bad_workspace_option_is_refused():
    with pytest.raises(TypeError, match="workspace=.yes.*or the device"):
        memwrap.estimate(ConvNet, conv_batch(), loss_fn=ce, workspace="yes")


def test_8bit_adamw_step_temporaries_are_measured():
    # bitsandbytes' 8-bit AdamW cannot run on fake tensors: its state comes from the plugin, and its step's
    # temporaries (it dequantizes one tensor's state at a time) from real steps, fitted in the parameter's size.
    pytest.importorskip("bitsandbytes")

    def build():
        return nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))

    g = torch.Generator().manual_seed(0)
    b = (torch.randn(8, 1024, generator=g), torch.randint(0, 10, (8,), generator=g))
    without = memwrap.estimate(build, b, loss_fn=ce, optimizer="adamw_8bit", workspace=False)
    with_ws = memwrap.estimate(build, b, loss_fn=ce, optimizer="adamw_8bit")
    measured = measure_peak(build, b, ce, optimizer="adamw_8bit")["peak"]
    assert measured / without.peak - 1 > TOL, (without.peak, measured)
    assert abs(measured / with_ws.peak - 1) <= TOL, (with_ws.peak, measured)
    row = with_ws.workspace["optimizer step (adamw_8bit)"]
    assert row["kind"] == "fit" and row["bytes"] > 0 and with_ws.peak_phase == "optimizer"


def test_8bit_adamw_embedding_steps_with_its_32bit_state_temporaries():
    # gpt2-tiny's largest parameter is its (tied) embedding, which the adamw_8bit plugin keeps in 32-bit state: its
    # step dequantizes nothing (12 B per element on CPU, not the 20 B of an 8-bit tensor). Probed per role, the
    # estimate equals the real CPU peak (it was 10.7% over when the 8-bit probe stood for every parameter).
    pytest.importorskip("bitsandbytes")
    from memwrap.models import build_preset, preset_batch

    def build():
        return build_preset("gpt2-tiny")

    b = preset_batch("gpt2-tiny", 4, 64)
    est = memwrap.estimate(build, b, optimizer="adamw_8bit", precision="bf16")
    measured = measure_peak(build, b, optimizer="adamw_8bit", precision="bf16")["peak"]
    assert abs(est.peak / measured - 1) <= 0.01, (est.peak, measured)
    rows = est.workspace
    assert rows["optimizer step (adamw_8bit, embedding)"]["bytes"] > rows["optimizer step (adamw_8bit)"]["bytes"] > 0


def test_where_the_workspaces_are_measured():
    """The model's device (a factory: the traced CPU), a device named by workspace=, or nowhere."""
    cpu = torch.device("cpu")
    assert W.probe_device(None, "meta", cpu) == cpu and W.probe_device(True, "cpu", cpu) == cpu
    assert W.probe_device("cpu", "meta", cpu) == cpu
    assert W.probe_device(False, "cpu", cpu) is None and W.probe_device(False, "cuda", cpu) is None
    if not torch.cuda.is_available():
        assert W.probe_device(None, "cuda", cpu) is None  # a CUDA model's kernels cannot be run here
        with pytest.raises(ValueError, match="no CUDA device.*Fix"):
            W.probe_device("cuda", "meta", cpu)


def test_on_cuda_only_the_convolutions_are_probed():
    """The fake trace runs on the CPU: its oneDNN RNN ops are CPU kernels, which a CUDA model never runs (cuDNN's RNN
    instead, not recorded), so a CUDA Workspace leaves them alone; convolutions are the same op on both."""
    ws = W.Workspace(torch.device("cuda"))  # nothing runs until an op is met
    aten = torch.ops.aten
    assert ws.wrap(aten.add.Tensor, (), {}) is aten.add.Tensor
    assert ws.wrap(aten.convolution.default, (), {}) is not aten.convolution.default
    assert W.modelled_ops(torch.device("cpu")) > W.modelled_ops(torch.device("cuda"))


def test_a_cuda_lstm_estimate_says_its_rnn_is_not_modelled(monkeypatch):
    """For a model trained on CUDA, the CPU trace's oneDNN RNN layers get no term (cuDNN's RNN runs there instead),
    and the report says so per op instead of passing over them. No CUDA needed: only the device the workspaces
    would be probed on is set, and an LSTM has no convolution to probe."""
    from memwrap.memory.tracing import trace as T
    plain = memwrap.estimate(LSTMNet, lstm_batch(), loss_fn=ce, workspace=False)
    monkeypatch.setattr(T, "probe_device", lambda *a: torch.device("cuda"))
    est = memwrap.estimate(LSTMNet, lstm_batch(), loss_fn=ce, workspace=True)
    rnn = {op: row for op, row in est.workspace.items() if "mkldnn_rnn_layer" in op}
    assert set(rnn) == {"aten.mkldnn_rnn_layer.default", "aten.mkldnn_rnn_layer_backward.default"}
    for op, row in rnn.items():
        assert row["bytes"] == row["kept"] == 0 and row["calls"] == 2  # two layers, no term
        assert row["kind"].startswith("not modelled on cuda") and "cuDNN's RNN" in row["kind"]
        assert f"kernel workspace {op}: not modelled on cuda" in str(est) and "no term added" in str(est)
    # No term: the trace's RNN bytes are what the plain trace has (the optimizer step's CPU row aside).
    assert est.breakdown["activations"] == plain.breakdown["activations"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_workspace_cuda_without_a_gpu_is_refused_before_tracing():
    before = W.probe_count()
    with pytest.raises(ValueError, match="workspace='cuda'.*no CUDA device.*Fix"):
        memwrap.estimate(ConvNet, conv_batch(), loss_fn=ce, workspace="cuda")
    assert W.probe_count() == before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py's zoo_cuda row)")
def test_cudnn_convolution_workspaces_are_measured_on_the_gpu():
    b = conv_batch()
    est = memwrap.estimate(ConvNet, b, loss_fn=ce, workspace="cuda")
    measured = measure_peak(ConvNet, b, ce, device="cuda")["peak"]
    assert set(est.workspace) <= {"aten.convolution.default", "aten.convolution_backward.default"}
    assert abs(est.peak / measured - 1) <= TOL, (est.peak, measured, est.workspace)


class Attention(nn.Module):
    """One causal self-attention over 512 tokens, 4 heads of 16: small tensors, so the CPU flash-attention kernel's
    per-thread score blocks are a large part of the step."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 16)).permute(2, 0, 3, 1, 4)
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
        return self.out(h.transpose(1, 2).flatten(-2))


def mse(out, y):
    return ((out - y) ** 2).mean()


def test_sdpa_cpu_flash_attention_scratch_is_measured_with_its_keywords():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    b = torch.randn(2, 512, 64, generator=g), torch.randn(2, 512, 64, generator=g)
    without = memwrap.estimate(Attention, b, loss_fn=mse, workspace=False)
    with_ws = memwrap.estimate(Attention, b, loss_fn=mse)
    measured = measure_peak(Attention, b, mse)["peak"]
    sdpa = {op: row for op, row in with_ws.workspace.items() if "flash_attention" in op}
    assert set(sdpa) == {"aten._scaled_dot_product_flash_attention_for_cpu.default",
                         "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"}
    assert all(row["kind"] == "fit" and row["bytes"] > 0 for row in sdpa.values())
    assert measured / without.peak - 1 > 0.03, (without.peak, measured)  # the kernel's buffers, unseen
    assert abs(with_ws.peak / measured - 1) < 0.01, (with_ws.peak, measured, with_ws.workspace)


def test_an_attention_call_too_costly_to_probe_is_reported_not_probed():
    q = torch.empty(1, 32, 2048, 128, device="meta")
    why = W._probe_too_costly(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
    assert why.startswith("not measured") and "GFLOP" in why
    small = torch.empty(1, 4, 128, 16, device="meta")
    assert W._probe_too_costly(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                               (small, small, small)) == ""


def _onednn_bf16_matmul_scratch() -> int:
    a, b = torch.randn(260, 64, dtype=torch.bfloat16), torch.randn(64, 128, dtype=torch.bfloat16)
    held = []
    return allocator_growth(lambda: held.append(a @ b)) - 260 * 128 * 2


def test_16_bit_matmul_scratch_is_measured_at_each_shape_and_fp32_is_not_probed():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    b = torch.randn(4, 65, 64, generator=g), torch.randn(4, 65, 64, generator=g)

    def build():
        return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))

    fp32 = memwrap.estimate(build, b, loss_fn=mse)
    assert not any(op.startswith(("aten.mm", "aten.addmm")) for op in fp32.workspace)  # fp32: BLAS, nothing
    est = memwrap.estimate(build, b, loss_fn=mse, precision="bf16")
    measured = measure_peak(build, b, mse, precision="bf16")["peak"]
    rows = {op: row for op, row in est.workspace.items() if op in ("aten.addmm.default", "aten.mm.default")}
    assert rows and all(row["kind"] == "measured" for row in rows.values())
    if _onednn_bf16_matmul_scratch() > 0:  # this CPU's bf16 matmuls take a scratchpad: the estimate now has it
        assert max(row["bytes"] for row in rows.values()) > 0
    assert abs(est.peak / measured - 1) < 0.01, (est.peak, measured, est.workspace)
    big = torch.empty(4096, 4096, dtype=torch.bfloat16, device="meta")
    assert W._probe_too_costly(torch.ops.aten.mm.default, (big, big)).startswith("not measured")
