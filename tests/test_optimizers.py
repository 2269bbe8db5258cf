"""Built-in optimizer plugins, the registry (lookup, creation, listing, conversion) and the kit."""
from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memwrap
from memwrap.plugin.registry import ConversionWarning, OptimizerUnavailableError, UnknownOptimizerError, convert_optimizer, create_optimizer, get_optimizer_spec, optimizers
from memwrap.plugin.state_size import measure_state_bytes, predict_state_bytes
from memwrap.testing import check_optimizer

try:  # only the 8-bit tests need it; the torch optimizers and the missing-package error are tested without it
    import bitsandbytes as bnb
except ImportError:
    bnb = None
needs_bnb = pytest.mark.skipif(bnb is None, reason="bitsandbytes not installed (pip install bitsandbytes)")

BNB_NAMES = {"adamw_8bit", "paged_adamw_8bit", "lion_8bit"}
BUILTINS = ["adamw", "adamw_8bit", "paged_adamw_8bit", "lion_8bit", "adafactor", "torch_adafactor"]
# As parameters: the 8-bit ones skip without bitsandbytes, the others always run.
BUILTIN_PARAMS = [pytest.param(n, marks=needs_bnb) if n in BNB_NAMES else n for n in BUILTINS]
AVAILABLE = [n for n in BUILTINS if bnb is not None or n not in BNB_NAMES]
HF_NAMES = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_bnb_8bit": "adamw_8bit",
            "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit", "adafactor": "adafactor",
            "lion_8bit": "lion_8bit"}


@pytest.fixture(autouse=True)
def quiet_paging():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        yield
    # The hand-built references below use bitsandbytes' process-wide manager; start each test clean.
    if bnb is not None:
        bnb.optim.GlobalOptimManager.get_instance().initialize()


@pytest.mark.parametrize("name", BUILTIN_PARAMS)
def test_every_builtin_passes_the_conformance_kit(name):
    check_optimizer(name, steps=25)


def test_kit_catches_a_wrong_state_bytes(monkeypatch):
    import dataclasses

    from memwrap.plugin import state_size

    spec = get_optimizer_spec("adamw")
    wrong = dataclasses.replace(spec, state_bytes=lambda p, module=None, **hp: p.numel() * 4)
    # predict_state_bytes reads specs through the name it imported from the registry.
    monkeypatch.setattr(state_size, "get_optimizer_spec", lambda name: wrong)
    with pytest.raises(AssertionError, match=r"\[state_bytes\].*predicts"):
        check_optimizer("adamw", checks=("state_bytes",))


@pytest.mark.parametrize("alias,name", sorted(HF_NAMES.items()))
def test_hugging_face_optim_strings_are_aliases(alias, name):
    assert get_optimizer_spec(alias).name == name
    assert get_optimizer_spec(alias.upper().replace("_", "-")).name == name


def test_unknown_name_lists_names_and_closest_match():
    with pytest.raises(UnknownOptimizerError) as err:
        create_optimizer("adamw8bit", [torch.zeros(1, requires_grad=True)])
    message = str(err.value)
    assert "Did you mean 'adamw_8bit'?" in message
    assert all(n in message for n in BUILTINS) and "adamw_torch" in message


