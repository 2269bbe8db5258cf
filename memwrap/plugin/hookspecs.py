"""Every memwrap hook, declared once. The docstring of each hook is its contract.

A plugin is any module or object with functions decorated by :data:`memwrap.hookimpl` whose
names match the hooks below. Plugins are found through the ``memwrap`` entry-point group
(see ``docs/plugins.md``); built-in plugins use the same group. A hook name that is not declared
here (a typo) makes the plugin fail to load (see :func:`memwrap.plugin.manager.plugin_errors`).

memwrap calls every hook through :func:`memwrap.plugin.calls.call_hook`, one implementation at a
time: an implementation that raises, or returns what its contract forbids, is recorded with its
plugin, distribution and hook, reported once as a warning, and left out; the other plugins'
results are used. A hook added here needs nothing more to be guarded.

Example (a whole plugin module)::

    import memwrap
    from memwrap.plugin.registry import OptimizerSpec

    @memwrap.hookimpl
    def memwrap_optimizers():
        return [OptimizerSpec(name="sgd", factory=torch.optim.SGD, ...)]
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:  # pragma: no cover - typing only
    from memwrap.plugin.registry import OptimizerSpec

hookspec = pluggy.HookspecMarker("memwrap")


@hookspec
def memwrap_optimizers() -> list[OptimizerSpec]:
    """Return the optimizers this plugin provides.

    :return: a list (possibly empty) of :class:`memwrap.plugin.registry.OptimizerSpec`.

    Called once per plugin when the optimizer registry is first used (and again whenever the set
    of registered plugins has changed). All results are collected (not ``firstresult``); the
    registry merges them. Every spec name and alias must be unique across all plugins: two
    plugins claiming one name make lookups of that name raise an error naming both plugins.

    The hook must be cheap and free of side effects: do not import heavy optional
    dependencies here (e.g. ``bitsandbytes``); import them inside ``factory`` and report their
    absence through ``available``. An exception raised here is reported as a warning naming
    the plugin and its distribution; the other plugins' optimizers remain usable.
    """


@hookspec
def memwrap_precisions() -> list[type]:
    """Return the precision modes this plugin provides.

    :return: a list (possibly empty) of subclasses of :class:`memwrap.precision.base.Precision` (classes,
        not instances: ``wrap()`` makes a fresh instance per wrapped model, passing the
        ``compensation=`` option, so that process-wide settings are saved and restored per model).

    A class states its storage dtype (``param_dtype``), its autocast dtype, whether it scales the
    loss (``uses_scaler``), what it requires of the optimizer (``optimizer_requirement``, enforced by
    ``check_optimizer`` before anything changes and met by ``convert_optimizer``) and its memory
    effect (``memory_per_param``); the base class's methods are neutral, so a mode overrides only
    what differs. ``name`` is lower case with ``-`` separators; names and ``aliases`` are matched
    case-insensitively and must be unique across all plugins (two plugins claiming one name make
    lookups of that name raise an error naming both).

    Called when a precision is first looked up (and again whenever the set of registered plugins
    has changed). All results are collected (not ``firstresult``). Like every memwrap hook it must
    be cheap and must not import heavy optional dependencies (import them inside the methods). An
    exception raised here, or a result that is not a valid ``Precision`` subclass, is reported as a
    warning naming the plugin; the other plugins' precisions remain usable.
    """


@hookspec
def memwrap_checkpoint_policies() -> dict[str, object]:
    """Return named activation-checkpointing policies this plugin provides.

    :return: a dict mapping a policy name to either a policy object that
        :func:`memwrap.checkpointing.apply.apply_checkpointing` accepts as ``policy``, or a dict of
        keyword arguments for ``apply_checkpointing``.

    Called when a checkpoint policy is looked up by name (e.g. ``wrap(checkpoint="name")``).
    All results are collected (not ``firstresult``) and merged; a name defined by two plugins is
    an error naming both when that name is used (every other name keeps working). A name of a
    built-in form (``auto``, ``full``, ``selective``, ``offload``, ``every-<k>``) or a result that
    is not a dict counts as this plugin's failure. Like every memwrap hook it must not import heavy
    optional dependencies; an exception raised here is reported as a warning naming the plugin
    and its distribution, and the other plugins' policies remain usable.
    """


@hookspec
def memwrap_loss_heads() -> list:
    """Return the loss-head adapters this plugin provides, for ``wrap(chunked_loss=...)``.

    :return: a list (possibly empty) of :class:`memwrap.techniques.loss_head.LossHeadSpec`: a ``name``, a
        ``matches(model) -> bool`` recognizing a model family, and ``forward(model, args, kwargs, loss)``
        which runs a labelled call through the model's body and returns an output like the model's with
        ``loss`` computed by the given chunked ``loss(hidden, head_weight, labels, ...)`` and no logits
        (None for a call without labels: the model then runs unchanged). An optional ``head(model)`` names
        the module the adapter replaces; memwrap then accepts only a plain ``nn.Linear`` head without hooks
        there, at ``wrap()`` and at each labelled forward (:func:`memwrap.techniques.loss_head.head_problem`).

    Called when ``wrap(chunked_loss=...)`` resolves the model's adapter. All results are collected (not
    ``firstresult``); exactly one adapter must match a model: none, or two, is an error at ``wrap()``
    naming the model class (and both plugins). The hook must be cheap and must not import heavy optional
    dependencies (``matches`` should look at ``sys.modules`` rather than import a framework). An exception
    raised here or in ``matches`` is reported as a warning naming the plugin; the other adapters remain usable.
    """


@hookspec
def memwrap_trace_inputs() -> list:
    """Return the trace-input adapters this plugin provides, for :func:`memwrap.estimate`.

    :return: a list (possibly empty) of :class:`memwrap.memory.tracing.unread_inputs.TraceInputSpec`: a ``name``
        and ``unused(model, kwargs) -> dict[str, str]``, the keyword inputs of a real batch that the real step
        would not pass on to the model's kernels because of their values (e.g. an all-ones ``attention_mask``
        that transformers drops for SDPA), each with why. The trace leaves them out of the traced call, which
        cannot read values, and keeps them in the batch.

    Called once per estimate of a real dict batch. All results are collected (not ``firstresult``); an input named
    by any adapter is left out. ``unused`` must be cheap (types, config, and reductions of the batch's small
    tensors), must not run the model, must not import heavy optional dependencies (look at ``sys.modules``), and
    must not change anything. An exception raised here or in ``unused`` is reported as a warning naming the
    plugin, and counts as leaving nothing out.
    """
