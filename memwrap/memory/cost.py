"""The planner's cost model: predicted seconds per optimizer update on a reference GPU.

Only the ranking matters (the plan reports costs relative to the cheapest candidate), so the
model keeps the terms that differ between candidates and one reference device::

    compute   = FLOPs per update (recompute included, from the trace) / (PEAK_FLOPS * MFU * speed[precision])
    launches  = micro-batches per update * dispatched ops per micro-batch (from the trace) * LAUNCH_S
    optimizer = (2 * parameter bytes + gradient bytes + 2 * optimizer-state bytes) / HBM_BYTES_S
    offload   = 2 * offloaded bytes / PCIE_BYTES_S      (out in forward, back in backward; no overlap assumed)

``launches`` is the micro-batch efficiency term: a small micro-batch pays the same per-kernel
overhead for less work, so splitting a global batch into more micro-batches costs time.
``speed`` is the matmul throughput of a precision relative to bf16 (tensor cores): fp16 1,
tf32 1/2, fp32 1/16 (A100/H100 dense ratios; fp32 without TF32 runs on CUDA cores).

Example:
    >>> step_seconds(flops=1e15, ops=1000, micro_batches=1, precision="bf16", param_bytes=0,
    ...              grad_bytes=0, state_bytes=0) > 0
    True
"""
from __future__ import annotations

from typing import Any

__all__ = ["PEAK_FLOPS", "MFU", "SPEED", "LAUNCH_S", "HBM_BYTES_S", "PCIE_BYTES_S", "step_seconds", "cost_terms"]

PEAK_FLOPS = 312e12  # dense bf16 of the reference GPU (A100)
MFU = 0.5  # fraction of peak a well-fed training step reaches
SPEED = {"bf16": 1.0, "fp16": 1.0, "tf32": 0.5, "fp32": 1 / 16}
LAUNCH_S = 8e-6  # per dispatched op: kernel launch + framework overhead
HBM_BYTES_S = 1.5e12
PCIE_BYTES_S = 20e9


def cost_terms(*, flops: float, ops: int, micro_batches: int, precision: str, param_bytes: int, grad_bytes: int,
               state_bytes: int, offloaded: int = 0) -> dict[str, float]:
    """The four terms of the model in seconds (see the module docstring)."""
    return {
        "compute": flops / (PEAK_FLOPS * MFU * SPEED.get(precision, 1 / 16)),
        "launches": micro_batches * ops * LAUNCH_S,
        "optimizer": (2 * param_bytes + grad_bytes + 2 * state_bytes) / HBM_BYTES_S,
        "offload": 2 * offloaded / PCIE_BYTES_S,
    }


def step_seconds(**kw: Any) -> float:
    """Predicted seconds per optimizer update: the sum of :func:`cost_terms`."""
    return sum(cost_terms(**kw).values())
