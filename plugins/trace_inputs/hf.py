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

import torch

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


def _all_ones(mask) -> bool:
    """A real 2-D padding mask with no zero (the values are read: a fake one is never all ones here)."""
    # import cost: the planner package; plugins load with `import memwrap`, and only an estimate calls this.
    from memwrap.memory.tracing.unread_inputs import is_real

    return is_real(mask) and mask.dim() == 2 and bool((mask == 1).all())


def _unused(model, kwargs: dict) -> dict[str, str]:
    if not _sdpa_model(model):
        return {}
    return {name: "all ones, which transformers gives SDPA as no mask (on fake tensors it would build the mask)"
            for name, blockers in _MASKS.items()
            if _all_ones(kwargs.get(name)) and all(kwargs.get(b) is None for b in blockers)}


# Families measured exact with it against the allocator (benchmarks/zoo.py, tests/test_held_outputs.py,
# tests/test_unread_inputs.py): they build their masks with transformers.masking_utils and run attention through
# ALL_ATTENTION_FUNCTIONS. The second line measured on transformers 5.25 (2 layers, d 64, GQA 4/2, 2 x 512 tokens,
# bf16 + checkpoint="auto"): the mask kept over-predicted each by 2.4-2.7%, the maskless trace is within 0.05% (fp32
# exact either way). Others keep the mask (safe side) until measured.
_NO_MASK_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "bart",
                     "qwen3", "qwen3_moe", "phi3", "olmo", "olmo2", "gemma", "granite", "starcoder2", "smollm3",
                     "cohere")
# inputs that, given, may make the real step build a mask (packed sequences, a cache's offsets, a 4-D mask)
_MASKING_INPUTS = ("position_ids", "decoder_position_ids", "past_key_values", "cache_position",
                   "encoder_outputs", "inputs_embeds", "decoder_inputs_embeds")
TRACE_SDPA = "memwrap_trace_sdpa"


def _no_mask(model, kwargs: dict) -> str:
    """The real step runs SDPA with no mask when no mask input has a zero, nothing hints at packed sequences or a
    cache, and the sequence is shorter than any sliding window: transformers then skips its mask (its checks read
    values). On fake tensors its packed-sequence check on the position ids it builds cannot read them and keeps the
    mask, and with it GQA repeats keys and values (+7.7% on a Llama-3-8B-shaped model at 1 x 8192 without a cache)."""
    if not _sdpa_model(model) or getattr(model.config, "model_type", None) not in _NO_MASK_FAMILIES:
        return ""
    if any(kwargs.get(k) is not None for k in _MASKING_INPUTS):
        return ""
    ids = [kwargs.get(k) for k in ("input_ids", "decoder_input_ids", "labels")]
    if not isinstance(ids[0], torch.Tensor):  # only their shapes matter: plan()'s fake batches decide too
        return ""
    if any(kwargs.get(name) is not None and not _all_ones(kwargs.get(name)) for name in _MASKS):
        return ""
    window = getattr(model.config, "sliding_window", None)
    longest = max(t.shape[-1] for t in ids if isinstance(t, torch.Tensor))
    if window and longest >= window:
        return ""
    return ("no padding, no packed positions, no sliding window reached: the real step gives SDPA no mask, so the "
            "trace's copy of the model runs transformers' SDPA attention registered without a mask function")


def _run_without_mask(fake) -> None:
    # transformers' own extension point: an attention implementation registered by name (its SDPA function), for
    # which masking_utils has no mask function and so builds none. Only the trace's fake copy is switched to it.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if TRACE_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(TRACE_SDPA, sdpa_attention_forward)
    fake.set_attn_implementation(TRACE_SDPA)


@hookimpl
def memwrap_trace_inputs():
    # import cost: the planner package; plugins load with `import memwrap`, which must not load the planner.
    from memwrap.memory.tracing.unread_inputs import TraceInputSpec

    return [TraceInputSpec("hf-sdpa-mask", _unused, decide=_no_mask, adjust=_run_without_mask)]
