"""The optimizer step inside backward (``wrap(..., step_in_backward=True)``).

Each parameter is updated, and its gradient freed, as soon as its gradient for the window is
complete: a ``register_post_accumulate_grad_hook`` on every parameter fires right after autograd
accumulated the parameter's gradient, and during the window's last backward (the accumulation
gate knows which one that is) it steps that one parameter and sets ``p.grad = None``. The full
set of gradients therefore never lives at once when ``accumulate=1``.

The loop is unchanged: ``loss.backward(); optimizer.step(); optimizer.zero_grad()``. ``step()``
still closes the window and does the bookkeeping (update counters, wrapped schedulers stepping
once per update, the monitor); it also steps any parameter whose gradient arrived only in an
earlier micro-batch of the window (its hook did not fire in the last backward), so the update
is exactly the ordinary one.

How one parameter is stepped, exactly as the whole optimizer would step it:

* torch-optimi optimizers built with ``gradient_release=True``: optimi's own per-parameter step,
  ``optimizer.step(param=p)`` (its state keeps a per-parameter step count). Their ``state_dict``
  leaves out the group link optimi keeps in each parameter's state (it would save a copy of every
  parameter and, once loaded, detach the learning rate from the scheduler); it is restored before
  each step.
* any other ``torch.optim.Optimizer`` (AdamW, Adafactor, bitsandbytes 8-bit, Lion, ...): a view of
  the user's optimizer whose only parameter group holds that one parameter, with the live group's
  hyperparameters (a scheduler's learning rate included) and the optimizer's own ``state``, so
  ``state_dict``/``load_state_dict`` of the returned optimizer work unchanged. This is exact for
  optimizers whose update of a parameter depends only on that parameter's gradient and state
  (every elementwise optimizer, and factored ones such as Adafactor), not for ones coupling
  parameters (a global norm inside ``step``); the optimizer's own step hooks do not fire per
  parameter.

Clipping by global norm (``max_grad_norm``) and fp16 loss scaling need every gradient of the
window before the first update; with either, the window's last backward runs twice over the graph
(:mod:`memwrap.techniques.norm_pass`): a first pass takes the global norm (and finiteness) one
parameter at a time and frees each gradient, the second steps each parameter clipped and unscaled,
or skips the whole update when the norm is not finite, exactly as ``unscale_``, ``clip_grad_norm_``,
``step`` and ``GradScaler.update`` would.

What is refused at ``wrap()``, each with the fix: a closure-based optimizer (LBFGS); DDP/FSDP2
(a gradient is final only after its reduction, which the hook precedes); a torch-optimi optimizer
built without ``gradient_release=True``; an optimizer from a library not known to keep all its
state per parameter (:data:`PER_PARAMETER_FAMILIES`). A view whose step changes its group (a
per-group counter) raises at once rather than count once per parameter.

The parameters stepped are the optimizer's at each window: one made trainable after ``wrap()`` (a
layer unfrozen, ``optimizer.add_param_group(...)``) gets its hook at the next window's end, and in
the window where it first has a gradient ``step()`` steps it from ``.grad``, as the ordinary step would.

Without the norm pass (no clipping, no fp16) a non-finite gradient cannot skip the whole update
(earlier parameters have stepped by the time a later one is seen), and deciding per parameter on the host would stall the backward once per
parameter. The check stays on the device: each gradient's norm (a reduction, no temporary the size
of the gradient) flags it, a non-finite gradient is replaced by zeros (the parameter stays finite;
its momentum and weight decay still act, SGD without them leaves it unchanged), and ``step()`` reads
all flags at once (the update's one host-device sync), then warns naming how many were non-finite
(or raises with ``on_nonfinite="raise"``).

Example:
    >>> model, optimizer = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), step_in_backward=True)  # doctest: +SKIP
    >>> loss.backward()  # each parameter is updated here, its gradient freed  # doctest: +SKIP
    >>> optimizer.step(); optimizer.zero_grad()  # bookkeeping  # doctest: +SKIP
"""
from __future__ import annotations

import collections
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from memwrap.runtime.optimizer import _no_values, _total_norm
from memwrap.techniques.norm_pass import NormPass, ParamHook as _Hook, missing_engine_queries, needs_norm_pass
from memwrap.techniques.updates_in_backward import supports_norm_pass
from memwrap.integrations.accelerate import accelerated_optimizer
from memwrap.runtime.distributed import sync_control

