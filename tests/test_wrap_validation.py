"""A refused wrap() changes nothing, a retry behaves like a first call, and unchecked inputs get clear errors.

Each failure is provoked with checkpoint= and precision="tf32" in the same call, the two options that
change the user's model and torch's global settings; afterwards the model's modules, hooks, attributes,
parameters and state_dict keys, the optimizer and float32 matmul precision must be exactly as before.
"""
import copy
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import memwrap
import memwrap.precision.base
import memwrap.wrapper
from memwrap.checkpointing.apply import is_checkpointed

pytestmark = pytest.mark.filterwarnings("ignore:precision='tf32' only changes CUDA", "ignore:converting ")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """Repeated blocks (found by checkpoint="auto") and a Hugging Face style config with a KV cache flag."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 2)
        self.config = SimpleNamespace(use_cache=True)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


def snapshot(model, optimizer=None):
    """Everything a wrap() could leave behind, in comparable form."""
    modules = {name: (type(m), sorted(m.__dict__), {h: list(getattr(m, h)) for h in _HOOK_DICTS},
                      m.__dict__.get("_compiled_call_impl"))
               for name, m in model.named_modules()}
    params = [(n, p, p.dtype, p.detach().clone()) for n, p in model.named_parameters()]
    opt = None
    if optimizer is not None:
        opt = (type(optimizer), sorted(optimizer.__dict__),
               [{k: (list(map(id, v)) if k == "params" else v) for k, v in g.items()} for g in optimizer.param_groups],
               copy.deepcopy(dict(optimizer.state)), dict(optimizer.defaults),
               list(optimizer._optimizer_step_pre_hooks), list(optimizer._optimizer_step_post_hooks))
    return {"modules": modules, "params": params, "keys": list(model.state_dict()), "opt": opt,
            "matmul": torch.get_float32_matmul_precision(), "use_cache": getattr(model.config, "use_cache", None)}


def assert_same(before, after):
    assert after["modules"] == before["modules"]
    assert after["keys"] == before["keys"]
    assert after["matmul"] == before["matmul"]
    assert after["use_cache"] == before["use_cache"]
    assert after["opt"] is None or (after["opt"][:3] == before["opt"][:3] and after["opt"][4:] == before["opt"][4:])
    if after["opt"] is not None:
        assert repr(after["opt"][3]) == repr(before["opt"][3])  # tensors in the state: same values
    for (n1, p1, d1, v1), (n2, p2, d2, v2) in zip(before["params"], after["params"], strict=True):
        assert (n1, d1) == (n2, d2) and p1 is p2 and torch.equal(v1, v2)


@pytest.fixture
def matmul_highest():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(previous)


def _stepped(model, opt):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def _scheduler_of_another_optimizer(model, opt):
    return torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1), 1)


# Each case: (prepare(model, opt) -> extra, the failing call(model, opt, extra), expected error, whether a plain
# retry must work). prepare runs before the snapshot (building a scheduler changes its optimizer). The calls pass
# checkpoint="auto" and precision="tf32": a wrap() acting before it checks would leave hooks and TF32 behind.
CHANGING = {"checkpoint": "auto", "precision": "tf32"}
FAILURES = {
    "unknown optim name": (None, lambda m, o, _: memwrap.wrap(m, o, optim="adamw8bitt", **CHANGING),
                           (ValueError, "unknown optimizer 'adamw8bitt'.*adamw_8bit"), True),
    "policy naming no module": (None, lambda m, o, _: memwrap.wrap(m, o, checkpoint={"NoSuchBlock"}, precision="tf32"),
                                (ValueError, "NoSuchBlock"), True),
    "scheduler of another optimizer": (_scheduler_of_another_optimizer,
                                       lambda m, o, sched: memwrap.wrap(m, o, sched, **CHANGING),
                                       (ValueError, "different optimizer"), True),
    "scheduler on the optimizer optim= replaces": (
        lambda m, o: torch.optim.lr_scheduler.StepLR(o, 1),
        lambda m, o, sched: memwrap.wrap(m, o, sched, optim="adamw", **CHANGING),
        (ValueError, "still drives the old one"), True),
    "loader without optimizer": (None, lambda m, o, _: memwrap.wrap(m, [torch.randn(2, 4)], **CHANGING),
                                 (TypeError, "needs the optimizer"), True),
    "optim= on an optimizer that stepped": (_stepped, lambda m, o, _: memwrap.wrap(m, o, optim="adamw", **CHANGING),
                                            (ValueError, "already holds state"), True),
    "a block checkpointed outside memwrap": (
        lambda m, o: torch.distributed._composable.checkpoint(m.blocks[1]),
        lambda m, o, _: memwrap.wrap(m, o, **CHANGING), (ValueError, "already checkpointed by torch"), True),
    "a compiled block": (lambda m, o: m.blocks[1].compile(backend="eager"),
                         lambda m, o, _: memwrap.wrap(m, o, **CHANGING), (ValueError, "torch.compile"), True),
    "a wrapped model inside": (lambda m, o: setattr(m, "blocks", nn.ModuleList(memwrap.wrap(b) for b in m.blocks)),
                               lambda m, o, _: memwrap.wrap(m, o, **CHANGING), (ValueError, "already wrapped"), False),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_a_refused_wrap_changes_nothing_and_a_retry_is_a_first_call(case, matmul_highest):
    prepare, call, (error, match), retry = FAILURES[case]
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = prepare(model, opt) if prepare is not None else None
    before = snapshot(model, opt)
    with pytest.raises(error, match=match):
        call(model, opt, extra)
    assert_same(before, snapshot(model, opt))
    if not retry:
        return
    # A retry without checkpointing reports none and leaves the model as it is; with it, unwrap() undoes it all.
    m, o = memwrap.wrap(model, opt)
    assert m.checkpoint_report is None
    assert_same(before, snapshot(model, opt))
    assert memwrap.unwrap(m) is model and memwrap.unwrap(o) is opt
    if case not in ("a compiled block", "a block checkpointed outside memwrap"):
        m, o = memwrap.wrap(model, opt, **CHANGING)
        assert m.checkpoint_report.modules == ["blocks.0", "blocks.1", "blocks.2"]
        assert torch.get_float32_matmul_precision() == "high" and model.config.use_cache is False
        memwrap.unwrap(m)
        assert_same(before, snapshot(model, opt))


@pytest.mark.parametrize("failing", ["WrappedModule", "WrappedOptimizer", "apply_checkpointing", "convert_module",
                                     "StepInBackward"])
def test_a_failure_after_the_checks_is_rolled_back(failing, matmul_highest, monkeypatch):
    """What cannot be checked beforehand (a constructor, checkpointing half applied, a precision's conversion)
    leaves nothing behind either: checkpoint hooks, TF32 and the KV-cache flag are undone."""
    import memwrap.checkpointing.apply

    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model, opt)

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    def half_applied(target, **how):
        memwrap.checkpointing.apply._checkpoint_module(target.blocks[0], "full", False)
        boom()

    with monkeypatch.context() as patch:
        # Each is patched where wrap() looks it up (memwrap.wrapper imports them at module level).
        if failing == "apply_checkpointing":
            patch.setattr(memwrap.wrapper, failing, half_applied)
        elif failing == "convert_module":
            patch.setattr(type(memwrap.precision.base.get_precision("tf32")), failing, boom)
        else:  # StepInBackward: hooks on the parameters, set up after the model's changes
            patch.setattr(memwrap.wrapper, failing, boom)
        with pytest.raises(RuntimeError, match="injected failure"):
            memwrap.wrap(model, opt, accumulate=2, step_in_backward=failing == "StepInBackward", **CHANGING)
    assert_same(before, snapshot(model, opt))
    m, o = memwrap.wrap(model, opt, accumulate=2, **CHANGING)  # the retry works and is undone by unwrap
    assert len(m.checkpoint_report.modules) == 3
    memwrap.unwrap(m)
    assert_same(before, snapshot(model, opt))


def test_unwrap_leaves_nothing_behind(matmul_highest):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = snapshot(model)
    m, o = memwrap.wrap(model, opt, accumulate=2, checkpoint={"policy": "auto", "mode": "selective", "offload": True},
                        precision="tf32")
    m(torch.randn(2, 4)).sum().backward()
    memwrap.unwrap(m)
    memwrap.unwrap(m)  # twice is harmless
    after = snapshot(model)
    after["params"] = before["params"]  # the backward left gradients, not part of what wrap() must undo
    assert_same(before, after)


def test_checkpointing_applied_before_wrap_is_reported_kept_and_not_replaced():
    model = Net()
    report = memwrap.apply_checkpointing(model, {Block}, every=2)
    m = memwrap.wrap(model)
    assert m.checkpoint_report == report  # not None while the hooks are on
    memwrap.unwrap(m)
    assert is_checkpointed(model.blocks[0]) and is_checkpointed(model.blocks[2])  # not wrap()'s
    with pytest.raises(ValueError, match="already checkpointed .* by memwrap.apply_checkpointing.*remove_checkpointing"):
        memwrap.wrap(model, checkpoint="auto")
    assert [is_checkpointed(b) for b in model.blocks] == [True, False, True]


def test_unwrapping_an_old_wrapper_does_not_undo_a_later_wrap():
    model = Net()
    first = memwrap.wrap(model, checkpoint="auto")
    memwrap.unwrap(first)
    second = memwrap.wrap(model, checkpoint="auto")
    memwrap.unwrap(first)
    assert all(is_checkpointed(b) for b in model.blocks)
    memwrap.unwrap(second)
    assert not any(is_checkpointed(b) for b in model.blocks)


# --- item 8: unchecked inputs -------------------------------------------------------------

def test_a_wrapped_model_nested_in_the_model_is_refused():
    """Wrapping an outer model around a wrapped one weighted gradients twice (x0.5 with accumulate=2)."""
    inner = memwrap.wrap(Net())
    outer = nn.Sequential(inner, nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"already wrapped by memwrap at '0'.*memwrap.unwrap"):
        memwrap.wrap(outer, torch.optim.SGD(outer.parameters(), lr=0.1), accumulate=2)
    compiled = torch.compile(memwrap.wrap(Net()), backend="eager")
    with pytest.raises(ValueError, match="already wrapped by memwrap at '_orig_mod'"):
        memwrap.wrap(compiled)


def test_wrap_with_nothing_is_refused():
    with pytest.raises(TypeError, match="nothing to wrap.*memwrap.wrap\\(model, optimizer"):
        memwrap.wrap()
    with pytest.raises(TypeError, match="nothing to wrap"):
        memwrap.wrap(accumulate=4)


def test_an_optimizer_name_in_a_list_gets_a_clear_error():
    model = Net()
    with pytest.raises(TypeError, match=r"name must be a single name \(a str\), got \['adamw'\].*create_optimizer\('adamw'"):
        memwrap.create_optimizer(["adamw"], model.parameters())
    with pytest.raises(TypeError, match=r"optim must be a single name \(a str\), got \['adamw'\].*Fix: optim='adamw'"):
        memwrap.wrap(model, torch.optim.AdamW(model.parameters()), optim=["adamw"])


def test_a_precision_in_a_list_gets_a_clear_error():
    with pytest.raises((TypeError, ValueError), match="precision") as info:
        memwrap.wrap(Net(), precision=["bf16"])
    assert "unhashable" not in str(info.value)


@pytest.mark.parametrize("objects, options, match", [
    ("model", {"max_grad_norm": 1.0}, "max_grad_norm=1.0 acts in optimizer.step"),
    ("model", {"on_nonfinite": "raise"}, "on_nonfinite='raise' acts in optimizer.step"),
    ("optimizer", {"precision": "bf16"}, "precision='bf16' acts in the model's forward"),
    ("optimizer", {"checkpoint": "auto"}, "checkpoint='auto' acts in the model's forward"),
    ("scheduler", {"accumulate": 2}, "needs the model and the optimizer"),
])
def test_an_option_without_the_object_it_acts_on_is_refused(objects, options, match):
    """Given without its object, an option used to be silently ignored."""
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    given = {"model": (model,), "optimizer": (opt,),
             "scheduler": (torch.optim.lr_scheduler.StepLR(memwrap.wrap(model, opt)[1], 1),)}[objects]
    with pytest.raises(TypeError, match=match):
        memwrap.wrap(*given, **options)


def test_compiling_a_model_wrapped_with_checkpointing_fails_at_the_first_forward():
    """torch 2.13: the composable checkpoint fails in backward under torch.compile (inductor, aot_eager), deep in
    torch. Now the first forward refuses with the fix; compiling without checkpoint= still trains."""
    torch._dynamo.reset()
    net = Net()
    model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2, checkpoint="auto")
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match="torch.compile of a model wrapped with checkpointing.*Fix"):
        torch.compile(model)(torch.randn(2, 4))
    assert time.perf_counter() - start < 20  # refused while tracing, before anything is compiled
    model.compile(backend="aot_eager")  # nn.Module.compile() in place: the same refusal
    with pytest.raises(RuntimeError, match="torch.compile of a model wrapped with checkpointing"):
        model(torch.randn(2, 4))
    torch._dynamo.reset()
    net = Net()
    plain, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), accumulate=2)
    compiled = torch.compile(plain, backend="aot_eager")
    for _ in range(2):
        compiled(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.updates == 1


def test_warnings_point_at_the_users_wrap_call():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.warns(UserWarning) as record:
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), iter([1, 2]), accumulate=2)
    assert {r.filename for r in record} == {__file__}


# --- the one pass and the technique interface (issue 19) ------------------------------------------------------

class _CountCalls:
    """Calls of each function's code object during a block, however a module imported the name. One profiler
    for all of them: sys.setprofile holds one function."""

    def __init__(self, *fns):
        self.codes = {fn.__code__: fn.__name__ for fn in fns}
        self.counts = dict.fromkeys(self.codes.values(), 0)

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code in self.codes:
            self.counts[self.codes[frame.f_code]] += 1

    def __enter__(self):
        import sys

        sys.setprofile(self._profile)
        return self.counts

    def __exit__(self, *exc):
        import sys

        sys.setprofile(None)


def test_wrap_parses_the_options_and_builds_the_precision_once():
    # Before the layout work the precision was validated three times, and budget checks re-parsed the options.
    from memwrap.config.options import parse_options
    from memwrap.precision.base import get_precision

    model = Net()
    opt = torch.optim.AdamW(model.parameters())
    loader = [torch.randn(8, 4)]
    with _CountCalls(parse_options, get_precision) as counts:
        memwrap.wrap(model, opt, loader, precision="bf16", checkpoint="auto", max_grad_norm=1.0,
                     gradient_accumulation_steps=2, budget_may_change=(), margin=None)
    assert counts == {"parse_options": 1, "get_precision": 1}


def test_every_technique_check_runs_through_the_one_interface():
    import inspect

    import memwrap.validation as validation

    assert validation.TECHNIQUES
    for technique in validation.TECHNIQUES:
        assert list(inspect.signature(technique.check_wrap).parameters) == ["call"], technique.__name__
        stepping = getattr(technique, "check_stepping", None)
        if stepping is not None:
            assert list(inspect.signature(stepping).parameters) == ["call", "optimizer"], technique.__name__
    # No technique keeps a checks module of its own beside the interface but the budget's, which holds its one check.
    names = {m.__name__ for m in validation.TECHNIQUES}
    assert "memwrap.techniques.budget.checks" in names and "memwrap.techniques.step_in_backward" in names


def test_a_new_technique_plugs_its_check_in_and_a_refusal_changes_nothing(monkeypatch, matmul_highest):
    import types

    import memwrap.validation as validation

    seen = []

    def check_wrap(call):
        seen.append((call.opts.accumulate, call.precision.name, sorted(call.given), call.model is not None))
        if call.opts.accumulate > 2:
            raise ValueError("the new technique refuses accumulate > 2. Fix: accumulate=2.")

    technique = types.ModuleType("my_technique")
    technique.check_wrap = check_wrap
    monkeypatch.setattr(validation, "TECHNIQUES", (*validation.TECHNIQUES, technique))
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = snapshot(model, opt)
    with pytest.raises(ValueError, match="refuses accumulate > 2"):
        memwrap.wrap(model, opt, accumulate=3, **CHANGING)
    assert_same(before, snapshot(model, opt))
    memwrap.wrap(model, opt, gradient_accumulation_steps=2, **CHANGING)
    assert seen == [(3, "tf32", ["accumulate", "checkpoint", "precision"], True),
                    (2, "tf32", ["accumulate", "checkpoint", "precision"], True)]


def test_a_technique_returning_an_unknown_plan_field_is_refused(monkeypatch):
    import types

    import memwrap.validation as validation

    technique = types.ModuleType("my_technique")
    technique.check_wrap = lambda call: {"chunk_size": 4}
    monkeypatch.setattr(validation, "TECHNIQUES", (*validation.TECHNIQUES, technique))
    with pytest.raises(TypeError, match=r"my_technique.check_wrap returned \['chunk_size'\]"):
        memwrap.wrap(Net())


def test_the_plan_is_frozen():
    import dataclasses

    from memwrap.validation import check_wrap

    plan = check_wrap((Net(),), {"checkpoint": "auto"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.checkpoint = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.call.opts = None  # type: ignore[misc]
