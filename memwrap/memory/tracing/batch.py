"""How the planner calls a model on a batch, and the loss it uses when none is given.

Example:
    >>> args, kwargs, targets = split_batch((torch.ones(2, 3), torch.tensor([0, 1])))
    >>> float(default_loss(torch.zeros(2, 3), targets))  # doctest: +ELLIPSIS
    1.0986...
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["split_batch", "default_loss", "Call"]


class Call(NamedTuple):
    """A micro-batch as a loop feeds it to the model: ``model(*args, **kwargs)``, and what the loss gets besides the
    outputs (``targets``). ``budget=`` learns it from the loop's first forward (:class:`memwrap.runtime.batch_split.Feed`)
    when the batch's own layout does not say it (a dict fed as ``model(batch["ids"])``).

    Example:
        >>> split_batch(Call((torch.ones(2, 3),), {}, torch.zeros(2)))[0][0].shape
        torch.Size([2, 3])
    """

    args: tuple
    kwargs: dict
    targets: Any


def split_batch(batch: Any) -> tuple[tuple, dict, Any]:
    """``(args, kwargs, targets)`` for calling the model on ``batch``.

    Conventions: a tuple/list ``(inputs, targets)`` calls ``model(inputs)`` (``model(*inputs)`` if
    ``inputs`` is a tuple, ``model(**inputs)`` if a dict); a dict calls ``model(**batch)``; a tensor
    calls ``model(batch)``; a :class:`Call` says the call itself.

    Example:
        >>> split_batch((torch.ones(2), torch.zeros(2)))[2].shape
        torch.Size([2])
    """
    if isinstance(batch, Call):
        return tuple(batch.args), dict(batch.kwargs), batch.targets
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        inputs, targets = batch
        if isinstance(inputs, dict):
            return (), dict(inputs), targets
        if isinstance(inputs, (tuple, list)):
            return tuple(inputs), {}, targets
        return (inputs,), {}, targets
    if isinstance(batch, (tuple, list)):
        raise TypeError(f"a {type(batch).__name__} batch must have exactly 2 items, (inputs, targets); got "
                        f"{len(batch)} item(s). Fix: pack several inputs as ((x1, x2), targets) or a dict of "
                        f"keyword arguments, and pass targets=None when there are none.")
    if isinstance(batch, dict):
        return (), dict(batch), batch
    if isinstance(batch, torch.Tensor):
        return (batch,), {}, None
    raise TypeError(f"cannot read a batch of type {type(batch).__name__}; give a tensor, a dict of model "
                    f"keyword arguments, or a tuple (inputs, targets).")


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The loss used when none is given.

    * a ``loss`` entry in dict-like outputs is used as is (Hugging Face style);
    * logits ``[..., C]`` with integer targets of shape ``logits.shape[:-1]``: cross entropy;
    * floating targets of the output's shape: mean squared error;
    * otherwise the mean square of the first floating output (its memory is that of any reduction).

    Example:
        >>> float(default_loss(torch.zeros(2, 3), torch.tensor([0, 1])))  # log(3)  # doctest: +ELLIPSIS
        1.0986...
    """
    if isinstance(outputs, dict) and isinstance(outputs.get("loss"), torch.Tensor):
        return outputs["loss"]
    tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not tensors:
        raise TypeError("the model returned no floating-point tensor to build a loss from; pass loss_fn=.")
    out = tensors[0]
    if isinstance(targets, torch.Tensor):
        if not targets.is_floating_point() and out.dim() >= 2 and tuple(targets.shape) == tuple(out.shape[:-1]):
            return torch.nn.functional.cross_entropy(out.flatten(0, -2).float(), targets.flatten())
        if targets.is_floating_point() and targets.shape == out.shape:
            return torch.nn.functional.mse_loss(out.float(), targets.float())
    return out.float().pow(2).mean()