__all__ = ["StepInBackward", "check_step_in_backward", "gradient_bytes_held", "PER_PARAMETER_FAMILIES"]


def check_step_in_backward(model: nn.Module | None, optimizer: torch.optim.Optimizer | None, opts: Any,
                           precision: Any) -> None:
    """Refuse, before anything changes, what cannot step exactly inside backward; each error names the fix.

    Example:
        >>> check_step_in_backward(model, torch.optim.LBFGS(model.parameters()), opts, precision)  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: step_in_backward=True with LBFGS: ...
    """
    if model is None or optimizer is None:
        raise TypeError("step_in_backward=True steps the optimizer from the model's backward pass: pass both. "
                        "Fix: model, optimizer = memwrap.wrap(model, optimizer, step_in_backward=True).")
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(f"step_in_backward=True with {name}: a closure-based optimizer re-evaluates the loss inside "
                         "step(), which cannot run inside backward. Fix: drop step_in_backward, or use a first-order "
                         "optimizer (AdamW, SGD, ...).")
    # Clipping (max_grad_norm) and fp16 loss scaling are not refused: the norm pass (memwrap.techniques.norm_pass)
    # takes the window's global norm in a first pass over the last micro-batch's graph before anything steps.
    missing = missing_engine_queries()
    if (opts.max_grad_norm is not None or precision.uses_scaler) and missing:
        # Private engine queries the norm pass needs (which outputs this backward reaches, which pass is running).
        raise ValueError(
            f"step_in_backward=True with {'max_grad_norm' if opts.max_grad_norm is not None else opts.precision}: the "
            f"norm pass needs torch._C.{', torch._C.'.join(missing)}, which torch {torch.__version__} lacks. Fix: "
            "use a torch that has them (memwrap is tested on 2.13), or drop step_in_backward.")

    if sync_control(model) is not None:
        raise ValueError(
            f"step_in_backward=True on a {type(model).__name__} (DDP/FSDP2): a gradient is final only after its "
            "all-reduce / reduce-scatter, and the post-accumulate hook fires before it, so each rank would step with "
            "its local gradient. Fix: drop step_in_backward under data parallelism (FSDP2 already shards the "
            "gradients), or train on one device.")
    family = type(optimizer).__module__.split(".")[0]
    if family not in PER_PARAMETER_FAMILIES:
        _refuse_optimizer_wrapper(optimizer)  # e.g. accelerate's AcceleratedOptimizer: name the real cause
        raise ValueError(
            f"step_in_backward=True with {family}.{name}: memwrap steps one parameter at a time, which equals the "
            "ordinary step only for optimizers whose update of a parameter depends on that parameter's gradient and "
            f"state alone, with no per-group counters; {family}'s optimizers are not known to be such (known: "
            f"{', '.join(sorted(PER_PARAMETER_FAMILIES))}). Fix: use one of those (torch.optim.AdamW, a bitsandbytes "
            "8-bit optimizer, Adafactor, torch-optimi with gradient_release=True, ...), or drop step_in_backward.")
    if _is_optimi(optimizer) and not optimizer.defaults.get("gradient_release"):
        raise ValueError(
            f"step_in_backward=True with optimi.{name} built without gradient_release=True: optimi steps one parameter "
            f"at a time only in that mode (it keeps a step count per parameter). Fix: optimi.{name}(..., "
            "gradient_release=True), or drop step_in_backward.")


