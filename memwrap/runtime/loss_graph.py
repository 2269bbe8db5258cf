"""What a running backward reaches other than through the wrapped model's outputs.

memwrap weights each micro-batch (and applies the fp16 loss scale) with hooks on the model's outputs, and the norm
pass takes the global gradient norm from those outputs. A loss term that reaches a parameter by another path (an L2
penalty over ``model.parameters()``, a head or tied weight applied outside the model, a tensor the model kept instead
of returning it) gets neither, and the result would be silently wrong. Autograd does not say which paths lead into a
leaf, so the check starts where the user's backward started: the roots of the running ``torch.autograd.backward``
call, read from its frame (``tensors``, a parameter of that public function, is what the engine was given). From
there it walks the loss's graph down to the outputs, never below them, and reports the parameters it reaches: the
loss side of the graph only (a few nodes for a loss over logits; one when the model returns its loss).

Where no such frame is found (a backward started by the engine directly, not through ``torch.autograd.backward``),
the check cannot tell and says so by returning ``None``; the callers then keep their other checks.

Example:
    >>> lin = torch.nn.Linear(2, 1)
    >>> out = lin(torch.ones(1, 2)).view_as(lin(torch.ones(1, 2)))
    >>> list(walk([out.grad_fn], stop=lambda node: False))[0] is out.grad_fn
    True
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

__all__ = ["ENGINE_QUERIES", "ENGINE_QUERIES_PRESENT", "backward_roots", "bypassing", "walk"]

# The private autograd-engine queries a hook needs to ask which backward it is in and at which node; the check is
# skipped (as where no roots are found) on a torch without them.
ENGINE_QUERIES = ("_current_graph_task_id", "_current_autograd_node")
ENGINE_QUERIES_PRESENT = all(hasattr(torch._C, name) for name in ENGINE_QUERIES)


def walk(start: Iterable[Any], stop: Callable[[Any], bool], budget: int | None = None) -> Iterator[Any]:
    """Each autograd node reachable from ``start``, once, without descending below a node where ``stop`` is true
    (that node is still yielded); at most ``budget`` nodes when given.

    The visited Python wrappers are kept alive for the walk: some torch versions make a new object per access, and a
    freed one's id could be reused by the next, which would then pass for visited.

    Example:
        >>> x = torch.ones(2, requires_grad=True)
        >>> [type(n).__name__ for n in walk([(x * 2).sum().grad_fn], stop=lambda n: False)]
        ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    """
    kept: list[Any] = []
    seen: set[int] = set()
    frontier = list(start)
    while frontier and (budget is None or len(seen) < budget):
        node = frontier.pop()
        if node is None or id(node) in seen:
            continue
        kept.append(node)
        seen.add(id(node))
        yield node
        if not stop(node):
            frontier.extend(reversed([fn for fn, _ in node.next_functions]))


def backward_roots() -> list[list[Any]]:
    """The root nodes of each running ``torch.autograd.backward`` call, the calling thread's first.

    On CPU the hooks run on the caller's thread, whose stack holds the call. On an accelerator they run on the
    engine's device thread while the caller's thread waits inside the call, so every thread's stack is searched.

    Example:
        >>> backward_roots()  # not inside a backward
        []
    """
    code = torch.autograd.backward.__code__
    own = threading.get_ident()
    found = []
    frames = sys._current_frames()
    frame = None
    try:
        for tid in sorted(frames, key=lambda t: t != own):
            frame = frames[tid]
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            tensors = frame.f_locals.get("tensors") if frame is not None else None
            if isinstance(tensors, tuple):
                roots = [t.node if isinstance(t, torch.autograd.graph.GradientEdge) else getattr(t, "grad_fn", None)
                         for t in tensors]
                found.append([r for r in roots if r is not None])
    finally:
        # This frame must not outlive the call: ``frames`` holds it, so it would sit in a reference cycle until the
        # garbage collector ran, keeping its callers' frames alive with them, and with those the output gradient an
        # output hook was called with (a logits-sized tensor past its last use).
        frames.clear()
        del frames, frame
    return found


def bypassing(current: Any, is_output: Callable[[Any], bool], params: Mapping[int, str]) -> list[str] | None:
    """Names of the parameters in ``params`` (``id(param) -> name``) that the running backward reaches other than
    through a node where ``is_output`` is true; ``None`` when that backward's roots are not found.

    ``current`` is the output node whose hook asks: the running call is the one whose loss graph reaches it (two
    threads running backward at once stay apart).

    Example:
        >>> bypassing(alias.grad_fn, lambda n: n is alias.grad_fn, {id(w): "w"})  # from alias's hook  # doctest: +SKIP
        ['w']
    """
    if not ENGINE_QUERIES_PRESENT or current is None:
        return None
    # Compared by their metadata dicts, which the C++ node holds: the Python wrappers are not stable across versions.
    target = current.metadata
    for roots in backward_roots():
        found, reached = [], False
        for node in walk(roots, stop=is_output):
            if is_output(node):
                reached = reached or node.metadata is target
                continue
            var = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
            if var is not None and id(var) in params:
                found.append(params[id(var)])
        if reached:
            return found
    return None
