"""A wrapped model and optimizer that the loop drops are freed, in every mode, without memwrap.unwrap().

Nothing memwrap attaches to the user's objects (hooks on parameters and outputs, checkpoint wrappers, the precision's
conversions) may keep them alive: a notebook or a sweep that builds one model after another would run out of memory.
"""
import gc
import warnings
import weakref

import pytest
import torch

import memwrap
from memwrap.models import GPT, GPTConfig

MODES = {
    "plain": {},
    "accumulate": {"accumulate": 2},
    "fp16": {"precision": "fp16"},
    "bf16-true": {"precision": "bf16-true"},
    "step_in_backward": {"step_in_backward": True},
    "step_in_backward-accumulate": {"step_in_backward": True, "accumulate": 2},
    "checkpoint": {"checkpoint": "full"},
    "chunked_loss": {"chunked_loss": True},
}


def _train(options):
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16-true's optimizer conversion notice
        model, optimizer = memwrap.wrap(net, opt, **options)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2 * options.get("accumulate", 1)):
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.updates == 2
    # optimizer.optimizer, not memwrap.unwrap(optimizer): unwrap() removes the step-in-backward hooks, the very
    # references whose cycle this test is about.
    return [weakref.ref(o) for o in (net, opt, model, optimizer, optimizer.optimizer)]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_dropped_wrapped_model_and_optimizer_are_collected(mode):
    if mode == "bf16-true":
        pytest.importorskip("optimi")
    refs = _train(MODES[mode])  # every strong reference was local to _train
    gc.collect()
    alive = [type(r()).__name__ for r in refs if r() is not None]
    assert alive == [], f"{mode}: still alive after del + gc.collect(): {alive}"


def _reaches(start, targets, limit=20000):
    """Whether a strong reference path leads from ``start`` to one of ``targets`` (modules and classes not entered)."""
    ids, seen, frontier = {id(t) for t in targets}, set(), [start]
    while frontier and len(seen) < limit:
        obj = frontier.pop()
        if id(obj) in ids:
            return True
        if id(obj) in seen or isinstance(obj, (type, type(gc))):
            continue
        seen.add(id(obj))
        frontier.extend(gc.get_referents(obj))
    return False


def test_the_step_in_backward_hooks_hold_their_owner_weakly():
    # A hook torch keeps on a parameter from C++ is a root the collector may not see through (issue 22 item 28: the
    # model and optimizer stayed alive after del + gc.collect()): no strong path from a hook to the optimizer.
    torch.manual_seed(0)
    net = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    model, optimizer = memwrap.wrap(net, opt, step_in_backward=True)
    hooks = [h for p in net.parameters() for h in (p._post_accumulate_grad_hooks or {}).values()]
    assert len(hooks) == len(list(net.parameters()))
    assert not any(_reaches(h, [opt, optimizer, net, model]) for h in hooks)
    del optimizer
    gc.collect()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())  # the dropped optimizer took them along
