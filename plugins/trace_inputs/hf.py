"""Built-in trace-input adapter for Hugging Face models with SDPA attention: an all-ones ``attention_mask``.

transformers' mask functions (``transformers.masking_utils``) give SDPA no mask (``is_causal=True`` for a decoder)
when the padding mask has no zero and the query and key lengths are equal, exactly as when no mask is given. On fake
tensors they cannot read the values and build the 4-D mask instead (``is_tracing`` counts a ``FakeTensor`` as
traced), which SDPA turns into a float mask kept for backward in every layer. So an all-ones mask of a real batch is
the same step as no mask, and is traced as that. Left alone: a mask with a zero (padding: the real step builds the
mask too), a model on another attention implementation (eager attention always applies its mask), and a call that
also passes ``position_ids`` (with no mask, transformers looks for packed sequences in them) or a cache (query and
key lengths differ).

Nothing here imports transformers: a model can only be a Hugging Face model if transformers is already imported.

Example:
    >>> import memwrap, torch, transformers  # doctest: +SKIP
    >>> ids = torch.randint(0, 100, (4, 512))  # doctest: +SKIP
    >>> est = memwrap.estimate(llama, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})  # doctest: +SKIP
    >>> print(est)  # doctest: +SKIP
    ... attention_mask not passed to the traced model: all ones, which transformers gives SDPA as no mask ...
"""
from __future__ import annotations

import sys

from memwrap.plugin.manager import hookimpl

# mask input -> the inputs that, given with it, make transformers take another path when the mask is left out
_MASKS = {"attention_mask": ("position_ids", "past_key_values", "cache_position"),
          "decoder_attention_mask": ("decoder_position_ids", "past_key_values", "cache_position")}


def _sdpa_model(model) -> bool:
    # A PreTrainedModel exists only once transformers.modeling_utils is loaded; asking before would import it.
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None or not isinstance(model, modeling.PreTrainedModel):
        return False
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == "sdpa"


def _unused(model, kwargs: dict) -> dict[str, str]:
    # import cost: the planner package; plugins load with `import memwrap`, and only an estimate calls this.
    from memwrap.memory.tracing.unread_inputs import is_real

    if not _sdpa_model(model):
        return {}
    out = {}
    for name, blockers in _MASKS.items():
        mask = kwargs.get(name)
        if not is_real(mask) or mask.dim() != 2 or any(kwargs.get(b) is not None for b in blockers):
            continue
        if bool((mask == 1).all()):
            out[name] = "all ones, which transformers gives SDPA as no mask (on fake tensors it would build the mask)"
    return out


@hookimpl
def memwrap_trace_inputs():
    # import cost: the planner package; plugins load with `import memwrap`, which must not load the planner.
    from memwrap.memory.tracing.unread_inputs import TraceInputSpec

    return [TraceInputSpec("hf-sdpa-mask", _unused)]
