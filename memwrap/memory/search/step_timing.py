"""The optimizer step's seconds on the planning CPU, measured: the cost model's ``optimizer`` term for ``device="cpu"``.

The bandwidth form of that term (``(2 * parameter + gradient + 2 * state bytes) / bandwidth``, see
:mod:`memwrap.memory.search.cost`) ranks optimizers by the bytes they touch. On a CPU that order is wrong: a bf16
step converts every element to fp32 and back, so bf16-true's AdamW (torch-optimi's, with Kahan summation) touches
fewer bytes than fp32 AdamW and yet takes 4-5x longer (rank_check: 32.7 ms against 8.3 ms on a 4.3M-parameter
GPT-2; the bandwidth term predicted 3.1 against 4.8 ms, rank correlation -0.83 with the measured steps).

So on a calibrated CPU profile the step is timed instead: the candidate's own ``wrap()`` (its precision, optimizer
and step options; accumulation and checkpointing do not change a step) on two probe modules, 32 parameters of
1,024 elements and 4 of 262,144, one real forward + backward each, then the wrapped ``step()`` + ``zero_grad()``
timed (best of 3 after 2 warm-ups, the first of which creates the state). The two give a time per parameter tensor
``a`` and per element ``b``; a model's step is ``a * tensors + b * elements`` over its trainable parameters (a
rank's share of the elements under FSDP2). A step inside backward (``step_in_backward``, LOMO) is the probe's
backward with the updates less the same backward without them. About 0.1 s per distinct (precision, optimizer,
step options), cached per process and thread count; an optimizer the probe cannot build or step (one that needs
CUDA, or target modules) keeps the bandwidth term. ``MEMWRAP_CALIBRATE=0`` (the fixed CPU profile) times nothing.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(64, 64)
    >>> optimizer_seconds({"precision": "fp32", "optim": "adamw"}, net) > 0
    True
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memwrap.plugin.registry import get_optimizer_spec, optimizer_on

__all__ = ["PROBES", "optimizer_seconds", "per_tensor_and_element"]

# (parameters, elements each): many small tensors give the per-tensor cost, few large ones (32 MiB of fp32 AdamW
# weights, gradients and state: a server CPU's last-level cache, where a model's step streams from memory) the
# per-element cost. Measured on a 2-core EPYC (32 MiB L3), a 4.3M-parameter GPT-2's AdamW step: fp32 predicted
# 4.0 ms against 4.3 measured, bf16-true 11.6 against 11.4.
PROBES = ((32, 1 << 10), (4, 1 << 19))
_REPS, _WARMUP = 3, 2
# What changes a step's time among wrap()'s options; accumulation, checkpointing, chunked loss and the trace's own
# options change the forward and backward, not the update.
_STEP_OPTIONS = ("precision", "optim", "compensation", "max_grad_norm", "step_in_backward")


class _Probe(nn.Module):
    """``count`` flat parameters of ``numel`` elements; the output is linear in each, so backward fills every
    gradient with one cheap op."""

    def __init__(self, count: int, numel: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(numel, generator=g) * 0.02) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w.float() * x).sum() for w in self.weights]).sum()


def _build(optim: Any, module: nn.Module):
    """The optimizer a candidate names, over ``module``: your own as built (``AsBuilt``: its class and the first
    group's hyperparameters), else the registry's."""
    if callable(getattr(optim, "build", None)) and getattr(optim, "groups", None):
        hyper = dict(optim.groups[0][1])
        try:
            return optim.cls([{"params": list(module.parameters()), **hyper}], **optim.defaults)
        except TypeError:  # as AsBuilt.build: a class whose defaults hold keys its constructor does not take
            return optim.cls([{"params": list(module.parameters()), **hyper}])
    return optimizer_on(str(optim), module)


def _time_probe(options: Mapping[str, Any], count: int, numel: int) -> tuple[float, float]:
    """(seconds of forward + backward, seconds of step() + zero_grad()) of one probe, best of ``_REPS``."""
    import memwrap

    probe = _Probe(count, numel)
    opts = {k: v for k, v in options.items() if k != "optim"}
    model, opt = memwrap.wrap(probe, _build(options["optim"], probe), **opts)
    x = torch.ones(1)
    best_fb = best_step = float("inf")
    for i in range(_WARMUP + _REPS):
        t0 = time.perf_counter()
        model(x).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= _WARMUP:
            best_fb, best_step = min(best_fb, t1 - t0), min(best_step, t2 - t1)
    return best_fb, best_step


def _in_backward(options: Mapping[str, Any]) -> bool:
    if options.get("step_in_backward"):
        return True
    try:
        return bool(get_optimizer_spec(str(options["optim"])).updates_in_backward)  # LOMO, AdaLomo
    except ValueError:
        return False


def _fit(options: Mapping[str, Any]) -> tuple[float, float] | None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            per_tensor = []
            for count, numel in PROBES:
                fb, step = _time_probe(options, count, numel)
                if _in_backward(options):
                    # The updates run inside backward: that backward less the same one with SGD stepping after it.
                    plain = {k: v for k, v in options.items() if k not in ("step_in_backward", "optim")}
                    fb0, _ = _time_probe({**plain, "optim": "sgd"}, count, numel)
                    step += max(0.0, fb - fb0)
                per_tensor.append(step / count)
    except Exception:  # noqa: BLE001 - an optimizer the probe cannot run keeps the bandwidth term
        return None
    (_, n_small), (_, n_large) = PROBES
    b = max(0.0, (per_tensor[1] - per_tensor[0]) / (n_large - n_small))
    a = max(0.0, per_tensor[0] - b * n_small)
    return a, b


def _key(options: Mapping[str, Any]) -> tuple:
    """What identifies a step's time: the step options, your own optimizer (``AsBuilt``) by its class and first
    group's hyperparameters."""
    def hashable(v: Any) -> Any:
        return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)

    optim = options["optim"]
    if getattr(optim, "groups", None):
        optim = (str(optim), optim.cls.__qualname__, repr(sorted(optim.groups[0][1].items(), key=str)))
    else:
        optim = str(optim)
    return (torch.get_num_threads(), optim) + tuple(sorted((k, hashable(v)) for k, v in options.items()
                                                           if k != "optim"))


