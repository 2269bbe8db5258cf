"""benchmarks/rank_check.py's statistics: Spearman's rank correlation with ties, checked by hand and against the
no-ties closed form 1 - 6 sum(d^2) / (n (n^2 - 1))."""
from __future__ import annotations

import itertools
import math

import pytest
from benchmark_loading import load_benchmark

pytestmark = pytest.mark.filterwarnings("ignore")


_load = load_benchmark  # tests/benchmark_loading.py


rank_check = _load("rank_check")


def test_average_ranks_share_the_mean_rank_of_a_tie():
    assert rank_check.average_ranks([10, 20, 20, 30]) == [1.0, 2.5, 2.5, 4.0]
    assert rank_check.average_ranks([3.0, 1.0, 2.0]) == [3.0, 1.0, 2.0]
    assert rank_check.average_ranks([5, 5, 5]) == [2.0, 2.0, 2.0]
    assert rank_check.average_ranks([2, 1, 2, 1, 3]) == [3.5, 1.5, 3.5, 1.5, 5.0]


def test_spearman_with_ties_by_hand():
    # x ranks [1, 2.5, 2.5, 4], y ranks [1, 3, 2, 4], both of mean 2.5: deviations [-1.5, 0, 0, 1.5] and
    # [-1.5, 0.5, -0.5, 1.5]; covariance sum 4.5, squares 4.5 and 5: rho = 4.5 / sqrt(22.5).
    assert rank_check.spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(4.5 / math.sqrt(22.5), abs=1e-12)
    assert rank_check.spearman([1, 2, 2, 3], [10, 30, 20, 40]) == pytest.approx(0.9486832980505138, abs=1e-12)
    # Ties on both sides: x ranks [1.5, 1.5, 3, 4], y ranks [1, 2.5, 2.5, 4]: deviations [-1, -1, .5, 1.5] and
    # [-1.5, 0, 0, 1.5]; covariance sum 3.75, squares 4.5 and 4.5: rho = 3.75 / 4.5.
    assert rank_check.spearman([7, 7, 8, 9], [1, 2, 2, 3]) == pytest.approx(3.75 / 4.5, abs=1e-12)


def test_spearman_is_the_closed_form_without_ties_and_only_sees_the_order():
    for n in (2, 3, 5):
        for perm in itertools.permutations(range(n)):
            d2 = sum((i - p) ** 2 for i, p in enumerate(perm))
            want = 1 - 6 * d2 / (n * (n * n - 1))
            assert rank_check.spearman(list(range(n)), list(perm)) == pytest.approx(want, abs=1e-12)
    # Any increasing transform of either side leaves rho unchanged (predicted seconds vs measured medians).
    x, y = [0.3, 0.1, 0.2, 0.9], [5.0, 1.0, 3.0, 2.0]
    assert rank_check.spearman([math.exp(v) for v in x], [v ** 3 for v in y]) == pytest.approx(
        rank_check.spearman(x, y), abs=1e-12)
    assert rank_check.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0, abs=1e-12)


def test_spearman_is_undefined_without_spread_and_refuses_mismatched_lengths():
    assert math.isnan(rank_check.spearman([1, 1, 1], [1, 2, 3]))
    assert math.isnan(rank_check.spearman([1, 2, 3], [4, 4, 4]))
    assert math.isnan(rank_check.spearman([1], [2]))
    with pytest.raises(ValueError, match="same length"):
        rank_check.spearman([1, 2], [1, 2, 3])


def test_summary_pools_times_relative_to_each_plans_first():
    def rows(pred, meas):
        return [{"predicted_s": p, "a100_s": p, "measured_s": m} for p, m in zip(pred, meas)]

    parts = dict.fromkeys(rank_check.PARTS, 1.0) | {"compute_plus_launches_vs_fwd_bwd": math.nan}
    results = [{"rho": 1.0, "rho_a100": 1.0, "top1_is_fastest": True, "parts": parts,
                "rows": rows([1.0, 2.0], [10.0, 30.0])},
               {"rho": -1.0, "rho_a100": -1.0, "top1_is_fastest": False, "parts": parts,
                "rows": rows([5.0, 6.0], [100.0, 50.0])}]
    s = rank_check.summary(results)
    assert s["mean_rho"] == 0.0 and s["top1_hits"] == 1 and s["workloads"] == 2
    # relative: predicted [1, 2, 1, 1.2], measured [1, 3, 1, 0.5]
    assert s["pooled_rho"] == pytest.approx(rank_check.spearman([1, 2, 1, 1.2], [1, 3, 1, 0.5]), abs=1e-12)
    assert s["mean_parts"]["launches_alone"] == 1.0 and math.isnan(s["mean_parts"]["compute_plus_launches_vs_fwd_bwd"])


def test_one_workload_runs_end_to_end_and_its_rho_is_that_of_its_own_rows():
    """The benchmark's path on a tiny model: plan on the cpu profile, the top candidates run as the plan configures
    them, medians of interleaved repetitions, rho from those rows."""
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                                        for _ in range(2))

        def forward(self, x):
            for b in self.blocks:
                x = x + b(x)
            return x

    def factory():
        torch.manual_seed(0)
        return Net()

    def batch(mb):
        g = torch.Generator().manual_seed(mb)
        return torch.randn(mb, 16, generator=g), torch.randn(mb, 16, generator=g)

    w = dict(factory=factory, batch=batch, loss=None, global_batch=4, micro_batches=(1, 4), source="test MLP")
    res = rank_check.run_workload("mlp", w, k=3, reps=2)
    rows = res["rows"]
    assert 2 <= len(rows) <= 3 and res["fitting"] >= len(rows)
    assert [r["predicted_s"] for r in rows] == sorted(r["predicted_s"] for r in rows)  # the plan's speed order
    for r in rows:
        assert r["error"] is None and r["measured_s"] > 0
        assert r["measured_fwd_bwd_s"] > 0 and r["measured_optimizer_s"] > 0
        assert r["spread"][0] <= r["measured_s"] <= r["spread"][1]
    rho = rank_check.spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    assert res["rho"] == rho or (math.isnan(rho) and math.isnan(res["rho"]))
    assert res["top1_is_fastest"] == (min(rows, key=lambda r: r["measured_s"]) is rows[0])


def test_the_a100_column_is_what_the_default_plan_predicts():
    import torch
    from torch import nn

    import memwrap

    def factory():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))

    def batch(mb):
        g = torch.Generator().manual_seed(mb)
        return torch.randn(mb, 16, generator=g), torch.randn(mb, 16, generator=g)

    kw = dict(budget="1GiB", global_batch=4, micro_batches=(1, 4), margin=(0, 0), **rank_check.SEARCH)
    cpu = memwrap.plan(factory, batch, device="cpu", **kw)
    default = {c.label: c.seconds for c in memwrap.plan(factory, batch, **kw).candidates}
    assert len(default) >= 4
    for c in cpu.candidates:
        assert rank_check.a100_seconds(c, 2**30) == pytest.approx(default[c.label], rel=1e-12)