def test_adamw_uses_the_fused_kernel_and_matches_torch():
    torch.manual_seed(0)
    model = nn.Linear(16, 8)
    ref = copy.deepcopy(model)
    opt = create_optimizer("adamw", model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    assert opt.defaults["fused"] is True
    x = torch.randn(4, 16)
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not create_optimizer("adamw", nn.Linear(2, 2).parameters(), foreach=True).defaults["fused"]


def test_missing_bitsandbytes_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    for name in ("adamw_8bit", "paged_adamw_8bit", "lion_8bit"):
        spec = get_optimizer_spec(name)
        assert spec.available()[0] is False
        with pytest.raises(OptimizerUnavailableError) as err:
            create_optimizer(name, nn.Linear(2, 2).parameters())
        assert "pip install bitsandbytes" in str(err.value) and 'pip install "memwrap[bnb]"' in str(err.value)
        # The factory itself (reached e.g. when availability was checked earlier) says the same.
        with pytest.raises(OptimizerUnavailableError, match="pip install bitsandbytes"):
            spec.factory(nn.Linear(2, 2).parameters())
    rows = {r.name: r for r in optimizers()}
    assert not rows["adamw_8bit"].available and "pip install bitsandbytes" in rows["adamw_8bit"].install_hint
    assert rows["adamw"].available and rows["adafactor"].available


def test_listing_reports_state_bytes_measured_on_a_large_layer():
    rows = {r.name: r for r in optimizers()}
    assert set(BUILTINS) <= set(rows)
    layer = nn.Linear(1024, 1024, bias=False)
    for name in AVAILABLE:
        opt = create_optimizer(name, layer.parameters())
        layer(torch.randn(2, 1024)).sum().backward()
        opt.step()
        opt.zero_grad()
        # shared quantization maps are per optimizer, not per parameter
        shared = get_optimizer_spec(name).shared_state_bytes
        measured = measure_state_bytes(opt) - (shared([(layer.weight, layer)]) if shared else 0)
        assert rows[name].state_bytes_per_param == measured / layer.weight.numel(), name
    assert rows["adamw"].state_bytes_per_param > 8 and rows["adafactor"].state_bytes_per_param < 0.01
    if bnb is not None:
        assert 8 > rows["adamw_8bit"].state_bytes_per_param > 2 and rows["lion_8bit"].state_bytes_per_param < 1.1


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 96)  # 6144 values: above the 8-bit threshold, kept 32-bit anyway
        self.proj = nn.Linear(96, 96)
        self.norm = nn.LayerNorm(96)

    def forward(self, ids):
        return self.norm(self.proj(self.embed(ids))).sum(-1)


def _run(model, opt, steps=3):
    ids = torch.arange(32) % 64
    for _ in range(steps):
        model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()


@needs_bnb
@pytest.mark.parametrize("name,cls", [("adamw_8bit", "AdamW8bit"), ("paged_adamw_8bit", "PagedAdamW8bit"),
                                      ("lion_8bit", "Lion8bit")])
def test_8bit_optimizers_keep_embeddings_32bit_and_match_bitsandbytes(name, cls):
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    opt = create_optimizer(name, model, lr=1e-3)
    ref_opt = getattr(bnb.optim, cls)(ref.parameters(), lr=1e-3)
    bnb.optim.GlobalOptimManager.get_instance().register_module_override(ref.embed, "weight", {"optim_bits": 32})
    _run(model, opt)
    _run(ref, ref_opt)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert opt.state[model.embed.weight]["state1"].dtype == torch.float32
    assert opt.state[model.proj.weight]["state1"].dtype == torch.uint8
    assert measure_state_bytes(opt) == predict_state_bytes(name, model)


@pytest.mark.parametrize("name,hp", [("adamw", {}), ("adamw", {"amsgrad": True}), ("adamw", {"foreach": True}),
                                     ("adafactor", {}), pytest.param("adamw_8bit", {}, marks=needs_bnb),
                                     pytest.param("lion_8bit", {"min_8bit_size": 100}, marks=needs_bnb)])
