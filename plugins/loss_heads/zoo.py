"""Built-in loss-head adapter for memwrap's own causal LMs (``memwrap.models.GPT`` and ``Llama``).

Both split into ``hidden_states(ids)`` (embeddings, blocks, final norm) and ``lm_head``; GPT's head is
tied to the token embedding, which needs nothing special: the head's weight *is* the embedding's
parameter, so its gradient gathers both uses as in the plain model.

Example:
    >>> import memwrap, torch
    >>> from memwrap.models import build_preset
    >>> model = memwrap.wrap(build_preset("llama-tiny", num_hidden_layers=1), chunked_loss=True)
    >>> ids = torch.randint(0, 4096, (1, 32))
    >>> model(ids, labels=ids).loss.shape
    torch.Size([])
"""
from __future__ import annotations

import inspect

from memwrap.techniques.loss_head import LossHeadSpec
from memwrap.plugin.manager import hookimpl


def _matches(model) -> bool:
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import GPT, Llama

    return isinstance(model, (GPT, Llama))


def _forward(model, args, kwargs, loss):
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import LMOutput

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    ids, labels, num_items = bound.args[0], bound.arguments.get("labels"), bound.arguments.get("num_items_in_batch")
    if labels is None:
        return None
    hidden = model.hidden_states(ids)
    head = model.lm_head
    return LMOutput(loss=loss(hidden, head.weight, labels, bias=head.bias, shift=True, num_items=num_items),
                    logits=None)


@hookimpl
def memwrap_loss_heads():
    return [LossHeadSpec("zoo-lm", _matches, _forward, "memwrap.models GPT and Llama", head=lambda m: m.lm_head)]
