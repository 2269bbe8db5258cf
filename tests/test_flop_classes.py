"""FLOPs by matmul dtype and size (memwrap/memory/tracing/flop_classes.py) and the cost model that rates each class at
the device's speed for that size (memwrap/memory/search/cost.py): the classes add up to the FLOPs the trace counts,
are the GEMMs' own, survive extrapolation and the accumulation window, and a profile whose bf16 is slow on small
matmuls and fast on large ones ranks fp32 first for a narrow model and bf16 first for a wide one."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memwrap
from memwrap.memory import plan
from memwrap.memory.search.cost import (A100, CPU_FIXED, SIZE_SPEED_SIDES, DeviceProfile, calibrate_cpu, class_speed,
                                        cost_terms)
from memwrap.memory.tracing.flop_classes import class_size, flop_class
from memwrap.models import GPT, GPTConfig
from tests.matmul_timing import bf16_over_fp32

pytestmark = pytest.mark.filterwarnings("ignore")


def _gpt(n_layer=4):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=32, vocab_size=64, block_size=16))


def _ids(mb=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 64, (mb, 16), generator=g), torch.randint(0, 64, (mb, 16), generator=g))


# ----------------------------------------------------------------------------- the classes

def test_a_linear_layers_gemms_are_one_class_per_micro_batch_times_the_window():
    # y = x @ W^T (512 x 64 @ 64 x 128) and dW = dy^T @ x (128 x 512 @ 512 x 64; the input needs no gradient, so
    # no dx): both have the mean side (512 * 64 * 128) ** (1/3) = 161, class 181 (half an octave: 2 ** 7.5).
    model = nn.Linear(64, 128)
    batch = (torch.randn(512, 64), torch.randn(512, 128))
    per_mb = 2 * 2 * 512 * 64 * 128
    for accumulate in (1, 3):
        est = memwrap.estimate(model, batch, accumulate=accumulate)
        assert est.flop_classes == {"fp32@181": accumulate * per_mb}
        assert est.flops == accumulate * per_mb
    bf16 = memwrap.estimate(model, batch, precision="bf16")
    assert bf16.flop_classes == {"bf16@181": per_mb}  # autocast: the GEMMs run in bf16


@pytest.mark.parametrize("options", [{}, {"precision": "bf16", "checkpoint": "full"}, {"precision": "bf16-true"},
                                     {"accumulate": 2}])
def test_every_counted_flop_is_in_a_class(options):
    est = memwrap.estimate(_gpt(), _ids(), **options)
    assert est.flop_classes and sum(est.flop_classes.values()) == est.flops
    dtypes = {c.split("@")[0] for c in est.flop_classes}
    assert dtypes == ({"fp32"} if not options.get("precision") else {"bf16"})
    assert all(int(c.split("@")[1]) > 0 for c in est.flop_classes)  # every GEMM's shape was read


def test_extrapolated_classes_are_the_full_traces():
    model = _gpt(n_layer=6)
    full = memwrap.estimate(model, _ids(), extrapolate=False)
    extra = memwrap.estimate(model, _ids(), extrapolate=True)
    assert "extrapolated" in extra.method and "full trace" in full.method
    assert extra.flop_classes == full.flop_classes and extra.flops == full.flops


class Attention(nn.Module):
    """One attention layer, through F.scaled_dot_product_attention or written out as matmuls."""

    def __init__(self, fused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.fused = nn.Linear(32, 96), fused

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 16)).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            y = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v
        return y.transpose(1, 2).flatten(-2)


def test_the_cpu_flash_attention_kernel_is_counted_as_the_written_out_matmuls_are():
    """The trace runs on CPU fake tensors, where SDPA dispatches a kernel torch's FLOP registry does not know: its
    FLOPs were counted as none (a 7B model's attention at seq 8192 is about a quarter of its FLOPs)."""
    batch = (torch.randn(4, 64, 32), torch.randn(4, 64, 32))
    fused = memwrap.estimate(Attention(True), batch)
    plain = memwrap.estimate(Attention(False), batch)
    # The written-out version: q @ k^T and p @ v forward, two GEMMs back through each. The flash kernel's backward
    # also recomputes q @ k^T (torch's formula for its CUDA flash kernel counts it; the CPU kernel does the same).
    one = 2 * (4 * 2) * 64 * 64 * 16  # one (64 x 16) @ (16 x 64) per head, 8 heads
    linear = 2 * 2 * 4 * 64 * 32 * 96  # the qkv layer's forward and weight-gradient GEMMs (no input gradient)
    assert plain.flops == linear + 6 * one and fused.flops == linear + 7 * one
    # per head: (64 x 16) @ (16 x 64), mean side 40, class 45
    assert fused.flop_classes == {"fp32@45": 7 * one, "fp32@91": linear}
    assert plain.flop_classes == {"fp32@45": 6 * one, "fp32@91": linear}


def test_class_sizes_and_the_op_layouts():
    assert class_size(256, 256, 256) == 256 and class_size(1, 1, 1) == 1 and class_size(32, 32, 32) == 32
    a = torch.ones(3, 8, 16)
    assert flop_class(torch.ops.aten.bmm.default, (a, a.transpose(1, 2)), None) == f"fp32@{class_size(8, 16, 8)}"
    x, w = torch.ones(2, 3, 10, 10), torch.ones(8, 3, 3, 3)
    y = torch.ones(2, 8, 8, 8)
    # a convolution as an implicit GEMM: 2*8*8 output positions x 27 filter inputs x 8 channels, forward and backward
    want = f"fp32@{class_size(128, 27, 8)}"
    assert flop_class(torch.ops.aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
                      y) == want
    assert flop_class(torch.ops.aten.convolution_backward.default, (y, x, w), None) == want
    assert flop_class(torch.ops.aten.mm.default, (), None) == "fp32@0"  # no operands: the shape is not read


# ----------------------------------------------------------------------------- the cost model

def _toy(**kw):
    base = dict(peak_flops=1e12, mfu=1.0, speed={"fp32": 1.0, "bf16": 2.0, "tf32": 1.5}, launch_s=1e-6,
                hbm_bytes_s=1e10, pcie_bytes_s=1e10)
    base.update(kw)
    return DeviceProfile("toy", **base)


def test_a_class_is_rated_log_linearly_between_the_sides_measured_and_clamped_outside():
    p = _toy(size_speed={"bf16": {64: 0.5, 256: 8.0}, "tf32": {64: 1.0, 256: 4.0}})
    assert class_speed("bf16@64", "bf16", p) == pytest.approx(0.5)
    assert class_speed("bf16@128", "bf16", p) == pytest.approx(2.0)  # half way in log2: sqrt(0.5 * 8)
    assert class_speed("bf16@16", "bf16", p) == pytest.approx(0.5) and class_speed("bf16@4096", "bf16", p) == 8.0
    assert class_speed("bf16@0", "bf16", p) == 2.0  # shape not read: the precision's speed
    assert class_speed("fp32@128", "bf16", p) == 1.0  # fp32 operands under bf16 autocast: fp32, no table
    assert class_speed("fp32@128", "tf32", p) == pytest.approx(2.0)  # fp32 operands with TF32 on: its table
    assert class_speed("fp64@128", "bf16", p) == pytest.approx(2.0)  # a dtype not rated: as its precision
    t = cost_terms(flops=3e9, ops=0, micro_batches=1, precision="bf16", param_bytes=0, grad_bytes=0, state_bytes=0,
                   device=p, flop_classes={"bf16@64": 1e9, "bf16@256": 2e9})
    assert t["compute"] == pytest.approx(1e9 / (1e12 * 0.5) + 2e9 / (1e12 * 8.0))


def test_without_classes_or_tables_the_terms_are_as_before():
    kw = dict(flops=3e12, ops=10, micro_batches=2, precision="bf16", param_bytes=0, grad_bytes=0, state_bytes=0)
    assert cost_terms(**kw, device=A100) == cost_terms(**kw, device=A100, flop_classes={"bf16@181": 3e12})
    assert cost_terms(**kw, device=CPU_FIXED)["compute"] == pytest.approx(
        3e12 / (CPU_FIXED.peak_flops * CPU_FIXED.speed["bf16"]))


@pytest.mark.parametrize("table", [{}, {64: 0.0}, {0: 1.0}, {True: 1.0}, {64.5: 1.0}])
def test_a_bad_size_table_is_refused_naming_it(table):
    with pytest.raises(ValueError, match=r"size_speed\['bf16'\] must map matmul sides"):
        _toy(size_speed={"bf16": table})


class Wide(nn.Module):
    def __init__(self, dim):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x):
        return self.body(x)