def test_state_bytes_prediction_is_exact(name, hp):
    model = TinyLM()
    assert predict_state_bytes(name, model, **hp) == predict_state_bytes(name, copy.deepcopy(model).to("meta"), **hp)
    opt = create_optimizer(name, model, **hp)
    _run(model, opt, steps=1)
    assert measure_state_bytes(opt) == predict_state_bytes(name, model, **hp)


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 70), min_size=1, max_size=3), name=st.sampled_from(AVAILABLE),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_state_bytes_matches_measurement_for_any_shape(shape, name, dtype):
    param = nn.Parameter(torch.randn(shape).to(dtype))
    opt = create_optimizer(name, [param])
    param.grad = torch.randn_like(param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    assert measure_state_bytes(opt) == predict_state_bytes(name, [param])


def _two_group_adamw(model, **extra):
    return torch.optim.AdamW([
        {"params": [model.embed.weight], "lr": 1e-3, "weight_decay": 0.1, "name": "embeddings"},
        {"params": list(model.proj.parameters()) + list(model.norm.parameters()), "lr": 3e-4, "weight_decay": 0.0,
         "betas": (0.8, 0.95), "eps": 1e-6},
    ], **extra)


@needs_bnb
def test_conversion_keeps_groups_and_matches_a_hand_built_optimizer():
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)
        opt = convert_optimizer(_two_group_adamw(model), "adamw_bnb_8bit", model=model)
    assert type(opt) is bnb.optim.AdamW8bit
    assert [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in opt.param_groups] == [
        (1e-3, 0.1, (0.9, 0.999), 1e-8), (3e-4, 0.0, (0.8, 0.95), 1e-6)]
    assert opt.param_groups[0]["name"] == "embeddings"
    ref_opt = bnb.optim.AdamW8bit([
        {"params": [ref.embed.weight], "lr": 1e-3, "weight_decay": 0.1},
        {"params": list(ref.proj.parameters()) + list(ref.norm.parameters()), "lr": 3e-4, "weight_decay": 0.0,
         "betas": (0.8, 0.95), "eps": 1e-6}])
    bnb.optim.GlobalOptimManager.get_instance().register_module_override(ref.embed, "weight", {"optim_bits": 32})
    _run(model, opt)
    _run(ref, ref_opt)
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)


def _convert_warnings(optimizer, name):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        new = convert_optimizer(optimizer, name)
    return new, [str(w.message) for w in record if issubclass(w.category, ConversionWarning)]


@needs_bnb
def test_conversion_names_every_uncarried_hyperparameter_in_one_warning():
    model = TinyLM()
    new, messages = _convert_warnings(_two_group_adamw(model, amsgrad=True), "adamw_8bit")
    assert len(messages) == 1 and "amsgrad=True" in messages[0] and "betas" not in messages[0]
    assert [g["lr"] for g in new.param_groups] == [1e-3, 3e-4]

    new, messages = _convert_warnings(_two_group_adamw(model), "lion_8bit")
    assert len(messages) == 1 and "betas=(0.9, 0.999)" in messages[0] and "eps=1e-08" in messages[0]
    assert "smaller" in messages[0]  # Lion's learning-rate note
    assert [(g["lr"], g["weight_decay"], g["betas"]) for g in new.param_groups] == [
        (1e-3, 0.1, (0.9, 0.99)), (3e-4, 0.0, (0.9, 0.99))]

    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)
    new, messages = _convert_warnings(sgd, "adamw")
    assert len(messages) == 1 and "momentum=0.9" in messages[0] and "nesterov=True" in messages[0]
    assert "dampening" not in messages[0]  # neutral value: nothing lost
    assert new.param_groups[0]["lr"] == 0.1 and new.param_groups[0]["weight_decay"] == 1e-4

    adam_l2 = torch.optim.Adam(model.parameters(), weight_decay=0.01)
    _, messages = _convert_warnings(adam_l2, "adamw")
    assert len(messages) == 1 and "coupled L2" in messages[0]

    _, messages = _convert_warnings(torch.optim.AdamW(model.parameters()), "adamw")
    assert messages == []


def test_conversion_refuses_an_optimizer_with_state():
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters())
    _run(model, opt, steps=1)
    with pytest.raises(ValueError, match=r"already holds state for 5 parameter\(s\).*before the first"):
        convert_optimizer(opt, "adamw_8bit")


