"""The disk cache of traces (memwrap/memory/tracing/disk_cache.py): a hit is the trace itself, and every input that
changes a trace changes its key."""
from __future__ import annotations

import importlib
import json
import sys
import textwrap

import pytest
import torch
from torch import nn

import memwrap

from memwrap.memory.tracing.disk_cache import cached, remember, stats, trace_key
from memwrap.models import GPT, GPTConfig


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMWRAP_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "1")
    monkeypatch.setenv("MEMWRAP_VALUE_CACHE", "1")
    return tmp_path / "cache" / "traces"


def _gpt(n_layer=2, n_embd=32):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, n_head=2, n_embd=n_embd, vocab_size=64, block_size=16))


def _batch(mb=2):
    return (torch.randint(0, 64, (mb, 16)), torch.randint(0, 64, (mb, 16)))


def _key(model, batch=None, loss_fn=None, options=None, optimizer="adamw", **layout):
    batch = batch if batch is not None else _batch()
    return trace_key(model, lambda: batch, loss_fn, options or {"precision": "fp32", "accumulate": 1}, optimizer,
                     **layout)


def test_a_hit_is_the_same_estimate_as_a_fresh_trace(cache_on, monkeypatch):
    model, batch = _gpt(), _batch()
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "0")
    fresh = memwrap.estimate(model, batch, precision="bf16", checkpoint="full", accumulate=2)
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "1")
    before = stats()
    first = memwrap.estimate(model, batch, precision="bf16", checkpoint="full", accumulate=2)
    second = memwrap.estimate(model, batch, precision="bf16", checkpoint="full", accumulate=2)
    after = stats()
    assert after["misses"] - before["misses"] == 1 and after["hits"] - before["hits"] == 1
    for est in (first, second):
        assert est.peak == fresh.peak and est.breakdown == fresh.breakdown and est.phases == fresh.phases
        assert est.flops == fresh.flops and est.state == fresh.state and est.flop_classes == fresh.flop_classes
        assert est.flop_classes and sum(est.flop_classes.values()) == est.flops
    assert "read from the trace cache" in second.method and "read from the trace cache" not in first.method
    assert len(list(cache_on.glob("*/*.json"))) == 1


def test_off_by_environment_stores_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMWRAP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "0")
    memwrap.estimate(_gpt(), _batch())
    assert not (tmp_path / "traces").exists()


def test_the_key_follows_the_model_structure():
    base = _key(_gpt())
    assert _key(_gpt()) == base  # a new instance of the same model: the same key
    assert _key(_gpt(n_embd=48)) != base  # parameter shapes
    assert _key(_gpt(n_layer=3)) != base  # depth
    frozen = _gpt()
    frozen.transformer.h[0].requires_grad_(False)
    assert _key(frozen) != base  # freezing
    half = _gpt().to(torch.bfloat16)
    assert _key(half) != base  # dtypes
    untied = _gpt()
    untied.lm_head.weight = nn.Parameter(untied.lm_head.weight.detach().clone())
    assert _key(untied) != base  # tying
    hooked = _gpt()
    hooked.transformer.h[1].register_forward_hook(lambda m, i, o: None)
    assert _key(hooked) != base  # hooks
    evaluated = _gpt().eval()
    assert _key(evaluated) != base  # train/eval
    dropped = _gpt()
    setattr(dropped.transformer.h[0], "some_setting", 3)
    assert _key(dropped) != base  # a module's own settings


