"""Every Hugging Face ``TrainingArguments.optim`` name as a memwrap optimizer, against Trainer's own optimizer.

The reference is transformers itself: ``Trainer.create_optimizer()`` with the stock ``TrainingArguments``
builds Trainer's optimizer, and the same call with ``memwrap_trainer_kwargs(model, args)`` builds memwrap's.
Trainer's is driven as Trainer drives it (``optimizer.train()``, LOMO's ``fused_backward``), memwrap's by
the unchanged loop (``loss.backward(); optimizer.step(); optimizer.zero_grad()``); the parameters must match.
"""
from __future__ import annotations

import importlib.util
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memwrap
from memwrap.plugin.registry import OptimizerUnavailableError, create_optimizer, get_optimizer_spec
from memwrap.plugin.state_size import predict_state_bytes
from memwrap.testing import check_optimizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")
from tests.hf_helpers import hf_args  # noqa: E402

HF_NAMES = (
    "adamw_torch adamw_torch_fused adamw_torch_xla adamw_torch_npu_fused adafactor adamw_anyprecision adamw_torch_4bit "
    "adamw_torch_8bit ademamix sgd adagrad adamw_bnb_8bit adamw_8bit ademamix_8bit lion_8bit lion_32bit "
    "paged_adamw_32bit paged_adamw_8bit paged_ademamix_32bit paged_ademamix_8bit paged_lion_32bit paged_lion_8bit "
    "rmsprop rmsprop_bnb rmsprop_bnb_8bit rmsprop_bnb_32bit galore_adamw galore_adamw_8bit galore_adafactor "
    "galore_adamw_layerwise galore_adamw_8bit_layerwise galore_adafactor_layerwise lomo adalomo grokadamw "
    "schedule_free_radam schedule_free_adamw schedule_free_sgd apollo_adamw apollo_adamw_layerwise stable_adamw"
).split()
HARDWARE = {"adamw_torch_xla": "xla", "adamw_torch_npu_fused": "npu"}
# Kernels that need CUDA (galore-torch's 8-bit path, lomo-optim's AdaLomo state): tested on a GPU
# (benchmarks/gpu_check.py has their row), refused with the fix on CPU.
CUDA_ONLY = {"adalomo", "galore_adamw_8bit", "galore_adamw_8bit_layerwise"}
# Run on the GPU when there is one (paging is real only on CUDA), with the CUDA-only ones.
ON_GPU = CUDA_ONLY | ({n for n in HF_NAMES if n.startswith("paged")} if torch.cuda.is_available() else set())
SLOW = {"adamw_torch_4bit", "adamw_torch_8bit"}  # torchao compiles its step: tens of seconds on CPU
# memwrap picks torch's fused AdamW kernel where Trainer's adamw_torch takes foreach: same maths, other rounding.
TOLERANCE = {"adamw_torch": dict(rtol=1e-5, atol=1e-6)}
EXACT = dict(rtol=0, atol=0)
LOW_RANK = dict(optim_target_modules=["q_proj", "up"], optim_args="rank=4,update_proj_gap=2")