@needs_bnb
def test_create_optimizer_accepts_a_module_and_public_names_exist():
    model = TinyLM()
    opt = memwrap.create_optimizer("adamw_8bit", model, lr=1e-3)
    _run(model, opt, steps=1)
    assert opt.state[model.embed.weight]["state1"].dtype == torch.float32
    assert {r.name for r in memwrap.optimizers()} >= set(BUILTINS)


def test_spec_flags_describe_the_builtins():
    specs = {n: get_optimizer_spec(n) for n in BUILTINS}
    assert specs["adamw"].fused and specs["paged_adamw_8bit"].paged and not specs["adamw_8bit"].paged
    assert specs["adamw"].runs_on_fake and not specs["adamw_8bit"].runs_on_fake
    assert not specs["torch_adafactor"].runs_on_fake  # its step needs values (.item()); the kit proves it
    with pytest.raises(AssertionError, match=r"\[fake\]"):
        import dataclasses
        from unittest import mock

        from memwrap.testing import optimizer as kit

        lying = dataclasses.replace(specs["torch_adafactor"], runs_on_fake=True)
        with mock.patch.object(kit, "get_optimizer_spec", lambda name: lying):  # the name the kit calls
            check_optimizer("torch_adafactor", checks=("fake",))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", BUILTIN_PARAMS)
def test_builtins_conform_on_cuda(name):
    check_optimizer(name, device="cuda", steps=25)


@needs_bnb
def test_embedding_override_does_not_leak_into_later_optimizers():
    model = TinyLM()
    _run(model, create_optimizer("adamw_8bit", model), steps=1)
    # bitsandbytes' process-wide manager, used the plain way, records a 32-bit override at (0, 0) too.
    ref = TinyLM()
    ref_opt = bnb.optim.AdamW8bit(ref.parameters())
    bnb.optim.GlobalOptimManager.get_instance().register_module_override(ref.embed, "weight", {"optim_bits": 32})
    _run(ref, ref_opt, steps=1)
    layer = nn.Linear(96, 96)  # its weight sits at position (0, 0), like the embeddings above
    opt = create_optimizer("adamw_8bit", layer.parameters())
    layer(torch.randn(2, 96)).sum().backward()
    opt.step()
    assert opt.state[layer.weight]["state1"].dtype == torch.uint8
    assert measure_state_bytes(opt) == predict_state_bytes("adamw_8bit", layer)


@needs_bnb
def test_wrap_optim_converts_through_the_registry():
    model = TinyLM()
    wmodel, wopt = memwrap.wrap(model, _two_group_adamw(model), optim="adamw_bnb_8bit", accumulate=2)
    inner = memwrap.unwrap(wopt)
    assert type(inner) is bnb.optim.AdamW8bit
    assert [g["lr"] for g in inner.param_groups] == [1e-3, 3e-4]
    ids = torch.arange(32) % 64
    for _ in range(2):
        wmodel(ids).square().mean().backward()
        wopt.step()
        wopt.zero_grad()
    assert wopt.updates == 1
    assert inner.state[model.embed.weight]["state1"].dtype == torch.float32  # model= reached bind_model


@pytest.mark.parametrize("flags,fused", [({}, True), ({"fused": False}, False), ({"foreach": True}, False)])
def test_conversion_keeps_an_explicit_kernel_choice(flags, fused):
    # Lightning refuses to clip gradients with a fused AdamW under mixed precision: a user's fused=False must survive.
    model = TinyLM()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = convert_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, **flags), "adamw")
    assert bool(new.defaults["fused"]) is fused and new.defaults["lr"] == 1e-3
    assert getattr(new, "_step_supports_amp_scaling", False) is fused


# --- conversion: every hyperparameter the user set reaches the new optimizer's maths, or is named ------------------

