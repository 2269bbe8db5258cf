"""The default search leaves out checkpointed candidates that a fitting candidate without checkpointing outruns
(plan(exhaustive=False)): proved against the exhaustive search, whose every checkpointed candidate costs at least as
much as its no-checkpoint twin, and whose best is the pruned search's best."""
from __future__ import annotations

import pytest
import torch

import memwrap
from memwrap.memory.search.planner import _settings
from memwrap.models import build_preset, preset_batch


def _twin_key(c):
    return _settings({"micro_batch": c.micro_batch, "precision": c.precision, "optim": c.optim,
                      "step_in_backward": c.extra.get("step_in_backward", False) or False,
                      "chunked_loss": c.extra.get("chunked_loss", False) or False,
                      "compensation": c.extra.get("compensation")})


CASES = {
    "gpt2-tiny": (lambda: build_preset("gpt2-tiny"), lambda mb: preset_batch("gpt2-tiny", mb, 64)),
    "llama-tiny": (lambda: build_preset("llama-tiny"), lambda mb: preset_batch("llama-tiny", mb, 32)),
    "bert-tiny": (lambda: build_preset("bert-tiny"), lambda mb: preset_batch("bert-tiny", mb, 32)),
}


def _both_plans(name):
    build, batch = CASES[name]
    kw = dict(budget="2GiB", global_batch=4, margin=(0.08, "16MiB"), keep_precision=None,
              precisions=None, chunked_loss=(False,))
    model = build()
    full = memwrap.plan(model, batch, exhaustive=True, **kw)
    pruned = memwrap.plan(model, batch, **kw)
    return name, full, pruned


@pytest.mark.parametrize("name", sorted(CASES))
def test_pruning_by_dominance(name):
    """The three checks below on one pair of plans per model: one test, so that pytest-xdist's workers do not each
    plan the same model again (a module fixture is set up once per worker: 700 s of a 23-minute suite)."""
    both_plans = _both_plans(name)
    _checkpointing_never_outruns_its_twin_without_it(both_plans)
    _the_pruned_search_finds_the_same_best_with_fewer_traces(both_plans)
    _with_budget_refuses_a_budget_that_would_need_what_was_left_out(both_plans)


def _checkpointing_never_outruns_its_twin_without_it(both_plans):
    """The claim the pruning rests on, on every pair the exhaustive search traced."""
    name, full, _ = both_plans
    plain = {_twin_key(c): c for c in full.candidates if c.checkpoint is None}
    pairs = [(c, plain[_twin_key(c)]) for c in full.candidates if c.checkpoint is not None and _twin_key(c) in plain]
    assert pairs, name
    for ckpt, twin in pairs:
        if twin.estimate.paged_state:
            continue  # paged state: excluded from the pruning (its spill term falls with the peak)
        assert ckpt.seconds >= twin.seconds, (name, ckpt.label, ckpt.terms, twin.label, twin.terms)
        assert ckpt.estimate.flops >= twin.estimate.flops and \
            ckpt.estimate.ops_per_micro_batch >= twin.estimate.ops_per_micro_batch, (name, ckpt.label)


def _the_pruned_search_finds_the_same_best_with_fewer_traces(both_plans):
    name, full, pruned = both_plans
    assert full.best is not None and pruned.best is not None
    assert pruned.best.label == full.best.label and pruned.best.estimate.peak == full.best.estimate.peak
    assert {c.label for c in pruned.candidates} < {c.label for c in full.candidates}, name
    by_label = {c.label: c for c in full.candidates}
    for c in pruned.candidates:  # what it traced, it traced the same
        assert c.estimate.peak == by_label[c.label].estimate.peak and c.seconds == by_label[c.label].seconds
    left_out = [why for _, why in pruned.skipped if why.startswith("not traced: it cannot outrun")]
    assert len(left_out) == len(full.candidates) - len(pruned.candidates)
    # Every candidate left out is slower than the best (the fitting twin it was pruned for is at least as fast).
    assert all(c.seconds >= pruned.best.seconds for c in full.candidates
               if c.label not in {p.label for p in pruned.candidates} and c.fits)


def _with_budget_refuses_a_budget_that_would_need_what_was_left_out(both_plans):
    _, full, pruned = both_plans
    assert pruned.with_budget("4GiB").best.label == pruned.best.label  # a bigger budget: nothing changes
    tight = min(d.estimate.peak for d in pruned.dominators) - 1
    with pytest.raises(ValueError, match="exhaustive=True"):
        pruned.with_budget(tight, margin=(0.0, 0))
    full.with_budget(tight, margin=(0.0, 0))  # the exhaustive plan re-judges as before


def test_listing_checkpoints_traces_them_all_and_bad_values_are_refused():
    model = build_preset("gpt2-tiny")
    batch = lambda mb: preset_batch("gpt2-tiny", mb, 32)  # noqa: E731
    p = memwrap.plan(model, batch, budget="2GiB", global_batch=2, checkpoints=(None, "full"), step_in_backward=(False,),
                     chunked_loss=(False,), margin=(0.0, 0))
    assert {c.checkpoint for c in p.candidates} == {None, "full"} and not p.dominators
    with pytest.raises(TypeError, match="exhaustive"):
        memwrap.plan(model, batch, budget="2GiB", global_batch=2, exhaustive="yes")
