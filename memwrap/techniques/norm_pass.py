"""The norm pass: exact clipping by global norm and fp16 loss scaling with the optimizer step inside backward.

Clipping by global norm needs every gradient of the window before the first update, and so does
fp16's non-finite check, which skips the whole update. With ``wrap(..., step_in_backward=True)``
and ``max_grad_norm`` (or ``precision="fp16"``) the window's last backward therefore runs twice
over the graph, inside the user's single ``loss.backward()``:

1. **first pass**: where the gradients of the model's outputs are all known (a hook on each output
   of the window's last micro-batch; the last one to receive its gradient starts it), a re-entrant
   ``torch.autograd.backward`` from those outputs with ``retain_graph=True``. Each parameter's
   gradient, as the window will hold it (the earlier micro-batches' accumulated gradient plus this
   one's), gives its norm (after unscaling in fp16, with GradScaler's own unscale kernel and its
   ``found_inf``) and is then freed; the accumulated gradient is put back. At most one parameter's
   window gradient is alive at a time. The total is formed exactly as ``clip_grad_norm_`` forms it
   (per-tensor norms with torch's foreach/per-tensor choice, stacked in parameter order grouped by
   device and dtype, then their 2-norm), and read once on the host: the update's one sync.
2. **second pass**: the user's backward goes on. Each parameter's gradient is unscaled, multiplied
   by ``clamp(max_grad_norm / (total + 1e-6), max=1)`` (torch's clip coefficient, with torch's
   ``_foreach_mul_``/``mul_`` choice) and stepped; when the total is not finite nothing steps (the
   gradients are freed), ``step()`` counts a skipped update and the GradScaler updates from the
   first pass's ``found_inf`` exactly as ``scaler.update()`` after ``unscale_`` would.

``memwrap.backward(loss, model)`` runs the two passes from the loss itself (a loss with terms that
bypass the outputs is covered there). With a plain ``loss.backward()``, a loss that reaches a
parameter other than through the model's outputs (a penalty computed from the parameters, also on
one the outputs reach) is found before the first pass, from the running backward's roots
(:mod:`memwrap.runtime.loss_graph`), and refused with that fix. Where those roots cannot be read (a
backward started on the engine directly), a parameter the outputs do not reach is still found (its
gradient arrives before the first pass, or the first pass misses it). A loss over several forward
calls of the model in the window's last micro-batch is refused at its backward (autograd runs and
frees the later call's graph before the earlier call's outputs get their gradient), with the same
fix; ``create_graph=True`` is refused, and selective checkpointing (one backward per region in torch) is refused at ``wrap()``.

What it costs: one more backward of the window's last micro-batch per update (checkpointed blocks
are recomputed in both passes), and during the first pass the last micro-batch's saved
activations all stay alive (the ordinary backward frees them as it goes), with the gradients of the
model's outputs and one parameter's gradient.

Example:
    >>> model, optimizer = memwrap.wrap(model, optimizer, step_in_backward=True, max_grad_norm=1.0)  # doctest: +SKIP
    >>> loss.backward()  # first pass: the norm; second pass: clipped updates, gradients freed  # doctest: +SKIP
    >>> optimizer.step(); optimizer.last_grad_norm  # doctest: +SKIP
    3.2
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.utils._foreach_utils import _has_foreach_support

from memwrap.runtime.loss_graph import ENGINE_QUERIES, bypassing
from memwrap.runtime.optimizer import _no_values

__all__ = ["NormPass", "ParamHook", "missing_engine_queries", "needs_norm_pass"]


def missing_engine_queries() -> list[str]:
    """The private autograd-engine queries the norm pass needs (which pass is running, which outputs this backward
    reaches) that this torch lacks, named as under ``torch._C``; empty on the torch memwrap is tested on.

    Example:
        >>> missing_engine_queries()
        []
    """
    names = ("_current_graph_task_id", "_will_engine_execute_node", *ENGINE_QUERIES)
    return [name for name in dict.fromkeys(names) if not hasattr(torch._C, name)]


def needs_norm_pass(max_grad_norm: float | None, scaler: torch.amp.GradScaler) -> bool:
    """Whether the step inside backward needs the first pass: clipping by global norm, or fp16 loss scaling.

    Example:
        >>> needs_norm_pass(1.0, torch.amp.GradScaler("cpu", enabled=False)), needs_norm_pass(None, torch.amp.GradScaler("cpu", enabled=False))
        (True, False)
    """
    return max_grad_norm is not None or scaler.is_enabled()


class ParamHook:
    """A post-accumulate-grad hook that calls ``owner._on_gradient(param)``, holding its owner weakly: a
    :class:`~memwrap.techniques.step_in_backward.StepInBackward` or
    :class:`~memwrap.techniques.updates_in_backward.UpdatesInBackward`, which the parameters must not keep alive.

    Example:
        >>> hook = ParamHook(weakref.ref(owner))  # doctest: +SKIP
        >>> param.register_post_accumulate_grad_hook(hook)  # doctest: +SKIP
    """

    __slots__ = ("owner",)

    def __init__(self, owner: weakref.ref):
        self.owner = owner

    def __call__(self, param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:
            owner._on_gradient(param)


def _graph_task_id() -> int:
    return torch._C._current_graph_task_id()


class NormPass:
    """The first pass of the window's last backward and the clip coefficient it gives; see the module docstring.

    Owned by :class:`~memwrap.techniques.step_in_backward.StepInBackward`, which routes each parameter's
    gradient here during the first pass (:meth:`contribute`) and asks :meth:`prepare` to unscale and clip it
    before stepping it in the second.

    Example:
        >>> optimizer.step_in_backward.norm.finite  # the last window's norm was finite  # doctest: +SKIP
        True
    """

    def __init__(self, wrapped: Any, names: dict[int, str]):
        self.wrapped = wrapped
        self.optimizer = wrapped.optimizer
        self.gate = wrapped.gate
        self.scaler = wrapped.scaler
        self.max_grad_norm = None if wrapped.max_grad_norm is None else float(wrapped.max_grad_norm)
        self._names = names
        self.running = False  # inside the first pass
        self.ready = False  # this window's norm is known (the second pass may step)
        self.finite = True
        self.coef: torch.Tensor | None = None
        self.first_passes = 0  # windows whose norm came from a first pass inside backward (for tests and reports)
        self._explicit = False  # inside memwrap.backward's two passes: the output hooks stand aside
        self.held = False  # a gradient of the last micro-batch arrived before any first pass: step() steps them all
        self._reset()

    def _reset(self) -> None:
        self._nodes: list[Any] = []  # autograd nodes of the outputs of the window's last micro-batch
        self._call_of: list[int] = []  # for each of them, which forward call of that micro-batch made it
        self._calls = 0
        self._collect_task = -1
        self._expected: set[int] = set()
        self._collected: dict[int, torch.Tensor] = {}
        self._stash: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # parameter id -> (norm, sparse?, the gradient's device and dtype): the gradient itself is gone by the total
        self._norms: dict[int, tuple[torch.Tensor, bool, torch.device, torch.dtype]] = {}
        self._reached: set[int] = set()
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._inv_scale: dict[torch.device, torch.Tensor] = {}
        self._scratch_inf: dict[torch.device, torch.Tensor] = {}
        self.ready = False
        self.held = False
        self.coef = None

    # --- the outputs of the window's last micro-batch ---------------------------------------------------------
    def track(self, aliases: list[torch.Tensor]) -> None:
        """Called by the wrapped model's forward with its hooked outputs; in the window's last micro-batch, hook each."""
        if not self.gate.closes_window() or self._explicit:
            return
        me = weakref.ref(self)
        self._calls += 1
        for alias in aliases:
            self._nodes.append(alias.grad_fn)
            self._call_of.append(self._calls)
            alias.register_hook(_OutputHook(me, len(self._nodes) - 1))

    def on_output_grad(self, index: int, grad: torch.Tensor | None) -> None:
        if self.running or self.ready or self.held or self._explicit or not self.gate.closes_window():
            return
        if torch.is_grad_enabled():  # the engine runs hooks in grad mode only for create_graph=True
            raise RuntimeError(
                f"step_in_backward with the norm pass ({self._what()}): backward(create_graph=True) in the window's "
                "last micro-batch would step parameters with gradients that carry a graph, and the first pass cannot "
                "take a norm of a higher-order backward. Nothing was updated. Fix: loss.backward() without "
                "create_graph (for a gradient penalty take torch.autograd.grad(..., create_graph=True) inside "
                "model.unweighted() and add the penalty to the loss), or step_in_backward=False.")
        task = _graph_task_id()
        if task != self._collect_task:  # the first output of this backward: which of them will it reach?
            self._collect_task, self._collected = task, {}
            self._expected = {i for i, node in enumerate(self._nodes) if torch._C._will_engine_execute_node(node)}
            self._refuse_paths_around_outputs(index)
            calls = sorted({self._call_of[i] for i in self._expected})
            if len(calls) > 1:
                # Autograd runs the newest nodes first: the later call's graph is run (and its saved tensors freed)
                # before the earlier call's outputs get their gradient, so no first pass could start from all outputs.
                self._expected = set()
                raise RuntimeError(
                    f"step_in_backward with the norm pass ({self._what()}): this backward goes through {len(calls)} "
                    "forward calls of the model in the window's last micro-batch; the first pass must start from all "
                    "their outputs once each has its gradient, and by then autograd has already run the later call's "
                    "graph and freed what it saved. Nothing was updated. Fix: finish this loss with "
                    "memwrap.backward(loss, model), which runs both passes from the loss itself, or call the model "
                    "once per micro-batch (concatenate the inputs).")
        self._collected[index] = grad
        if not self._expected <= set(self._collected):
            return
        roots, grads = [], []
        for i in sorted(self._collected):
            g = self._collected[i]
            if g is None:
                continue
            node, nr = self._nodes[i].next_functions[0]
            if node is not None:  # below the alias: its own hooks (the weighting) already ran on this gradient
                roots.append(GradientEdge(node, nr))
                grads.append(g)
        self._collected = {}
        outer = self._reached_by_this_backward()
        self.begin()
        try:
            if roots:
                torch.autograd.backward(roots, grads, retain_graph=True)
        except BaseException:
            self.abort()
            raise
        del roots, grads
        missed = [pid for pid in outer if pid not in self._reached]
        if missed:
            self.abort()
            raise RuntimeError(
                f"step_in_backward with the norm pass ({self._what()}): this backward reaches parameter "
                f"{self._names.get(missed[0], '(unnamed)')!r} (and {len(missed) - 1} more) other than through the "
                "model's outputs, e.g. a penalty computed from the parameters, so the norm taken from the outputs "
                "would miss its gradient. Nothing was updated and the window's gradients are as they were. Fix: "
                "finish this loss with memwrap.backward(loss, model), which runs both passes from the loss itself.")
        self.end()

    def _refuse_paths_around_outputs(self, index: int) -> None:
        """Refuse, before the first pass, a loss that reaches a parameter other than through the outputs (a penalty on
        a parameter the outputs also reach: the norm from the outputs would miss that term's gradient)."""
        outputs = {id(node.metadata) for node in self._nodes}
        found = bypassing(self._nodes[index], lambda node: id(node.metadata) in outputs, self._names)
        if found:
            self._expected, self._collected = set(), {}
            raise RuntimeError(
                f"step_in_backward with the norm pass ({self._what()}): this backward reaches parameter "
                f"{found[0]!r}" + (f" (and {len(found) - 1} more)" if len(found) > 1 else "") + " other than "
                "through the model's outputs (a loss term computed from the parameters, e.g. a penalty, or a head "
                "applied outside the model), so the norm taken from the outputs would miss that term's gradient. "
                "Nothing was updated (a parameter reached only that way may already hold this micro-batch's part). "
                "Fix: finish this loss with memwrap.backward(loss, model), which runs both passes from the loss "
                "itself, or compute the term inside the model's forward and return it with the outputs.")

    def hold(self, param: torch.Tensor) -> None:
        """A parameter's gradient arrived in the window's last backward before any first pass: hold it for step().

        Legitimate when this backward reaches none of the outputs hooked in this micro-batch (a loss that does not
        go through the model: step() then takes the norm and steps, the ordinary clipped step). When it will reach
        them, the gradient came by another path (a loss term computed from the parameter itself), and the norm the
        first pass would take from the outputs would miss it: refused, before any parameter changed.
        """
        if not self.held and not self._explicit and _graph_task_id() >= 0 \
                and any(torch._C._will_engine_execute_node(node) for node in self._nodes):
            name = self._names.get(id(param), "(unnamed)")
            raise RuntimeError(
                f"step_in_backward with the norm pass ({self._what()}): this backward reaches parameter {name!r} "
                "other than through the model's outputs (a loss term computed from the parameter itself, e.g. a "
                "penalty or a learned temperature), so the norm taken from the outputs would miss its gradient. "
                f"Nothing was updated (only {name!r}'s gradient already holds this micro-batch's part). Fix: finish "
                "this loss with memwrap.backward(loss, model), which runs both passes from the loss itself.")
        self.held = True

    def _reached_by_this_backward(self) -> list[int]:
        """Ids of the optimizer's parameters whose gradient accumulator the running backward will execute."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and torch._C._will_engine_execute_node(get_gradient_edge(p).node):
                    out.append(id(p))
        return out

    # --- the first pass ----------------------------------------------------------------------------------------
    def begin(self) -> None:
        """Set the accumulated gradients aside: the first pass must see this micro-batch's contribution alone."""
        self.running = True
        self._reached = set()
        if self.scaler.is_enabled():
            scale = self.scaler._scale
            # GradScaler.unscale_: the reciprocal in fp64, found_inf in fp32 on the scale's device.
            inv = scale.double().reciprocal().float() if scale.device != torch.device("mps:0") else scale.reciprocal()
            self._inv_scale = {scale.device: inv}
            self._found_inf = {scale.device: torch.full((), 0.0, dtype=torch.float32, device=scale.device)}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._stash[id(p)] = (p, p.grad)
                    p.grad = None

    def contribute(self, param: torch.Tensor) -> None:
        """First pass: this parameter's window gradient gives its norm, then is freed (the accumulated one put back)."""
        pid = id(param)
        self._reached.add(pid)
        fresh = param.grad
        kept = self._stash.pop(pid, None)
        old = kept[1] if kept is not None else None
        param.grad = old
        if fresh is None:
            return
        with torch.no_grad():
            # What the second pass's AccumulateGrad will hold: old += fresh, the same additions.
            window = fresh if old is None else torch.add(old, fresh)
            del fresh
            self._norms[pid] = self._norm_of(window, unscale_in_place=True)

    def end(self) -> None:
        """After the first pass: the gradients it did not reach (earlier micro-batches only) count too; the total."""
        with torch.no_grad():
            for pid, (p, g) in self._stash.items():
                p.grad = g
                self._norms[pid] = self._norm_of(g.clone() if self.scaler.is_enabled() else g,
                                                 unscale_in_place=self.scaler.is_enabled())
            self._stash = {}
            self.running = False
            self._finalize()

    def abort(self) -> None:
        """Put every set-aside gradient back (a failed or refused first pass changes nothing)."""
        for p, g in self._stash.values():
            p.grad = g
        self._stash = {}
        self._norms = {}
        self.running = False

    def _norm_of(self, g: torch.Tensor, unscale_in_place: bool) -> tuple[torch.Tensor, bool, torch.device, torch.dtype]:
        if g.is_sparse:
            g = g.coalesce()
        values = g._values() if g.is_sparse else g
        if self.scaler.is_enabled() and unscale_in_place:
            device = values.device
            torch._amp_foreach_non_finite_check_and_unscale_([values], self._on(self._found_inf, device),
                                                             self._on(self._inv_scale, device))
        if g.is_sparse:
            return torch.linalg.vector_norm(values), True, g.device, g.dtype
        # torch.nn.utils.get_total_norm's choice for this tensor: the foreach kernel where it has one, else vector_norm.
        if _has_foreach_support([g], g.device):
            return torch._foreach_norm([g], 2.0)[0], False, g.device, g.dtype
        return torch.linalg.vector_norm(g, 2.0), False, g.device, g.dtype

    @staticmethod
    def _on(per_device: dict[torch.device, torch.Tensor], device: torch.device) -> torch.Tensor:
        found = per_device.get(device)
        if found is None:  # GradScaler's _MultiDeviceReplicator: a copy per device
            found = per_device[device] = next(iter(per_device.values())).to(device)
        return found

    def _finalize(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) in self._norms]
        if not params:
            total: torch.Tensor | float = 0.0
            self.finite = True
        else:
            total = self._total(params)
            # The update's one host-device sync: every parameter's step waits on it. Fake tensors (the planner's
            # trace) carry no value to read.
            self.finite = True if _no_values(total) else bool(torch.isfinite(total))
            if self.max_grad_norm is not None:
                self.coef = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        self.wrapped._grad_norm = total
        self.ready = True

    def _total(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The norms stacked as torch.nn.utils.get_total_norm stacks them (grouped by device and dtype, first
        appearance order), then their 2-norm; with sparse gradients, as memwrap's _total_norm (no clipping)."""
        dense = [p for p in params if not self._norms[id(p)][1]]
        sparse = [p for p in params if self._norms[id(p)][1]]
        first = self._norms[id(params[0])][2]
        groups: dict[tuple, list[torch.Tensor]] = {}
        for p in dense:
            norm, _, device, dtype = self._norms[id(p)]
            groups.setdefault((device, dtype), []).append(norm)
        norms = [n for group in groups.values() for n in group]
        if not sparse:
            return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), 2.0)
        # memwrap.runtime.optimizer._total_norm: the sparse norms, then the dense total, on the first device.
        out = [self._norms[id(p)][0].to(first) for p in sparse]
        if dense:
            d0 = self._norms[id(dense[0])][2]
            out.append(torch.linalg.vector_norm(torch.stack([n.to(d0) for n in norms]), 2.0).to(first))
        return torch.linalg.vector_norm(torch.stack(out))

    # --- the second pass -------------------------------------------------------------------------------------------
    def prepare(self, grad: torch.Tensor) -> None:
        """Second pass: unscale (fp16) and clip one parameter's gradient in place, as unscale_ and clip_grad_norm_ do."""
        if self.scaler.is_enabled():
            values = grad._values() if grad.is_sparse else grad
            device = values.device
            scratch = self._scratch_inf.get(device)
            if scratch is None:
                scratch = self._scratch_inf[device] = torch.zeros((), dtype=torch.float32, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_([values], scratch, self._on(self._inv_scale, device))
        if self.coef is not None:
            coef = self.coef.to(grad.device)
            if _has_foreach_support([grad], grad.device):
                torch._foreach_mul_([grad], coef)
            else:
                grad.mul_(coef)

    def ensure_ready(self) -> None:
        """At ``step()``: a window whose last backward started no first pass (no output reached) takes its norm now,
        from the gradients as they are (the ordinary clipped step)."""
        if not self.ready:
            self.begin()
            self.end()
        elif not self.held:
            self.first_passes += 1

    def finish(self) -> float | None:
        """Close the window: update the GradScaler from the first pass's found_inf; return the scale the skipped
        update was computed with (1.0 without loss scaling), or None when it was applied."""
        finite = self.finite
        used = None
        if self.scaler.is_enabled():
            if not finite:
                used = self.scaler.get_scale()
            from torch.amp.grad_scaler import OptState

            found = self._found_inf or {self.scaler._scale.device: torch.zeros((), device=self.scaler._scale.device)}
            state = self.scaler._per_optimizer_states[id(self.optimizer)]
            state["found_inf_per_device"], state["stage"] = found, OptState.UNSCALED
            self.scaler.update()  # as after unscale_: backoff on found_inf, growth after growth_interval clean steps
        elif not finite:
            used = 1.0
        self._reset()
        self.finite = True
        return used

    # --- memwrap.backward ----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``memwrap.backward``'s two passes: both from the (weighted) loss, so terms bypassing the outputs count."""
        refused = [k for k in ("create_graph", "inputs") if kwargs.get(k)]
        if refused:
            raise ValueError(
                f"memwrap.backward(..., {refused[0]}=...) with step_in_backward and the norm pass ({self._what()}): "
                "the first pass must reach every parameter's gradient exactly as the second does, and "
                f"{refused[0]} changes what the backward computes. Nothing was run. Fix: call memwrap.backward(loss, "
                "model) without it, or drop step_in_backward.")
        if not self.gate.closes_window():
            loss.backward(**kwargs)
            return
        self._explicit = True
        try:
            self.begin()
            try:
                torch.autograd.backward(loss, kwargs.get("gradient"), retain_graph=True)
            except BaseException:
                self.abort()
                raise
            self.end()
            loss.backward(**kwargs)
        finally:
            self._explicit = False

    def _what(self) -> str:
        parts = ([f"max_grad_norm={self.max_grad_norm:g}"] if self.max_grad_norm is not None else []) + (
            ["fp16 loss scaling"] if self.scaler.is_enabled() else [])
        return ", ".join(parts)


class _OutputHook:
    """Hook on one output of the window's last micro-batch; holds the norm pass weakly (as the parameter hooks do)."""

    __slots__ = ("owner", "index")

    def __init__(self, owner: weakref.ref, index: int):
        self.owner, self.index = owner, index

    def __call__(self, grad: torch.Tensor) -> None:
        owner = self.owner()
        if owner is not None:
            owner.on_output_grad(self.index, grad)
        return None
