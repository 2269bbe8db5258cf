"""The planner's technique dimensions beyond micro-batch, checkpointing and optimizer, learned from the plugins.

* precision: every mode the precision plugins register (:func:`default_precisions`, ``bf16-true`` included);
  a mode whose updates need compensating (``Precision.compensations``, e.g. ``bf16-true``) is planned with its
  default compensation for an optimizer that has a compensated equivalent, and with ``compensation="none"`` for one
  that has none (bitsandbytes' paged 8-bit AdamW, as torchtune runs it): that candidate is marked as changing the
  training maths;
* ``step_in_backward``: tried where :mod:`memwrap.techniques.step_in_backward` allows it (not with several ranks, an
  optimizer that already updates inside backward, or selective checkpointing together with clipping or loss scaling);
  with clipping (``max_grad_norm``) or fp16 the trace runs the norm pass (:mod:`memwrap.techniques.norm_pass`), so its
  memory and its second backward's FLOPs are in the candidate's peak and cost;
* ``chunked_loss``: tried where a loss-head plugin recognizes the model (:func:`memwrap.techniques.loss_head.find_loss_head`)
  and the micro-batch carries ``labels`` (the model computes its own loss);
* paged / host optimizer state: an optimizer's ``OptimizerSpec.state_location``, read by the estimator.

Every value is traced on fake tensors through the real ``wrap()``: nothing here predicts memory.

Example:
    >>> "bf16-true" in default_precisions()
    True
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from memwrap.memory.tracing.disk_cache import remember
from memwrap.memory.budget import format_bytes
from memwrap.checkpointing.apply import resolve_policy
from memwrap.checkpointing.policies import parse_checkpoint_option
from memwrap.plugin.registry import create_optimizer, get_optimizer_spec
from memwrap.precision.base import UnknownPrecisionError, get_precision, get_precision_class, precision_names
from memwrap.techniques.loss_head import LossHeadError, find_loss_head

__all__ = ["default_precisions", "technique_values", "expand_techniques", "compensation_for", "technique_tags",
           "traced_as", "family", "state_floor"]


def default_precisions() -> tuple[str, ...]:
    """Every registered precision mode (built-in and third-party plugins alike): the plan's default precisions.

    Example:
        >>> default_precisions()  # doctest: +SKIP
        ('bf16', 'bf16-true', 'fp16', 'fp32', 'tf32')
    """

    return tuple(precision_names())


def _has_labels(batch: Any) -> bool:
    return isinstance(batch, dict) and isinstance(batch.get("labels"), torch.Tensor)


def technique_values(module: torch.nn.Module, make_batch: Callable[[int], Any], micro_batch: int,
                     step_in_backward: Iterable[bool] | None, chunked_loss: Iterable[Any] | None, ranks: int = 1
                     ) -> tuple[tuple[bool, ...], tuple[Any, ...], list[str]]:
    """The values of ``step_in_backward`` and ``chunked_loss`` to search, and why a default left one out.

    None means "both where it applies": ``(False, True)`` for step in backward; ``(False, True)`` for the chunked
    loss when a loss-head plugin recognizes the model and ``make_batch`` gives a dict with ``labels``.

    Example:
        >>> technique_values(model, make_batch, 1, None, None)  # doctest: +SKIP
        ((False, True), (False, True), [])
    """
    notes: list[str] = []
    sib = (False, True) if step_in_backward is None else tuple(bool(v) for v in step_in_backward)
    if chunked_loss is not None:
        return sib, tuple(chunked_loss), notes
    if ranks > 1:  # wrap() refuses it there: the adapter calls the model's body, past DDP's and FSDP2's forward
        notes.append("chunked_loss not searched: wrap() refuses it under DDP/FSDP2 (the loss head calls the "
                     "model's body directly, around the wrapper's forward).")
        return sib, (False,), notes

    try:
        find_loss_head(module)
    except LossHeadError:
        return sib, (False,), notes  # no adapter knows this model: nothing to try
    if not _has_labels(make_batch(micro_batch)):
        notes.append("chunked_loss not searched: the micro-batch has no 'labels' (the model does not compute its own "
                     "loss); give make_batch a dict with input ids and labels to plan it.")
        return sib, (False,), notes
    return sib, (False, True), notes


@functools.lru_cache(maxsize=None)
def compensation_for(precision: str, optim: str) -> str | None:
    """The ``compensation=`` a candidate runs with: None (the mode's default or none needed), or ``"none"`` when the
    precision needs compensated updates and ``optim`` has no compensated equivalent (the precision plugin's own
    ``check_optimizer`` decides, on a one-element parameter).

    Example:
        >>> compensation_for("bf16-true", "adamw"), compensation_for("bf16-true", "paged_adamw_8bit")  # doctest: +SKIP
        (None, 'none')
    """

    cls = get_precision_class(precision)
    if "none" not in cls.compensations:
        return None
    # Building the optimizer imports its library (bitsandbytes: a second): the answer is stored with the code and
    # versions it depends on (memwrap.memory.tracing.disk_cache.remember).
    return remember("compensation", [precision, str(optim)], lambda: _compensation(cls, optim))


def _compensation(cls: Any, optim: str) -> str | None:
    param = torch.nn.Parameter(torch.zeros(4, 4))
    try:
        spec = get_optimizer_spec(optim)
        opt = create_optimizer(optim, [param], model=torch.nn.Linear(4, 4) if spec.needs_model else None)
        cls().check_optimizer(opt)
    except (ValueError, ImportError, TypeError, RuntimeError):
        return "none"
    return None


def expand_techniques(specs: list[dict], sibs: tuple[bool, ...], chunks: tuple[Any, ...], *, max_grad_norm: Any,
                      ranks: int) -> tuple[list[dict], list[tuple[str, str]]]:
    """Each spec times the technique values; those ``wrap()`` would refuse are left out with the reason.

    Example:
        >>> expand_techniques([{"micro_batch": 1, "precision": "fp16", "checkpoint": "selective", "optim": "adamw"}],
        ...                   (False, True), (False,), max_grad_norm=None, ranks=1)[1][0][1]  # doctest: +SKIP
        'step_in_backward with fp16 and selective checkpointing: the norm pass backpropagates the last micro-batch twice, which selective checkpoint allows once'
    """

    out, refused = [], []
    for s in specs:
        base = {k: v for k, v in s.items() if k not in ("step_in_backward", "chunked_loss", "compensation")}
        for sib in ((s["step_in_backward"],) if "step_in_backward" in s else sibs):
            for chunk in ((s["chunked_loss"],) if "chunked_loss" in s else chunks):
                spec = {**base, "step_in_backward": bool(sib), "chunked_loss": chunk}
                if chunk and ranks > 1:
                    refused.append((label(spec), "chunked_loss with several ranks: wrap() refuses it under DDP/FSDP2"))
                    continue
                spec["compensation"] = s.get("compensation", compensation_for(s["precision"], s["optim"]))
                why = _refusal(spec, get_precision_class(s["precision"]), get_optimizer_spec(s["optim"]),
                               max_grad_norm, ranks) if sib else None
                if why is None:
                    out.append(spec)
                elif "step_in_backward" in s or len(sibs) == 1:  # asked for explicitly: say why it is not planned
                    refused.append((label(spec), why))
    return out, refused


def _refusal(spec: dict, precision: Any, optim: Any, max_grad_norm: Any, ranks: int) -> str | None:
    if (precision.uses_scaler or max_grad_norm is not None) and _checkpoint_mode(spec["checkpoint"]) == "selective":
        # Clipping and loss scaling run the norm pass (memwrap.techniques.norm_pass): a second backward over the last
        # micro-batch's graph, which torch's selective checkpoint does not allow (wrap() refuses it the same way).
        return (f"step_in_backward with {'max_grad_norm' if max_grad_norm is not None else spec['precision']} and "
                "selective checkpointing: the norm pass backpropagates the last micro-batch twice, which selective "
                "checkpoint allows once")
    if ranks > 1:
        return "step_in_backward with several ranks: a gradient is final only after its reduction"
    if optim.updates_in_backward:
        return f"step_in_backward with {optim.name}: it already updates inside backward"
    return None


def _checkpoint_mode(checkpoint: Any) -> str | None:
    """The checkpoint mode (``"full"``, ``"selective"``, ...) a plan's ``checkpoint`` value applies, None for none."""
    how = parse_checkpoint_option(checkpoint)
    if how is None:
        return None
    return resolve_policy(how["policy"], how.get("every", 1), how.get("mode", "full"), how.get("offload", False))[2]


def technique_tags(extra: dict) -> str:
    """The label suffix for a candidate's technique options, e.g. ``' +sib +chunked uncompensated'``.

    Example:
        >>> technique_tags({"step_in_backward": True, "chunked_loss": True})
        ' +sib +chunked'
    """
    tags = ""
    if extra.get("step_in_backward"):
        tags += " +sib"
    if extra.get("chunked_loss"):
        tags += " +chunked" if extra["chunked_loss"] is True else f" +chunked{extra['chunked_loss']}"
    if extra.get("compensation") == "none":
        tags += " uncompensated"
    return tags


def label(spec: dict) -> str:
    """A spec's label as the plan table shows it."""
    return (f"{spec['micro_batch']}x? {spec['precision']} {spec['checkpoint'] or 'no-ckpt'} {spec['optim']}"
            + technique_tags(spec))


def trace_options(spec: dict) -> dict[str, Any]:
    """The wrap options a spec adds to the traced step (only those that are set)."""
    out: dict[str, Any] = {}
    if spec.get("step_in_backward"):
        out["step_in_backward"] = True
    if spec.get("chunked_loss"):
        out["chunked_loss"] = spec["chunked_loss"]
    if spec.get("compensation") is not None:
        out["compensation"] = spec["compensation"]
    return out


# ----------------------------------------------------------------------------- bounds that spare traces

def weight_bytes(module: torch.nn.Module, precision: str) -> int:
    """Bytes of the weights once stored by ``precision`` (its plugin's ``memory_per_param``; meta tensors work)."""

    mode = get_precision(precision)
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += mode.memory_per_param(p)["weights"]
    return total


def prune_by_weights(groups: dict, module: torch.nn.Module, budget: int, margin: Any, ranks: int
                     ) -> tuple[dict, list[tuple[str, str]]]:
    """Leave out the trace groups whose weights alone (plus the margin) exceed the budget: nothing in them can fit,
    whatever its activations or optimizer. Only when some group is left (so a plan that fits nowhere still traces
    everything and says what dominates) and on one rank (sharded weights are smaller). Returns the groups kept and
    ``(label, why)`` for each candidate left out.

    Example:
        >>> kept, why = prune_by_weights(groups, llama_7b, 24 * 2**30, Margin(), 1)  # doctest: +SKIP
        >>> why[0][1]  # doctest: +SKIP
        'not traced: the weights alone take 25.10 GiB in fp32 (+ margin 3.01 GiB) > budget 24.00 GiB'
    """

    if ranks > 1:
        return groups, []
    weights = {p: weight_bytes(module, p) for p in {members[0]["precision"] for members in groups.values()}}
    over = {p for p, w in weights.items() if w + margin.of(w) > budget}
    if len(over) == len(weights):
        return groups, []
    kept, why = {}, []
    for key, members in groups.items():
        p = members[0]["precision"]
        if p not in over:
            kept[key] = members
            continue
        w = weights[p]
        why += [(label(m), f"not traced: the weights alone take {format_bytes(w)} in {p} (+ margin "
                           f"{format_bytes(margin.of(w))}) > budget {format_bytes(budget)}") for m in members]
    return kept, why


def traced_as(precision: str) -> str:
    """The precision whose trace gives ``precision``'s memory: its plugin's ``memory_like`` when that mode is
    registered (``tf32`` -> ``fp32``, ``fp16`` -> ``bf16``), else ``precision`` itself. The planner traces each
    such class of modes once; speed is still ranked per mode.

    Example:
        >>> traced_as("tf32"), traced_as("fp16"), traced_as("bf16-true")
        ('fp32', 'bf16', 'bf16-true')
    """

    seen = []
    cls = get_precision_class(precision)
    while cls.memory_like is not None and cls.name not in seen:
        seen.append(cls.name)
        try:
            cls = get_precision_class(cls.memory_like)
        except UnknownPrecisionError:  # its twin is not installed: trace the mode itself
            break
    return cls.name


def family(key: tuple, per_rank: int) -> tuple:
    """The trace groups whose weights, gradients and optimizer state are the same: a group key
    ``(micro_batch, precision, checkpoint, step_in_backward, chunked_loss, compensation)`` without the micro-batch
    and the checkpoint policy, with whether the micro-batches accumulate (the window's gradients then live
    between micro-batches, and FSDP2 keeps them unsharded)."""
    micro_batch, precision, _checkpoint, *rest = key
    return (precision, *rest, per_rank // micro_batch > 1)


def state_floor(est: Any) -> int:
    """Device bytes alive together at some point of every step of ``est``'s family (:func:`family`): the persistent
    parameters, buffers and on-device optimizer state, plus the gradients where they are largest. A lower bound of the peak
    of every other micro-batch and checkpoint policy in the family, read from a trace, not predicted.

    Example:
        >>> state_floor(plan_result.best.estimate) <= plan_result.best.estimate.peak  # doctest: +SKIP
        True
    """
    s = est.state
    # est.state counts all the optimizer state (the step reads it all); paged or host state is not on the device.
    device_state = s["optimizer_state"] - est.paged_state - est.host_state
    return s["parameters"] + s.get("buffers", 0) + device_state + s["gradients"]
