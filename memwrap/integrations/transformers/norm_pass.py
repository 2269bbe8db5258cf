"""``max_grad_norm`` inside ``transformers.Trainer`` for optimizers that update inside backward (LOMO, AdaLomo,
layer-wise GaLore/APOLLO).

Trainer clips after its backward (``clip_grad_norm_`` between ``backward`` and ``optimizer.step()``). These optimizers
have updated every parameter and freed its gradient by then, so Trainer's clip finds nothing: its own LOMO and
layer-wise GaLore train unclipped whatever ``max_grad_norm`` says. memwrap's optimizers built for Trainer
(:func:`memwrap.integrations.transformers.trainer.memwrap_trainer_kwargs`) clip exactly instead, with the norm pass of
a plain ``memwrap.wrap(model, optimizer, max_grad_norm=...)`` loop (:mod:`memwrap.techniques.updates_in_backward`):

* when Trainer builds the optimizer, memwrap wraps the model and that optimizer with ``max_grad_norm`` (``wrap()``'s
  own checks and norm pass; no precision, accumulation or checkpointing of its own: those stay Trainer's);
* a forward hook on the model Trainer trains hands its outputs to the wrapped model's
  :meth:`~memwrap.runtime.module.WrappedModule.finish_outputs`, where the first pass starts once the outputs have
  their gradient, inside Trainer's one backward (``loss.backward()``, or lomo-optim's ``fused_backward`` that
  accelerate calls for ``optim="lomo"``/``"adalomo"``);
* a hook on those outputs queues the close of the update at the end of that backward (what the hooks held, the
  optimizer's per-update bookkeeping, ``last_grad_norm``): accelerate makes ``step()`` a no-op for lomo-optim's
  classes, and the optimizer's own ``step()`` has nothing left to do afterwards.

Trainer keeps the optimizer it built, lomo-optim's class included, so accelerate still recognises LOMO. Its clip after
backward finds no gradient, so the ``grad_norm`` Trainer logs is 0.0; the norm that was clipped is
``optimizer.memwrap_norm_pass.last_grad_norm``.

Resuming: Trainer saves and restores the optimizer's own ``state_dict()``; the norm pass holds nothing that changes
the maths between updates (no accumulation, no loss scale), only its counters, which restart.

Refused with the fix, before anything changes (:func:`check_trainer_updates_in_backward`):
``gradient_accumulation_steps > 1`` (each micro-batch would update the weights; nothing accumulates), several
processes (each rank would update from its own gradient before DDP averages them), ``fp16=True`` (accelerate's
GradScaler scales the loss, and these optimizers would update from the scaled gradients before any unscale or
overflow check) and, with clipping, ``checkpoint="selective"`` (one backward per region in torch).

Example:
    >>> args = TrainingArguments(..., optim="lomo", max_grad_norm=1.0)  # doctest: +SKIP
    >>> Trainer(model=model, args=args, train_dataset=ds, **memwrap_trainer_kwargs(model, args)).train()  # doctest: +SKIP
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from memwrap.checkpointing.apply import checkpoint_mode, refuse_selective_norm_pass
from memwrap.runtime.outputs import map_outputs
from memwrap.techniques.norm_pass import missing_engine_queries

__all__ = ["TrainerNormPass", "check_trainer_updates_in_backward"]


def check_trainer_updates_in_backward(model: nn.Module, args: Any, name: str, checkpoint: Any) -> float | None:
    """Refuse what an optimizer that updates inside backward cannot do in a Trainer run; return the ``max_grad_norm``
    memwrap's norm pass applies (None: no clipping).

    Reads only: the model and ``args`` are left as they are.

    Example:
        >>> check_trainer_updates_in_backward(model, TrainingArguments(..., max_grad_norm=1.0), "lomo", None)  # doctest: +SKIP
        1.0
    """
    steps = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    if steps > 1:
        raise ValueError(
            f"optimizer {name} updates each parameter inside backward, so with gradient_accumulation_steps={steps} "
            "Trainer's every micro-batch would update the weights (Trainer's own one does, and its gradients are "
            "never accumulated). Fix: gradient_accumulation_steps=1 with a larger per_device_train_batch_size, or an "
            "optimizer that steps after backward (e.g. the non-layer-wise variant).")
    world = int(getattr(args, "world_size", 1) or 1)
    if world > 1:
        raise ValueError(
            f"optimizer {name} updates each parameter inside backward, and this Trainer run has {world} processes: "
            "DDP averages the gradients across ranks only after that, so each rank would update from its own "
            "gradient and the replicas would drift apart. Fix: an optimizer that steps after backward (e.g. "
            "optim='adamw_torch'; FSDP shards its state), or train in one process.")
    if getattr(args, "fp16", False):
        raise ValueError(
            f"optimizer {name} updates each parameter inside backward, and TrainingArguments(fp16=True) scales the "
            "loss with accelerate's GradScaler, which unscales and checks for overflow only after backward: every "
            "update would use the scaled gradient. Fix: bf16=True, or a plain loop with memwrap.wrap(model, "
            "optimizer, precision='fp16') (memwrap's norm pass unscales and checks inside backward).")
    clip = getattr(args, "max_grad_norm", None)
    if clip is None or not clip > 0:
        return None
    clip = float(clip)
    # Private torch APIs: the norm pass's engine queries, and the engine's callback at the end of a backward (where
    # the update closes, see TrainerNormPass.queue_close).
    missing = [f"torch._C.{m}" for m in missing_engine_queries()]
    if not hasattr(torch.autograd.Variable._execution_engine, "queue_callback"):
        missing.append("torch.autograd.Variable._execution_engine.queue_callback")
    if missing:
        raise ValueError(
            f"optimizer {name} with max_grad_norm={clip} in a Trainer run: memwrap's norm pass needs "
            f"{', '.join(missing)}, which torch {torch.__version__} lacks. Fix: a torch that has them (memwrap is "
            "tested on 2.13), or max_grad_norm=0 (Trainer's own clip finds no gradient left with this optimizer).")
    refuse_selective_norm_pass(checkpoint_mode(checkpoint, model), f"max_grad_norm={clip}", step_in_backward=False)
    return clip


class TrainerNormPass:
    """memwrap's norm pass inside a Trainer run, attached to the optimizer Trainer steps (see the module docstring).

    ``last_grad_norm`` is the norm of the last update's gradients before clipping; ``remove()`` takes the hooks off
    (the optimizer's own hooks update again, unclipped).

    Example:
        >>> trainer.optimizer.optimizer.memwrap_norm_pass.last_grad_norm  # doctest: +SKIP
        2.71
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float):
        import memwrap  # the public API, as a user's loop calls it: wrap() sits above this module's import floor

        self.wrapped_model, self.wrapped = memwrap.wrap(model, optimizer, max_grad_norm=max_grad_norm)
        self._queued = False  # the close of this backward's update is queued on its graph task
        me = weakref.ref(self)  # the optimizer holds this object; the model's hook must not keep it alive on its own
        self._forward = model.register_forward_hook(lambda module, args, outputs: _finish(me, outputs))

    @property
    def last_grad_norm(self) -> float | None:
        """The total norm of the last update's gradients, before clipping (as ``clip_grad_norm_`` returns it)."""
        return self.wrapped.last_grad_norm

    @property
    def updates(self) -> int:
        """Updates applied so far (a window whose norm is not finite counts in ``skipped``)."""
        return self.wrapped.updates

    @property
    def skipped(self) -> int:
        return self.wrapped.skipped

    def finish_outputs(self, outputs: Any) -> Any:
        """The forward hook: the wrapped model's output aliases, and on each a hook that closes the update when the
        backward through them ends."""
        outputs = self.wrapped_model.finish_outputs(outputs)
        if torch.is_grad_enabled():
            me = weakref.ref(self)
            map_outputs(outputs, lambda t: _on_output(t, me))
        return outputs

    def queue_close(self) -> None:
        """Close the update at the end of the backward now running (its graph task), once per backward.

        At its end, not at ``optimizer.step()``: accelerate's ``step()`` is a no-op for lomo-optim's classes, and
        Trainer clips between the two (here it finds nothing left to clip).
        """
        if self._queued:
            return
        self._queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self.close_window)

    def close_window(self) -> None:
        """Finish the update of the backward that ran: what the hooks held, the optimizer's own per-update bookkeeping
        (its ``step()``), the norm pass's close (``last_grad_norm``)."""
        self._queued = False
        self.wrapped.step()

    def remove(self) -> None:
        """Remove the forward hook and the norm pass's own hooks."""
        import memwrap  # the public API, as in __init__

        self._forward.remove()
        memwrap.unwrap(self.wrapped)


def _finish(ref: weakref.ref, outputs: Any) -> Any:
    norm_pass = ref()
    return outputs if norm_pass is None else norm_pass.finish_outputs(outputs)


def _on_output(t: torch.Tensor, ref: weakref.ref) -> torch.Tensor:
    if t.requires_grad:
        t.register_hook(lambda grad: _queue(ref))
    return t


def _queue(ref: weakref.ref) -> None:
    norm_pass = ref()
    if norm_pass is not None:
        norm_pass.queue_close()
