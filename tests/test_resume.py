"""Stopping after any micro-step and resuming in a new process reproduces the uninterrupted run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("resume_worker.py")
TOTAL = 17  # micro-steps: crosses an epoch end (11 batches, windows of 3, last window of 2)


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(WORKER), *map(str, args)], check=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = {}
    for precision in ("fp32", "fp16"):
        path = tmp_path_factory.mktemp("full") / f"{precision}.pt"
        run(path, precision, 0, TOTAL)
        out[precision] = torch.load(path, weights_only=True)
    return out


@pytest.mark.parametrize("precision,stop_at", [("fp32", 1), ("fp32", 10), ("fp16", 5)])
def test_resume_in_new_process_is_exact(tmp_path, uninterrupted, precision, stop_at):
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    run(first, precision, 0, stop_at)
    run(second, precision, stop_at, TOTAL, first)
    resumed = torch.load(second, weights_only=True)
    expected = uninterrupted[precision]
    for key, value in expected["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    assert resumed["optimizer"]["counters"] == expected["optimizer"]["counters"]
    assert resumed["optimizer"]["gate"] == expected["optimizer"]["gate"]
    assert resumed["scheduler"] == expected["scheduler"]
