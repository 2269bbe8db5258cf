"""Precision modes are plugins: registry, names, conformance kit, third-party plugins, TF32 restore."""
import gc
import warnings

import pytest
import torch

import memwrap
from memwrap.config.options import parse_options
from memwrap.plugin.manager import hookimpl, plugin_errors
from memwrap.precision.base import (Precision, PrecisionConflictError, UnknownPrecisionError, get_precision_class,
                               precision_names, precisions, resolve_precision)
from memwrap.testing import check_precision
from plugin_registration import registered

BUILTINS = {"fp32", "tf32", "bf16", "fp16", "bf16-true"}


def test_builtin_precisions_are_plugins_and_listed_with_their_memory():
    rows = {r.name: r for r in precisions()}
    assert BUILTINS <= set(rows) and BUILTINS <= set(precision_names())
    assert all("precision_" in rows[n].plugin for n in BUILTINS)  # registered through the entry-point group
    assert (rows["fp32"].param_dtype, rows["fp32"].autocast_dtype, rows["fp32"].weight_bytes) == ("float32", None, 4.0)
    assert (rows["bf16"].autocast_dtype, rows["bf16"].loss_scaling, rows["bf16"].grad_bytes) == ("bfloat16", False, 4.0)
    assert rows["fp16"].loss_scaling and rows["fp16"].autocast_dtype == "float16"
    true = rows["bf16-true"]
    assert (true.param_dtype, true.weight_bytes, true.grad_bytes) == ("bfloat16", 2.0, 2.0)
    assert "compensated" in true.optimizer_requirement and "none" in true.compensations


@pytest.mark.parametrize("given, canonical", [
    ("BF16", "bf16"), ("bf16-mixed", "bf16"), ("bfloat16", "bf16"), ("16-mixed", "fp16"), ("FP16", "fp16"),
    ("32-true", "fp32"), ("32", "fp32"), ("bf16-true", "bf16-true"), ("bf16_true", "bf16-true"),
    ("Pure-BF16", "bf16-true"), (" TF32 ", "tf32"),
])
def test_names_are_case_insensitive_and_lightning_aliases_resolve(given, canonical):
    assert resolve_precision(given) == canonical
    assert parse_options(precision=given).precision == canonical  # wrap() sees the canonical name
    net = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf32 on CPU
        model, _ = memwrap.wrap(net, torch.optim.AdamW(net.parameters()), precision=given)
    assert model._precision.name == canonical
    memwrap.unwrap(model)


def test_bad_precision_values_get_a_clear_error():
    # Before: precision=["bf16"] raised TypeError "unhashable type: 'list'", and "BF16" suggested 'fp16'.
    with pytest.raises(ValueError, match=r"precision must be a string such as 'bf16', got list \['bf16'\]"):
        memwrap.wrap(torch.nn.Linear(2, 2), precision=["bf16"])
    with pytest.raises(UnknownPrecisionError, match=r"unknown precision 'bf61'. Did you mean 'bf16'\?.*Valid: bf16"):
        parse_options(precision="bf61")
    with pytest.raises(ValueError, match="compensation='kahan' only applies to precisions.*Fix: drop compensation="):
        parse_options(precision="bf16", compensation="kahan")
    with pytest.raises(ValueError, match="compensation='kahn' is not known.*Did you mean 'kahan'"):
        parse_options(precision="bf16-true", compensation="kahn")