def check_updates_in_backward(name: str | None, opts: Any, precision: Any, model: nn.Module | None = None,
                              optimizer: torch.optim.Optimizer | None = None) -> None:
    """Refuse what an optimizer that updates inside backward (LOMO, layer-wise GaLore; ``name``, or None for an
    ordinary one) cannot do exactly: it holds no gradient across micro-batches (accumulation), already steps in
    backward, and under DDP/FSDP2 would update before the gradients are averaged across ranks. Clipping
    (``max_grad_norm``) and fp16 loss scaling are not refused where the optimizer lets the norm pass drive it
    (:mod:`memwrap.techniques.updates_in_backward`): the global norm and the overflow check come from a first pass
    inside the same backward, before any update.

    Example:
        >>> check_updates_in_backward(None, opts, precision)  # an ordinary optimizer: nothing to refuse  # doctest: +SKIP
    """
    if name is None:
        return

    if model is not None and sync_control(model) is not None:
        # Measured (2 ranks, gloo): under DDP, LOMO's hooks update with each rank's own gradient before the all-reduce,
        # and the ranks' weights drift apart (0.16 after one update); under FSDP2 its hooks sit on the sharded
        # parameters, which autograd never reaches, so the update falls back to after backward and holds every
        # gradient: the optimizer's whole point is lost.
        raise ValueError(f"optimizer {name} updates each parameter inside backward(), but {type(model).__name__} "
                         "(DDP/FSDP2) averages the gradients across ranks only after that: each rank would update "
                         "with its own gradient (DDP) or the update would wait for the gradients anyway (FSDP2). Fix: "
                         "an optimizer that steps after backward (e.g. optim='sgd' or 'adamw'; FSDP2 already shards "
                         "gradients and state), or train on one device.")
    refused = [text for text, on in (
        (f"accumulate={opts.accumulate} (it keeps no gradient between micro-batches: each would update the weights)",
         opts.accumulate > 1),
        ("step_in_backward=True (it already steps in backward)", getattr(opts, "step_in_backward", False)),
    ) if on]
    if refused:
        raise ValueError(f"optimizer {name} updates each parameter inside backward(), which rules out "
                         f"{'; '.join(refused)}. Fix: drop those options (accumulate=1; clipping with max_grad_norm "
                         "and fp16 work), or choose an optimizer that steps after backward (e.g. the non-layer-wise "
                         "variant).")
    what = ", ".join(([f"max_grad_norm={opts.max_grad_norm}"] if opts.max_grad_norm is not None else [])
                     + ([f"precision={opts.precision!r}"] if precision.uses_scaler else []))
    if not what:
        return
    if model is None:
        raise ValueError(
            f"optimizer {name} with {what}: its updates inside backward are clipped or loss-scaled by the norm pass, "
            "which starts from the wrapped model's outputs, and no model was passed to wrap(). Nothing was wrapped. "
            "Fix: model, optimizer = memwrap.wrap(model, optimizer, ...).")
    if optimizer is not None and not supports_norm_pass(optimizer):
        raise ValueError(
            f"optimizer {name} updates each parameter inside backward() and does not let memwrap's norm pass drive "
            f"its updates (no update_in_backward()/updates_deferred), so {what} cannot be exact: the global norm "
            "(and whether fp16 overflowed) is known only after every update. Fix: build it with "
            "memwrap.create_optimizer (lomo, adalomo, galore_*_layerwise, apollo_adamw_layerwise have it), or drop "
            f"{'max_grad_norm' if opts.max_grad_norm is not None else 'fp16'}.")
    missing = missing_engine_queries()
    if missing:
        raise ValueError(
            f"optimizer {name} with {what}: updates made inside backward are clipped or loss-scaled by the norm pass, "
            f"which needs torch._C.{', torch._C.'.join(missing)}, missing from torch {torch.__version__}. Fix: use a "
            "torch that has them (memwrap is tested on 2.13), or drop max_grad_norm / fp16.")


