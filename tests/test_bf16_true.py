"""precision="bf16-true": bf16 weights, gradients and state, no fp32 master copy; compensated updates."""
import warnings

import pytest
import torch

import memwrap
from memwrap.plugin.registry import ConversionWarning

optimi = pytest.importorskip("optimi")


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))


def batch(seed=0, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def train(model, opt, steps, seed=0):
    x, y = batch(seed)
    for _ in range(steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def test_adamw_becomes_kahan_summed_optimi_with_its_hyperparameters_and_everything_is_bf16():
    model = net()
    keys = list(model.state_dict())
    groups = [{"params": [model[0].weight], "lr": 1e-3, "weight_decay": 0.1, "name": "w0"},
              {"params": [model[0].bias, *model[2].parameters()], "lr": 2e-3, "betas": (0.8, 0.95), "eps": 1e-7}]
    opt = torch.optim.AdamW(groups, weight_decay=0.0)
    with pytest.warns(ConversionWarning, match=r"AdamW converted to optimi.AdamW \(kahan_sum=True\)"):
        m, o = memwrap.wrap(model, opt, precision="bf16-true")
    inner = memwrap.unwrap(o)
    assert isinstance(inner, optimi.AdamW)
    got = [(g["lr"], g["beta1"], g["beta2"], g["eps"], g["weight_decay"], g["kahan_sum"]) for g in inner.param_groups]
    assert got == [(1e-3, 0.9, 0.999, 1e-8, 0.1, True), (2e-3, 0.8, 0.95, 1e-7, 0.0, True)]
    assert inner.param_groups[0]["name"] == "w0"  # the user's own group keys are kept
    assert list(model.state_dict()) == keys and list(m.state_dict()) == keys
    x, y = batch()
    out = m(x)
    assert out.dtype == torch.float32  # outputs come back fp32 for the loss
    torch.nn.functional.mse_loss(out, y).backward()
    assert all(p.dtype == torch.bfloat16 and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    o.step()
    state = inner.state[model[0].weight]
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "kahan_comp")} == {torch.bfloat16}
    mem = m._precision.memory_per_param(torch.empty(10, device="meta"))
    assert mem == {"weights": 20, "grads": 20} and m._precision.compensation_bytes(model[0].weight) == 2 * 128


@pytest.mark.parametrize("make, target", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=0.05), "AdamW"),
    (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01), "Adam"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01), "SGD"),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.9), "SGD"),
])
def test_conversion_keeps_the_maths(make, target):
    # The converted optimizer, on fp32 weights (where Kahan summation is off), follows the source optimizer:
    # proof that every hyperparameter was carried with its meaning.
    from memwrap_plugins.precision.true_bf16 import _build

    ref, conv = net(), net()
    source = make(ref.parameters())
    converted = _build(make(conv.parameters()), f"optimi.{target}", step_in_backward=False)
    assert type(converted).__name__ == target
    train(ref, source, 5)
    train(conv, converted, 5)
    for a, b in zip(ref.parameters(), conv.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _fine_tune(compensation, steps=100, lr=2e-3):
    """Adam moves each weight by about lr per step; the weights lie in [8, 16), where one bf16 ulp is
    0.0625: every step is 1/30 of an ulp (a relative step of 2e-4, below bf16's 2^-8 resolution)."""
    torch.manual_seed(0)
    w0 = (8 + 7.9 * torch.rand(256)).bfloat16().float()
    ref = torch.nn.Parameter(w0.clone())
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    model = torch.nn.Linear(256, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_(w0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        m, o = memwrap.wrap(model, opt, precision="bf16-true", compensation=compensation)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 256, generator=g)
    for _ in range(steps):
        m(x).sum().backward()
        o.step()
        o.zero_grad()
        ref.grad = x.sum(0).to(torch.bfloat16).float()  # the same gradient the bf16 model sees
        ref_opt.step()
    state = memwrap.unwrap(o).state[model.weight]
    weight = model.weight.detach().float()[0]
    effective = weight + (state["kahan_comp"].float()[0] if "kahan_comp" in state else 0)
    return (ref.detach() - w0).abs().mean().item(), (weight - w0).abs().mean().item(), \
        (effective - ref.detach()).abs().max().item()


def test_kahan_compensation_keeps_updates_that_plain_bf16_rounds_away():
    moved_ref, moved_plain, err_plain = _fine_tune("none")
    assert moved_ref == pytest.approx(100 * 2e-3, rel=0.05)  # fp32 moved every weight by ~0.2 (3 ulps)
    assert moved_plain == 0.0 and err_plain > 0.19  # plain bf16: every update rounded away
    moved_ref, moved_kahan, err = _fine_tune("kahan")
    assert moved_kahan == pytest.approx(moved_ref, rel=0.1)  # compensated: the weights really move
    assert err < 0.1 * 0.0625  # weight + Kahan buffer stay within a tenth of an ulp of the fp32 reference


@pytest.mark.slow
def test_stochastic_rounding_through_torchao_is_unbiased():
    pytest.importorskip("torchao")
    moved_ref, moved_sr, _ = _fine_tune("stochastic", steps=40, lr=5e-3)
    assert moved_sr == pytest.approx(moved_ref, rel=0.3)


def test_an_optimizer_without_compensated_equivalent_is_refused_and_nothing_changes():
    model = net()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"torch.Adafactor: this optimizer has no 'kahan'-compensated equivalent.*"
                                         r"compensation='none'.*precision='bf16'"):
        memwrap.wrap(model, opt, precision="bf16-true")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # a refused call changes nothing
    with pytest.raises(ValueError, match="cannot carry amsgrad=True"):
        memwrap.wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True), precision="bf16-true")
    with pytest.raises(ValueError, match="no 'stochastic'-compensated equivalent \\(with compensation='kahan' it has"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16-true", compensation="stochastic")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_explicit_opt_out_keeps_the_optimizer_uncompensated():
    model = net()
    opt = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConversionWarning)  # no conversion, no notice
        m, o = memwrap.wrap(model, opt, precision="bf16-true", compensation="none")
    assert memwrap.unwrap(o) is opt
    train(m, o, 3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_already_compensated_optimizers_are_kept_and_a_stale_scheduler_is_refused():
    model = net()
    own = optimi.AdamW(model.parameters(), lr=1e-3)  # kahan_sum=None: applied to bf16 weights
    _, o = memwrap.wrap(model, own, precision="bf16-true")
    assert memwrap.unwrap(o) is own
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match="scheduler passed along still drives the old one"):
        memwrap.wrap(model, opt, sched, precision="bf16-true")
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_optim_option_then_bf16_true():
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        _, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), optim="adamw", precision="bf16-true")
    assert isinstance(memwrap.unwrap(o), optimi.AdamW)
    model = net()
    with pytest.raises(ValueError, match="no 'kahan'-compensated equivalent"):
        memwrap.wrap(model, torch.optim.AdamW(model.parameters()), optim="adafactor", precision="bf16-true")


