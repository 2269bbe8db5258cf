"""The planner's cost model: predicted seconds per optimizer update on a reference GPU.

Only the ranking matters (the plan reports costs relative to the cheapest candidate), so the
model keeps the terms that differ between candidates and one reference device::

    compute   = FLOPs per update (recompute included, from the trace) / (PEAK_FLOPS * MFU * speed[precision])
    launches  = micro-batches per update * dispatched ops per micro-batch (from the trace) * LAUNCH_S
    optimizer = (2 * parameter bytes + gradient bytes + 2 * optimizer-state bytes) / HBM_BYTES_S
    offload   = 2 * offloaded bytes / PCIE_BYTES_S      (out in forward, back in backward; no overlap assumed)
    paging    = 2 * spilled paged-state bytes / PCIE_BYTES_S  (paged optimizer state that does not fit in the
                device memory left free is paged in for the step and out again; all of it when nothing is free)
    host_state= 2 * host optimizer-state bytes / PCIE_BYTES_S  (state on the host: gradients out, updates back,
                about one state-sized transfer each way per step)

``launches`` is the micro-batch efficiency term: a small micro-batch pays the same per-kernel
overhead for less work, so splitting a global batch into more micro-batches costs time.
``speed`` is the matmul throughput of a precision relative to bf16 (tensor cores): fp16 1,
tf32 1/2, fp32 1/16 (A100/H100 dense ratios; fp32 without TF32 runs on CUDA cores). A precision plugin not
named there is rated by its autocast (or storage) dtype: 16-bit runs at bf16 speed, anything else at fp32's.

Example:
    >>> step_seconds(flops=1e15, ops=1000, micro_batches=1, precision="bf16", param_bytes=0,
    ...              grad_bytes=0, state_bytes=0) > 0
    True
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["PEAK_FLOPS", "MFU", "SPEED", "LAUNCH_S", "HBM_BYTES_S", "PCIE_BYTES_S", "step_seconds", "cost_terms"]

PEAK_FLOPS = 312e12  # dense bf16 of the reference GPU (A100)
MFU = 0.5  # fraction of peak a well-fed training step reaches
SPEED = {"bf16": 1.0, "fp16": 1.0, "tf32": 0.5, "fp32": 1 / 16}
LAUNCH_S = 8e-6  # per dispatched op: kernel launch + framework overhead
HBM_BYTES_S = 1.5e12
PCIE_BYTES_S = 20e9


def _speed(precision: str) -> float:
    if precision in SPEED:
        return SPEED[precision]
    try:  # learned from the precision plugin: its matmuls run in its autocast (or storage) dtype
        from memwrap.precision.base import get_precision_class

        cls = get_precision_class(precision)
    except ValueError:
        return SPEED["fp32"]
    dtype = cls.autocast_dtype or cls.param_dtype
    return 1.0 if dtype in (torch.bfloat16, torch.float16) else SPEED["fp32"]


def cost_terms(*, flops: float, ops: int, micro_batches: int, precision: str, param_bytes: int, grad_bytes: int,
               state_bytes: int, offloaded: int = 0, paged_spill: int = 0, host_state: int = 0) -> dict[str, float]:
    """The terms of the model in seconds (see the module docstring)."""
    return {
        "compute": flops / (PEAK_FLOPS * MFU * _speed(precision)),
        "launches": micro_batches * ops * LAUNCH_S,
        "optimizer": (2 * param_bytes + grad_bytes + 2 * state_bytes) / HBM_BYTES_S,
        "offload": 2 * offloaded / PCIE_BYTES_S,
        "paging": 2 * paged_spill / PCIE_BYTES_S,
        "host_state": 2 * host_state / PCIE_BYTES_S,
    }


def step_seconds(**kw: Any) -> float:
    """Predicted seconds per optimizer update: the sum of :func:`cost_terms`."""
    return sum(cost_terms(**kw).values())
