"""The planner's search space: which optimizers and checkpoint policies are tried by default (learned from the
registries, plugins included), the micro-batch sizes, and the grid of candidate options.

Example:
    >>> "adamw" in default_optimizers()
    True
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["DEFAULT_PRECISIONS", "DEFAULT_CHECKPOINTS", "default_optimizers", "default_checkpoints"]

DEFAULT_PRECISIONS = ("bf16", "fp32")
# The built-in policy forms; default_checkpoints() adds the policies plugins register.
DEFAULT_CHECKPOINTS = (None, "selective", "every-2", "full", "offload")


def default_optimizers() -> tuple[str, ...]:
    """Every registered optimizer whose backend is installed (built-in and third-party plugins alike):
    the plan's default search space. A plugin's optimizer is planned like a built-in one.

    Example:
        >>> "adamw" in default_optimizers()
        True
    """
    from memwrap.registry import optimizers

    return tuple(r.name for r in optimizers() if r.available)


def _smaller_state(keep: str) -> tuple[str, ...]:
    """``keep`` and the installed optimizers that can need less device memory than it: less state per parameter,
    or paged/host state. When ``keep`` fits nowhere these are the only optimizers that could fit, so the others
    are not traced (a larger state can only add memory)."""
    from memwrap.registry import optimizers

    rows = [r for r in optimizers() if r.available]
    own = next((r.state_bytes_per_param for r in rows if r.name == keep), float("inf"))
    return (keep,) + tuple(r.name for r in rows if r.name != keep and (r.state_bytes_per_param < own or r.paged))


def default_checkpoints() -> tuple[Any, ...]:
    """The built-in checkpoint policy forms (:data:`DEFAULT_CHECKPOINTS`) and every policy a plugin
    registers: the plan's default checkpointing search space.

    Example:
        >>> default_checkpoints()[:2]
        (None, 'selective')
    """
    from memwrap.checkpoint_policies import plugin_policies

    return DEFAULT_CHECKPOINTS + tuple(sorted(plugin_policies()))


def _micro_batches(global_batch: int, given: Iterable[int] | None) -> list[int]:
    if given is not None:
        sizes = sorted({int(m) for m in given}, reverse=True)
        bad = [m for m in sizes if m < 1 or global_batch % m]
        if bad:
            raise ValueError(f"micro-batch sizes {bad} do not divide global_batch={global_batch}; "
                             f"valid: {[d for d in range(1, global_batch + 1) if global_batch % d == 0]}.")
        return sizes
    sizes = sorted({d for d in range(1, global_batch + 1) if global_batch % d == 0 and (d & (d - 1) == 0)}
                   | {global_batch}, reverse=True)
    return sizes if len(sizes) <= 4 else sizes[:3] + [1]


def _expand(global_batch, candidates, micro_batches, precisions, checkpoints, optimizers) -> list[dict]:
    if candidates is not None:
        out = []
        for c in candidates:
            techniques = {"step_in_backward", "chunked_loss", "compensation"}
            unknown = set(c) - {"micro_batch", "precision", "checkpoint", "optim"} - techniques
            if unknown:
                raise ValueError(f"candidate keys {sorted(unknown)} are not known; use micro_batch, precision, "
                                 f"checkpoint, optim, step_in_backward, chunked_loss, compensation.")
            mb = int(c.get("micro_batch", global_batch))
            _micro_batches(global_batch, [mb])
            out.append({"micro_batch": mb, "precision": c.get("precision", "fp32"),
                        "checkpoint": c.get("checkpoint"), "optim": c.get("optim", "adamw"),
                        **{k: c[k] for k in techniques if k in c}})
        return out
    return [{"micro_batch": mb, "precision": p, "checkpoint": ck, "optim": o}
            for mb in _micro_batches(global_batch, micro_batches) for p in precisions for ck in checkpoints
            for o in optimizers]


def _checkpoint_spec(value: Any) -> Any:
    # "none" is how the docs and the CLI name "no checkpointing"; wrap() itself only takes None/False.
    if isinstance(value, str) and value.lower() in ("none", "no", "off"):
        return None
    return value


def _updates_in_backward_refusals(specs: list[dict], per_rank: int, max_grad_norm: float | None,
                                  ranks: int = 1) -> tuple[list[dict], list[tuple[str, str]]]:
    """Drop optimizers that update inside backward (LOMO, layer-wise GaLore) where wrap() refuses them: with
    accumulation, clipping, fp16 loss scaling or several ranks. Returned as ``(label, why)`` like the other skipped
    rows."""
    from memwrap.precision import get_precision
    from memwrap.registry import get_optimizer_spec

    keep, skipped = [], []
    for s in specs:
        accumulate = per_rank // s["micro_batch"]
        if not get_optimizer_spec(s["optim"]).updates_in_backward:
            keep.append(s)
        elif ranks > 1:
            skipped.append((f"{s['micro_batch']} {s['precision']} {s['checkpoint'] or 'no-ckpt'} {s['optim']}",
                            f"{s['optim']} updates inside backward, before DDP/FSDP2 average the gradients across "
                            f"ranks: wrap() refuses it with {ranks} ranks"))
        elif accumulate > 1 or max_grad_norm is not None or get_precision(s["precision"]).uses_scaler:
            skipped.append((f"{s['micro_batch']} {s['precision']} {s['checkpoint'] or 'no-ckpt'} {s['optim']}",
                            f"{s['optim']} updates inside backward: no accumulation ({accumulate}), clipping or fp16"))
        else:
            keep.append(s)
    return keep, skipped


def _validate(specs: list[dict], max_grad_norm: float | None) -> None:
    """Reject invalid options before tracing, with wrap()'s own messages: a typo ("fulll", "fp8") must
    fail the plan, not be reported as a policy that "cannot run on this model"."""
    from memwrap.config import parse_options

    seen = set()
    for s in specs:
        key = (s["precision"], repr(s["checkpoint"]))
        if key not in seen:
            seen.add(key)
            parse_options(precision=s["precision"], checkpoint=s["checkpoint"], max_grad_norm=max_grad_norm)
