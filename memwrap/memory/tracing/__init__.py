"""One training step traced on fake tensors and what it measures: the trace, ``estimate()``, depth
truncation, how the model is called on a batch, and the fake kernels and gradient accumulation the trace needs.
"""
