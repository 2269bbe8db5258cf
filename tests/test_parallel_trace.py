"""Two traces at once (memwrap/memory/tracing/parallel.py): the same results and errors as one after the other."""
from __future__ import annotations

import os
import time

import pytest
import torch

import memwrap
from memwrap.memory.tracing import parallel
from memwrap.models import build_preset, preset_batch

needs_fork = pytest.mark.skipif(not parallel.enabled(), reason="needs Linux, fork and two cores")


@needs_fork
def test_the_first_runs_in_a_child_and_both_results_come_back():
    here = os.getpid()
    first, second = parallel.both(lambda: (os.getpid(), torch.arange(4).sum().item()), lambda: os.getpid())
    assert second == here and first[0] != here and first[1] == 6


def test_off_by_environment_runs_both_here(monkeypatch):
    monkeypatch.setenv("MEMWRAP_TRACE_WORKERS", "0")
    here = os.getpid()
    assert parallel.both(os.getpid, os.getpid) == (here, here)


@needs_fork
def test_an_error_of_either_is_raised_here():
    def bad():
        raise IndexError("the model's forward depends on its depth")

    with pytest.raises(IndexError, match="depends on its depth"):  # the child failed: run here, raising here
        parallel.both(bad, lambda: 1)
    with pytest.raises(KeyError):
        parallel.both(lambda: 1, lambda: {}["missing"])


@needs_fork
def test_a_child_that_sends_nothing_in_time_is_stopped_and_the_first_runs_here(monkeypatch):
    monkeypatch.setattr(parallel, "MIN_WAIT_S", 0.3)
    here = os.getpid()

    def first():
        if parallel._IN_CHILD:
            time.sleep(30)
        return os.getpid()

    start = time.monotonic()
    assert parallel.both(first, lambda: 2) == (here, 2)
    assert time.monotonic() - start < 10


@needs_fork
def test_an_extrapolated_estimate_is_the_same_with_and_without_the_child(monkeypatch):
    with torch.device("meta"):
        model = build_preset("llama-tiny", num_hidden_layers=6)
    batch = lambda: preset_batch("llama-tiny", 2, 32)  # noqa: E731
    est = {}
    for workers in ("1", "0"):
        monkeypatch.setenv("MEMWRAP_TRACE_WORKERS", workers)
        est[workers] = memwrap.estimate(model, batch, precision="bf16", checkpoint="full", accumulate=2)
    a, b = est["1"], est["0"]
    assert "extrapolated" in a.method and "extrapolated" in b.method
    assert (a.peak, a.breakdown, a.phases, a.flops, a.state) == (b.peak, b.breakdown, b.phases, b.flops, b.state)


@needs_fork
def test_a_child_that_needs_a_workspace_probe_hands_the_trace_back_instead_of_hanging(monkeypatch, tmp_path):
    # oneDNN's bf16 matmul scratch is measured at the step's thread count (2 here). A forked child that switched to it
    # hung in OpenMP (its thread pool does not survive fork) until the parent gave up after MIN_WAIT_S (30 s) for each
    # trace: a 12-trace plan of a 2-layer GPT took 97 s instead of 8. Now the child refuses the probe at once and the
    # parent traces: the same estimate as without the child, long before a hung child would be given up on.
    if torch.get_num_threads() < 2:
        pytest.skip("the probes run at the step's thread count, which must differ from the child's one thread")
    monkeypatch.setenv("MEMWRAP_CACHE_DIR", str(tmp_path / "empty"))  # every matmul shape is probed anew
    monkeypatch.setattr(parallel, "MIN_WAIT_S", 600.0)  # a hung child would hold this test for ten minutes
    with torch.device("meta"):
        model = build_preset("llama-tiny", num_hidden_layers=6)
    batch = lambda: preset_batch("llama-tiny", 2, 32)  # noqa: E731
    torch.randn(512, 512) @ torch.randn(512, 512)  # OpenMP's threads exist in this process when it forks
    start = time.monotonic()
    forked = memwrap.estimate(model, batch, precision="bf16", workspace="cpu")
    assert time.monotonic() - start < 300  # a hang detector, not a timing: a hung child costs 600 s
    assert "extrapolated" in forked.method
    assert any(op.startswith("aten.mm") and row["kind"] == "measured" for op, row in forked.workspace.items())
    monkeypatch.setenv("MEMWRAP_TRACE_WORKERS", "0")
    here = memwrap.estimate(model, batch, precision="bf16", workspace="cpu")
    assert (forked.peak, forked.breakdown, forked.workspace) == (here.peak, here.breakdown, here.workspace)


def test_a_pinned_process_refuses_to_switch_threads_and_counts_it(monkeypatch):
    from memwrap.memory.tracing import workspace

    monkeypatch.setitem(workspace._threads, "pinned", True)
    monkeypatch.setitem(workspace._threads, "refused", 0)
    monkeypatch.setitem(workspace._threads, "training", torch.get_num_threads() + 1)
    with pytest.raises(workspace.ThreadsPinned, match="cannot switch"):
        with workspace._at_training_threads():
            pass
    assert workspace.probes_refused() == 1 and torch.get_num_threads() == workspace.training_threads() - 1
