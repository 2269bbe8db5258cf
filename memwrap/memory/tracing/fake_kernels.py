"""Fake-tensor kernels for ops whose torch fake/meta kernel refuses what the real kernel runs.

``aten::_grouped_mm`` (``torch.nn.functional.grouped_mm``, which Hugging Face's Mixtral and Qwen2-MoE experts call)
has a meta kernel written for the CUDA bf16 kernel: it raises "Expected inputs of BF16 type" for fp32 or fp16
inputs, while the CPU kernel (and the traced model's real step) multiplies them. So a trace of an MoE model in
fp32, or under bf16 autocast (which leaves the op in fp32), failed where training runs. For inputs of one
floating dtype other than bf16, the fake result here is the real kernel's: the output shape of the grouped product
(the same rules as torch's meta kernel), in the inputs' dtype (or ``out_dtype``), contiguous. bf16 inputs, and any
other call, go to torch's own meta kernel, unchanged.

The kernel is registered with FakeTensorMode only (:func:`torch._subclasses.fake_impls.register_op_impl`), once,
when the tracer imports this module: real and meta tensors never see it.

Example:
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     out = torch._grouped_mm(torch.empty(6, 4), torch.empty(3, 4, 5),
    ...                             offs=torch.tensor([2, 4, 6], dtype=torch.int32))
    >>> tuple(out.shape), out.dtype
    ((6, 5), torch.float32)
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["grouped_mm_shape"]


def grouped_mm_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output shape of ``torch._grouped_mm(mat_a, mat_b, offs=offs)`` (2-D/3-D operands, as torch's meta kernel
    reads them); raises naming the mismatch.

    Example:
        >>> grouped_mm_shape(torch.empty(6, 4), torch.empty(3, 4, 5), torch.empty(3))
        [6, 5]
    """
    if mat_a.dim() not in (2, 3) or mat_b.dim() not in (2, 3):
        raise RuntimeError(f"grouped_mm multiplicands must be 2D or 3D, got {mat_a.dim()}D and {mat_b.dim()}D")
    if (mat_a.dim() == 3 or mat_b.dim() == 3) and mat_a.size(-1) != mat_b.size(-2):
        raise RuntimeError("contraction dimension of mat_a and mat_b must match")
    if (mat_a.dim() == 2 or mat_b.dim() == 2) and offs is None:
        raise RuntimeError(f"grouped_mm needs offs for {mat_a.dim()}D/{mat_b.dim()}D multiplicands")
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        return [offs.size(0), mat_a.size(0), mat_b.size(1)]
    if mat_a.dim() == 2:
        return [mat_a.size(0), mat_b.size(-1)]
    if mat_b.dim() == 2:
        return [mat_a.size(1), mat_b.size(1)]
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]


def _grouped_mm(fake_mode: Any, func: Any, mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    if (mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype or not mat_a.is_floating_point()
            or bias is not None):
        return NotImplemented  # torch's meta kernel decides (bf16 is what it was written for)
    meta = torch.empty(grouped_mm_shape(mat_a, mat_b, offs), dtype=out_dtype or mat_a.dtype, device="meta")
    return FakeTensor(fake_mode, meta, mat_a.device)


def _register() -> None:
    from torch._subclasses.fake_impls import op_implementations_checks, register_op_impl

    op = getattr(torch.ops.aten, "_grouped_mm", None)
    if op is None or any(impl is _grouped_mm for _, impl in op_implementations_checks):
        return  # a torch without the op, or registered already
    register_op_impl(lambda func: func is op.default)(_grouped_mm)


_register()
