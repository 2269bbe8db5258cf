"""The cost model's device profiles: the A100 reference by default, a "cpu" profile measured on this machine,
chosen by plan(device=...), and candidate order following the terms (memwrap/memory/search/cost.py)."""
from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import memwrap
from memwrap.memory import plan
from memwrap.memory.search import cost
from memwrap.memory.search.cost import (A100, CPU_FIXED, DeviceProfile, calibrate_cpu, cost_terms, cpu_profile,
                                        device_profile, step_seconds)
from tests.matmul_timing import bf16_over_fp32

pytestmark = pytest.mark.filterwarnings("ignore")

TERMS = dict(flops=3e12, ops=1200, micro_batches=4, param_bytes=40_000_000, grad_bytes=40_000_000,
             state_bytes=80_000_000, offloaded=10_000_000, paged_spill=5_000_000, host_state=7_000_000)


def _toy(name="toy", **kw) -> DeviceProfile:
    base = dict(peak_flops=1e12, mfu=1.0, speed={"fp32": 1.0, "bf16": 1.0}, launch_s=1e-6, hbm_bytes_s=1e10,
                pcie_bytes_s=1e10)
    base.update(kw)
    return DeviceProfile(name, **base)


# ----------------------------------------------------------------------------- selection

@pytest.mark.parametrize("device", [None, "cuda", "cuda:1", "GPU", "a100", torch.device("cuda", 0)])
def test_gpu_targets_and_the_default_select_the_a100_reference(device):
    assert device_profile(device) is A100


def test_cpu_selects_the_calibrated_profile_or_the_fixed_one(monkeypatch):
    monkeypatch.delenv("MEMWRAP_CALIBRATE", raising=False)
    assert device_profile("cpu") is calibrate_cpu()
    assert device_profile(torch.device("cpu")) is calibrate_cpu()
    assert device_profile("cpu", calibrate=False) is CPU_FIXED
    monkeypatch.setenv("MEMWRAP_CALIBRATE", "0")  # reproducible plans: no timing at all
    assert cpu_profile() is CPU_FIXED and device_profile("cpu") is CPU_FIXED
    assert device_profile("cpu", calibrate=True) is calibrate_cpu()  # the argument wins over the environment
    mine = _toy()
    assert device_profile(mine) is mine


@pytest.mark.parametrize("device", ["tpu", "mps:0", 3, 1.5])
def test_an_unknown_device_is_refused_with_the_choices(device):
    with pytest.raises(ValueError, match=r"'cuda'.*'cpu'.*DeviceProfile"):
        device_profile(device)


def test_a_profile_with_a_non_positive_constant_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"launch_s must be a finite number > 0"):
        _toy(launch_s=0.0)
    with pytest.raises(ValueError, match=r"speed must rate 'fp32'"):
        _toy(speed={"bf16": 1.0})


def test_plan_refuses_an_unknown_device_before_tracing():
    calls = []

    def factory():
        calls.append(1)
        return nn.Linear(4, 4)

    with pytest.raises(ValueError, match="device='tpu'"):
        plan(factory, lambda mb: torch.randn(mb, 4), budget="1GiB", global_batch=2, device="tpu")
    assert calls == []


# ----------------------------------------------------------------------------- the terms

def test_the_default_is_the_a100_model_term_by_term():
    """Backwards compatible: no device= gives the module constants' model, exactly as before the profiles."""
    got = cost_terms(precision="fp32", **TERMS)
    want = {"compute": 3e12 / (cost.PEAK_FLOPS * cost.MFU * cost.SPEED["fp32"]),
            "launches": 4 * 1200 * cost.LAUNCH_S, "traffic": 0.0,
            "optimizer": (2 * 40e6 + 40e6 + 2 * 80e6) / cost.HBM_BYTES_S,
            "offload": 2 * 10e6 / cost.PCIE_BYTES_S, "paging": 2 * 5e6 / cost.PCIE_BYTES_S,
            "host_state": 2 * 7e6 / cost.PCIE_BYTES_S}
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-12)
    assert cost_terms(precision="fp32", device=A100, **TERMS) == got
    assert step_seconds(precision="fp32", **TERMS) == pytest.approx(sum(want.values()), rel=1e-12)


def test_views_cost_view_s_and_the_other_ops_bytes_cost_bandwidth():
    stats = {"views": 200, "bytes": 3_000_000}
    p = _toy(launch_s=10e-6, view_s=1e-6, hbm_bytes_s=1e10)
    got = cost_terms(precision="fp32", device=p, op_stats=stats, **TERMS)
    assert got["launches"] == pytest.approx(4 * (1000 * 10e-6 + 200 * 1e-6))  # 4 micro-batches of 1200 ops
    assert got["traffic"] == pytest.approx(4 * 3e6 / 1e10)
    # A profile without view_s (the A100's) charges a view as any op: only the traffic term is new there.
    a100 = cost_terms(precision="fp32", op_stats=stats, **TERMS)
    assert a100["launches"] == pytest.approx(4 * 1200 * cost.LAUNCH_S)
    assert a100["traffic"] == pytest.approx(4 * 3e6 / cost.HBM_BYTES_S)
    with pytest.raises(ValueError, match="view_s"):
        _toy(view_s=0.0)


