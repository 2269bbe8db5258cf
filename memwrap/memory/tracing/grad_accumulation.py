"""Autograd's in-place gradient accumulation, which tracing under a dispatch mode turns off, put back in the trace.

When a tensor is used twice in forward (a residual stream, a weight tied between embedding and head), its two
gradients meet in the autograd engine's input buffer (``torch/csrc/autograd/input_buffer.cpp``, ``accumulate``).
Outside backward's grad mode the engine adds the second into the first *in place* when ``can_accumulate_inplace``
holds for the first: a plain dense tensor, held only by the buffer (``is_tensor_stealable``, storage use count 1).
Otherwise it adds out of place, ``old + new``, a third buffer of the same size while both are alive.

``can_accumulate_inplace`` starts with ``!at::isTensorSubclassLike(v)``, and ``isTensorSubclassLike``
(``ATen/TensorSubclassLikeUtils.h``) returns true whenever a Python dispatch mode is active
(``c10::impl::dispatch_mode_enabled()``), and for every FakeTensor anyway. So under the trace (FakeTensorMode plus
MemTracker, both dispatch modes) every such accumulation is out of place, while the real step (no mode) does it in
place: the trace over-predicts by one gradient-sized tensor wherever the step's peak sits at such a moment (bf16 +
full checkpointing on the README's test GPT: +4.8 %; the tied-head GPT with the chunked loss: +9.7 %). A do-nothing
``TorchDispatchMode`` around the *real* step reproduces the trace's prediction to the byte.

:class:`InPlaceAccumulation` recognises the engine's accumulation among the ops the tracker sees and lets the tracker
run it as ``add_`` (the storage reused, nothing allocated), exactly when the real engine would:

* an ``aten.add.Tensor`` with the default alpha, in backward, with grad mode off (backward's own mode; checkpoint
  recomputation runs with grad mode on and is left alone), of two tensors of one shape, dtype and device;
* the first is a plain dense tensor (not a view of a larger storage, not another subclass) and is held only by the
  engine's buffer: its use counts equal those that :func:`engine_buffer_counts` measures on a probe graph whose
  accumulation is in place in the real engine (a tensor also referenced elsewhere, e.g. the same gradient in two
  slots, or a tensor a Python hook or custom ``Function.backward`` holds, shows higher or different counts);
* the first was not made by the autograd node now running: the engine adds after the node returns, into a gradient
  an earlier node produced, while an ``add`` inside a node's own formula (``var_mean``'s ``gv + gm``) is out of place
  in the real step too and stays so. The price: a node that returns both gradients itself (``y * y``:
  MulBackward0) is added in place by the real engine but stays out of place here (over-prediction, the safe side).

``tests/test_estimate.py`` checks every decision against the real engine (by buffer address) on small graphs, and
the estimates against the allocator's peak where the step peaks at such an accumulation.

Where the probe cannot tell a held-only-by-the-buffer tensor from a shared one (a future torch changing its
reference counting), nothing is rewritten and the trace stays on the safe side (over-prediction).

Example:
    >>> engine_buffer_counts() is not None
    True
"""
from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["InPlaceAccumulation", "engine_buffer_counts"]

_ADD = torch.ops.aten.add.Tensor
_ADD_ = torch.ops.aten.add_.Tensor


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _counts(args: tuple) -> tuple[int, int, int]:
    """References to ``args[0]``: C++ (the engine's buffer, the dispatcher's), its storage's, and Python's.

    Called with the dispatch's own ``args`` tuple before anything else binds the tensor, by the probe and by the
    tracker alike, so that both see the same references of their own (the tuple, this frame, ``untyped_storage()``'s
    storage object); what differs is what else holds the tensor: a Python hook keeping the gradient shows in the
    Python count, a second buffer slot or a saved tensor in the C++ count, a view of the same storage in the storage
    count.
    """
    return args[0]._use_count(), torch._C._storage_Use_Count(args[0].untyped_storage()._cdata), sys.getrefcount(args[0])


def engine_buffer_counts() -> tuple[int, int, int] | None:
    """The references (C++, storage, Python; see :func:`_counts`) that a gradient held only by autograd's input buffer shows inside a
    ``__torch_dispatch__`` of the engine's accumulating ``add``; None where a shared gradient shows the same.

    Measured, not assumed: a probe graph ``y = 2x; sin(y) + cos(y)`` gives ``y`` two gradients that only the
    engine holds (accumulated in place by the real engine), ``y + y`` one gradient in two slots (out of place). Runs
    under whatever fake mode is active, so it sees the same dispatch path as the trace.
    """
    seen: list[tuple[int, int]] = []

    class Probe(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is _ADD and _in_backward() and not torch.is_grad_enabled():
                seen.append(_counts(args))
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(False), torch.enable_grad(), Probe():
        x = torch.empty(4, requires_grad=True)
        y = x * 2
        (y.sin() + y.cos()).sum().backward()
        y = x * 2
        (y + y).sum().backward()
    if len(seen) != 2 or seen[0] == seen[1]:
        return None
    return seen[0]


class InPlaceAccumulation:
    """The part of a tracker's ``__torch_dispatch__`` that runs the engine's accumulation in place as the real step
    does (see the module docstring). Call :meth:`rewrite` before dispatching and :meth:`made` after.

    Example:
        >>> acc = InPlaceAccumulation()
        >>> acc.rewrite(torch.ops.aten.mm.default, (torch.ones(1, 1), torch.ones(1, 1)), {}) is torch.ops.aten.mm.default
        True
    """

    def __init__(self) -> None:
        self.unique = engine_buffer_counts()
        self.rewritten = 0  # accumulations run in place (for tests and diagnostics)
        self._node = None  # the autograd node whose ops _made holds
        self._made = WeakTensorKeyDictionary()

    def rewrite(self, func, args: tuple, kwargs: dict | None):
        """``aten.add_.Tensor`` for the engine's accumulation into a gradient only the engine holds, else ``func``."""
        if func is not _ADD or kwargs or self.unique is None or len(args) != 2 or not _in_backward() \
                or torch.is_grad_enabled():
            return func
        counts = _counts(args)  # first: nothing of this frame holds the tensor yet
        old, new = args
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or not _plain(old) or \
                not _plain(new) or old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
            return func
        if old.is_nested or old._is_zerotensor() or not _non_overlapping_and_dense(old):
            return func
        if self._current() is not None and old in self._made:  # a temporary of the running node's own formula
            return func
        if counts != self.unique:
            return func
        self.rewritten += 1
        return _ADD_

    def made(self, res) -> None:
        """Remember the tensors the running autograd node made (its formula's temporaries and outputs)."""
        if not _in_backward():
            self._node = None  # holds no node past its backward
            return
        self._current()
        for t in torch.utils._pytree.tree_leaves(res):
            if isinstance(t, torch.Tensor):
                self._made[t] = True

    def _current(self):
        node = torch._C._current_autograd_node()
        if node is not self._node:  # a new node runs: the previous one's tensors are gradients now
            self._node, self._made = node, WeakTensorKeyDictionary()
        return node


def _plain(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    # A fake tensor stands for a plain one; any other subclass is "subclass-like" to the real engine too.
    return type(t) in (torch.Tensor, FakeTensor)


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    from torch._prims_common import is_non_overlapping_and_dense_or_false

    return is_non_overlapping_and_dense_or_false(t)
