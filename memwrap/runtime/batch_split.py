"""Cut a global batch of any structure into micro-batches along its sample dimension.

A batch is walked as a tree: tuples and lists (named tuples too), mappings (``dict``, and
``Mapping``/``UserDict`` subclasses such as Hugging Face's ``BatchEncoding``, which is duck-typed:
transformers is never imported), dataclasses, and any nesting of those. Leaves are classified:

* a tensor whose first dimension is the batch size ``N``: per-sample, cut along dim 0 (views, no copy);
* a list/tuple of plain values (strings, numbers) of length ``N``: per-sample, cut;
* a scalar, a 0-dim tensor, ``None``, a string, a list of plain values of another length: not
  per-sample, passed unchanged to every micro-batch;
* a tensor with ``dim >= 1`` whose first dimension is not ``N``: ambiguous (per-token? packed? metadata?),
  refused with an error that names the entry and the fix.

``N`` is the first dimension of the first tensor with ``dim >= 1`` (as Accelerate's ``find_batch_size``).

Example:
    >>> import torch
    >>> batch = {"x": torch.zeros(5, 3), "y": torch.arange(5), "lr_scale": 0.5}
    >>> batch_size(batch)
    5
    >>> [tuple(mb["x"].shape) for mb in cut_batch(batch, cut_sizes(5, 2))]
    [(2, 3), (2, 3), (1, 3)]
"""
from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["batch_size", "cut_sizes", "cut_batch", "describe_shapes", "UncuttableBatchError", "Feed",
           "feeds_by_layout"]

_PLAIN = (str, bytes, int, float, bool, complex, type(None))


class UncuttableBatchError(TypeError):
    """The loader yielded something memwrap cannot cut into micro-batches (the message names the entry and the fix)."""


def _children(obj: Any) -> list[tuple[str, Any]] | None:
    """``(name, child)`` pairs of a container, or None for a leaf."""
    if isinstance(obj, torch.Tensor):
        return None
    if isinstance(obj, Mapping):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f".{f.name}", getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)) and not _plain_sequence(obj):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    return None


def _plain_sequence(obj: Any) -> bool:
    return isinstance(obj, (tuple, list)) and len(obj) > 0 and all(isinstance(v, _PLAIN) for v in obj)


def _tensors(obj: Any, path: str = "batch"):
    kids = _children(obj)
    if kids is None:
        if isinstance(obj, torch.Tensor):
            yield path, obj
        return
    for name, child in kids:
        yield from _tensors(child, path + name)


def batch_size(batch: Any) -> int:
    """The number of samples in ``batch``: the first dimension of its first tensor with ``dim >= 1``.

    Raises :class:`UncuttableBatchError` when the batch holds no such tensor.

    Example:
        >>> batch_size((torch.zeros(4, 2), torch.zeros(4)))
        4
    """
    for _, t in _tensors(batch):
        if t.dim() >= 1:
            return int(t.shape[0])
    raise UncuttableBatchError(
        f"memwrap cannot cut a batch of type {type(batch).__name__} into micro-batches: it holds no tensor with a "
        "sample (first) dimension. budget= cuts each batch the loader yields along dim 0 of its tensors. Fix: make "
        "the loader yield tensors (or tuples, lists, dicts, dataclasses of them) whose first dimension is the "
        "batch size, or drop budget= and set accumulate= yourself.")


def cut_sizes(total: int, micro_batch: int) -> list[int]:
    """Sizes of the micro-batches for ``total`` samples with at most ``micro_batch`` each, as even as possible.

    ``ceil(total / micro_batch)`` micro-batches whose sizes differ by at most one (largest first), so
    that none is left with a sliver and the largest is at most ``micro_batch``.

    Example:
        >>> cut_sizes(10, 4)
        [4, 3, 3]
        >>> cut_sizes(8, 8)
        [8]
    """
    if total < 1 or micro_batch < 1:
        raise ValueError(f"cannot cut {total} sample(s) into micro-batches of {micro_batch}.")
    count = math.ceil(total / micro_batch)
    return split_even(total, count)


