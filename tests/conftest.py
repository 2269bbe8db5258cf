import os
import tempfile

import pytest
import torch

# Two cores are shared by everything on CI machines; oversubscription only slows tests down.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# Kernel workspace fits (memwrap/memory/tracing/workspace.py) go to a folder of this test session, never the user's cache.
os.environ.setdefault("MEMWRAP_CACHE_DIR", tempfile.mkdtemp(prefix="memwrap-test-cache-"))
# The trace cache (memwrap/memory/tracing/disk_cache.py) is off: many tests patch the tracer or a plugin and must see
# their patch traced, not a trace stored by an earlier test. tests/test_disk_cache.py turns it on where it is tested.
os.environ.setdefault("MEMWRAP_TRACE_CACHE", "0")
os.environ.setdefault("MEMWRAP_VALUE_CACHE", "0")  # the same for stored probe answers (disk_cache.remember)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error, robust to elements that are ~0 in both."""
    denom = b.detach().double().norm().clamp_min(1e-30)
    return float((a.detach().double() - b.detach().double()).norm() / denom)


def max_rel_err(params_a, params_b) -> float:
    return max(rel_err(a, b) for a, b in zip(list(params_a), list(params_b), strict=True))


@pytest.fixture
def seeded():
    torch.manual_seed(0)
    yield