def _param(name, *extra_marks):
    marks = list(extra_marks)
    if name in CUDA_ONLY:
        marks.append(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (see benchmarks/gpu_check.py)"))
    if name in SLOW:
        marks.append(pytest.mark.slow)
    return pytest.param(name, marks=marks, id=name)


@pytest.fixture(autouse=True)
def quiet_and_clean():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
        warnings.filterwarnings("ignore", category=FutureWarning)
        yield
    if "bitsandbytes" in sys.modules:  # Trainer registers embedding overrides in bitsandbytes' process-wide manager
        sys.modules["bitsandbytes"].optim.GlobalOptimManager.get_instance().initialize()


class Tiny(nn.Module):
    """An embedding, a norm and linears named like a transformer's; two weights reach 8-bit state (>= 4096 values)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 64)
        self.q_proj = nn.Linear(64, 64)
        self.up = nn.Linear(64, 96, bias=False)
        self.down = nn.Linear(96, 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 64)

    def forward(self, input_ids, labels=None):
        h = self.embed(input_ids)
        h = h + self.q_proj(h)
        h = h + self.down(torch.tanh(self.up(h)))
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


BATCHES = [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i)) for i in range(3)]
# Schedule-free RAdam's first steps have a zero step size (its "silent SGD phase"): more steps, so that weights move.
STEPS = {"schedule_free_radam": 6}


def _trainer_optimizer(tmp_path, name, use_memwrap, **args_kw):
    from transformers import Trainer

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    model = Tiny()
    if name in ON_GPU:  # Trainer moves the model to the GPU; these kernels need it there
        args_kw.setdefault("use_cpu", False)
    args = hf_args(tmp_path, optim=name, learning_rate=1e-2, gradient_accumulation_steps=1, **args_kw)
    extra = memwrap_trainer_kwargs(model, args) if use_memwrap else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, **extra)
        return model, trainer.create_optimizer(), args


def _batches(steps):
    return [torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(i)) for i in range(steps)]


def _drive_like_trainer(model, opt, args, steps=3):
    """What Trainer does each step: optimizer.train(), backward (LOMO: fused_backward), step, zero_grad."""
    lomo = type(opt).__module__.startswith("lomo_optim")
    device = next(model.parameters()).device
    for ids in _batches(steps):
        ids = ids.to(device)
        model.train()
        if hasattr(opt, "train") and callable(opt.train):
            opt.train()
        loss = model(ids, labels=ids)
        if lomo:
            opt.fused_backward(loss, args.learning_rate)  # accelerate's lomo_backward; its step() is then a no-op
        else:
            loss.backward()
            opt.step()
        model.zero_grad()
    model.eval()
    if hasattr(opt, "eval") and callable(opt.eval):
        opt.eval()  # as Trainer's evaluation loop does


def _drive_plain_loop(model, opt, steps=3):
    """The user's unchanged loop; model.eval() and a forward at the end (schedule-free must follow the model)."""
    device = next(model.parameters()).device
    for ids in _batches(steps):
        ids = ids.to(device)
        model.train()
        loss = model(ids, labels=ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        model(BATCHES[0].to(device), labels=BATCHES[0].to(device))


def _no_triton_on_cpu(monkeypatch, name):
    """optimi 0.3 picks its Triton kernel for CPU tensors whenever Triton is installed (it decides on an empty list)
    and then fails, so Trainer's own stable_adamw cannot step on CPU. Only that kernel choice is changed for the
    reference; memwrap passes triton=False off-GPU itself."""
    if name == "stable_adamw" and not torch.cuda.is_available():
        import importlib

        monkeypatch.setattr(importlib.import_module("optimi.stableadamw"), "_default_to_triton", lambda params: False)


def _args_for(name):
    return dict(LOW_RANK) if name.startswith(("galore", "apollo")) else {}


TRAINER_NAMES = [n for n in HF_NAMES if n not in HARDWARE and n not in {"adamw_anyprecision"}]


@pytest.mark.parametrize("name", [_param(n) for n in TRAINER_NAMES])
def test_memwrap_builds_trainers_optimizer_with_the_same_maths(tmp_path, monkeypatch, name):
    """Trainer's optimizer driven by Trainer's protocol == memwrap's (taken over from args.optim) in a plain loop."""
    kw = dict(_args_for(name), weight_decay=0.1)
    if name.endswith("_layerwise"):  # taken over from args.optim under a constant schedule only (see below)
        kw["lr_scheduler_type"] = "constant"
    if get_optimizer_spec(name).updates_in_backward:
        # Trainer's own clip finds no gradient left for these; memwrap's clips (tests/test_trainer_norm_pass.py).
        # The maths compared here is the unclipped update.
        kw["max_grad_norm"] = 0.0
    _no_triton_on_cpu(monkeypatch, name)
    ours, our_opt, _ = _trainer_optimizer(tmp_path / "m", name, True, **kw)
    assert type(our_opt).__name__.startswith(("MemwrapOptimizer",)) is False  # a real optimizer, not the stand-in
    if name == "galore_adafactor_layerwise":
        # transformers 5 cannot build this one (it sets relative_step=False after building the per-parameter
        # optimizers): its maths is galore_adafactor's, stepped one parameter at a time.
        with pytest.raises(ValueError, match="relative_step"):
            _trainer_optimizer(tmp_path / "t0", name, False, **kw)
        theirs, their_opt, args = _trainer_optimizer(tmp_path / "t", "galore_adafactor", False, **kw)
    else:
        theirs, their_opt, args = _trainer_optimizer(tmp_path / "t", name, False, **kw)
    _drive_like_trainer(theirs, their_opt, args, STEPS.get(name, 3))
    _drive_plain_loop(ours, our_opt, STEPS.get(name, 3))
    tolerance = TOLERANCE.get(name, EXACT)
    changed = False
    for (pname, p), q, start in zip(ours.named_parameters(), theirs.parameters(), Tiny().parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}: {pname}", **tolerance)
        changed |= not torch.equal(p.cpu(), start)
    assert changed, f"{name}: three steps changed nothing; the comparison would prove nothing"


# Trainer's optim_args strings, parsed by memwrap as Trainer parses them (non-default values each).
OPTIM_ARGS = [
    ("sgd", "momentum=0.9,nesterov=True,dampening=0"),
    ("adagrad", "lr_decay=0.01,eps=1e-6"),
    ("rmsprop", "momentum=0.5,centered=True,alpha=0.9"),
    ("ademamix_8bit", "beta3=0.999,alpha=4.0,t_alpha=10,t_beta3=10"),
    ("grokadamw", "lamb=1.5,alpha_init=0.9,gradient_clipping=0.5"),
    ("schedule_free_adamw", "weight_lr_power=1.5,r=0.5"),
    ("schedule_free_sgd", "weight_lr_power=1.0"),
    ("stable_adamw", "max_lr=0.02"),
    ("apollo_adamw", "rank=2,scale=2.0,scale_type=tensor,update_proj_gap=1"),
    ("galore_adamw", "rank=2,scale=0.5,proj_type=left,update_proj_gap=1"),
]


@pytest.mark.parametrize("name,optim_args", OPTIM_ARGS, ids=[n for n, _ in OPTIM_ARGS])
def test_optim_args_strings_mean_what_they_mean_to_trainer(tmp_path, monkeypatch, name, optim_args):
    _no_triton_on_cpu(monkeypatch, name)
    kw = {**_args_for(name), "optim_args": optim_args, "adam_beta1": 0.8, "warmup_steps": 2}
    ours, our_opt, _ = _trainer_optimizer(tmp_path / "m", name, True, **kw)
    theirs, their_opt, args = _trainer_optimizer(tmp_path / "t", name, False, **kw)
    _drive_like_trainer(theirs, their_opt, args)
    _drive_plain_loop(ours, our_opt)
    for (pname, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}: {pname}", **EXACT)


def _groups(opt):
    """Param groups as Trainer's optimizer holds them (a layer-wise one: its per-parameter optimizers' groups)."""
    inner = getattr(opt, "optimizer_dict", None)
    if inner is not None:  # transformers' LayerWiseDummyOptimizer
        return [g for o in inner.values() for g in o.param_groups]
    return list(opt.param_groups)


_KERNEL_KEYS = {"foreach", "fused", "capturable", "differentiable", "triton"}  # same maths, kernel choice


@pytest.mark.parametrize("name", [_param(n) for n in TRAINER_NAMES if n != "galore_adafactor_layerwise"])
def test_trainer_optimizer_has_trainers_param_groups_for_a_plain_loop(tmp_path, monkeypatch, name):
    """The plain-loop route trainer_optimizer(model, args) == Trainer(...).create_optimizer(): the same groups (weight
    decay on most weights, 0.0 on biases and norm weights), each with Trainer's hyperparameters."""
    from memwrap.integrations.transformers.trainer import trainer_optimizer

    _no_triton_on_cpu(monkeypatch, name)
    kw = dict(_args_for(name), weight_decay=0.1)
    theirs, their_opt, args = _trainer_optimizer(tmp_path / "t", name, False, **kw)
    ours = Tiny().to(next(theirs.parameters()).device)
    our_opt = trainer_optimizer(ours, args)
    index = {id(q): i for i, q in enumerate(theirs.parameters())}
    mine = {id(p): i for i, p in enumerate(ours.parameters())}
    ours_by = {frozenset(mine[id(p)] for p in g["params"]): g for g in _groups(our_opt)}
    their_groups = [g for g in _groups(their_opt) if g["params"]]
    assert len(their_groups) == len(ours_by), name
    if not get_optimizer_spec(name).needs_model:
        assert sorted(g["weight_decay"] for g in their_groups) == [0.0, 0.1]
    for group in their_groups:
        key = frozenset(index[id(q)] for q in group["params"])
        assert key in ours_by, f"{name}: Trainer's group of parameters {sorted(key)} is not one of memwrap's"
        for k, v in group.items():
            if k != "params" and k not in _KERNEL_KEYS:
                assert ours_by[key].get(k, "missing") == v, f"{name}: {k}: memwrap {ours_by[key].get(k, 'missing')!r}"


def test_trainer_optimizer_trains_as_trainers_own_in_a_plain_loop(tmp_path):
    """bitsandbytes' AdamW defaults to weight_decay=0.01: with only trainer_hyperparameters every weight decayed so."""
    from memwrap.integrations.transformers.trainer import trainer_optimizer

    for name in ("adamw_8bit", "galore_adamw"):
        kw = dict(_args_for(name), weight_decay=0.1)
        theirs, their_opt, args = _trainer_optimizer(tmp_path / name, name, False, **kw)
        model = Tiny()
        opt = trainer_optimizer(model, args)
        _drive_like_trainer(theirs, their_opt, args)
        _drive_plain_loop(model, opt)
        for p, q in zip(model.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, **EXACT)
    # The route documented before: one group, no Trainer weight decay split; it trains otherwise.
    from memwrap.integrations.transformers.trainer import trainer_hyperparameters

    theirs, their_opt, args = _trainer_optimizer(tmp_path / "old", "adamw_8bit", False, weight_decay=0.1)
    model = Tiny()
    _drive_like_trainer(theirs, their_opt, args)
    _drive_plain_loop(model, memwrap.create_optimizer(args.optim, model, **trainer_hyperparameters(args)))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), theirs.parameters()))