def split_even(total: int, count: int) -> list[int]:
    """``total`` samples in ``count`` parts differing by at most one, largest first (``count <= total``)."""
    if not 1 <= count <= total:
        raise ValueError(f"cannot cut {total} sample(s) into {count} non-empty micro-batches.")
    base, extra = divmod(total, count)
    return [base + 1] * extra + [base] * (count - extra)


def cut_batch(batch: Any, sizes: list[int]) -> list[Any]:
    """Cut ``batch`` into ``len(sizes)`` micro-batches of those many samples, keeping its structure and types.

    Per-sample tensors become views (no copy); entries that are not per-sample are passed to every
    micro-batch unchanged; ambiguous entries raise :class:`UncuttableBatchError` naming them.

    Example:
        >>> xs, ys = zip(*cut_batch((torch.arange(6), torch.arange(6) * 2), [3, 3]))
        >>> [x.tolist() for x in xs]
        [[0, 1, 2], [3, 4, 5]]
    """
    total = batch_size(batch)
    if sum(sizes) != total:
        raise ValueError(f"micro-batch sizes {sizes} add up to {sum(sizes)}, not the batch's {total} samples.")
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return [_slice(batch, lo, hi, total, "batch") for lo, hi in bounds]


def _slice(obj: Any, lo: int, hi: int, total: int, path: str) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0:
            return obj
        if obj.shape[0] != total:
            raise UncuttableBatchError(
                f"{path} is a tensor of shape {tuple(obj.shape)} while the batch has {total} samples (the first "
                f"dimension of its first tensor): memwrap cannot tell whether it is per-sample. budget= cuts every "
                "tensor along its first dimension. Fix: give per-sample tensors the batch size as first dimension "
                "(e.g. transpose a [seq, batch] layout to [batch, seq]); pass batch-level metadata as a Python value "
                "or a 0-dim tensor; or drop budget= and set accumulate= yourself.")
        return obj[lo:hi]
    if _plain_sequence(obj):
        return type(obj)(obj[lo:hi]) if len(obj) == total else obj
    if isinstance(obj, Mapping):
        items = {k: _slice(v, lo, hi, total, f"{path}[{k!r}]") for k, v in obj.items()}
        return _rebuild_mapping(obj, items, lo, hi, total)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _slice(getattr(obj, f.name), lo, hi, total, f"{path}.{f.name}"))
        return new
    if isinstance(obj, (tuple, list)):
        parts = [_slice(v, lo, hi, total, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
            return type(obj)(*parts)
        return type(obj)(parts)
    return obj  # any other object (a string, a number, None, a custom object): not per-sample


def _rebuild_mapping(obj: Mapping, items: dict, lo: int, hi: int, total: int) -> Mapping:
    if type(obj) is dict:
        return items
    if hasattr(obj, "data") and isinstance(getattr(obj, "data"), dict):
        # A UserDict (Hugging Face's BatchEncoding is one): a shallow copy keeps its other attributes.
        new = copy.copy(obj)
        new.data = items
        encodings = getattr(obj, "_encodings", None)  # BatchEncoding's per-sample fast-tokenizer encodings
        if isinstance(encodings, list) and len(encodings) == total:
            new._encodings = encodings[lo:hi]
        return new
    try:
        return type(obj)(items)
    except TypeError:
        raise UncuttableBatchError(
            f"memwrap cut a {type(obj).__name__} batch but cannot build a new one from its items "
            f"({type(obj).__name__}(dict) failed). Fix: yield a dict (or a dict subclass constructible from a dict), "
            "or drop budget= and set accumulate= yourself.") from None


def describe_shapes(batch: Any) -> tuple:
    """A hashable description of the batch's tensors: ``(path, shape without dim 0, dtype)`` for each.

    Two batches with the same description trace the same (per sample), so a plan made for one holds for the
    other; the batch size is kept apart (see :mod:`memwrap.techniques.budget.plan`).

    Example:
        >>> describe_shapes({"x": torch.zeros(4, 7)})
        (("batch['x']", (7,), 'torch.float32'),)
    """
    return tuple((path, tuple(t.shape[1:]), str(t.dtype)) for path, t in _tensors(batch) if t.dim() >= 1)


def for_planner(micro: Any) -> Any:
    """The micro-batch in the form the planner reads (see :func:`memwrap.memory.tracing.batch.split_batch`): a
    mapping becomes a dict of keyword arguments, a dataclass the dict of its fields.

    Example:
        >>> for_planner({"x": 1})
        {'x': 1}
    """
    if isinstance(micro, Mapping) and type(micro) is not dict:
        return dict(micro)
    if dataclasses.is_dataclass(micro) and not isinstance(micro, type):
        return {f.name: getattr(micro, f.name) for f in dataclasses.fields(micro)}
    return micro


def feeds_by_layout(module: torch.nn.Module, micro: Any) -> bool:
    """Whether the planner's reading of ``micro`` (:func:`memwrap.memory.tracing.batch.split_batch`: a dict as
    ``model(**batch)``, ...) binds to ``module.forward``'s signature; a forward that cannot be inspected counts
    as binding.

    Example:
        >>> feeds_by_layout(torch.nn.Linear(2, 2), {"ids": torch.zeros(1, 2)})
        False
    """
    import inspect

    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.tracing.batch import split_batch

    try:
        args, kwargs, _ = split_batch(for_planner(micro))
        signature = inspect.signature(module.forward)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin forward)
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


@dataclasses.dataclass
class Feed:
    """How a loop feeds the model a micro-batch, learned from one call: each argument is the batch entry at a path
    (``"batch['ids']"``) or a constant; what the call does not use is the loss's. Used by ``budget=`` to trace the
    model as the loop calls it (:class:`memwrap.memory.tracing.batch.Call`).

    Example:
        >>> micro = {"ids": torch.zeros(1, 3), "labels": torch.zeros(1)}
        >>> feed = Feed.learn(micro, (micro["ids"],), {})
        >>> feed.args, feed.call(micro).targets.shape
        ((('entry', "batch['ids']"),), torch.Size([1]))
    """

    args: tuple  # ("entry", path) or ("value", constant) per positional argument
    kwargs: dict  # name -> the same

    @classmethod
    def learn(cls, micro: Any, args: tuple, kwargs: dict) -> Feed:
        """The feed whose call on ``micro`` gives ``args`` and ``kwargs`` (batch entries found by identity, or by
        being the only entry of that shape, dtype and values, as after ``.to(device)``)."""
        entries = list(_tensors(micro))

        def source(value: Any, where: str) -> tuple:
            if not isinstance(value, torch.Tensor):
                return ("value", value)
            same = [path for path, t in entries if t is value]
            if not same:
                same = [path for path, t in entries if t.shape == value.shape and t.dtype == value.dtype
                        and torch.equal(t.to(value.device), value)]
            if len(same) != 1:
                raise UncuttableBatchError(
                    f"budget= learns how your loop feeds the model from its first call, but the model's {where} is a "
                    f"tensor of shape {tuple(value.shape)} that is {'none' if not same else 'more than one'} of the "
                    "batch's entries (computed in the loop?), so the plan cannot trace the model as you call it. Fix: "
                    "pass the batch's entries to the model as they are (a dtype or device move is fine), compute the "
                    "rest inside the model's forward, or drop budget= and set accumulate= yourself.")
            return ("entry", same[0])

        return cls(tuple(source(a, f"argument {i}") for i, a in enumerate(args)),
                   {k: source(v, f"argument {k!r}") for k, v in kwargs.items()})

    def call(self, micro: Any) -> Any:
        """``micro`` as the planner traces it: the model's arguments, and the entries the call does not use as the
        loss's targets (the one left, or a dict of them)."""
        # import cost: memwrap.memory's package loads the planner.
        from memwrap.memory.tracing.batch import Call

        entries = dict(_tensors(micro))
        used = {p for kind, p in (*self.args, *self.kwargs.values()) if kind == "entry"}
        pick = lambda src: entries[src[1]] if src[0] == "entry" else src[1]  # noqa: E731
        rest = {p: t for p, t in entries.items() if p not in used}
        targets = next(iter(rest.values())) if len(rest) == 1 else (rest or None)
        return Call(tuple(pick(a) for a in self.args), {k: pick(v) for k, v in self.kwargs.items()}, targets)