def test_the_key_follows_the_batch_options_optimizer_loss_and_layout():
    model = _gpt()
    base = _key(model)
    assert _key(model, batch=_batch(4)) != base
    assert _key(model, batch=(torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)))) != base
    assert _key(model, options={"precision": "bf16", "accumulate": 1}) != base
    assert _key(model, options={"precision": "fp32", "accumulate": 1, "checkpoint": "full"}) != base
    assert _key(model, optimizer="sgd") != base and _key(model, optimizer=None) != base
    assert _key(model, world_size=4, strategy="fsdp2") != base
    scale = 2.0
    loss_a = lambda out, y: out.float().pow(2).mean() * scale  # noqa: E731
    scale_b = 3.0
    loss_b = lambda out, y: out.float().pow(2).mean() * scale_b  # noqa: E731
    assert _key(model, loss_fn=loss_a) != base and _key(model, loss_fn=loss_a) != _key(model, loss_fn=loss_b)
    keep = memwrap.memory.search.space.AsBuilt(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    keep_plain = memwrap.memory.search.space.AsBuilt(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert _key(model, optimizer=keep) != _key(model, optimizer=keep_plain)


def test_the_key_follows_the_model_code(tmp_path, monkeypatch):
    """Editing the forward of a model defined in the user's own package changes the key."""
    pkg = tmp_path / "userpkg_tc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    src = textwrap.dedent("""
        import torch
        from torch import nn
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(8, 8)
            def forward(self, x):
                return self.fc(x){extra}
    """)
    (pkg / "model.py").write_text(src.format(extra=""))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("userpkg_tc.model")
    batch = torch.randn(2, 8)
    first = _key(mod.Net(), batch=batch)
    assert _key(mod.Net(), batch=batch) == first
    (pkg / "model.py").write_text(src.format(extra=".relu() * 2"))
    mod = importlib.reload(mod)
    assert _key(mod.Net(), batch=batch) != first
    sys.modules.pop("userpkg_tc.model", None)
    sys.modules.pop("userpkg_tc", None)


def test_a_damaged_entry_is_traced_again_and_replaced(cache_on):
    model, batch = _gpt(), _batch()
    good = memwrap.estimate(model, batch)
    (entry,) = cache_on.glob("*/*.json")
    entry.write_text("{not json")
    again = memwrap.estimate(model, batch)
    assert again.peak == good.peak and "trace cache" not in again.method
    json.loads(entry.read_text())  # replaced by a readable entry
    assert "read from the trace cache" in memwrap.estimate(model, batch).method


def test_an_unwritable_folder_warns_and_plans_on(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("MEMWRAP_CACHE_DIR", str(blocker))
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "1")
    monkeypatch.setenv("MEMWRAP_WORKSPACE", "0")  # the workspace cache has its own warning for the same folder
    with pytest.warns(RuntimeWarning, match="could not store a trace"):
        est = memwrap.estimate(_gpt(), _batch())
    monkeypatch.setenv("MEMWRAP_TRACE_CACHE", "0")
    assert est.peak == memwrap.estimate(_gpt(), _batch()).peak


def test_an_option_without_identity_is_traced_not_cached(cache_on):
    class Opaque:
        __slots__ = ()

    calls = []
    before = stats()["uncacheable"]
    out = cached(lambda: calls.append(1) or "traced", _gpt(), _batch, None, {"x": Opaque()}, "sgd",
                 kinds=(object, object))
    assert out == "traced" and calls == [1] and stats()["uncacheable"] == before + 1


def test_a_plan_run_again_reads_every_trace(cache_on):
    from memwrap.models import build_preset, preset_batch

    model = build_preset("gpt2-tiny")
    kw = dict(budget="2GiB", global_batch=4, precisions=("bf16", "fp32"), checkpoints=(None, "full"),
              step_in_backward=(False,), chunked_loss=(False,))
    first = memwrap.plan(model, lambda mb: preset_batch("gpt2-tiny", mb, 32), **kw)
    hits = stats()["hits"]
    second = memwrap.plan(model, lambda mb: preset_batch("gpt2-tiny", mb, 32), **kw)
    assert stats()["hits"] - hits == len({(c.micro_batch, c.precision, c.checkpoint) for c in first.candidates})
    assert [c.to_dict()["estimate"]["peak"] for c in second.candidates] == \
        [c.to_dict()["estimate"]["peak"] for c in first.candidates]
    assert [c.label for c in second.candidates] == [c.label for c in first.candidates]


def test_remember_stores_a_value_and_the_fsdp2_probe_uses_it(cache_on, monkeypatch):
    calls = []
    assert remember("t", ["a"], lambda: calls.append(1) or {"v": 1}) == {"v": 1}
    assert remember("t", ["a"], lambda: calls.append(1) or {"v": 2}) == {"v": 1}
    assert remember("t", ["b"], lambda: calls.append(1) or None) is None
    assert calls == [1, 1]

    from memwrap.memory.sharded import trace as sharded

    probes = []
    real = sharded.sharding_refusal
    monkeypatch.setattr(sharded, "sharding_refusal", lambda name, mesh: probes.append(name) or real(name, mesh))
    first = sharded.fsdp2_refusals(["adamw", "adafactor"], 2)
    second = sharded.fsdp2_refusals(["adamw", "adafactor"], 2)
    assert probes == ["adamw", "adafactor"] and first == second


def test_an_optimizer_that_cannot_step_is_not_probed_again_until_the_libraries_change(tmp_path, monkeypatch):
    from memwrap.memory.tracing import workspace

    calls = []

    def make(module):
        calls.append(1)
        raise ImportError("this optimizer's library is broken here")

    ws = workspace.Workspace(torch.device("cpu"), tmp_path)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="ImportError: this optimizer's library is broken here"):
            ws.step_temporary("broken", make, 1000, torch.float32)
    with pytest.raises(RuntimeError, match="broken here"):  # a new process reads it from the file
        workspace.Workspace(torch.device("cpu"), tmp_path).step_temporary("broken", make, 1000, torch.float32)
    assert calls == [1]
    monkeypatch.setattr(workspace, "installed_digest", lambda: "other libraries")
    with pytest.raises(RuntimeError, match="broken here"):
        workspace.Workspace(torch.device("cpu"), tmp_path).step_temporary("broken", make, 1000, torch.float32)
    assert calls == [1, 1]