def test_the_trace_counts_the_ops_a_real_step_dispatches():
    """The fake trace's own metadata queries (prim.device: 912 of 1314 'ops' of a small GPT-2 before) are not ops;
    the count equals the eager step's under a dispatch mode, and so do its views."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from memwrap.memory.tracing.op_stats import is_view

    torch.manual_seed(0)

    def factory():
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(),
                                   torch.nn.Linear(32, 16))

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    est = memwrap.estimate(factory, (x, y), loss_fn=lambda out, t: ((out - t) ** 2).mean())
    counts = {"ops": 0, "views": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            counts["ops"] += func.namespace != "prim"
            counts["views"] += is_view(func)
            return func(*args, **(kwargs or {}))

    model = factory()
    with Count():
        ((model(x) - y) ** 2).mean().backward()
    assert est.ops_per_micro_batch == counts["ops"]
    assert est.op_stats["views"] == counts["views"] and est.op_stats["bytes"] > 0


def test_a_profile_replaces_every_constant():
    p = _toy(peak_flops=2e11, mfu=0.5, speed={"fp32": 1.0, "bf16": 0.25}, launch_s=3e-6, hbm_bytes_s=2e10,
             pcie_bytes_s=5e9)
    got = cost_terms(precision="bf16", device=p, **TERMS)
    assert got["compute"] == pytest.approx(3e12 / (2e11 * 0.5 * 0.25), rel=1e-12)
    assert got["launches"] == pytest.approx(4 * 1200 * 3e-6, rel=1e-12)
    assert got["optimizer"] == pytest.approx(280e6 / 2e10, rel=1e-12)
    assert got["offload"] == pytest.approx(2e7 / 5e9, rel=1e-12)
    assert got["paging"] == pytest.approx(1e7 / 5e9, rel=1e-12)
    assert got["host_state"] == pytest.approx(1.4e7 / 5e9, rel=1e-12)


def test_bf16_on_the_cpu_profile_is_rated_by_its_measured_speed():
    p = calibrate_cpu()
    assert p.name == "cpu" and p.speed["fp32"] == 1.0 and p.mfu == 1.0
    for precision in ("bf16", "bf16-true"):  # a plugin precision: by its dtype (bf16 storage / autocast)
        got = cost_terms(precision=precision, device=p, **TERMS)["compute"]
        assert got == pytest.approx(3e12 / (p.peak_flops * p.speed["bf16"]), rel=1e-12)
    ratio = (cost_terms(precision="fp32", device=p, **TERMS)["compute"]
             / cost_terms(precision="bf16", device=p, **TERMS)["compute"])
    assert ratio == pytest.approx(p.speed["bf16"], rel=1e-12)
    assert ratio != pytest.approx(A100.speed["bf16"] / A100.speed["fp32"])  # not the A100's 16x
    # An independent measurement of the same two matmuls agrees on which dtype is faster wherever the two differ
    # clearly (bf16 is fast with AMX and several times slower than fp32 without it).
    mine = bf16_over_fp32(256)
    if max(mine, p.speed["bf16"]) / min(mine, p.speed["bf16"]) < 20 and abs(math.log(mine)) > math.log(2):
        assert (mine > 1) == (p.speed["bf16"] > 1), (mine, p.speed)


def test_calibration_is_cached_per_process_and_thread_count_and_its_numbers_are_sane():
    threads = torch.get_num_threads()
    first = calibrate_cpu()
    t0 = time.perf_counter()
    again = calibrate_cpu()
    assert again is first and time.perf_counter() - t0 < 0.01  # cached: no second measurement
    assert first == calibrate_cpu(size=256, reps=3)  # the defaults spelled out: the same cache entry
    for v in (first.peak_flops, first.launch_s, first.hbm_bytes_s, first.pcie_bytes_s, *first.speed.values()):
        assert math.isfinite(v) and v > 0
    # Units, not speed: a loaded 2-core machine measured 8 GFLOP/s and 1 ms per op with 2 threads (each op waits for
    # the busy core), 165 GFLOP/s and 4 us with 1.
    assert 1e7 < first.peak_flops < 1e15 and 1e-8 < first.launch_s < 1e-1 and 1e7 < first.hbm_bytes_s < 1e14
    assert first.speed["tf32"] == 1.0  # a CPU has no TF32: fp32 matmuls
    try:
        torch.set_num_threads(1 if threads != 1 else 2)
        other = calibrate_cpu()
        assert other is not first and other is calibrate_cpu()
    finally:
        torch.set_num_threads(threads)
    assert calibrate_cpu() is first
    with pytest.raises(ValueError, match="size"):
        calibrate_cpu(size=4)
    with pytest.raises(ValueError, match="reps"):
        calibrate_cpu(reps=0)


def test_the_fixed_cpu_profile_is_deterministic_and_documented(monkeypatch):
    assert CPU_FIXED.name == "cpu" and "fixed" in CPU_FIXED.source
    monkeypatch.setenv("MEMWRAP_CALIBRATE", "off")
    a = cost_terms(precision="bf16", device="cpu", **TERMS)
    assert a == cost_terms(precision="bf16", device=CPU_FIXED, **TERMS)
    assert a["compute"] == pytest.approx(3e12 / (CPU_FIXED.peak_flops * CPU_FIXED.speed["bf16"]), rel=1e-12)
    assert CPU_FIXED.to_dict()["speed"] == dict(CPU_FIXED.speed)


# ----------------------------------------------------------------------------- the plan ranks by the profile

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(self, x):
        return self.blocks(x)


def _factory():
    torch.manual_seed(0)
    return MLP()


def _batch(mb):
    g = torch.Generator().manual_seed(mb)
    return torch.randn(mb, 32, generator=g), torch.randn(mb, 32, generator=g)


HAND_MADE = [{"micro_batch": 4, "precision": "bf16", "checkpoint": None, "optim": "adamw"},  # 1 micro-batch, bf16
             {"micro_batch": 1, "precision": "fp32", "checkpoint": None, "optim": "adamw"}]  # 4 micro-batches, fp32


def _plan(device):
    return plan(_factory, _batch, budget="1GiB", global_batch=4, candidates=HAND_MADE, keep_optim=None,
                keep_precision=None, margin=(0, 0), step_in_backward=(False,), chunked_loss=(False,), device=device)


def _expected(c, profile):
    est = c.estimate
    return cost_terms(flops=est.flops, ops=est.ops_per_micro_batch, micro_batches=c.accumulate, precision=c.precision,
                      param_bytes=est.state["parameters"], grad_bytes=est.state["gradients"],
                      state_bytes=est.state["optimizer_state"], offloaded=est.offloaded, paged_spill=0,
                      host_state=est.host_state, device=profile, flop_classes=est.flop_classes,
                      op_stats=est.op_stats)


def test_two_hand_made_candidates_are_ordered_by_the_profiles_terms():
    # Launch-bound with equal matmul speeds: the single micro-batch (bf16) pays 1/4 of the launches: it ranks first.
    launch_bound = _toy("launch-bound", launch_s=1e-3, peak_flops=1e15)
    # Compute-bound with a slow bf16 (as on a CPU without AMX): the fp32 one ranks first despite 4x the launches.
    slow_bf16 = _toy("slow-bf16", launch_s=1e-12, peak_flops=1e6, speed={"fp32": 1.0, "bf16": 0.05})
    order = {}
    for profile in (launch_bound, slow_bf16):
        p = _plan(profile)
        assert p.device is profile and all(c.fits for c in p.candidates)
        for c in p.candidates:
            terms = _expected(c, profile)
            assert c.terms == pytest.approx(terms, rel=1e-12)
            assert c.seconds == pytest.approx(sum(terms.values()), rel=1e-12)
        seconds = [c.seconds for c in p.candidates]
        assert seconds == sorted(seconds) and seconds[0] < seconds[1]
        order[profile.name] = [(c.micro_batch, c.precision) for c in p.candidates]
    assert order["launch-bound"] == [(4, "bf16"), (1, "fp32")]
    assert order["slow-bf16"] == [(1, "fp32"), (4, "bf16")]
    # The launches term is exactly 4x for the 4-micro-batch candidate when both trace the same ops per micro-batch.
    p = _plan(launch_bound)
    bf16, fp32 = sorted(p.candidates, key=lambda c: c.precision)
    assert fp32.terms["launches"] / fp32.estimate.ops_per_micro_batch == pytest.approx(
        4 * bf16.terms["launches"] / bf16.estimate.ops_per_micro_batch, rel=1e-12)


def test_a_cpu_plan_ranks_with_cpu_costs_and_says_so(monkeypatch):
    monkeypatch.setenv("MEMWRAP_CALIBRATE", "0")
    p = _plan("cpu")
    assert p.device is CPU_FIXED
    for c in p.candidates:
        assert c.seconds == pytest.approx(sum(_expected(c, CPU_FIXED).values()), rel=1e-12)
    assert "this CPU" in p.verdict and p.to_dict()["device"] == "cpu"
    default = _plan(None)
    assert default.device is A100 and "reference GPU (A100)" in default.verdict
    for c in default.candidates:
        assert c.seconds == pytest.approx(sum(_expected(c, A100).values()), rel=1e-12)
