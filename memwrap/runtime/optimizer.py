"""WrappedOptimizer: a real ``torch.optim.Optimizer`` whose step is gated by the accumulation window.

``step()`` on a micro-batch that does not close the window only counts it. At the window's end
it unscales (fp16), clips, checks for non-finite gradients, then steps the inner optimizer or
skips the update (counted, reported), and updates the GradScaler.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from memwrap.errors import refuse_unwrapped
from memwrap.precision.loss_scale import SCALE_FLOOR
from memwrap.runtime.gate import AccumulationGate
from memwrap.state.checks import check_optimizer_state, class_name
from memwrap.runtime.window_loss import WindowLoss
from memwrap.integrations.accelerate import check_outer_accumulation

__all__ = ["WrappedOptimizer", "check_params_in_model", "check_sparse_clipping"]


def check_params_in_model(model: torch.nn.Module, params: list[torch.Tensor]) -> None:
    """Refuse optimizer parameters outside the wrapped model: no output hook weights their gradients.

    Example:
        >>> check_params_in_model(torch.nn.Linear(2, 2), [torch.zeros(1, requires_grad=True)])
        Traceback (most recent call last):
        ...
        ValueError: the optimizer holds 1 parameter(s) (e.g. shape (1,)) that are not in the model passed to wrap(). ...
    """
    in_model = {id(p) for p in model.parameters()}
    stray = [p for p in params if id(p) not in in_model]
    if stray:
        raise ValueError(
            f"the optimizer holds {len(stray)} parameter(s) (e.g. shape {tuple(stray[0].shape)}) that are not in "
            "the model passed to wrap(). Their gradients would not be weighted per micro-batch. Fix: build the "
            "optimizer from this model's parameters (a module trained alongside belongs inside the wrapped model)."
        )


def _refuse_outer_accumulation(wrapped: WrappedOptimizer) -> None:
    """Refuse accumulation counted twice: memwrap's and an outer loop's (accelerate, Hugging Face Trainer).

    Read from the objects around this optimizer (memwrap.integrations.accelerate), never from stack frames: an
    ``AcceleratedOptimizer`` it wraps or that wraps it, a Trainer holding either. accelerate's process-wide state is
    read only through such an object, so a plain loop after a Trainer run is not refused.
    """
    stepping_in_backward = wrapped.__dict__.get("step_in_backward") is not None
    if wrapped.gate.accumulate == 1 and not stepping_in_backward:
        return

    check_outer_accumulation(wrapped.optimizer, wrapped.gate.accumulate, stepping_in_backward, wrapper=wrapped)


def _no_values(t: torch.Tensor) -> bool:
    """Whether ``t`` has no data to read on the host: a fake tensor (the planner's trace) or one on ``meta``."""
    return t.is_meta or is_fake(t)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients, as torch's ``get_total_norm``, sparse gradients included.

    ``foreach`` is left to torch: its fused kernels where the device has them (CPU, CUDA), the per-tensor norm
    elsewhere (``meta``), which ``foreach=True`` would refuse. torch has no norm for sparse tensors: theirs is the
    norm of their coalesced values.
    """
    sparse = [g for g in grads if g.is_sparse]
    if not sparse:
        return torch.nn.utils.get_total_norm(grads)
    dense = [g for g in grads if not g.is_sparse]
    device = grads[0].device
    norms = [torch.linalg.vector_norm(g.coalesce()._values()).to(device) for g in sparse]
    if dense:
        norms.append(torch.nn.utils.get_total_norm(dense).to(device))
    return torch.linalg.vector_norm(torch.stack(norms))


def check_sparse_clipping(model: torch.nn.Module | None, max_grad_norm: float | None) -> None:
    """Refuse clipping a model whose modules make sparse gradients (``nn.Embedding(sparse=True)``, ``EmbeddingBag``).

    torch's ``clip_grad_norm_`` has no sparse kernel, so the plain loop fails at its first clip; ``wrap()`` says so
    before anything changes. A sparse gradient from elsewhere is refused at the step that meets it.

    Example:
        >>> check_sparse_clipping(torch.nn.Embedding(4, 2, sparse=True), 1.0)
        Traceback (most recent call last):
        ...
        ValueError: max_grad_norm=1.0 with sparse gradients (Embedding(4, 2, sparse=True)): ...
    """
    if model is None or max_grad_norm is None:
        return
    sparse = next((m for m in model.modules() if getattr(m, "sparse", False) is True
                   and isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))), None)
    if sparse is not None:
        raise ValueError(_sparse_clipping_message(max_grad_norm, repr(sparse)))


def _refuse_sparse_clipping(params: list[torch.Tensor], max_grad_norm: float) -> None:
    sparse = next((p for p in params if p.grad.is_sparse), None)
    if sparse is not None:
        raise ValueError(_sparse_clipping_message(max_grad_norm, f"a parameter of shape {tuple(sparse.shape)}")
                         + " This window's update was not applied.")


def _sparse_clipping_message(max_grad_norm: float, what: str) -> str:
    return (f"max_grad_norm={max_grad_norm} with sparse gradients ({what}): torch's clip_grad_norm_ has no kernel for "
            "sparse tensors, so clipping by global norm cannot run (a plain torch loop fails the same way). Fix: drop "
            "max_grad_norm (memwrap trains sparse gradients without clipping), or build the embedding with "
            "sparse=False.")


# Frames a warning must not point into: memwrap's own, and torch.optim's (an LR scheduler built on the
# wrapped optimizer replaces its step() with a wrapper defined in torch/optim/lr_scheduler.py).
_INTERNAL_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (sys.modules["memwrap"], torch.optim))


def _user_stacklevel() -> int:
    """``stacklevel`` for a ``warnings.warn`` made by the caller: the first frame outside memwrap and torch.optim."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL_DIRS):
        frame, level = frame.f_back, level + 1
    return level


class WrappedOptimizer(torch.optim.Optimizer):
    """Gate ``step()``/``zero_grad()`` of ``optimizer`` on the accumulation window.

    Shares ``param_groups``, ``state`` and ``defaults`` with the inner optimizer, so LR
    schedulers built on either object change the same learning rates.

    Example:
        >>> import memwrap, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> model, opt = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step(); opt.did_update
        False
    """

    # Not calling Optimizer.__init__ on purpose: it would rebuild param_groups instead of sharing them.
    def __init__(self, optimizer: torch.optim.Optimizer, gate: AccumulationGate, scaler: torch.amp.GradScaler,
                 max_grad_norm: float | None = None, on_nonfinite: str = "skip", monitor: Any = None,
                 model: torch.nn.Module | None = None):
        self.optimizer = optimizer
        self._model = model  # parameter groups added later must belong to it too
        self.gate = gate
        self.scaler = scaler
        self.max_grad_norm = max_grad_norm
        self.on_nonfinite = on_nonfinite
        self.monitor = monitor
        self.did_update = False
        self.step_was_skipped = False
        self.updates = 0
        self.skipped = 0
        self._consecutive_skips = 0  # skipped windows in a row (fp16 raises only at the scale floor)
        # The last window's gradient norm as a device tensor: read (one sync) only when someone asks.
        self._grad_norm: torch.Tensor | float | None = None
        self._window_lrs: list[float] | None = None
        self._lr_warned = False
        self._no_backward_warned = False
        self._outer_checked = False
        # The window's loss for logging; the wrapped model records outputs.loss into it (see window_loss).
        self.loss_log = WindowLoss(gate)

    # --- shared state -----------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        model = self.__dict__.get("_model")
        if model is not None:
            params = param_group["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            param_group = {**param_group, "params": params}  # a generator would be used up by the check
            check_params_in_model(model, params)
        self.optimizer.add_param_group(param_group)

    @property
    def sync_gradients(self) -> bool:
        """Whether the micro-batch in progress closes the window, so its step() updates (Accelerate's name)."""
        return self.gate.sync_gradients

    # Step hooks belong on the inner optimizer: its step() runs exactly once per real update.
    def register_step_pre_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Any) -> Any:
        return self.optimizer.register_step_post_hook(hook)

    def register_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Any, prepend: bool = False) -> Any:
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __repr__(self) -> str:
        return f"WrappedOptimizer(accumulate={self.gate.accumulate}, {self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        # Without the model: pickling or deep-copying the optimizer must not copy the model with it.
        return {k: v for k, v in self.__dict__.items() if k != "_model"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    # --- the gated step ---------------------------------------------------------------
    def step(self, closure: Any = None) -> Any:
        """Count a micro-batch; at the window's end, update the parameters (or skip a non-finite update)."""
        if closure is not None:
            raise ValueError(
                "memwrap's wrapped optimizer does not take a closure: with accumulation, the forward "
                "and backward passes belong to your loop. Call optimizer.step() without arguments."
            )
        self._refuse_if_unwrapped("step()")
        # Both describe this call: one that closes no window neither updated nor skipped an update.
        self.did_update = self.step_was_skipped = False
        if not self._outer_checked:
            self._outer_checked = True
            _refuse_outer_accumulation(self)
        self._check_backward_seen()
        first_in_window = self.gate.micro_step == 0  # read before tick(): a one-batch window is first and last
        closes = self.gate.tick()
        self._check_lr_unchanged(first_in_window)
        if not closes:
            return None
        self.loss_log.close()
        used_scale = self._update()
        self.step_was_skipped = used_scale is not None
        self.did_update = not self.step_was_skipped
        if self.did_update:
            self.updates += 1
            self._consecutive_skips = 0
            if self.monitor is not None:
                self.monitor.on_update(self.updates)
        else:
            self.skipped += 1
            self._consecutive_skips += 1
            if self.on_nonfinite == "raise" and (not self.scaler.is_enabled() or used_scale <= SCALE_FLOOR):
                self._raise_nonfinite(used_scale)
        return None

    @property
    def window_loss(self) -> float | None:
        """Mean loss of the last closed window (what Trainer logs), weighted like its gradient.

        The micro-batches' mean, or with ``count_items`` the mean over the window's items. Losses the model
        returns as ``outputs.loss`` (Hugging Face) or ``outputs["loss"]`` are recorded by themselves; record a
        loss computed outside the model with :meth:`record_loss`. None when nothing was recorded.

        Example:
            >>> import memwrap, torch
            >>> net = torch.nn.Linear(2, 1)
            >>> model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
            >>> for target in (1.0, 3.0):
            ...     loss = (model(torch.zeros(1, 2)) * 0 + target).sum(); loss.backward()
            ...     opt.record_loss(loss); opt.step(); opt.zero_grad()
            >>> opt.window_loss
            2.0
        """
        return self.loss_log.value

    def record_loss(self, loss: torch.Tensor | float) -> None:
        """Record this micro-batch's loss for :attr:`window_loss`; call it once per micro-batch before ``step()``.

        Needed only when the loss is computed outside the model (``loss = loss_fn(model(x), y)``); it replaces
        what the model recorded for the same micro-batch, so nothing is counted twice. No device sync.
        """
        self.loss_log.record(loss)

    def _update(self) -> float | None:
        """Step the inner optimizer; on a non-finite window return the loss scale it was computed with (1.0
        without loss scaling) instead, or None when the update was applied."""
        if self.__dict__.get("step_in_backward") is not None:  # the parameters stepped inside backward
            return self.step_in_backward.finish_window()
        if self.__dict__.get("norm_in_backward") is not None:  # LOMO / layer-wise: clipped, unscaled in backward
            return self.norm_in_backward.finish_window()
        scaler = self.scaler
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.max_grad_norm is not None:  # before unscale_: a refused step leaves the scaler as it was
            _refuse_sparse_clipping(params, self.max_grad_norm)
        if scaler.is_enabled():
            scaler.unscale_(self.optimizer)
        finite = self._clip_and_check(params)
        used_scale = None if finite else (scaler.get_scale() if scaler.is_enabled() else 1.0)
        try:
            if finite:
                # Our norm check sees exactly what GradScaler's inf check saw after unscale_, so the inner
                # step is called directly instead of through scaler.step (which would read the flag again).
                self.optimizer.step()
        finally:
            # Also when the inner step raised, and before on_nonfinite raises: update() backs off or grows the
            # scale and clears the per-window unscale_ record, without which every later unscale_ would fail.
            # A no-op when the scaler is disabled.
            scaler.update()
        return used_scale

    def _raise_nonfinite(self, used_scale: float) -> None:
        # The loop's zero_grad() after step() will not run: clear the window here, or every later window would
        # accumulate onto these inf/NaN gradients and raise again. The gate already closed the window.
        self.optimizer.zero_grad(set_to_none=True)
        window = self.updates + self.skipped
        why = ""
        if self.scaler.is_enabled():
            why = (f" This window's loss scale {used_scale:g} is at or below the floor {SCALE_FLOOR:g} after "
                   f"{self._consecutive_skips} consecutive skipped windows: backing off the scale cannot absorb this overflow.")
        raise FloatingPointError(
            f"non-finite gradient in accumulation window {window} (grad norm {self.last_grad_norm}); its update was not "
            f"applied and its gradients were cleared, so the run can go on ({self.updates} updates applied, "
            f"{self.skipped} skipped so far).{why} Fix: look for inf/NaN in the loss or the data, lower the learning "
            "rate, use precision='bf16' or 'fp32', or pass on_nonfinite='skip' to skip such updates."
        )

    @property
    def last_grad_norm(self) -> float | None:
        """The last closed window's gradient norm (unscaled, before clipping); None before the first window.

        Kept on the device until read: reading it is one host-device sync, and a run that never reads
        it pays none. None also when the gradients carry no values (fake or meta tensors).

        Example:
            >>> import memwrap, torch
            >>> net = torch.nn.Linear(2, 1, bias=False)
            >>> model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
            >>> model(torch.tensor([[3.0, 4.0]])).sum().backward(); opt.step()
            >>> opt.last_grad_norm
            5.0
        """
        norm = self._grad_norm
        if isinstance(norm, torch.Tensor):
            norm = self._grad_norm = None if _no_values(norm) else float(norm)
        return norm

    def _clip_and_check(self, params: list[torch.Tensor]) -> bool:
        # One norm over the (unscaled) gradients serves clipping, the non-finite check and last_grad_norm; the
        # check is this step's one host-device sync (the norm itself stays on the device until it is read).
        if not params:
            self._grad_norm = 0.0
            return True
        if self.max_grad_norm is not None:  # no sparse gradient here (_update refused them)
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        else:
            norm = _total_norm([p.grad for p in params])
        full_tensor = getattr(norm, "full_tensor", None)
        if full_tensor is not None:
            # FSDP2: a DTensor norm of the shards. Reduced here, where every rank steps, so that reading
            # last_grad_norm later (on rank 0 only, for logging) starts no collective of its own.
            norm = full_tensor()
        self._grad_norm = norm
        if _no_values(norm):
            # The planner traces this very step on fake tensors (parameters on meta likewise), which carry no values
            # to check: only this 0-d read is skipped, the norm's memory is traced.
            return True
        return bool(torch.isfinite(norm))

    def _check_backward_seen(self) -> None:
        # Every step() counts a micro-batch; one without a backward through the wrapped model (step()
        # called twice per batch) would silently shorten the window.
        # Under fp16 the hooks also apply the loss scale, so a gradient that bypassed them is wrong even
        # without accumulation.
        seen, self.gate.backward_seen = self.gate.backward_seen, False
        if seen or self._no_backward_warned or (self.gate.accumulate == 1 and not self.scaler.is_enabled()):
            return
        self._no_backward_warned = True
        warnings.warn(
            "optimizer.step() was called without a backward pass through the wrapped model's outputs since the "
            "previous step(), so this micro-batch's gradients were not weighted (nor loss-scaled in fp16). Causes: "
            "step() called twice per batch; a loss from tensors that did not come out of model(...) (another method "
            "of the model, an output type memwrap cannot look into); an output modified in place before the loss. "
            "Fix: call optimizer.step() once per micro-batch after loss.backward(), compute the loss from model(...)'s "
            "outputs without in-place edits, or call memwrap.backward(loss, model).",
            stacklevel=_user_stacklevel(),
        )

    def _check_lr_unchanged(self, first_in_window: bool) -> None:
        # LRs are recorded after the window's first micro-batch (a wrapped scheduler has stepped by
        # then) and compared at every later step() of the window, the closing one included.
        if self._lr_warned or self.gate.accumulate == 1:
            return
        lrs = [group["lr"] for group in self.param_groups]
        if first_in_window or self._window_lrs is None:
            self._window_lrs = lrs
            return
        if lrs != self._window_lrs:
            self._lr_warned = True
            warnings.warn(
                "the learning rate changed inside an accumulation window: an LR scheduler is stepping every "
                "micro-batch instead of every update. Fix: pass it to memwrap.wrap(model, optimizer, scheduler, ...) "
                "(or wrap it: scheduler = memwrap.wrap(scheduler)) so it steps once per real update.",
                stacklevel=_user_stacklevel(),
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients only at a window boundary; inside a window they are still accumulating."""
        self._refuse_if_unwrapped("zero_grad()")
        if self.gate.micro_step == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def _refuse_if_unwrapped(self, call: str) -> None:
        if self.__dict__.get("_unwrapped"):  # memwrap.unwrap(optimizer) undid what wrap() set up
            refuse_unwrapped(self, call)

    # --- resume -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Inner optimizer, GradScaler, accumulation position, counters and, mid-window, the partial gradients."""
        grads = None
        if self.gate.micro_step:
            grads = [p.grad.detach().clone() if p.grad is not None else None
                     for g in self.param_groups for p in g["params"]]
        return {
            "optimizer": self.optimizer.state_dict(),
            "optimizer_class": class_name(self.optimizer),  # lets a load refuse another optimizer's state up front
            "scaler": self.scaler.state_dict(),
            "gate": self.gate.state_dict(),
            "counters": {"updates": self.updates, "skipped": self.skipped, "consecutive_skipped": self._consecutive_skips},
            "accumulated_grads": grads,
            "monitor": self.monitor.state_dict() if self.monitor is not None and hasattr(self.monitor, "state_dict") else None,
            "window_loss": self.loss_log.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`; a state that does not fit this run is refused before anything changes."""
        check_optimizer_state(self, state_dict)
        # The inner optimizer first: torch validates before it mutates, and nothing after it can fail.
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if state_dict.get("scaler"):
            self.scaler.load_state_dict(state_dict["scaler"])
        self.gate.load_state_dict(state_dict["gate"])
        self.updates = state_dict["counters"]["updates"]
        self.skipped = state_dict["counters"]["skipped"]
        self._consecutive_skips = state_dict["counters"].get("consecutive_skipped", 0)
        if state_dict.get("window_loss") is not None:
            self.loss_log.load_state_dict(state_dict["window_loss"])
        if state_dict.get("monitor") is not None and self.monitor is not None:
            self.monitor.load_state_dict(state_dict["monitor"])
        grads = state_dict.get("accumulated_grads")
        if grads is not None:
            params = [p for g in self.param_groups for p in g["params"]]
            for p, grad in zip(params, grads, strict=True):
                p.grad = None if grad is None else grad.to(device=p.device, dtype=p.dtype).clone()


def check_wrap(call) -> None:
    """``wrap()``'s check of ``max_grad_norm=`` against the model (run by :mod:`memwrap.validation`):
    :func:`check_sparse_clipping`."""
    check_sparse_clipping(call.model, call.opts.max_grad_norm)