def test_conversion_runs_on_fake_tensors_for_the_planner():
    # The planner traces a step on fake parameters: the bf16 conversion and the Kahan step must run there too.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memwrap.memory.tracing.trace import fake_model
    from memwrap.precision.base import get_precision

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(net(), mode, torch.device("cpu"))
    with mode, warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)
        precision = get_precision("bf16-true")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        assert precision.check_optimizer(opt)
        opt = precision.convert_optimizer(opt, model)
        precision.convert_module(model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    state = opt.state[model[0].weight]
    assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "kahan_comp")} == {torch.bfloat16}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


# --- floating inputs are cast to bf16, as Lightning's bf16-true (issue 22 item 16) --------------------------------

@pytest.mark.parametrize("norm", [lambda n: torch.nn.LayerNorm(n), lambda n: torch.nn.BatchNorm1d(n),
                                  lambda n: torch.nn.GroupNorm(1, n)], ids=["layernorm", "batchnorm", "groupnorm"])
def test_floating_inputs_are_cast_like_lightning_bf16_true(norm):
    # Before: "mixed dtype (CPU): expect parameter to have scalar type of Float" (fp32 input, bf16 norm weights).
    precision = pytest.importorskip("lightning.fabric.plugins.precision")
    import copy

    torch.manual_seed(0)
    model = torch.nn.Sequential(norm(4), torch.nn.Linear(4, 3), torch.nn.GELU(), norm(3))
    ref = copy.deepcopy(model)
    x = torch.randn(6, 4, requires_grad=True)
    m = memwrap.wrap(model, precision="bf16-true")
    out = m(x)
    out.square().sum().backward()
    # Lightning Fabric's own bf16-true plugin on the same module and input: the reference.
    plugin = precision.HalfPrecision("bf16-true")
    ref = plugin.convert_module(ref)
    x_ref = x.detach().clone().requires_grad_()
    with plugin.forward_context():
        ref_out = ref(plugin.convert_input(x_ref))
    ref_out = plugin.convert_output(ref_out)
    ref_out.square().sum().backward()
    assert out.dtype == torch.float32  # outputs come back fp32 (memwrap's output rule)
    assert torch.equal(out, ref_out)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, q.grad), name
    assert x.grad.dtype == torch.float32 and torch.equal(x.grad, x_ref.grad)  # the input's gradient flows back