def test_tf32_is_restored_whatever_the_unwrap_order():
    # Issue 11 item 9: each model saved the value it found, so unwrapping A then B left "high".
    gc.collect()  # models wrapped with tf32 by earlier tests and dropped release their hold when collected
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = memwrap.wrap(torch.nn.Linear(2, 2), precision="tf32")
            b = memwrap.wrap(torch.nn.Linear(2, 2), precision="tf32")
        assert torch.get_float32_matmul_precision() == "high"
        memwrap.unwrap(a)
        assert torch.get_float32_matmul_precision() == "high"  # b still trains with TF32
        memwrap.unwrap(a)  # twice: harmless, does not release b's hold
        assert torch.get_float32_matmul_precision() == "high"
        memwrap.unwrap(b)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_a_dropped_tf32_model_releases_its_hold():
    gc.collect()
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            a = memwrap.wrap(torch.nn.Linear(2, 2), precision="tf32")
        assert torch.get_float32_matmul_precision() == "high"
        del a
        gc.collect()
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16"])
def test_builtin_precisions_pass_the_conformance_kit(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf32 on CPU says it trains in plain fp32
        check_precision(name)


def test_conformance_kit_catches_a_wrong_memory_claim():
    class Liar(Precision):
        name = "liar"
        param_dtype = torch.float16  # claims fp16 storage, converts nothing

    with _registered(Liar), pytest.raises(AssertionError, match=r"check_precision\('liar'\) failed \[train\]"):
        check_precision("liar", checks=("train",))
    with _registered(Liar), pytest.raises(AssertionError, match=r"\[memory\].*fix memory_per_param"):
        check_precision("liar", checks=("memory",))


def _registered(*classes, name="test_precision_plugin", hook=None):
    """Register precision classes (or a ready ``memwrap_precisions`` hook) as a run-time plugin in a ``with`` block."""
    return registered(name, memwrap_precisions=hook or (lambda: list(classes)))


class Fp32Logged(Precision):
    """A third-party precision: fp32 that counts the forwards it wraps (docs/plugins.md's example shape)."""

    name = "fp32-logged"
    aliases = ("logged",)
    description = "fp32, counting forwards"
    forwards = 0

    def autocast(self, device_type):
        Fp32Logged.forwards += 1
        return super().autocast(device_type)


def test_a_third_party_precision_is_found_listed_used_and_conforms():
    with _registered(Fp32Logged):
        assert "fp32-logged" in precision_names() and get_precision_class("LOGGED") is Fp32Logged
        row = next(r for r in precisions() if r.name == "fp32-logged")
        assert "test_precision_plugin" in row.plugin
        model = memwrap.wrap(torch.nn.Linear(2, 1), precision="logged")
        model(torch.ones(1, 2))
        assert Fp32Logged.forwards == 1
        check_precision("fp32-logged")
    assert "fp32-logged" not in precision_names()  # gone with its plugin


def test_a_broken_precision_plugin_is_isolated_and_named():
    def broken():
        raise RuntimeError("boom")

    with pytest.warns(UserWarning, match="broken_precisions.*memwrap_precisions.*boom"):
        with _registered(name="broken_precisions", hook=hookimpl(broken)):
            assert BUILTINS <= set(precision_names())  # everyone else still works
            assert resolve_precision("BF16") == "bf16"
            assert any(e.name == "broken_precisions" and e.hook == "memwrap_precisions" for e in plugin_errors())

    with pytest.warns(UserWarning, match="must return Precision subclasses"):
        with _registered("not a class", name="bad_result"):
            assert "bf16" in precision_names()


def test_two_plugins_claiming_one_name_conflict_naming_both():
    class Other(Precision):
        name = "bf16-other"
        aliases = ("bfloat16",)  # the built-in bf16 already has this alias

    with _registered(Other, name="shadow_plugin"):
        with pytest.raises(PrecisionConflictError, match="'bfloat16'.*precision_bf16.*shadow_plugin"):
            get_precision_class("bfloat16")
        assert resolve_precision("bf16-other") == "bf16-other"  # its other names still work


class HalfwayBF16(Precision):
    """Converts parameters one by one and fails at the third: a plugin that breaks part-way (issue 22 item 15)."""

    name = "halfway-bf16"
    param_dtype = torch.bfloat16

    def convert_module(self, module):
        for i, t in enumerate([*module.buffers(), *module.parameters()]):
            if i == 4:
                raise RuntimeError("halfway-bf16 cannot convert this tensor")
            t.data = t.data.to(torch.bfloat16)
            if t.grad is not None:
                t.grad = t.grad.to(torch.bfloat16)
        return module


def test_a_conversion_that_fails_part_way_leaves_every_tensor_as_it_was():
    # Before: the tensors converted before the failure stayed bf16 (the dtype conversion had no undo).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    model(torch.randn(5, 4)).sum().backward()  # gradients present, BatchNorm statistics moved
    opt = torch.optim.Adagrad(model.parameters())  # state made in the constructor, in fp32
    tensors = [*model.buffers(), *model.parameters()]
    before = [(t, t.detach().clone(), None if t.grad is None else t.grad.clone()) for t in tensors]
    state = {p: {k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()}
    with _registered(HalfwayBF16), pytest.raises(RuntimeError, match="halfway-bf16 cannot convert"):
        memwrap.wrap(model, opt, precision="halfway-bf16", checkpoint={"Linear"})
    assert [*model.buffers(), *model.parameters()] == tensors  # the same objects
    for t, value, grad in before:
        assert t.dtype == value.dtype and torch.equal(t, value)  # bit for bit
        assert (t.grad is None) == (grad is None) and (grad is None or torch.equal(t.grad, grad))
    for p in model.parameters():
        assert opt.state[p].keys() == state[p].keys()
        assert all(torch.equal(opt.state[p][k], v) and opt.state[p][k].dtype == v.dtype for k, v in state[p].items())
    from memwrap.checkpointing.apply import is_checkpointed

    assert not any(is_checkpointed(m) for m in model.modules())  # the change before it was undone too
    memwrap.wrap(model, opt, precision="bf16-true", compensation="none")  # a retry behaves like a first call
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_the_conversion_undo_restores_after_a_success():
    from memwrap.precision.base import convert_model, get_precision

    net = torch.nn.Linear(3, 2)
    opt = torch.optim.Adagrad(net.parameters())
    weight = net.weight.detach().clone()
    undo = convert_model(get_precision("bf16-true", compensation="none"), net, opt)
    assert net.weight.dtype == opt.state[net.weight]["sum"].dtype == torch.bfloat16
    undo()  # what wrap() runs when a change after the conversion fails
    assert net.weight.dtype == opt.state[net.weight]["sum"].dtype == torch.float32
    assert torch.equal(net.weight, weight)
