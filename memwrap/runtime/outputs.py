"""Mapping a function over every tensor in a model's outputs, whatever their structure.

Both the wrapped module (weighting hooks, fp32 casts) and the precision plugins (output casting) use it, so it sits
below both.
"""
from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["map_outputs"]


def map_outputs(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor nested in tuples, lists, dicts, namedtuples and dataclass-like outputs.

    Example:
        >>> map_outputs({"a": (torch.ones(1),)}, lambda t: t * 2)
        {'a': (tensor([2.]),)}
    """
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        items = {k: map_outputs(v, fn) for k, v in obj.items()}
        if type(obj) is dict:
            return items
        if dataclasses.is_dataclass(obj):  # e.g. Hugging Face ModelOutput: a dict and a dataclass
            return _rebuild_dict_dataclass(obj, items, fn)
        try:
            return type(obj)(items)
        except TypeError:
            obj.update(items)
            return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A shallow copy keeps every attribute; then each field gets its mapped value, init=False fields (set in
        # forward or __post_init__) included. dataclasses.replace would re-run __init__ with the init fields only
        # and leave the others at their defaults (None): a lost output, and a tensor without its weighting hook.
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if hasattr(obj, f.name):  # an init=False field without default may never have been set
                object.__setattr__(new, f.name, map_outputs(getattr(obj, f.name), fn))  # frozen ones too
        return new
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(map_outputs(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_outputs(v, fn) for v in obj)
    return obj


def _rebuild_dict_dataclass(obj: Any, items: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """A dict that is a dataclass (``ModelOutput``), rebuilt with every entry and field it held, mapped."""
    init = {f.name for f in dataclasses.fields(obj) if f.init}
    new = type(obj)(**{k: v for k, v in items.items() if k in init})
    for k, v in items.items():
        if k not in init:  # an init=False field that is also a key
            new[k] = v
    # Fields set as attributes only (ModelOutput keeps a field assigned after construction out of its keys).
    for f in dataclasses.fields(obj):
        if f.name not in items and getattr(obj, f.name, None) is not None:
            setattr(new, f.name, map_outputs(getattr(obj, f.name), fn))
    return new
