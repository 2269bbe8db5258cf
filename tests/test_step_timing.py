"""The optimizer term timed on the planning CPU (memwrap.memory.search.step_timing).

Timings themselves are checked in benchmarks/rank_check.py (docs/benchmarks/rank_check.md); these tests check what
is timed, how the fit is applied to a model, that it is measured once, and where the planner uses it.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import memwrap
from memwrap.memory.search import step_timing as st
from memwrap.memory.search.cost import CPU_FIXED, calibrate_cpu, cost_terms
from memwrap.memory.search.space import AsBuilt


@pytest.fixture(autouse=True)
def fresh_fits(monkeypatch):
    monkeypatch.setattr(st, "_fits", {})


def test_a_model_step_is_per_tensor_plus_per_element_over_trainable_parameters_counted_once(monkeypatch):
    monkeypatch.setattr(st, "_fit", lambda options: (1e-3, 1e-6))
    net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10, bias=False), nn.Linear(10, 10))
    net[2].weight = net[0].weight  # tied: one tensor, stepped once
    net[2].bias.requires_grad_(False)  # frozen: not stepped
    # trainable: net[0].weight (100), net[0].bias (10), net[1].weight (100)
    got = st.optimizer_seconds({"precision": "fp32", "optim": "adamw"}, net)
    assert got == pytest.approx(3 * 1e-3 + 210 * 1e-6)
    # FSDP2: each rank steps its share of the elements (every tensor is sharded, so the per-tensor cost stays).
    sharded = st.optimizer_seconds({"precision": "fp32", "optim": "adamw"}, net, 4, sharded=True)
    assert sharded == pytest.approx(3 * 1e-3 + 53 * 1e-6)
    assert st.optimizer_seconds({"precision": "fp32", "optim": "adamw"}, net, 4) == pytest.approx(got)  # DDP


def test_the_fit_solves_the_two_probes_and_is_measured_once_per_step(monkeypatch):
    calls = []
    (c_small, n_small), (c_large, n_large) = st.PROBES
    a, b = 2e-5, 3e-9

    def fake_probe(options, count, numel):
        calls.append((options["precision"], count, numel))
        return 0.0, count * (a + b * numel)

    monkeypatch.setattr(st, "_time_probe", fake_probe)
    fit = st.per_tensor_and_element({"precision": "bf16-true", "optim": "adamw", "accumulate": 4,
                                     "checkpoint": "full"})
    assert fit == pytest.approx((a, b))
    assert calls == [("bf16-true", c_small, n_small), ("bf16-true", c_large, n_large)]
    # accumulation and checkpointing do not change a step: the same fit, not measured again
    assert st.per_tensor_and_element({"precision": "bf16-true", "optim": "adamw"}) == fit
    assert len(calls) == 2
    st.per_tensor_and_element({"precision": "bf16-true", "optim": "adamw", "max_grad_norm": 1.0})
    assert len(calls) == 4  # clipping is part of the step: its own fit


def test_a_step_inside_backward_is_that_backward_less_a_plain_one(monkeypatch):
    seen = []

    def fake_probe(options, count, numel):
        seen.append((options["optim"], options.get("step_in_backward", False)))
        fb = 5.0 if options.get("step_in_backward") else 2.0  # the updates add 3 s per probe to backward
        return fb * count, 0.0

    monkeypatch.setattr(st, "_time_probe", fake_probe)
    a, b = st.per_tensor_and_element({"precision": "fp32", "optim": "adamw", "step_in_backward": True})
    assert a == pytest.approx(3.0) and b == pytest.approx(0.0)
    assert seen == [("adamw", True), ("sgd", False)] * 2


def test_an_optimizer_the_probe_cannot_run_keeps_the_bandwidth_term(monkeypatch):
    def broken(options, count, numel):
        raise RuntimeError("needs CUDA")

    monkeypatch.setattr(st, "_time_probe", broken)
    assert st.optimizer_seconds({"precision": "fp32", "optim": "adamw"}, nn.Linear(4, 4)) is None


def test_the_probe_runs_the_real_wrapped_step():
    # Real timing, no assertion on its size: the probe builds, steps and fits bf16-true's converted optimizer.
    a, b = st.per_tensor_and_element({"precision": "bf16-true", "optim": "adamw"})
    assert a >= 0 and b > 0
    probe = st._Probe(2, 64)
    model, opt = memwrap.wrap(probe, st._build("adamw", probe), precision="bf16-true")
    before = [w.detach().clone() for w in probe.weights]
    model(torch.ones(1)).backward()
    opt.step()
    assert all(w.dtype == torch.bfloat16 for w in probe.weights)
    assert all(not torch.equal(w0, w) for w0, w in zip(before, probe.weights))


def test_your_own_optimizer_is_timed_as_built():
    net = nn.Linear(8, 8)
    keep = AsBuilt(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net)
    built = st._build(keep, st._Probe(2, 16))
    assert type(built) is torch.optim.SGD and built.param_groups[0]["momentum"] == 0.9
    plain = st._key({"optim": "sgd", "precision": "fp32"})
    assert st._key({"optim": keep, "precision": "fp32"}) != plain


def _tiny_plan(device):
    torch.manual_seed(0)

    def factory():
        return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    return memwrap.plan(factory, lambda mb: (torch.randn(mb, 32), torch.randn(mb, 32)), budget="1GiB",
                        global_batch=4, micro_batches=(4,), precisions=("fp32", "bf16-true"), checkpoints=(None,),
                        optimizers=("adamw",), loss_fn=lambda out, y: ((out - y) ** 2).mean(), device=device,
                        keep_optim=None, keep_precision=None)


def test_the_calibrated_cpu_plan_uses_the_timed_step_and_the_fixed_profile_the_bandwidth_form(monkeypatch):
    monkeypatch.setattr(st, "_fit", lambda options: (1e-3, 0.0) if options["precision"] == "fp32" else (2e-3, 0.0))
    assert calibrate_cpu().time_steps and not CPU_FIXED.time_steps
    timed = _tiny_plan("cpu")
    by_precision = {c.precision: c for c in timed.candidates}
    assert by_precision["fp32"].terms["optimizer"] == pytest.approx(4 * 1e-3)  # 4 parameter tensors
    assert by_precision["bf16-true"].terms["optimizer"] == pytest.approx(4 * 2e-3)
    for c in timed.candidates:
        assert c.seconds == pytest.approx(sum(c.terms.values()))
    fixed = _tiny_plan(CPU_FIXED)
    for c in fixed.candidates:
        est = c.estimate
        assert c.terms["optimizer"] == cost_terms(
            flops=est.flops, ops=est.ops_per_micro_batch, micro_batches=c.accumulate, precision=c.precision,
            param_bytes=est.state["parameters"], grad_bytes=est.state["gradients"],
            state_bytes=est.state["optimizer_state"], device=CPU_FIXED)["optimizer"]
    a100 = _tiny_plan(None)  # the default reference GPU: nothing is timed
    assert all(c.terms["optimizer"] != 4e-3 for c in a100.candidates)
