"""FLOPs by matmul dtype and size: what the cost model needs to rate a step on a device whose matmul speed depends on
the size of the matrices.

On a CPU the ratio of bf16 to fp32 matmul speed is not one number: on a 2-core AMX Xeon it is 0.08x at 32^3 and
7.3x at 512^3, because the bf16 tiles pay off only on large blocks. A step's FLOPs rated at one calibration size
therefore mis-rank precisions on small models (docs/benchmarks/rank_check.md). The trace keeps each FLOP-counted
op's FLOPs under a class ``"<dtype>@<size>"``: the dtype of its operands and the geometric mean of its GEMM's three
sides ``(m * k * n) ** (1/3)``, per matrix of a batched matmul, rounded to half an octave; ``size`` 0 is an op
whose GEMM shape is not read (the profile rates it at its reference size). The cost model
(:mod:`memwrap.memory.search.cost`) interpolates the device's measured rate at each class.

The geometric mean is the measured best single predictor on that CPU: a (512 x 64) @ (64 x 128) GEMM (mean 161)
runs bf16 at 1.5x fp32, between the square 128^3 (1.1x) and 256^3 (3.9x) rates; its smallest side (64) would say
0.25x.

Example:
    >>> import torch
    >>> a, b = torch.ones(512, 64), torch.ones(64, 128)
    >>> flop_class(torch.ops.aten.mm.default, (a, b), a @ b)
    'fp32@181'
"""
from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["flop_class", "class_size", "dtype_name", "merge", "flop_formulas"]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
# Ops whose operands are laid out (batch, seq, heads, dim) rather than (batch, heads, seq, dim).
_SEQ_SECOND = ("_flash_attention_forward", "_efficient_attention_forward", "_flash_attention_backward",
               "_efficient_attention_backward")


def dtype_name(dtype: torch.dtype) -> str:
    """``'fp32'``, ``'bf16'``, ``'fp16'``, ``'fp64'``, else the dtype's own name (``'float8_e4m3fn'``).

    Example:
        >>> dtype_name(torch.bfloat16)
        'bf16'
    """
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def _tensors(args: Any) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


# matmul op -> the position of its left operand among its tensor arguments (addmm/baddbmm take the bias first)
_LEFT = {"mm": 0, "_scaled_mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1}


def _gemm(name: str, args: tuple, out: Any) -> tuple[int, int, int] | None:
    """``(m, k, n)`` of one of the op's GEMMs, or None where the op's shape is not read here."""
    ts = _tensors(args)
    if name in _LEFT and len(ts) >= _LEFT[name] + 2:
        a, b = ts[_LEFT[name]], ts[_LEFT[name] + 1]
    elif "convolution" in name or name == "_slow_conv2d_forward":
        # As an implicit GEMM: rows = output positions, depth = a filter's inputs, columns = output channels.
        # convolution_backward(grad_output, input, weight, ...): grad_output has the forward output's shape.
        backward = name == "convolution_backward"
        y = ts[0] if backward else out
        w = ts[2] if backward else ts[1]
        if not isinstance(y, torch.Tensor) or y.dim() < 3 or w.dim() < 3:
            return None
        return y.numel() // max(1, y.shape[1]), w[0].numel(), w.shape[0]
    elif "attention" in name and len(ts) >= 3:
        q, k = (ts[1], ts[2]) if name.endswith("backward") else (ts[0], ts[1])
        if q.dim() < 3:
            return None
        seq = 1 if name in _SEQ_SECOND else -2
        return q.shape[seq], q.shape[-1], k.shape[seq]  # q @ k^T per head: (L, E) @ (E, S)
    else:
        return None
    if a.dim() < 2 or b.dim() < 2:
        return None
    return a.shape[-2], a.shape[-1], b.shape[-1]


def class_size(m: int, k: int, n: int) -> int:
    """The size class of an ``(m, k) @ (k, n)`` GEMM: its geometric mean side rounded to half an octave.

    Example:
        >>> class_size(256, 256, 256), class_size(512, 64, 128), class_size(1, 1, 1)
        (256, 181, 1)
    """
    mean = max(1.0, float(m) * float(k) * float(n)) ** (1 / 3)
    return round(2 ** (round(2 * math.log2(mean)) / 2))


def flop_class(func: Any, args: tuple, out: Any) -> str:
    """The class ``"<dtype>@<size>"`` of one FLOP-counted op (see the module docstring).

    Example:
        >>> x = torch.ones(4, 32, 16, dtype=torch.bfloat16)
        >>> flop_class(torch.ops.aten.bmm.default, (x, x.transpose(1, 2)), None)
        'bf16@23'
    """
    packet = getattr(func, "_overloadpacket", func)
    name = getattr(packet, "__name__", str(packet)).split(".")[-1]
    ts = _tensors(args)
    dtype = dtype_name(ts[0].dtype) if ts else "fp32"
    try:
        shape = _gemm(name, args, out)
    except (IndexError, AttributeError, TypeError):
        shape = None
    return f"{dtype}@{class_size(*shape) if shape else 0}"


def _cpu_flash(query, key, value, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


def flop_formulas() -> dict:
    """torch's FLOP formulas (``torch.utils.flop_counter.flop_registry``, keyed by op packet) plus the CPU flash
    attention kernel's, which torch's registry leaves out: the trace runs on CPU fake tensors whatever the device
    trained on, so ``F.scaled_dot_product_attention`` dispatches ``_scaled_dot_product_flash_attention_for_cpu``
    there, and without these its FLOPs (forward and backward) would be counted as none. Same formulas as torch's
    for the CUDA flash kernel (causal masking not discounted, as torch does not).

    Example:
        >>> q = torch.ones(1, 2, 8, 4)
        >>> f = flop_formulas()[torch.ops.aten._scaled_dot_product_flash_attention_for_cpu]
        >>> f(q, q, q)  # two (8 x 4) @ (4 x 8) products per head: 2 * 2 * (2 * 8 * 4 * 8)
        2048
    """
    from torch.utils.flop_counter import flop_registry

    aten = torch.ops.aten
    return {**flop_registry, aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward}


def merge(a: dict[str, int], b: dict[str, int], fn) -> dict[str, int]:
    """``{class: fn(a.get(class, 0), b.get(class, 0))}`` over the classes of both (extrapolating two depths).

    Example:
        >>> merge({"fp32@64": 2}, {"fp32@64": 3, "bf16@0": 1}, lambda x, y: x + y)
        {'bf16@0': 1, 'fp32@64': 5}
    """
    return {c: fn(a.get(c, 0), b.get(c, 0)) for c in sorted(a.keys() | b.keys())}