# The user's optimizer per kind of target, each hyperparameter away from both optimizers' defaults.
CONVERSION_SOURCES = {
    "adam": (torch.optim.AdamW, dict(lr=0.02, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.3)),
    "sgd": (torch.optim.SGD, dict(lr=0.02, momentum=0.7, dampening=0.1, weight_decay=0.3)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.02, alpha=0.9, eps=1e-3, momentum=0.5, weight_decay=0.3)),
    "adagrad": (torch.optim.Adagrad, dict(lr=0.02, lr_decay=0.1, eps=1e-3, weight_decay=0.3,
                                          initial_accumulator_value=0.1)),
}
SOURCE_OF = {"sgd": "sgd", "schedule_free_sgd": "sgd", "lomo": "sgd", "adalomo": "sgd", "rmsprop": "rmsprop",
             "rmsprop_bnb": "rmsprop", "rmsprop_bnb_8bit": "rmsprop", "adagrad": "adagrad"}
# What the target needs besides the user's hyperparameters, given the same to both sides.
CONVERSION_EXTRA = {"galore": dict(target_modules="all-linear", rank=2, update_proj_gap=1),
                    "apollo": dict(target_modules="all-linear", rank=2, update_proj_gap=1),
                    "schedule_free_radam": dict(silent_sgd_phase=False)}  # else its first steps have lr 0


def _by_hand(name, carried):
    """The keyword arguments a user builds the target with by hand for the same maths (AdEMAMix: three betas)."""
    if "ademamix" in name and "betas" in carried:
        return {**carried, "betas": (*carried["betas"], 0.9999)}
    return carried


def _conversion_targets():
    params = []
    for row in optimizers():
        spec = get_optimizer_spec(row.name)
        marks = []
        if not row.available:
            marks.append(pytest.mark.skip(reason=f"not available here: {row.install_hint[:80]}"))
        elif "cpu" not in spec.devices and not torch.cuda.is_available():
            marks.append(pytest.mark.skip(reason="GPU-only kernels"))
        if row.name.startswith("adamw_torch_") and row.name.endswith("bit"):
            marks.append(pytest.mark.slow)  # torchao compiles its step
        params.append(pytest.param(row.name, marks=marks, id=row.name))
    return params


def _conversion_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 8))  # 6144 weights: 8-bit state for one
    return model.cuda() if torch.cuda.is_available() else model


# A second value for each hyperparameter: a target that dropped the user's value would step differently.
OTHER_VALUE = {"lr": 0.05, "betas": (0.7, 0.9), "eps": 1e-2, "weight_decay": 0.6, "momentum": 0.3, "dampening": 0.3,
               "alpha": 0.8, "lr_decay": 0.3, "initial_accumulator_value": 0.3}
# RAdam's first steps are un-adapted (no second moment, so no eps) until its variance estimate is tractable.
CONVERSION_STEPS = {"schedule_free_radam": 7}


def _three_steps(model, opt, steps=3):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(next(model.parameters()).device)
    model.train()
    for _ in range(steps):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", _conversion_targets())
