"""plan(): ranking, the no-fit verdict, options that wrap() accepts, trace reuse."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memwrap
from memwrap.memory import estimate, plan
from memwrap.memory.budget import format_bytes
from memwrap.memory.planner import Margin
from memwrap.models import build_preset, lm_loss, preset_batch

pytestmark = pytest.mark.filterwarnings("ignore")

PRESET = "llama-tiny"


def make_batch(mb):
    return preset_batch(PRESET, mb, 32, generator=torch.Generator().manual_seed(mb))


def factory():
    return build_preset(PRESET)


@pytest.fixture(scope="module")
def grid():
    """One plan over a small grid; its estimates are reused with other budgets below."""
    return plan(factory, make_batch, budget="1GiB", global_batch=4, micro_batches=(4, 1),
                precisions=("bf16", "fp32"), checkpoints=(None, "full"), optimizers=("adamw", "adamw_8bit"),
                margin=(0.0, 0))


def rerank(p, budget):
    """The same candidates judged against another budget (no new traces)."""
    return p.with_budget(budget)


def test_candidates_keep_the_global_batch_and_cover_the_grid(grid):
    assert len(grid.candidates) == 2 * 2 * 2 * 2
    assert all(c.micro_batch * c.accumulate == 4 for c in grid.candidates)
    assert {(c.micro_batch, c.precision, c.checkpoint, c.optim) for c in grid.candidates} == {
        (m, p, ck, o) for m in (4, 1) for p in ("bf16", "fp32") for ck in (None, "full") for o in ("adamw", "adamw_8bit")}


def _check_ranking(p):
    fits = [c.fits for c in p.candidates]
    assert fits == sorted(fits, reverse=True), "a fitting candidate is ranked below one that does not fit"
    fitting = [c.seconds for c in p.candidates if c.fits]
    assert fitting == sorted(fitting)
    for c in p.candidates:
        assert c.fits == (c.estimate.peak + c.margin <= p.budget)
    assert p.best is (p.candidates[0] if p.candidates[0].fits else None)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.floats(min_value=0.0, max_value=1.0))
def test_a_fitting_candidate_is_never_ranked_below_one_that_does_not(grid, q):
    peaks = sorted(c.estimate.peak for c in grid.candidates)
    budget = int(peaks[0] + q * (peaks[-1] - peaks[0])) + 1
    _check_ranking(rerank(grid, budget))


def test_best_options_work_with_wrap_on_the_real_model(grid):
    best = grid.best
    assert best is not None and best.options["accumulate"] == 4 // best.micro_batch
    model = factory()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wmodel, wopt = memwrap.wrap(model, opt, **{**best.options, "optim": "adamw"})
    for _ in range(best.accumulate):
        x, y = make_batch(best.micro_batch)
        lm_loss(wmodel(x), y).backward()
        wopt.step()
        wopt.zero_grad()
    assert wopt.updates == 1
    code = grid.code()
    assert code.splitlines()[0] == "import memwrap" and "memwrap.wrap(model, optimizer," in code


def test_no_fit_verdict_names_the_smallest_peak_and_what_dominates(grid):
    smallest = min(c.estimate.peak for c in grid.candidates)
    p = rerank(grid, smallest - 1)
    assert p.best is None and not p.fits
    assert p.smallest.estimate.peak == smallest
    dominant = p.smallest.estimate.dominant
    assert dominant == max(p.smallest.estimate.breakdown, key=p.smallest.estimate.breakdown.get)
    assert "nothing fits" in p.verdict and dominant in p.verdict
    assert f"the smallest peak is {format_bytes(smallest)} " in p.verdict
    _check_ranking(p)
    assert [c.required for c in p.candidates] == sorted(c.required for c in p.candidates)


def test_derived_optimizer_equals_a_direct_estimate(grid):
    c = next(c for c in grid.candidates if c.optim == "adamw_8bit" and c.micro_batch == 4 and c.checkpoint is None
             and c.precision == "bf16")
    direct = estimate(factory, lambda: make_batch(4), loss_fn=None, precision="bf16", accumulate=1,
                      optim="adamw_8bit")
    assert c.estimate.peak == direct.peak and c.estimate.breakdown == direct.breakdown


def test_margin_is_kept_apart_and_decides_the_fit(grid):
    smallest = min(grid.candidates, key=lambda c: c.estimate.peak)
    budget = smallest.estimate.peak + 1000
    tight = grid.with_budget(budget, margin=(0.0, 1000))
    assert tight.fits and tight.best.estimate.peak == smallest.estimate.peak and tight.best.margin == 1000
    assert not grid.with_budget(budget, margin=(0.0, 1001)).fits
    one = plan(factory, make_batch, budget=budget, global_batch=4, margin=(0.0, 1000),
               candidates=[{"micro_batch": smallest.micro_batch, "precision": smallest.precision,
                            "checkpoint": smallest.checkpoint, "optim": smallest.optim}])
    assert one.fits and one.best.estimate.peak == smallest.estimate.peak
    assert Margin().of(10 * 2**30) == int(0.08 * 10 * 2**30) + 2**30


def test_plan_input_errors():
    with pytest.raises(ValueError, match="do not divide"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, micro_batches=(3,))
    with pytest.raises(ValueError, match="global_batch"):
        plan(factory, make_batch, budget="1GiB", global_batch=0)
    with pytest.raises(ValueError, match="Accepted"):
        plan(factory, make_batch, budget="lots", global_batch=4)
    with pytest.raises(ValueError, match="margin"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, margin="big")
    with pytest.raises(ValueError, match="candidate keys"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, candidates=[{"micro": 1}])
    # a typo fails the plan with wrap()'s message; it is not a policy that "cannot run on this model"
    with pytest.raises(ValueError, match="'fulll' is not a known policy. Did you mean 'full'"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, checkpoints=(None, "fulll"))
    with pytest.raises(ValueError, match="every=0 is not valid"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, checkpoints=("every-0",))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        plan(factory, make_batch, budget="1GiB", global_batch=4, precisions=("bf16", "fp8"), checkpoints=("full",))


def test_none_names_no_checkpointing_as_in_the_docs():
    p = plan(factory, make_batch, budget="64GiB", global_batch=2, micro_batches=(2,), precisions=("fp32",),
             checkpoints=("none",), optimizers=("adamw",))
    assert not p.skipped and [c.options.get("checkpoint") for c in p.candidates] == [None]


def test_plan_serialises(grid):
    import json

    d = json.loads(json.dumps(grid.to_dict(), default=repr))
    assert d["fits"] is True and len(d["candidates"]) == len(grid.candidates)
    assert d["best"]["options"] == grid.best.options
    assert "budget" in str(grid) and grid.best.label in str(grid)


def test_margin_alone_not_fitting_is_named_in_the_verdict(grid):
    low = min(grid.candidates, key=lambda c: c.estimate.peak)
    p = grid.with_budget(low.estimate.peak, margin=(0.0, 1))  # the peak fits exactly; the margin does not
    assert not p.fits
    assert "the margin is what does not fit" in p.verdict.lower() and "--margin" in p.verdict
    assert low.label in p.verdict and format_bytes(low.estimate.peak) in p.verdict
    assert "dominated by" not in p.verdict
    assert "dominated by" in grid.with_budget(low.estimate.peak - 1, margin=(0.0, 1)).verdict


def test_margin_parse_keeps_the_default_fixed_part_and_validates():
    assert Margin.parse(0.1) == Margin(0.1, Margin().fixed) and Margin().fixed == 2**30
    assert Margin.parse((0.1, "0B")) == Margin.parse((0.1, "0GiB")) == Margin.parse((0.1, 0)) == Margin(0.1, 0)
    assert Margin.parse((0.05, "512MiB")) == Margin(0.05, 512 * 2**20)
    for bad in (1.0, -0.1, 1.5, float("nan"), (1.2, "1GiB"), (-0.5, 0)):
        with pytest.raises(ValueError, match="margin fraction"):
            Margin.parse(bad)
    with pytest.raises(ValueError, match="margin") as info:
        Margin.parse((0.1, "-1GiB"))
    assert "budget" not in str(info.value)
    with pytest.raises(ValueError, match="margin fraction"):
        Margin(2.0, 0)


def test_extra_wrap_options_reach_the_pasted_code_and_the_json():
    import json

    p = plan(factory, make_batch, budget="4GiB", global_batch=2, micro_batches=(1,), precisions=("fp32",),
             checkpoints=(None,), optimizers=("adamw",), max_grad_norm=0.5)
    best = p.best
    assert best.options == {"precision": "fp32", "accumulate": 2, "max_grad_norm": 0.5, "optim": "adamw"}
    assert best.estimate.options["max_grad_norm"] == 0.5  # the option the trace ran with
    assert "max_grad_norm=0.5" in p.code()
    assert json.loads(json.dumps(p.to_dict(), default=repr))["best"]["options"]["max_grad_norm"] == 0.5