def test_adamw_anyprecision_is_optimi_adamw_matching_torch_adamw(tmp_path):
    """Trainer cannot build it (torchdistx has no PyPI release); memwrap's stand-in has AnyPrecision's fp32 maths."""
    from transformers import Trainer

    args = hf_args(tmp_path, optim="adamw_anyprecision")
    with pytest.raises(ValueError, match="torchdistx"):
        Trainer.get_optimizer_cls_and_kwargs(args, Tiny())
    ours, reference = Tiny(), Tiny()
    opt = create_optimizer("adamw_anyprecision", ours, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(reference.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    _drive_plain_loop(ours, opt)
    _drive_plain_loop(reference, ref)
    for p, q in zip(ours.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)  # optimi's debiased-beta form: rounding differs
    with pytest.raises(ValueError, match="momentum_dtype.*Fix"):
        create_optimizer("adamw_anyprecision", Tiny(), lr=1e-3, momentum_dtype="bfloat16")


# --- resolution: create_optimizer, wrap(optim=...), options_from(args) ---------------------------------------------

def test_the_names_are_transformers_own():
    from transformers.training_args import OptimizerNames

    assert sorted(n.value for n in OptimizerNames) == sorted(HF_NAMES)


@pytest.mark.parametrize("name", HF_NAMES)
def test_every_name_resolves_through_options_from_and_wrap_checks(tmp_path, name):
    from memwrap.config.options import parse_options

    spec = get_optimizer_spec(name)
    from transformers import TrainingArguments

    options = memwrap.options_from(hf_args(tmp_path, optim=name, gradient_accumulation_steps=1))
    if name == TrainingArguments.optim:  # Trainer's default only means "AdamW": options_from leaves the optimizer be
        assert "optim" not in options
    else:
        assert options["optim"] == name
    assert parse_options(**{**options, "optim": name}).optim == name
    assert spec.trainer_kwargs is not None  # memwrap knows how Trainer builds it
    listed = {n for row in memwrap.optimizers() for n in (row.name, *row.aliases)}
    assert name in listed


@pytest.mark.parametrize("name", ["sgd", "adafactor", "schedule_free_adamw", "lomo", "stable_adamw"])
def test_wrap_optim_converts_to_each_kind(name):
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wmodel, wopt = memwrap.wrap(model, optimizer, optim=name)
    before = [p.detach().clone() for p in model.parameters()]
    for ids in BATCHES:
        wmodel(ids, labels=ids).backward()
        wopt.step()
        wopt.zero_grad()
    assert wopt.updates == len(BATCHES)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("name,device", sorted(HARDWARE.items()))
def test_hardware_names_say_why_they_are_unavailable(name, device):
    ok, hint = get_optimizer_spec(name).available()
    assert not ok and f"{device} hardware" in hint and "adamw_torch" in hint
    with pytest.raises(OptimizerUnavailableError, match=f"{device} hardware.*Fix"):
        create_optimizer(name, Tiny().parameters(), lr=1e-3)


# --- bad input -----------------------------------------------------------------------------------------------------

def test_optim_args_that_do_not_apply_are_refused_with_the_keys_that_do(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    args = hf_args(tmp_path, optim="sgd", optim_args="momentun=0.9")
    with pytest.raises(ValueError, match=r"\['momentun'\] do not apply to optim='sgd'.*dampening, momentum, nesterov"):
        memwrap_trainer_kwargs(Tiny(), args)
    with pytest.raises(ValueError, match="optim_args momentum='fast'"):
        memwrap_trainer_kwargs(Tiny(), hf_args(tmp_path, optim="sgd", optim_args="momentum=fast"))


@pytest.mark.parametrize("name", ["galore_adamw", "apollo_adamw_layerwise"])
def test_low_rank_without_target_modules_names_the_fix(tmp_path, name):
    with pytest.raises(ValueError, match="needs target modules.*Fix: target_modules=.*optim_target_modules"):
        create_optimizer(name, Tiny(), lr=1e-3)
    with pytest.raises(ValueError, match="no nn.Linear layer of the model matches"):
        create_optimizer(name, Tiny(), lr=1e-3, target_modules=["attention"])
    with pytest.raises(ValueError, match="needs the model"):
        create_optimizer(name, Tiny().parameters(), lr=1e-3, target_modules="all-linear")
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=rf"optim='{name}' needs target modules.*Fix: .*optim_target_modules="):
        memwrap.wrap(model, optimizer, optim=name)
    assert memwrap.unwrap(optimizer) is optimizer and not model._forward_pre_hooks  # refused before anything changed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU runs")
@pytest.mark.parametrize("name", ["adalomo", "galore_adamw_8bit"])
def test_gpu_only_optimizers_on_a_cpu_run_name_the_fix(name):
    kw = {"target_modules": "all-linear"} if name.startswith("galore") else {}
    with pytest.raises(ValueError, match="Fix") as err:
        create_optimizer(name, Tiny(), lr=1e-3, **kw)
    assert "CUDA" in str(err.value) or "GPU" in str(err.value)


@pytest.mark.parametrize("name", ["paged_ademamix_8bit", "paged_ademamix_32bit"])
def test_paged_ademamix_on_cpu_refuses_what_bitsandbytes_cannot_page(name):
    bnb = pytest.importorskip("bitsandbytes")
    with pytest.raises(ValueError, match="cannot page its state on CPU.*Fix"):
        create_optimizer(name, [nn.Parameter(torch.zeros(100_000))], lr=1e-3)
    # Trainer's own fails there too, with bitsandbytes' raw error.
    big = nn.Parameter(torch.zeros(400, 300))
    theirs = bnb.optim.AdEMAMix([big], optim_bits=8 if "8bit" in name else 32, is_paged=True)
    big.grad = torch.ones_like(big)
    with pytest.raises(RuntimeError):
        theirs.step()
    create_optimizer(name, [nn.Parameter(torch.zeros(99_999))], lr=1e-3)  # below: no paging


@pytest.mark.parametrize("name", ["ademamix", "paged_ademamix_32bit"])
def test_32bit_ademamix_is_the_class_trainer_builds_and_steps_on_cpu(tmp_path, name):
    """Trainer builds bnb.optim.AdEMAMix(optim_bits=32); bitsandbytes' AdEMAMix32bit fails on CPU for every shape."""
    bnb = pytest.importorskip("bitsandbytes")
    from transformers import Trainer

    their_cls, their_kwargs = Trainer.get_optimizer_cls_and_kwargs(hf_args(tmp_path, optim=name), Tiny())
    model = Tiny()
    opt = create_optimizer(name, model, lr=1e-2)
    assert type(opt) is their_cls is bnb.optim.AdEMAMix
    assert (opt.args.optim_bits, opt.is_paged) == (their_kwargs["optim_bits"], their_kwargs["is_paged"])
    before = [p.detach().clone() for p in model.parameters()]
    _drive_plain_loop(model, opt, 1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # every shape stepped


@pytest.mark.parametrize("options", [dict(accumulate=2), dict(max_grad_norm=1.0), dict(precision="fp16")],
                         ids=["accumulate", "clip", "fp16"])
@pytest.mark.parametrize("name", ["lomo", "galore_adamw_layerwise"])
def test_updates_in_backward_refuse_what_they_cannot_do(name, options):
    model = Tiny()
    kw = {"target_modules": "all-linear", "rank": 4} if name.startswith("galore") else {}
    targets = {"optim_target_modules": "all-linear"} if name.startswith("galore") else {}
    if "accumulate" not in options:
        # Clipping and fp16 are no longer refused: the norm pass takes the global norm and the overflow check inside
        # the same backward, before any update (tests/test_norm_pass_in_backward.py holds them to clip_grad_norm_ then
        # the optimizer's own step, and to torch AMP's GradScaler loop).
        _, opt = memwrap.wrap(model, create_optimizer(name, model, lr=1e-3, **kw), **options)
        assert opt.norm_in_backward is not None and opt.optimizer.updates_deferred
        other = Tiny()
        _, opt = memwrap.wrap(other, torch.optim.SGD(other.parameters(), lr=1e-3), optim=name, **targets, **options)
        assert opt.norm_in_backward is not None
        return
    with pytest.raises(ValueError, match="updates each parameter inside backward.*Fix"):
        memwrap.wrap(model, create_optimizer(name, model, lr=1e-3, **kw), **options)
    with pytest.raises(ValueError, match="inside backward.*Fix"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1e-3), optim=name, **targets, **options)


def test_a_missing_library_gives_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "galore_torch", None)
    ok, hint = get_optimizer_spec("galore_adamw").available()
    assert not ok and 'pip install "memwrap[galore]"' in hint
    with pytest.raises(OptimizerUnavailableError, match=r'pip install "memwrap\[galore\]"'):
        create_optimizer("galore_adamw", Tiny(), lr=1e-3, target_modules="all-linear")


def test_layerwise_gradient_accumulation_is_refused_like_trainer(tmp_path):
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    args = hf_args(tmp_path, optim="galore_adamw_layerwise", gradient_accumulation_steps=2, **LOW_RANK)
    with pytest.raises(ValueError, match="cannot accumulate.*Fix: set it to 1"):
        memwrap_trainer_kwargs(Tiny(), args, optim="galore_adamw_layerwise")


# --- what the plugins add: modes, layer-wise scheduling, state --------------------------------------------------------

def test_schedule_free_follows_the_models_mode():
    model = Tiny()
    opt = create_optimizer("schedule_free_adamw", model, lr=1e-2)
    ids = BATCHES[0]
    for _ in range(2):  # after one step the averaged x still equals y
        model.train()
        model(ids, labels=ids).backward()
        opt.step()  # would raise "not in train mode" without the hook
        opt.zero_grad()
    trained = [p.detach().clone() for p in model.parameters()]
    model.eval()
    model(ids, labels=ids)
    assert opt.param_groups[0]["train_mode"] is False
    assert any(not torch.equal(a, b) for a, b in zip(trained, model.parameters()))  # x, not y, for evaluation
    model.train()
    model(ids, labels=ids)
    assert opt.param_groups[0]["train_mode"] is True
    for a, b in zip(trained, model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # back to y


def test_layerwise_param_groups_are_the_inner_optimizers_so_schedulers_work():
    model = Tiny()
    opt = create_optimizer("galore_adamw_layerwise", model, lr=1e-2, target_modules="all-linear", rank=4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    scheduler.step()
    assert all(inner.param_groups[0]["lr"] == 5e-3 for inner in opt._inner.values())
    assert len(opt.param_groups) == len(list(model.parameters()))


def test_lomo_in_a_plain_loop_equals_fused_backward():
    lomo_optim = pytest.importorskip("lomo_optim")
    ours, theirs = Tiny(), Tiny()
    opt = create_optimizer("lomo", ours, lr=1e-2)
    ref = lomo_optim.Lomo(theirs, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    for step, ids in enumerate(BATCHES):
        ours(ids, labels=ids).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
        ref.fused_backward(theirs(ids, labels=ids), 1e-2 / (step + 1))
    for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, **EXACT)
    assert all(p.grad is None for p in ours.parameters())  # gradients freed as they were used


# --- the conformance kit and the planner's numbers ------------------------------------------------------------------

KIT_HP = {"galore": dict(target_modules="all-linear", rank=4), "apollo": dict(target_modules="all-linear", rank=4),
          "schedule_free_radam": dict(silent_sgd_phase=False)}  # RAdam's first steps are otherwise silent (lr 0)


def _kit_names():
    names = sorted({get_optimizer_spec(n).name for n in HF_NAMES} | {"torch_adafactor"})
    return [_param(n) for n in names if n not in HARDWARE]


@pytest.mark.parametrize("name", _kit_names())
def test_every_plugin_passes_the_conformance_kit(name):
    from memwrap.testing import RegressionModel

    hp = next((v for k, v in KIT_HP.items() if name.startswith(k)), {})
    # torchao compiles its step once per parameter shape: the kit's model in the shapes the Trainer test used.
    factory = (lambda: RegressionModel(dim=64, hidden=64)) if name in SLOW else None
    check_optimizer(name, steps=15, lr=1e-2, device="cuda" if name in ON_GPU else "cpu", model_factory=factory, **hp)


def test_state_bytes_of_the_low_rank_optimizers_on_a_transformer_shape():
    """Exact for 'all-linear' (the planner's assumption); measured after a real step."""
    from memwrap.plugin.state_size import measure_state_bytes

    for name in ("galore_adamw", "galore_adafactor", "apollo_adamw"):
        model = Tiny()
        opt = create_optimizer(name, model, lr=1e-2, target_modules="all-linear", rank=8)
        model(BATCHES[0], labels=BATCHES[0]).backward()
        opt.step()
        assert predict_state_bytes(name, model, rank=8) == measure_state_bytes(opt), name


# --- inside Trainer's own loop (scheduler, accelerate, LOMO's fused_backward) --------------------------------------

@pytest.mark.parametrize("name", ["lomo", "galore_adamw_layerwise", "schedule_free_adamw"])
def test_trainer_trains_with_memwrap_optimizer_exactly_as_with_its_own(tmp_path, name):
    from transformers import Trainer

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    class TinyOutputs(Tiny):  # Trainer reads the loss from the model's outputs
        def forward(self, input_ids, labels=None):
            return {"loss": super().forward(input_ids, labels)}

    # transformers 5.24's own layer-wise optimizers never see the LR schedule (get_scheduler receives the
    # accelerate-wrapped optimizer, not its LayerWiseDummyOptimizer, so the per-parameter schedulers are not made);
    # memwrap's follow it. Compared under a constant schedule, where both mean the same.
    schedule = "constant" if name.endswith("layerwise") else "linear"

    def train(use_memwrap):
        model = TinyOutputs()
        args = hf_args(tmp_path / str(use_memwrap), optim=name, learning_rate=1e-2, gradient_accumulation_steps=1,
                       max_steps=3, lr_scheduler_type=schedule, max_grad_norm=0.0, **_args_for(name))
        extra = memwrap_trainer_kwargs(model, args) if use_memwrap else {}
        data = [{"input_ids": ids[0], "labels": ids[0]} for ids in _batches(6)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            Trainer(model=model, args=args, train_dataset=data, **extra).train()
        return model

    ours, theirs = train(True), train(False)
    for (pname, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}: {pname}", **EXACT)


def test_a_tied_head_is_not_a_low_rank_target_as_in_trainer(tmp_path):
    """Trainer picks targets by parameter name, so a head tied to the embedding stays a plain parameter."""
    from transformers import Trainer

    model = Tiny()
    model.head = nn.Linear(64, 64, bias=False)
    model.head.weight = model.embed.weight
    args = hf_args(tmp_path, optim="galore_adamw", optim_target_modules="all-linear")
    _, theirs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    ours = create_optimizer("galore_adamw", model, target_modules="all-linear")
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs["params"]]
    assert model.embed.weight in ours.param_groups[0]["params"]


def test_the_planner_skips_backward_updating_optimizers_where_wrap_would_refuse_them():
    from memwrap.memory import plan
    from memwrap.models import build_preset, preset_batch

    result = plan(lambda: build_preset("gpt2-tiny"), lambda mb: preset_batch("gpt2-tiny", mb, 16), budget="1GiB",
                  global_batch=2, micro_batches=(2, 1), precisions=("fp32",), checkpoints=(None,),
                  optimizers=("lomo", "adamw"), margin=(0.0, 0))
    rows = {(c.accumulate, c.optim) for c in result.candidates}
    skipped = [why for label, why in result.skipped if "lomo" in label]
    assert skipped and all("updates inside backward" in why for why in skipped)  # micro-batch 1 = accumulate 2
    assert (1, "lomo") in rows and (2, "lomo") not in rows and (2, "adamw") in rows


# --- GaLore / APOLLO through wrap(optim=...) and options_from(args) -------------------------------------------------

@pytest.mark.parametrize("name", ["galore_adamw", "galore_adafactor_layerwise", "apollo_adamw", "apollo_adamw_layerwise"])
def test_low_rank_names_resolve_through_options_from_and_wrap(tmp_path, name):
    """TrainingArguments(optim_target_modules=..., optim_args=...) -> options_from -> wrap(): the optimizer built by hand
    with the same targets, projection and the user's own hyperparameters."""
    args = hf_args(tmp_path, optim=name, gradient_accumulation_steps=1, max_grad_norm=0.0, **LOW_RANK)
    options = memwrap.options_from(args)
    assert options["optim_target_modules"] == ["q_proj", "up"] and options["optim_args"] == LOW_RANK["optim_args"]
    model, reference = Tiny(), Tiny()
    user = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # galore_adafactor: Adam's betas/eps do not carry, and say so
        wmodel, wopt = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), **user), **options)
    spec = get_optimizer_spec(name)
    by_hand = create_optimizer(name, reference, target_modules=["q_proj", "up"], rank=4, update_proj_gap=2,
                               **{k: v for k, v in user.items() if k in spec.carries})
    projected = [g for g in wopt.optimizer.param_groups if "rank" in g]
    assert projected and all(g["rank"] == 4 and g["update_proj_gap"] == 2 for g in projected)
    for ids in _batches(3):
        wmodel(ids, labels=ids).backward()
        wopt.step()
        wopt.zero_grad()
        reference(ids, labels=ids).backward()
        by_hand.step()
        by_hand.zero_grad()
    for (pname, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}: {pname}", **EXACT)