def test_conversion_carries_every_hyperparameter_into_the_targets_maths(name):
    """wrap(optim=name) / convert_optimizer: one step sequence equals the target built by hand with the user's values;
    each carried value changes the result (so the comparison proves it arrived); every other one is named."""
    spec = get_optimizer_spec(name)
    cls, user = CONVERSION_SOURCES[SOURCE_OF.get(spec.name, "adam")]
    extra = next((v for k, v in CONVERSION_EXTRA.items() if spec.name.startswith(k)), {})
    model = _conversion_model()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        converted = convert_optimizer(cls(model.parameters(), **user), name, model=model, **extra)
    message = " ".join(str(w.message) for w in record if issubclass(w.category, ConversionWarning))
    assert "does not read" not in message, message
    carried = {k: v for k, v in user.items() if k in spec.carries}
    for key in set(user) - set(carried):
        assert f"{key}=" in message, f"{name}: {key} neither carried nor named in the warning: {message!r}"
    steps = CONVERSION_STEPS.get(spec.name, 3)
    ours = _three_steps(model, converted, steps)

    def by_hand(values):
        reference = _conversion_model()
        opt = create_optimizer(name, reference, **_by_hand(spec.name, values), **extra)
        return _three_steps(reference, opt, steps)

    for a, b in zip(ours, by_hand(carried), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{name}: converted != built by hand with {carried}")
    for key in carried:
        other = by_hand({**carried, key: OTHER_VALUE[key]})
        assert any(not torch.equal(a, b) for a, b in zip(ours, other)), (
            f"{name}: {key}={carried[key]!r} changes nothing in {steps} steps; the comparison would not see it dropped")


def test_stable_adamw_and_anyprecision_conversions_equal_optimi_built_by_hand():
    """The issue's case: AdamW(betas=(0.8, 0.95)) -> optimi, which reads beta1/beta2 from its param groups."""
    optimi = pytest.importorskip("optimi")
    for name, by_hand in (("stable_adamw", lambda p: optimi.StableAdamW(p, lr=0.02, betas=(0.8, 0.95), eps=1e-3,
                                                                        weight_decay=0.3, triton=False)),
                          ("adamw_anyprecision", lambda p: optimi.AdamW(p, lr=0.02, betas=(0.8, 0.95), eps=1e-3,
                                                                        weight_decay=0.3, kahan_sum=False,
                                                                        triton=False))):
        model, reference = _conversion_model(), _conversion_model()
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConversionWarning)
            _, wopt = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=0.02, betas=(0.8, 0.95), eps=1e-3,
                                                            weight_decay=0.3), optim=name)
        inner = memwrap.unwrap(wopt)
        assert (inner.param_groups[0]["beta1"], inner.param_groups[0]["beta2"]) == (0.8, 0.95)
        for a, b in zip(_three_steps(model, wopt), _three_steps(reference, by_hand(reference.parameters()))):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@needs_bnb
def test_rmsprop_to_bitsandbytes_keeps_alpha_and_names_what_it_cannot_do():
    """bitsandbytes' RMSprop keeps (alpha, momentum) as its groups' betas; momentum and centering it cannot do."""
    model, reference = _conversion_model(), _conversion_model()
    user = dict(lr=0.02, alpha=0.9, eps=1e-3, weight_decay=0.3)
    converted = convert_optimizer(torch.optim.RMSprop(model.parameters(), **user), "rmsprop_bnb_8bit", model=model)
    assert converted.param_groups[0]["betas"] == (0.9, 0)
    for a, b in zip(_three_steps(model, converted),
                    _three_steps(reference, bnb.optim.RMSprop(reference.parameters(), optim_bits=8, **user))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # bitsandbytes' RMSprop kernels never read momentum and cannot center: both named, never silently dropped.
    _, messages = _convert_warnings(torch.optim.RMSprop(model.parameters(), centered=True, momentum=0.5), "rmsprop_bnb")
    assert len(messages) == 1 and "centered=True" in messages[0] and "momentum=0.5" in messages[0]
    with pytest.raises(ValueError, match=r"momentum=0.5 would be ignored.*Fix: momentum=0, or optim='rmsprop'"):
        create_optimizer("rmsprop_bnb", model, lr=0.01, momentum=0.5)


def test_a_carried_value_the_target_does_not_read_is_named(monkeypatch):
    """The safety net: a plugin carrying a key its optimizer never reads (as optimi's betas were) is not silent."""
    import dataclasses

    from memwrap.plugin import registry

    pytest.importorskip("optimi")
    broken = dataclasses.replace(get_optimizer_spec("stable_adamw"), group_keys=None)
    monkeypatch.setattr(registry, "get_optimizer_spec", lambda name: broken)
    model = _conversion_model()
    with pytest.warns(ConversionWarning, match=r"does not read the param-group key\(s\) \['betas'\]"):
        convert_optimizer(torch.optim.AdamW(model.parameters(), betas=(0.8, 0.95)), "stable_adamw")
