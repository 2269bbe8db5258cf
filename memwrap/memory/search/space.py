"""The planner's search space: which optimizers and checkpoint policies are tried by default (learned from the
registries, plugins included), the micro-batch sizes, and the grid of candidate options.

Example:
    >>> "adamw" in default_optimizers()
    True
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from memwrap.checkpointing.policies import plugin_policies
from memwrap.config.options import parse_options
from memwrap.plugin.registry import get_optimizer_spec, optimizers

__all__ = ["DEFAULT_PRECISIONS", "DEFAULT_CHECKPOINTS", "default_optimizers", "default_checkpoints", "AsBuilt"]

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

    return tuple(r.name for r in optimizers() if r.available)


def _smaller_state(keep: str) -> tuple[str, ...]:
    """``keep`` and the installed optimizers that can need less device memory than it: less state per parameter,
    or paged/host state. When ``keep`` fits nowhere these are the only optimizers that could fit, so the others
    are not traced (a larger state can only add memory)."""

    rows = [r for r in optimizers() if r.available]
    own = next((r.state_bytes_per_param for r in rows if r.name == keep), float("inf"))
    return (keep,) + tuple(r.name for r in rows if r.name != keep and (r.state_bytes_per_param < own or r.paged))


class AsBuilt(str):
    """Your own optimizer, planned as you built it: its class, its param groups and every hyperparameter in them
    (``SGD(momentum=0.9)`` holds a momentum buffer per parameter; the registry's ``"sgd"`` holds none).

    It is the ``str`` of the registry name that describes the optimizer (what labels, ranks and capability flags
    read), so it goes wherever the planner takes an optimizer name; the trace builds the optimizer with
    :meth:`build` instead of the registry's factory and defaults. Parameters are matched by name, so a fake copy
    of the model (or one with its block stack truncated) gets the same groups.

    Example:
        >>> net = torch.nn.Linear(4, 4)
        >>> keep = AsBuilt(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net)
        >>> keep, type(keep.build(net)).__name__, keep.build(net).param_groups[0]["momentum"]
        ('sgd', 'SGD', 0.9)
    """

    def __new__(cls, optimizer: Any, module: Any, name: str | None = None) -> "AsBuilt":
        inner = optimizer
        while not isinstance(inner, torch.optim.Optimizer) and isinstance(getattr(inner, "optimizer", None),
                                                                          torch.optim.Optimizer):
            inner = inner.optimizer  # memwrap's, Accelerate's or Lightning's wrapper around the real optimizer
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"keep_optim must be a registry name or a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}.")
        self = str.__new__(cls, name if name is not None else registry_name(inner))
        names = {id(p): n for n, p in module.named_parameters()}
        # A tensor the optimizer holds outside the model has no fake copy in the trace: the groups name model
        # parameters only (the trace counts the model's memory).
        self.groups = [([names[id(p)] for p in g["params"] if id(p) in names],
                        {k: v for k, v in g.items() if k != "params"}) for g in inner.param_groups]
        self.cls, self.defaults = type(inner), dict(inner.defaults)
        return self

    def build(self, model: Any) -> Any:
        """The optimizer of this class with these groups, over ``model``'s parameters of the same names."""
        by_name = dict(model.named_parameters())
        groups = [{"params": [by_name[n] for n in names if n in by_name], **hyper} for names, hyper in self.groups]
        groups = [g for g in groups if g["params"]] or [{"params": [], **self.groups[0][1]}]
        try:
            return self.cls(groups, **self.defaults)
        except TypeError:  # a class whose defaults hold keys its constructor does not take: the groups carry them
            return self.cls(groups)

    def __reduce__(self):  # pickled/copied as its name (a plan's JSON and copies keep the label)
        return (str, (str(self),))


def registry_name(optimizer: Any) -> str:
    """The registry name that describes ``optimizer`` (its class name, ``Adam`` as ``adamw``), else ``"adamw"``.

    Example:
        >>> registry_name(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
        'sgd'
    """

    name = type(optimizer).__name__.lower()
    for guess in (name, {"adam": "adamw"}.get(name)):
        if guess:
            try:
                return get_optimizer_spec(guess).name
            except ValueError:
                continue
    return "adamw"  # two fp32 states per parameter: the common, and a conservative, guess


def default_checkpoints() -> tuple[Any, ...]:
    """The built-in checkpoint policy forms (:data:`DEFAULT_CHECKPOINTS`) and every policy a plugin
    registers: the plan's default checkpointing search space.

    Example:
        >>> default_checkpoints()[:2]
        (None, 'selective')
    """

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


def plan_values(name: str, value: Any, *, single: tuple[type, ...] = (str,), element: tuple[type, ...] | None = None,
                example: str = "") -> tuple | None:
    """One of plan()'s search dimensions as a tuple of values: None stays None (the default), a single value (a
    ``bool`` for ``step_in_backward``, a name for ``precisions``) means that one value, an iterable gives its values.
    Anything else is refused naming the argument and the fix.

    Example:
        >>> plan_values("step_in_backward", False, single=(bool,), element=(bool,))
        (False,)
        >>> plan_values("precisions", "bf16")
        ('bf16',)
    """
    if value is None:
        return None
    if isinstance(value, single):
        values = (value,)
    elif isinstance(value, Iterable) and not isinstance(value, (str, bytes, dict)):
        values = tuple(value)
    else:
        raise TypeError(f"plan({name}={value!r}): give one value or a list of values{example}.")
    bad = [v for v in values if element is not None and not isinstance(v, element)]
    if bad:
        raise TypeError(f"plan({name}={value!r}): {bad[0]!r} is a {type(bad[0]).__name__}, not a "
                        f"{' or '.join(t.__name__ for t in element)}{example}.")
    return values


def _checkpoint_spec(value: Any) -> Any:
    # "none" is how the docs and the CLI name "no checkpointing"; wrap() itself only takes None/False.
    if isinstance(value, str) and value.lower() in ("none", "no", "off"):
        return None
    return value


def _updates_in_backward_refusals(specs: list[dict], per_rank: int, max_grad_norm: float | None,
                                  ranks: int = 1) -> tuple[list[dict], list[tuple[str, str]]]:
    """Drop optimizers that update inside backward (LOMO, layer-wise GaLore) where wrap() refuses them: with
    accumulation or several ranks. With ``max_grad_norm`` or fp16 they are planned: their trace's stand-in steps
    inside backward and runs the norm pass, as wrap() does for them (memwrap.techniques.updates_in_backward).
    Returned as ``(label, why)`` like the other skipped rows."""

    keep, skipped = [], []
    for s in specs:
        accumulate = per_rank // s["micro_batch"]
        if not get_optimizer_spec(s["optim"]).updates_in_backward:
            keep.append(s)
        elif ranks > 1:
            skipped.append((f"{s['micro_batch']} {s['precision']} {s['checkpoint'] or 'no-ckpt'} {s['optim']}",
                            f"{s['optim']} updates inside backward, before DDP/FSDP2 average the gradients across "
                            f"ranks: wrap() refuses it with {ranks} ranks"))
        elif accumulate > 1:
            skipped.append((f"{s['micro_batch']} {s['precision']} {s['checkpoint'] or 'no-ckpt'} {s['optim']}",
                            f"{s['optim']} updates inside backward: no accumulation ({accumulate})"))
        else:
            keep.append(s)
    return keep, skipped


def _validate(specs: list[dict], max_grad_norm: float | None) -> None:
    """Reject invalid options before tracing, with wrap()'s own messages: a typo ("fulll", "fp8") must
    fail the plan, not be reported as a policy that "cannot run on this model"."""

    seen = set()
    for s in specs:
        key = (s["precision"], repr(s["checkpoint"]))
        if key not in seen:
            seen.add(key)
            parse_options(precision=s["precision"], checkpoint=s["checkpoint"], max_grad_norm=max_grad_norm)