_fits: dict[tuple, tuple[float, float] | None] = {}


def per_tensor_and_element(options: Mapping[str, Any]) -> tuple[float, float] | None:
    """(seconds per parameter tensor, seconds per element) of the step ``options`` configure (wrap()'s
    ``precision``, ``optim``, ``compensation``, ``max_grad_norm``, ``step_in_backward``; the rest is ignored) on
    this CPU at the current thread count, or None when the probe cannot build or step that optimizer. Measured
    once per process per distinct step.

    Example:
        >>> a, b = per_tensor_and_element({"precision": "fp32", "optim": "adamw"})
        >>> a >= 0 and b > 0
        True
    """
    options = {"optim": "adamw", **{k: options[k] for k in _STEP_OPTIONS if k in options}}
    key = _key(options)
    if key not in _fits:
        _fits[key] = _fit(options)
    return _fits[key]


def optimizer_seconds(options: Mapping[str, Any], model: nn.Module, ranks: int = 1, *,
                      sharded: bool = False) -> float | None:
    """Predicted seconds of one optimizer step of ``model`` (its trainable parameters) under wrap() ``options`` on
    this CPU (see the module docstring); ``sharded`` (FSDP2): each of ``ranks`` steps its share of the elements.
    None when the probe cannot run the optimizer (the caller keeps the bandwidth term).

    Example:
        >>> optimizer_seconds({"precision": "bf16-true", "optim": "adamw"}, torch.nn.Linear(256, 256)) > 0
        True
    """
    fit = per_tensor_and_element(options)
    if fit is None:
        return None
    seen: set[int] = set()
    tensors = elements = 0
    for p in model.parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            tensors += 1
            elements += p.numel()
    if sharded and ranks > 1:
        elements = -(-elements // ranks)
    a, b = fit
    return a * tensors + b * elements