@pytest.mark.parametrize("options,match", [
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="rank=0"), r"rank=0 must be a whole number"),
    (dict(optim="apollo_adamw", optim_target_modules="all-linear", optim_args="rank=-2"), r"rank=-2 must be a whole"),
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="scale=0"), r"scale=0.0 must be a number > 0"),
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="update_proj_gap=0"),
     r"update_proj_gap=0 must be a whole number >= 1"),
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="proj_type=diag"),
     r"proj_type='diag' is not one of"),
    (dict(optim="apollo_adamw", optim_target_modules="all-linear", optim_args="scale_type=row"),
     r"scale_type='row' is not one of 'channel', 'tensor'"),
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="rnak=4"), r"\['rnak'\].*Did you mean 'rank'"),
    (dict(optim="galore_adamw", optim_target_modules="all-linear", optim_args="lr=0.1"), r"\['lr'\] do not apply"),
    (dict(optim="sgd", optim_args="momentum=0.9"), r"\['momentum'\] for optim='sgd' are hyperparameters of the optimizer"),
    (dict(optim="sgd", optim_target_modules=["q_proj"]), r"optim_target_modules=.*is for the low-rank optimizers"),
    (dict(optim_target_modules=["q_proj"]), r"no optim= was given"),
    (dict(optim="galore_adamw"), r"needs target modules.*optim_target_modules"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_low_rank_settings_are_refused_at_wrap_before_anything_changes(options, match):
    model = Tiny()
    optimizer = torch.optim.AdamW(model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        memwrap.wrap(model, optimizer, **options)
    assert not model._forward_pre_hooks and not model._forward_hooks and optimizer.param_groups[0]["lr"] == 1e-3
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("name,hp,match", [
    ("galore_adamw", dict(target_modules="all-linear", rank=0), r"'galore_adamw': rank=0 must be a whole number >= 1"),
    ("apollo_adamw_layerwise", dict(target_modules="all-linear", rank=0), r"rank=0 must be a whole number >= 1"),
    ("galore_adamw", dict(target_modulez="all-linear"), r"no hyperparameter 'target_modulez'. Did you mean 'target_modules'"),
    ("adamw_8bit", dict(betas=0.9), r"'adamw_8bit': betas=0.9 must be a pair of numbers in \[0, 1\). Fix: e.g. betas="),
    ("adamw", dict(lr=-1e-3), r"lr=-0.001 must be a finite number >= 0. Fix"),
    ("sgd", dict(lr=0.1, momentum=-0.9), r"momentum=-0.9 must be a finite number >= 0"),
    ("adamw", dict(weight_decay="0.01"), r"weight_decay='0.01' is a string, not a number. Fix: weight_decay=0.01"),
    ("sgd", dict(lr=0.1, momentun=0.9), r"'sgd' takes no hyperparameter 'momentun'. Did you mean 'momentum'"),
])
def test_bad_hyperparameters_get_memwraps_message_naming_the_option(name, hp, match):
    model = Tiny()
    with pytest.raises((ValueError, TypeError), match=match):
        create_optimizer(name, model, **hp)
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())  # nothing was hooked


# --- layer-wise GaLore / APOLLO inside Trainer.train() under an LR schedule ----------------------------------------

def _train_layerwise(tmp_path, name, *, use_memwrap, explicit=False, per_parameter_schedulers=False, **args_kw):
    from transformers import Trainer

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    class TinyOutputs(Tiny):
        def forward(self, input_ids, labels=None):
            return {"loss": super().forward(input_ids, labels)}

    class PerParameterSchedulers(Trainer):
        """Trainer as transformers means it: what get_scheduler does when it receives the LayerWiseDummyOptimizer (one
        scheduler per parameter's optimizer, stepped in its backward hook). Its LayerWiseDummyScheduler itself fails
        under torch 2.13 (a strict zip of one dummy group with every parameter's lr), so only its hooks are made."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            from transformers.optimization import get_scheduler

            inner = self.optimizer.optimizer.optimizer_dict
            schedulers = {p: get_scheduler(self.args.lr_scheduler_type, optimizer=o,
                                           num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
                                           num_training_steps=num_training_steps) for p, o in inner.items()}
            for p in inner:
                p.register_post_accumulate_grad_hook(lambda q: schedulers[q].step())
            return super().create_scheduler(num_training_steps, optimizer)

    model = TinyOutputs()
    # max_grad_norm=0: Trainer's own layer-wise optimizers are never clipped (no gradient is left when Trainer clips),
    # memwrap's are (tests/test_trainer_norm_pass.py); compared here is the schedule.
    args = hf_args(tmp_path, optim=name, learning_rate=1e-3, gradient_accumulation_steps=1, max_steps=3,
                   **{"max_grad_norm": 0.0, **_args_for(name), **args_kw})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        extra = (memwrap_trainer_kwargs(model, args, optim=name) if explicit else memwrap_trainer_kwargs(model, args)
                 ) if use_memwrap else {}
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in _batches(6)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = (PerParameterSchedulers if per_parameter_schedulers else Trainer)(
            model=model, args=args, train_dataset=data, **extra)
        trainer.train()
    return model, extra, [str(w.message) for w in record]


@pytest.mark.parametrize("name", ["galore_adamw_layerwise", "apollo_adamw_layerwise"])
def test_layerwise_in_trainer_under_a_schedule_matches_trainer(tmp_path, name):
    """Issue 22 item 24 (max_steps=3, learning_rate=1e-3, the default linear schedule and clipping): the difference
    was the schedule, which Trainer's own layer-wise optimizers never see. From args.optim Trainer keeps its own
    (a warning says why); optim= explicitly builds memwrap's, equal to Trainer's per-parameter schedulers."""
    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs

    args = hf_args(tmp_path / "d", optim=name, learning_rate=1e-3, gradient_accumulation_steps=1, **_args_for(name))
    with pytest.warns(UserWarning, match=r"keeps its own optimizer.*never see lr_scheduler_type='linear'.*constant"):
        assert memwrap_trainer_kwargs(Tiny(), args) == {}  # Trainer's own optimizer, untouched
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under a constant schedule memwrap's is taken over, as exact (test above);
        # max_grad_norm=0: no norm pass (tests/test_trainer_norm_pass.py has the clipped runs).
        assert memwrap_trainer_kwargs(Tiny(), hf_args(tmp_path / "c", optim=name, gradient_accumulation_steps=1,
                                                      lr_scheduler_type="constant", max_grad_norm=0.0,
                                                      **_args_for(name)))

    theirs, _, _ = _train_layerwise(tmp_path / "t", name, use_memwrap=False)
    ours, extra, messages = _train_layerwise(tmp_path / "m", name, use_memwrap=True, explicit=True)
    assert extra and any("follows the schedule" in m for m in messages), messages
    scheduled, _, _ = _train_layerwise(tmp_path / "s", name, use_memwrap=False, per_parameter_schedulers=True)
    for (pname, p), q, r in zip(ours.named_parameters(), scheduled.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=f"{name}: {pname}", rtol=1e-6, atol=1e-7)
    assert any(not torch.equal(p, r) for p, r in zip(ours.parameters(), theirs.parameters()))  # the schedule acted
