"""Built-in loss-head adapter for Hugging Face causal LMs (``LlamaForCausalLM``, ``GPT2LMHeadModel``, ...).

Such a model's ``forward`` runs its body (``model.base_model``: ``model.model`` or ``model.transformer``)
with every argument except ``labels`` and ``logits_to_keep``, applies ``lm_head`` to the last hidden
state, then (some families) transforms the logits, and computes ``ForCausalLMLoss``. The adapter does
the same with the head and the loss fused and chunked. Only families whose ``forward`` was checked to
follow that pattern are recognized; each has an exactness test in ``tests/test_chunked_loss.py``.
Families whose loss adds more (a mixture-of-experts router loss, e.g. Mixtral) are not, and are
refused at ``wrap()``.

Nothing here imports transformers: a model can only be a Hugging Face model if transformers is
already imported.

Example:
    >>> import memwrap, transformers  # doctest: +SKIP
    >>> net = transformers.LlamaForCausalLM(config)  # doctest: +SKIP
    >>> model = memwrap.wrap(net, chunked_loss=True)  # doctest: +SKIP
    >>> model(input_ids=ids, labels=ids).loss.backward()  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

from memwrap.techniques.loss_head import LossHeadSpec
from memwrap.plugin.manager import hookimpl


def _softcap(model):
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is None:
        return None
    return lambda logits: (logits / cap).tanh() * cap  # Gemma 2/3's order: divide, tanh, multiply


def _divide(model):
    scaling = model.config.logits_scaling  # Granite
    return lambda logits: logits / scaling


def _multiply(model):
    scale = model.logit_scale  # Cohere
    return lambda logits: logits * scale


def _none(model):
    return None


# model_type -> the logit transform between lm_head and the loss, as in that family's forward.
FAMILIES = {
    "llama": _none, "mistral": _none, "qwen2": _none, "qwen3": _none, "gemma": _none, "phi3": _none,
    "olmo2": _none, "gpt2": _none, "gemma2": _softcap, "gemma3_text": _softcap, "granite": _divide,
    "cohere": _multiply,
}
_HEAD_ONLY = ("labels", "logits_to_keep")  # what the model's forward keeps from its body


def _causal_lm_class_names(model_type: str) -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return {name} if isinstance(name, str) else set(name or ())


def _matches(model) -> bool:
    # A PreTrainedModel exists only once transformers.modeling_utils is loaded; asking `transformers.PreTrainedModel`
    # before that would load it (2.3 s, e.g. when only HF's Adafactor had imported transformers).
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return False
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        return False
    # The family's causal-LM class (or a subclass): LlamaForSequenceClassification has model_type "llama" too.
    names = _causal_lm_class_names(model_type)
    if not any(cls.__name__ in names for cls in type(model).__mro__):
        return False
    # The head itself is checked by memwrap (LossHeadSpec.head): a head it cannot reproduce is refused by name.
    return model.base_model is not model


def _head(model):
    return model.get_output_embeddings()


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _output_class(cls: type):
    annotation = _signature(cls).return_annotation
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        fields = {f.name for f in dataclasses.fields(annotation)}
        if {"loss", "logits"} <= fields:
            return annotation
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast


def _forward(model, args, kwargs, loss):
    signature = _signature(type(model))
    bound = signature.bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop(next(iter(signature.parameters)))  # self
    extra = {}
    for name, param in signature.parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            extra = arguments.pop(name, {})
    labels = arguments.pop("labels", None)
    if labels is None:
        return None
    keep = arguments.pop("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        raise ValueError(f"{type(model).__name__}(..., labels=..., logits_to_keep={keep!r}) with chunked_loss: the "
                         "loss needs every position's logits. Fix: drop logits_to_keep when passing labels.")
    # return_dict is the causal LM's (transformers' can_return_tuple: the argument, else config.return_dict); the
    # body is asked for its named fields, so that a tuple answer still carries the cache and hidden states.
    return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    # As the model's own forward: the body gets every other argument, **kwargs included (num_items_in_batch too).
    body_out = model.base_model(**arguments, **extra, return_dict=True)
    hidden = body_out.last_hidden_state
    head = model.get_output_embeddings()
    shift_labels = extra.get("shift_labels")
    value = loss(hidden, head.weight, labels if shift_labels is None else shift_labels, bias=head.bias,
                 transform=FAMILIES[model.config.model_type](model), shift=shift_labels is None,
                 ignore_index=extra.get("ignore_index", -100), num_items=extra.get("num_items_in_batch"))
    cls = _output_class(type(model))
    fields = {f.name for f in dataclasses.fields(cls)} - {"loss", "logits"}
    carried = {name: getattr(body_out, name) for name in fields if getattr(body_out, name, None) is not None}
    out = cls(loss=value, logits=None, **carried)
    if return_dict:
        return out
    # The model's tuple is its output's to_tuple() (the fields that are set, in order); logits keeps its place as
    # None, so that `loss, logits, cache = model(..., return_dict=False)` unpacks as without chunked_loss.
    return tuple(getattr(out, f.name) for f in dataclasses.fields(cls)
                 if f.name == "logits" or getattr(out, f.name) is not None)


@hookimpl
def memwrap_loss_heads():
    return [LossHeadSpec("hf-causal-lm", _matches, _forward,
                         f"Hugging Face causal LMs of the families {', '.join(sorted(FAMILIES))}", head=_head)]