def _refuse_optimizer_wrapper(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that only wraps another (accelerate's AcceleratedOptimizer, ZeroRedundancyOptimizer, ...),
    naming the wrapped one: memwrap steps each parameter through the optimizer that computes the update, and a
    wrapper's own step() (gating on accelerate's window, fp16 unscaling, sharding) cannot run per parameter."""
    inner = next((v for v in (getattr(optimizer, a, None) for a in ("optimizer", "optim", "_optimizer"))
                  if isinstance(v, torch.optim.Optimizer) and v is not optimizer), None)
    if inner is None:
        return
    name, inner_name = type(optimizer).__name__, type(inner).__name__

    if accelerated_optimizer(optimizer) is not None:
        raise ValueError(
            f"step_in_backward=True with accelerate's AcceleratedOptimizer around {inner_name}: memwrap steps one "
            f"parameter at a time through the optimizer that computes the update ({inner_name}), and "
            "AcceleratedOptimizer.step() cannot run per parameter (it steps only when accelerate's accumulation "
            "window closes, and unscales fp16 gradients). Fix: wrap() before accelerator.prepare(): model, optimizer "
            "= memwrap.wrap(model, optimizer, step_in_backward=True), then model, optimizer = "
            "accelerator.prepare(model, optimizer), with Accelerator(gradient_accumulation_steps=1) (memwrap's "
            "accumulate= accumulates instead) and mixed_precision 'no' or 'bf16'.")
    raise ValueError(
        f"step_in_backward=True with {name}, a wrapper around {inner_name}: memwrap steps one parameter at a time "
        f"through the optimizer that computes the update, and {name}.step() (which may gate, scale or shard the "
        f"step) cannot run per parameter. Fix: wrap the optimizer it holds ({inner_name}) and apply {name} outside "
        "memwrap, or drop step_in_backward.")


# Libraries whose optimizers keep all state per parameter (none counts steps per group or couples parameters inside
# step(), LBFGS aside): stepping one parameter at a time is exactly their ordinary step.
PER_PARAMETER_FAMILIES = frozenset({"torch", "bitsandbytes", "transformers", "optimi", "torchao"})


def _is_optimi(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.split(".")[0] == "optimi"


class StepInBackward:
    """Steps each parameter of ``wrapped``'s optimizer inside backward; see the module docstring.

    Attached by ``wrap()`` as ``optimizer.step_in_backward``; ``memwrap.unwrap(optimizer)`` removes
    the hooks. ``partial_windows`` counts windows in which a parameter had a non-finite gradient.

    The hooks on the parameters hold this object weakly: a parameter must not keep its optimizer
    (and through it the model) alive, and once the wrapped optimizer is dropped the hooks go too.

    Example:
        >>> optimizer.step_in_backward.stepped_this_window  # doctest: +SKIP
        0
    """

    def __init__(self, wrapped: Any, model: nn.Module | None = None):
        self.wrapped = wrapped
        self.optimizer = wrapped.optimizer
        self.gate = wrapped.gate
        self.partial_windows = 0
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._stepped: set[int] = set()
        self._flags: list[tuple[int, torch.Tensor]] = []  # (parameter id, gradient finite?) of this window, on device
        self._task: int | None = None  # the backward pass (graph task) that stepped parameters in this window
        self._steppers: dict[int, Any] = {}
        self._hooks: dict[int, Any] = {}  # parameter id -> handle of its post-accumulate hook
        self._handles: list[Any] = []
        self._optimi = _is_optimi(self.optimizer)
        if self._optimi:
            self._handles.append(self.optimizer.register_state_dict_post_hook(_drop_group_links))
            for state in self.optimizer.state.values():  # linked again before each step (_OptimiStep)
                state.pop("group", None)
        self._hook = _Hook(weakref.ref(self))
        # Clipping or fp16: the window's last backward runs a first pass for the global norm (see norm_pass).
        self.norm: NormPass | None = None
        if needs_norm_pass(wrapped.max_grad_norm, wrapped.scaler):
            self.norm = NormPass(wrapped, self._names)
            self.gate.norm_pass = weakref.ref(self.norm)
        self.follow_param_groups()
        # The wrapped model's output hooks call this at the start of each backward pass (see check_backward_start).
        self.gate.backward_watch = weakref.WeakMethod(self.check_backward_start)
        weakref.finalize(self, _remove_handles, self._handles, self._hooks)

    @property
    def stepped_this_window(self) -> int:
        return len(self._stepped)

    def follow_param_groups(self) -> None:
        """Hook every parameter the optimizer holds that requires grad now (called at each window's end).

        Parameters that became trainable after ``wrap()`` (a layer unfrozen, ``add_param_group``) get their
        hook here; in the window where that happened their gradient is stepped by ``finish_window`` instead.
        A parameter that left the optimizer is no longer stepped.
        """
        current = {id(p): (index, p) for index, group in enumerate(self.optimizer.param_groups) for p in group["params"]}
        for pid in [pid for pid in self._steppers if pid not in current]:
            del self._steppers[pid]
            handle = self._hooks.pop(pid, None)
            if handle is not None:
                handle.remove()
        added = False
        for pid, (index, p) in current.items():
            stepper = self._steppers.get(pid)
            if stepper is None or stepper.index != index:
                self._steppers[pid] = (_OptimiStep if self._optimi else _ViewStep)(self.optimizer, index, p)
                added = True
            if pid not in self._hooks and p.requires_grad:
                self._hooks[pid] = p.register_post_accumulate_grad_hook(self._hook)
        if added and not self._optimi and hasattr(self.optimizer, "check_overrides"):
            # bitsandbytes resolves per-module overrides (32-bit embedding state) at its first step; that step
            # never runs on the whole optimizer here, so resolve them now, into its per-parameter table.
            self.optimizer.check_overrides()

    def check_backward_start(self) -> None:
        """Refuse a second backward pass in the window's last micro-batch once parameters stepped in an earlier one.

        Called from the wrapped model's output hooks, which run before any node of the model's graph: memwrap's
        message comes before torch's "modified by an inplace operation" (a saved weight changed by its step).
        """
        if not self.gate.closes_window():
            return
        task = _graph_task_id()
        if task < 0:  # not inside a backward pass (memwrap.backward marks the micro-batch before it starts one)
            return
        if self._stepped and task != self._task:
            raise RuntimeError(
                f"step_in_backward: a second backward pass through the wrapped model's outputs in the window's last "
                f"micro-batch, after {len(self._stepped)} parameter(s) were updated inside the first: its gradients "
                "would reach parameters that already changed (their update used only the first backward's gradient). "
                "Fix: one backward per micro-batch (sum the losses first: (loss_a + loss_b).backward()), or "
                "step_in_backward=False.")
        if not self._stepped:
            self._task = task

    def _on_gradient(self, param: torch.Tensor) -> None:
        if not self.gate.closes_window() or id(param) not in self._steppers:
            return  # an earlier micro-batch of the window (the gradient keeps accumulating), or not the optimizer's
        norm = self.norm
        if norm is not None:
            if norm.running:  # the first pass: this parameter's window gradient gives its norm, then is freed
                norm.contribute(param)
                return
            if not norm.ready:
                # No first pass ran before this gradient (the backward does not go through the model's outputs):
                # keep it; step() takes the norm from the gradients as they are and steps them (the ordinary clipped
                # step). A gradient that overtakes the outputs of this micro-batch is refused there.
                norm.hold(param)
                return
        if id(param) in self._stepped:
            raise RuntimeError(
                f"step_in_backward: parameter {self._name(param)} got a second gradient in the window's last "
                "micro-batch after it had been updated (two backward passes before optimizer.step()?). Its update "
                "used only the first. Fix: one backward per micro-batch (sum the losses first), or step_in_backward=False.")
        self._step(param)

    def _step(self, param: torch.Tensor) -> None:
        if not self._stepped:
            # The backward that steps first in this window (not necessarily the first to reach the outputs: the norm
            # pass's first pass steps nothing); a parameter reached before the outputs (a loss term on the parameter
            # itself) steps before check_backward_start sees this backward, which is not a second one.
            task = _graph_task_id()
            self._task = task if task >= 0 else None
        self._stepped.add(id(param))
        grad = param.grad
        if grad is None:
            return
        if self.norm is not None:
            with torch.no_grad():
                if self.norm.finite:  # else the whole update is skipped: the gradient is only freed
                    self.norm.prepare(grad)  # unscaled (fp16) and clipped, as unscale_ and clip_grad_norm_ do
                    self._steppers[id(param)].step()
            param.grad = None
            return
        with torch.no_grad():
            # Checked on the device, without waiting for it: a norm is a reduction (no temporary the size of the
            # gradient), and a non-finite gradient is replaced by zeros so the parameter stays finite. finish_window
            # reads all flags at once, the step's one host-device sync. The same ops run on the planner's fake
            # tensors, so their memory is traced.
            finite = torch.isfinite(_total_norm([grad]) if grad.is_sparse else torch.linalg.vector_norm(grad))
            (grad._values() if grad.is_sparse else grad).masked_fill_(finite.logical_not(), 0)
            self._flags.append((id(param), finite))
            self._steppers[id(param)].step()
        param.grad = None  # freed: the point of stepping here

    def finish_window(self) -> float | None:
        """Called by ``optimizer.step()`` at the window's end: step what the hooks did not, report, reset.

        Returns None (the update was applied), like ``WrappedOptimizer._update``; raises
        ``FloatingPointError`` with ``on_nonfinite="raise"`` when a gradient was non-finite.
        """
        self.follow_param_groups()
        if self.norm is not None:
            self.norm.ensure_ready()  # a window whose last backward ran no first pass takes its norm here
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None and id(p) not in self._stepped:
                    self._step(p)  # its gradient came from earlier micro-batches only, or it had no hook yet
        flags, self._flags = self._flags, []
        self._stepped.clear()
        self._task = None
        # An LR scheduler built on the inner optimizer checks that its step() ran before the scheduler's; it did, one
        # parameter at a time, through views that torch's step counter does not see.
        self.optimizer._opt_called = True
        if self.norm is not None:
            # The norm pass decided for the whole window: applied, or skipped (counted by WrappedOptimizer.step as
            # the ordinary step's skip); the GradScaler updates as after unscale_.
            return self.norm.finish()
        left_out = _non_finite(flags)
        if left_out:
            self.partial_windows += 1
            message = (f"step_in_backward: {len(left_out)} parameter(s) had non-finite gradients (e.g. "
                       f"{self._names.get(left_out[0], 'of the optimizer')!r}) and were stepped with a zero gradient "
                       "instead (their momentum and weight decay still acted); the others were updated inside "
                       "backward before these gradients existed. Fix: look for inf/NaN in the loss or the data, or "
                       "lower the learning rate.")
            if self.wrapped.on_nonfinite == "raise":
                raise FloatingPointError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)
        return None

    def remove(self) -> None:
        """Remove the hooks: the optimizer steps the ordinary way again."""
        _remove_handles(self._handles, self._hooks)
        self._steppers.clear()
        if self.norm is not None and self.gate.__dict__.get("norm_pass") is not None \
                and self.gate.norm_pass() is self.norm:
            self.gate.norm_pass = None
        if self.gate.__dict__.get("backward_watch") is not None and self.gate.backward_watch() == self.check_backward_start:
            self.gate.backward_watch = None

    def _name(self, param: torch.Tensor) -> str:
        return repr(self._names.get(id(param), f"of shape {tuple(param.shape)}"))


def _graph_task_id() -> int:
    """The running backward pass's id (-1 outside one): torch's own, as torch.utils.checkpoint reads it."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1  # a torch without it: the check in _on_gradient still holds


def _remove_handles(handles: list, hooks: dict) -> None:
    for handle in [*handles, *hooks.values()]:
        handle.remove()
    handles.clear()
    hooks.clear()


def _non_finite(flags: list[tuple[int, torch.Tensor]]) -> list[int]:
    """Ids of the parameters whose flag says non-finite: one host read per device (fake/meta flags have no values)."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for pid, flag in flags:
        by_device.setdefault(flag.device, []).append((pid, flag))
    bad = []
    for items in by_device.values():
        stacked = torch.stack([flag for _, flag in items])
        if _no_values(stacked) or bool(stacked.all()):
            continue
        bad += [pid for (pid, _), ok in zip(items, stacked.tolist()) if not ok]  # only in a window that went wrong
    return bad


class _ViewStep:
    """Steps one parameter through a view of the optimizer: same class, state and settings, one one-parameter group."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, param: torch.Tensor):
        self.optimizer, self.index, self.param = optimizer, index, param
        view = object.__new__(type(optimizer))
        # Instance attributes that shadow a method are left out: an LR scheduler replaces optimizer.step on the
        # instance with a wrapper bound to the whole optimizer, which the view must not call.
        view.__dict__.update({k: v for k, v in optimizer.__dict__.items()
                              if not (callable(v) and hasattr(type(optimizer), k))})
        # The inner optimizer's step hooks run once per update, not once per parameter.
        view._optimizer_step_pre_hooks = collections.OrderedDict()
        view._optimizer_step_post_hooks = collections.OrderedDict()
        mng = getattr(optimizer, "mng", None)
        if mng is not None and hasattr(mng, "index2config"):
            # bitsandbytes keeps per-parameter overrides in a process-wide table keyed by (group, index) positions,
            # which a one-parameter view would read as the first parameter's. The view reads them by parameter id.
            view.mng = _ById(mng)
        self.view = view

    def step(self) -> None:
        group = self.optimizer.param_groups[self.index]  # the live group: load_state_dict and schedulers change it
        view_group = {**group, "params": [self.param]}
        self.view.param_groups = [view_group]
        self.view.state = self.optimizer.state
        self.view.step()
        changed = [k for k, v in view_group.items() if k != "params" and (k not in group or group[k] is not v)]
        if changed:  # a per-group counter: stepping per parameter would count it once per parameter
            raise RuntimeError(
                f"step_in_backward: {type(self.optimizer).__name__}.step() changed its parameter group's {changed}, so "
                "it keeps per-group state and cannot be stepped one parameter at a time exactly. Fix: "
                "step_in_backward=False for this optimizer.")


class _ById:
    """bitsandbytes' override table as seen by a one-parameter view: by parameter id only."""

    def __init__(self, mng: Any):
        self.pid2config = mng.pid2config
        self.index2config: dict = {}
        self.module_weight_config_triple: list = []


class _OptimiStep:
    """Steps one parameter with torch-optimi's own per-parameter step (``gradient_release=True``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int, param: torch.Tensor):
        self.optimizer, self.index, self.param = optimizer, index, param

    def step(self) -> None:
        # optimi links each parameter's state to its group; a loaded state_dict has no link (see _drop_group_links).
        self.optimizer.state[self.param]["group"] = self.optimizer.param_groups[self.index]
        self.optimizer.step(param=self.param)


def _drop_group_links(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    # torch's state_dict holds the live per-parameter dicts: copy them, never edit them.
    state = {k: {kk: vv for kk, vv in v.items() if kk != "group"} for k, v in state_dict["state"].items()}
    return {**state_dict, "state": state}


def gradient_bytes_held(grad_bytes: list[int], accumulate: int) -> int:
    """Peak bytes of parameter gradients alive at once under ``step_in_backward=True`` (for the planner).

    With ``accumulate=1`` a gradient lives from its accumulation to its parameter's step, which the
    hook runs at once: at most one parameter's gradient exists at a time (the largest). With
    ``accumulate>1`` the gradients of the whole model accumulate across the window as without
    step_in_backward and all live into the window's last backward, which frees them one by one: the
    bound is all of them (a peak inside the last backward sees fewer; the planner's trace measures
    that). In both cases the optimizer step's temporaries are one parameter's, not all parameters'.

    Example:
        >>> gradient_bytes_held([400, 1600, 40], accumulate=1), gradient_bytes_held([400, 1600, 40], accumulate=4)
        (1600, 2040)
    """
    if not grad_bytes:
        return 0
    return max(grad_bytes) if accumulate == 1 else sum(grad_bytes)


# --- wrap()'s checks (memwrap.validation runs them with the other techniques'; they only read) ----------------

def check_wrap(call) -> None:
    """Refuse what an optimizer that updates inside backward (``optim=`` LOMO, layer-wise GaLore/APOLLO, or such an
    optimizer passed in) cannot do with the other options; see :func:`check_updates_in_backward`.

    Example:
        >>> from memwrap.validation import check_wrap as check_call
        >>> net = nn.Linear(2, 2)
        >>> check_call((net, torch.optim.SGD(net.parameters(), lr=0.1)), {"step_in_backward": True}).opts.step_in_backward
        True
    """
    spec, optimizer = call.optim_spec, call.optimizer
    if spec is not None:
        check_updates_in_backward(spec.name if spec.updates_in_backward else None, call.opts, call.precision, call.model)
    elif optimizer is not None and getattr(optimizer, "updates_in_backward", False):
        check_updates_in_backward(type(optimizer).__name__, call.opts, call.precision, call.model, optimizer)


def check_stepping(call, optimizer: torch.optim.Optimizer) -> None:
    """With ``step_in_backward=True``: what the optimizer that will step (after ``optim=`` conversion) must allow;
    see :func:`check_step_in_backward`."""
    if call.opts.step_in_backward:
        check_step_in_backward(call.model, optimizer, call.opts, call.precision)
    elif call.optim_spec is not None and getattr(optimizer, "updates_in_backward", False):
        # optim= built it: the optimizer that will update must let the norm pass drive it (memwrap's plugins do)
        check_updates_in_backward(call.optim_spec.name, call.opts, call.precision, call.model, optimizer)
