"""Clipping and fp16 for optimizers that update inside backward themselves (LOMO, AdaLomo, layer-wise GaLore/APOLLO).

These optimizers update each parameter from a hook as soon as its gradient exists and free the gradient, so
the full set of gradients never lives at once: ``clip_grad_norm_`` after ``backward()`` would find nothing to
clip, and GradScaler's overflow check would come after the updates it should have skipped. With
``wrap(model, optimizer, max_grad_norm=...)`` or ``precision="fp16"`` memwrap runs the norm pass of
:mod:`memwrap.techniques.norm_pass` inside the user's single ``loss.backward()``:

1. **first pass** (started where the model's outputs have all their gradients, ``retain_graph=True``): each
   parameter's gradient gives its norm (unscaled first in fp16, with GradScaler's kernel and ``found_inf``) and is
   freed; the optimizer's own hooks stand aside, so nothing is updated. The total is formed as
   ``clip_grad_norm_`` forms it (see the norm pass), in the optimizer's parameter order.
2. **second pass** (the user's backward goes on): each parameter's gradient is unscaled, multiplied by the clip
   coefficient (torch's, with torch's ``_foreach_mul_``/``mul_`` choice) and handed to the optimizer's own update
   for that one parameter (``update_in_backward`` of the plugin's optimizer), which frees it. A window whose norm
   is not finite updates nothing (every gradient is freed), ``step()`` counts a skipped update and the GradScaler
   backs off or grows as ``scaler.update()`` after ``unscale_`` would.

At most one parameter's gradient is alive at a time in either pass, as without clipping. The parameters
equal the ordinary clipped step (``unscale_``, ``clip_grad_norm_`` over all gradients, then the optimizer's math for
each parameter) bit for bit. What it costs is the norm pass's: one more backward of the micro-batch, and its saved
activations alive during the first pass.

The optimizer's side of the protocol (memwrap's LOMO/AdaLomo classes and
:class:`plugins.optim._lowrank.LayerwiseOptimizer` have it): ``updates_deferred`` (a settable flag: while True its
own hooks update nothing) and ``update_in_backward(params)`` (update exactly these parameters from their ``.grad``
and free it).

Still refused at ``wrap()``, with the fix: accumulation (these optimizers hold no gradient across micro-batches),
``step_in_backward=True`` (they already step there), DDP/FSDP2, and an optimizer without the protocol (see
:func:`memwrap.techniques.step_in_backward.check_updates_in_backward`); at the backward, as with the norm pass: a
second backward in the micro-batch after updates, ``create_graph=True``, a loss over several forward calls, a
parameter reached other than through the outputs (each names ``memwrap.backward(loss, model)`` where it is the fix).

Example:
    >>> model, optimizer = memwrap.wrap(model, memwrap.create_optimizer("lomo", model, lr=1e-3), max_grad_norm=1.0)  # doctest: +SKIP
    >>> loss.backward()  # first pass: the norm; second pass: LOMO's clipped updates, gradients freed  # doctest: +SKIP
    >>> optimizer.step(); optimizer.zero_grad(); optimizer.last_grad_norm  # doctest: +SKIP
    3.2
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memwrap.techniques.norm_pass import NormPass, ParamHook as _Hook, _graph_task_id, needs_norm_pass

__all__ = ["UpdatesInBackward", "supports_norm_pass", "uses_norm_pass"]


def supports_norm_pass(optimizer: torch.optim.Optimizer) -> bool:
    """Whether an optimizer that updates inside backward lets memwrap's norm pass drive its updates.

    Example:
        >>> supports_norm_pass(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))]))
        False
    """
    return callable(getattr(optimizer, "update_in_backward", None)) and hasattr(optimizer, "updates_deferred")


def uses_norm_pass(wrapped: Any) -> bool:
    """Whether ``wrap()`` attaches :class:`UpdatesInBackward` to this wrapped optimizer: its optimizer updates inside
    backward and the window clips (``max_grad_norm``) or loss-scales (fp16).

    Example:
        >>> uses_norm_pass(optimizer)  # doctest: +SKIP
        True
    """
    return bool(getattr(wrapped.optimizer, "updates_in_backward", False)
                and needs_norm_pass(wrapped.max_grad_norm, wrapped.scaler))


class UpdatesInBackward:
    """Drives the clipped (and fp16-unscaled) updates of an optimizer that updates inside backward; see the module
    docstring.

    Attached by ``wrap()`` as ``optimizer.norm_in_backward``; ``memwrap.unwrap(optimizer)`` removes its hooks and
    gives the optimizer its own hooks back. The hooks on the parameters hold this object weakly.

    Example:
        >>> optimizer.norm_in_backward.norm.first_passes  # updates whose norm came from a first pass  # doctest: +SKIP
        4
    """

    def __init__(self, wrapped: Any, model: nn.Module):
        self.wrapped = wrapped
        self.optimizer = wrapped.optimizer
        self.gate = wrapped.gate
        self._names = {id(p): n for n, p in model.named_parameters()}
        self.norm = NormPass(wrapped, self._names)
        self._updated: set[int] = set()  # parameters updated in this window
        self._task: int | None = None  # the backward pass (graph task) that updated them
        hook = _Hook(weakref.ref(self))
        params = {id(p): p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad}
        # Registered after the optimizer's own hooks, which stand aside while updates_deferred is set: this hook
        # decides, for each gradient, whether it gives a norm (first pass), waits for step(), or is clipped and
        # handed to the optimizer's update for that parameter.
        self._hooks = {pid: p.register_post_accumulate_grad_hook(hook) for pid, p in params.items()}
        self.optimizer.updates_deferred = True
        self.gate.norm_pass = weakref.ref(self.norm)
        # The wrapped model's output hooks call this at the start of each backward (a second one is refused).
        self.gate.backward_watch = weakref.WeakMethod(self.check_backward_start)
        weakref.finalize(self, _release, list(self._hooks.values()), self.optimizer)

    def check_backward_start(self) -> None:
        """Refuse a second backward through the outputs once parameters were updated inside the first."""
        task = _graph_task_id()
        if task < 0:  # memwrap.backward marks the micro-batch before it starts one
            return
        if self._updated and task != self._task:
            raise RuntimeError(
                f"{type(self.optimizer).__name__} with the norm pass ({self.norm._what()}): a second backward pass "
                f"through the wrapped model's outputs before optimizer.step(), after {len(self._updated)} parameter(s) "
                "were updated inside the first: its gradients would reach parameters that already changed, and its "
                "norm would not be in the clip. Fix: one backward per micro-batch (sum the losses first: "
                "(loss_a + loss_b).backward()), then optimizer.step().")

    def _on_gradient(self, param: torch.Tensor) -> None:
        if id(param) not in self._hooks:
            return
        norm = self.norm
        if norm.running:  # the first pass: this gradient gives its norm and is freed
            norm.contribute(param)
            return
        if not norm.ready:
            # No first pass ran before this gradient (the backward does not go through the model's outputs): keep
            # it; step() takes the norm from the gradients as they are and updates them (the ordinary clipped step).
            # A gradient that overtakes the outputs of this backward is refused there.
            norm.hold(param)
            return
        if id(param) in self._updated:
            raise RuntimeError(
                f"{type(self.optimizer).__name__} with the norm pass ({self.norm._what()}): parameter "
                f"{self._names.get(id(param), '(unnamed)')!r} got a second gradient after it had been updated (two "
                "backward passes before optimizer.step()?); its update used only the first. Fix: one backward per "
                "micro-batch (sum the losses first), then optimizer.step().")
        self._update([param])

    def _update(self, params: list[torch.Tensor]) -> None:
        if not self._updated:
            task = _graph_task_id()
            self._task = task if task >= 0 else None
        self._updated.update(id(p) for p in params)
        with torch.no_grad():
            if not self.norm.finite:  # the whole update is skipped: the gradients are only freed
                for p in params:
                    p.grad = None
                return
            for p in params:
                if p.grad is not None:
                    self.norm.prepare(p.grad)  # clipped as clip_grad_norm_ clips it
            # All of them clipped before any update: the optimizer may update every parameter holding a .grad.
            self.optimizer.update_in_backward([p for p in params if p.grad is not None])

    def finish_window(self) -> float | None:
        """Called by ``optimizer.step()``: update what the hooks held, close the norm pass; as
        ``WrappedOptimizer._update``, return None when the update was applied, else the loss scale it used."""
        self.norm.ensure_ready()  # a backward that ran no first pass: the norm of the held gradients, now
        left = [p for g in self.optimizer.param_groups for p in g["params"]
                if p.grad is not None and id(p) not in self._updated]
        if left:
            self._update(left)
        self.optimizer.step()  # nothing left to update: the optimizer's own per-update bookkeeping (AdaLomo's count)
        self._updated.clear()
        self._task = None
        return self.norm.finish()

    def remove(self) -> None:
        """Remove the hooks: the optimizer's own hooks update (unclipped) again."""
        _release(list(self._hooks.values()), self.optimizer)
        self._hooks.clear()
        if self.gate.__dict__.get("norm_pass") is not None and self.gate.norm_pass() is self.norm:
            self.gate.norm_pass = None
        if self.gate.__dict__.get("backward_watch") is not None \
                and self.gate.backward_watch() == self.check_backward_start:
            self.gate.backward_watch = None


def _release(handles: list, optimizer: torch.optim.Optimizer) -> None:
    # Also when the driver is collected (the wrapped optimizer dropped): the optimizer must not stay deferred, or its
    # own hooks would never update again.
    for handle in handles:
        handle.remove()
    handles.clear()
    optimizer.updates_deferred = False