def _ranked(dim, rows, profile):
    def batch(mb):
        g = torch.Generator().manual_seed(mb)
        return torch.randn(mb, dim, generator=g), torch.randn(mb, dim, generator=g)

    p = plan(lambda: Wide(dim), batch, budget="4GiB", global_batch=rows, keep_optim=None, keep_precision=None,
             margin=(0, 0), step_in_backward=(False,), chunked_loss=(False,), device=profile,
             candidates=[{"micro_batch": rows, "precision": pr, "checkpoint": None, "optim": "adamw"}
                         for pr in ("fp32", "bf16")])
    return [c.precision for c in p.candidates]


def test_a_profile_slow_on_small_bf16_matmuls_ranks_a_narrow_model_fp32_first_and_a_wide_one_bf16_first():
    # An AMX CPU's shape (measured: bf16 0.08x fp32 at 32^3, 7.3x at 512^3), compute-bound (launches negligible).
    amx = _toy(peak_flops=1e8, launch_s=1e-12, hbm_bytes_s=1e15, pcie_bytes_s=1e15,
               speed={"fp32": 1.0, "bf16": 4.0}, size_speed={"fp32": {32: 1.0, 512: 1.0}, "bf16": {32: 0.1, 512: 7.0}})
    assert _ranked(16, 16, amx) == ["fp32", "bf16"]
    assert _ranked(512, 512, amx) == ["bf16", "fp32"]
    one_number = dataclasses.replace(amx, size_speed={})  # the old model: bf16 4x everywhere
    assert _ranked(16, 16, one_number) == ["bf16", "fp32"]


def test_the_calibrated_profile_has_a_table_per_dtype_that_orders_small_and_large_matmuls_as_measured():
    p = calibrate_cpu()
    assert set(p.size_speed) == {"fp32", "tf32", "bf16", "fp16"}
    for table in p.size_speed.values():
        assert tuple(sorted(table)) == SIZE_SPEED_SIDES and all(math.isfinite(v) and v > 0 for v in table.values())
    assert p.size_speed["tf32"] == p.size_speed["fp32"]
    assert "by size" in p.source and p.to_dict()["size_speed"]["bf16"] == dict(p.size_speed["bf16"])
    # An independent measurement (single calls, best of 20) agrees on which dtype is faster at each end, wherever
    # the two differ clearly (bf16 on an AMX CPU: slower at 32^3, faster at 512^3; without AMX: slower at both).
    for side in (SIZE_SPEED_SIDES[0], SIZE_SPEED_SIDES[-1]):
        mine = bf16_over_fp32(side, reps=20)
        theirs = p.size_speed["bf16"][side] / p.size_speed["fp32"][side]
        if abs(math.log(mine)) > math.log(3) and abs(math.log(theirs)) > math.log(3):
            assert (mine > 1) == (theirs > 1), (side, mine, theirs)
