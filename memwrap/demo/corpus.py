"""The text ``memwrap demo`` trains on: a few KB written for the demo, embedded so nothing is downloaded.

Tokens are the UTF-8 bytes of the text (a byte-level vocabulary of 256), which fits every
text preset's vocabulary.

Example:
    >>> from memwrap.demo.corpus import corpus_tokens
    >>> int(corpus_tokens().max()) < 256
    True
"""
from __future__ import annotations

import torch

__all__ = ["CORPUS", "corpus_tokens"]

CORPUS = """\
A training step has a shape, and the shape decides where the memory goes. First the weights sit in
memory, four bytes for every parameter in full precision. Then the optimizer keeps its own state:
AdamW remembers a running mean and a running square of every gradient, eight more bytes for every
parameter. The gradients themselves take four bytes per parameter while they exist. None of this
depends on the batch. What depends on the batch is the forward pass: every layer keeps the tensors
its backward pass will need, and for a transformer that is many times the size of its input for
every block, for every token, for every sample.

When the memory runs out, there are four things to try, and each of them trades something away.

Gradient accumulation splits one big batch into several small ones. Each small batch runs forward
and backward on its own, the gradients add up in place, and the optimizer steps once at the end.
The activations of one small batch are alive at a time, so activation memory shrinks with the size
of the small batch. The gradients must now live across the whole window, and the weights, the
gradients and the optimizer state do not shrink at all. The maths is the same as one big batch if
every small batch is weighted by its share of the window. Layers that look across the batch, like
batch normalization, see only the small batch and are the exception.

Activation checkpointing keeps only the inputs of chosen blocks during the forward pass and runs
those blocks a second time during the backward pass to rebuild what was thrown away. It costs one
more forward pass through the checkpointed blocks and saves most of their activations. Selective
checkpointing keeps the results of the expensive operations, such as matrix products and attention,
and recomputes only the cheap ones around them, which saves less memory and costs almost no time.

Mixed precision runs the forward pass in a sixteen bit format. The master weights stay in full
precision, so the weights, the gradients and the optimizer state cost what they cost before; what
shrinks are the activations saved in the lower precision, and on hardware with matrix units the
step gets faster. Brain float keeps the exponent range of full precision. Half precision does not,
so small gradients vanish unless the loss is scaled up before the backward pass and the gradients
are scaled down before the update, skipping any update whose gradients overflowed.

A smaller optimizer state is the fourth lever. Eight bit Adam stores its two moments in one byte
each, with a scale for every block of values, and so needs about two bytes per parameter instead of
eight. Adafactor keeps factored second moments, one row and one column per matrix, and no first
moment at all. Both change the update a little; both can turn a model that does not fit into one
that does, when the optimizer state is what fills the memory.

A planner can try all of these before anything runs. It traces one training step on fake tensors,
which have shapes and types but no storage, and records for every allocation whether it holds a
weight, a gradient, optimizer state, an activation or a temporary. The largest total over the step
is the peak. Because the trace runs the real code, the prediction is the memory of the real step,
not the result of a formula, and the measured peak of the real run should match it closely.

Good training code stays boring. The loop loads a batch, calls the model, computes the loss, calls
backward, steps the optimizer and clears the gradients. A wrapper that keeps that loop unchanged is
easier to trust than one that asks for a new loop: the loss, the data and the logging stay where
the user put them, and the memory savings arrive through two added lines.

Every claim about memory and speed should come with the setting in which it was measured: the
model, the batch, the sequence length, the precision and the device. A number without its setting
is a rumour. Checkpointing may save three quarters of the activation memory of one model and a
tenth of the total memory of another. Mixed precision may double the speed on one card and slow
down a processor without matrix units. Accumulation saves activation memory in proportion to the
split, and nothing else. Measure, then decide.
"""


def corpus_tokens() -> torch.Tensor:
    """The corpus as a 1-D ``int64`` tensor of byte values (0..255).

    Example:
        >>> corpus_tokens().dtype
        torch.int64
    """
    return torch.tensor(list(CORPUS.encode("utf-8")), dtype=torch.long)