def test_integer_inputs_stay_and_uncast_arguments_are_passed_as_given():
    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.norm = torch.nn.LayerNorm(4)

        def forward(self, batch):
            seen.append(batch)
            return self.norm(self.emb(batch["ids"]) * batch["scale"][:, None, None]).sum()

    m = memwrap.wrap(Model(), precision="bf16-true")
    ids = torch.tensor([[1, 2], [3, 4]])
    m({"ids": ids, "scale": torch.ones(2)})  # a float entry: the dict is rebuilt with it in bf16
    assert seen[-1]["ids"] is ids and seen[-1]["scale"].dtype == torch.bfloat16
    batch = {"ids": ids, "scale": torch.ones(2, dtype=torch.bfloat16)}
    m(batch)
    assert seen[-1] is batch  # nothing to cast: the caller's own object


# --- optimizer state made before the first step follows the parameters (issue 22 item 10) -----------------------

def test_adagrad_state_from_its_constructor_becomes_bf16_and_trains_as_built_on_bf16():
    # Before: torch.optim.Adagrad creates state["sum"] in its constructor, on the fp32 parameters; after wrap() it
    # stayed fp32 (twice the memory the docs promise, and another update than Adagrad built on bf16 weights).
    model, ref = net(), net().to(torch.bfloat16)
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    ref_opt = torch.optim.Adagrad(ref.parameters(), lr=0.05)
    m, o = memwrap.wrap(model, opt, precision="bf16-true", compensation="none")
    assert o.optimizer is opt  # compensation='none': the user's own optimizer steps
    for p in model.parameters():
        assert opt.state[p]["sum"].dtype == torch.bfloat16 and opt.state[p]["step"].dtype == torch.float32
    x, y = batch()
    for _ in range(3):
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
        o.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # what wrap() runs: bf16 input, bf16 autocast
            out = ref(x.to(torch.bfloat16)).float()
        torch.nn.functional.mse_loss(out, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q) and opt.state[p]["sum"].dtype == torch.bfloat16
        assert torch.equal(opt.state[p]["sum"], ref_opt.state[q]["sum"])


def test_state_of_an_optimizer_that_already_stepped_is_cast_too():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    step = {p: opt.state[p]["step"].clone() for p in model.parameters()}
    memwrap.wrap(model, opt, precision="bf16-true", compensation="none")
    for p in model.parameters():
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(state["step"], step[p]) and state["step"].dtype == torch.float32  # "step" as torch loads it


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_converting_inside_wrap_does_not_hold_the_fp32_weights_on_the_device():
    # convert_model keeps what it needs to undo a failed conversion in host memory on an accelerator: the device peak of
    # wrap(precision="bf16-true") stays at the fp32 weights (plus one tensor in flight), as model.to(bfloat16) does.
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(8)]).cuda()
    fp32 = sum(p.numel() * 4 for p in net.parameters())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    memwrap.wrap(net, precision="bf16-true", compensation="none")
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base <= 1024 * 1024 * 2 + 4096  # one converted tensor in flight
    assert net[0].weight.dtype == torch.bfloat16 and torch.cuda.memory_allocated() - base <= -fp32 // 2 + 4096
