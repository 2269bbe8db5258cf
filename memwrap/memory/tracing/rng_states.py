"""The RNG states activation checkpointing keeps, made visible to the fake trace.

``torch.utils.checkpoint`` (``preserve_rng_state``, the default, and memwrap's policies) saves
``torch.get_rng_state()`` for each checkpointed region, to replay its dropout in the recompute, and ``fork_rng`` takes
a transient copy during the recompute. That is a 5056-byte CPU tensor made outside the dispatcher: the fake trace
never saw it, and it was the residue of every checkpointed cell of the CPU zoo (-0.1 to -0.24% of 3-12 MB steps;
a bf16 + checkpointed Llama at 1 x 512 was 5064 bytes under, now 8). While tracing a step that runs on the CPU,
:func:`fake_states` makes ``torch.get_rng_state()`` return a fake tensor of the real state's size, which the tracker
counts and which lives as long as the real one (until the region's backward); ``torch.set_rng_state`` ignores a fake
state. On a GPU these are host tensors: not counted there.

Example:
    >>> steps_on_cpu("cpu", None), steps_on_cpu("cpu", "cuda")
    (True, False)
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["fake_states", "steps_on_cpu", "REAL"]

REAL = (torch.get_rng_state, torch.set_rng_state)  # what fake_states restores (tests check it)


@contextlib.contextmanager
def fake_states(on: bool):
    """While active and ``on``, ``torch.get_rng_state()`` returns a fake tensor of the real state's size (under the
    trace's fake mode, so the tracker sees it) and ``torch.set_rng_state`` ignores a fake state.

    Example:
        >>> with fake_states(False):
        ...     torch.get_rng_state is REAL[0]
        True
    """
    if not on:
        yield
        return
    real_get, real_set = torch.get_rng_state, torch.set_rng_state
    size = real_get().numel()

    def get() -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)  # under the trace's fake mode: a tracked fake tensor

    def set_(state: torch.Tensor) -> None:
        if not isinstance(state, FakeTensor):
            real_set(state)

    torch.get_rng_state, torch.set_rng_state = get, set_
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = real_get, real_set


def steps_on_cpu(home: str, workspace_option: Any) -> bool:
    """Whether the traced step runs on the CPU, whose host tensors (these RNG states) are then the device's memory: a
    device named by ``estimate(workspace=...)``, else ``home``, the model's own device type (a meta-built model or a
    factory is planned on the machine that traces it, as its kernel workspaces are).

    Example:
        >>> steps_on_cpu("meta", None), steps_on_cpu("cuda", None)
        (True, False)
    """
    if isinstance(workspace_option, str):
        return torch.device(workspace_option).type == "cpu"
    return home in ("cpu", "meta")
