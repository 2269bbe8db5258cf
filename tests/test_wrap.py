"""wrap(): ordering, transparency, schedulers, explicit backward and one test per error message."""
import collections
import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

import memwrap
from memwrap.runtime.optimizer import WrappedOptimizer
from tests.conftest import max_rel_err


def net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_returns_objects_in_the_order_given():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    loader = [torch.randn(2, 4)]
    out = memwrap.wrap(loader, sched, opt, model, accumulate=2)
    assert [type(o).__name__ for o in out] == ["WrappedLoader", "WrappedScheduler", "WrappedOptimizer", "WrappedModule"]
    assert memwrap.unwrap(out[0]) is loader and memwrap.unwrap(out[1]) is sched
    assert memwrap.unwrap(out[2]) is opt and memwrap.unwrap(out[3]) is model


def test_single_object_is_returned_alone():
    model = net()
    wrapped = memwrap.wrap(model)
    assert isinstance(wrapped, torch.nn.Module) and memwrap.unwrap(wrapped) is model


def test_module_is_transparent():
    model = net()
    model.config = SimpleNamespace(hidden=8)
    m = memwrap.wrap(model, precision="bf16")
    assert list(m.state_dict()) == list(model.state_dict())
    assert m.config.hidden == 8 and m[0] is model[0]
    m.eval()
    assert not model.training
    m.train()
    assert model.training
    other = net(1)
    m.load_state_dict(other.state_dict())
    assert torch.equal(model[0].weight, other[0].weight)


def test_optimizer_is_a_real_optimizer_sharing_state():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, o = memwrap.wrap(model, opt)
    assert isinstance(o, torch.optim.Optimizer)
    assert o.param_groups is opt.param_groups and o.state is opt.state
    sched = torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5)  # schedulers accept it
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4) and sched.get_last_lr() == [pytest.approx(5e-4)]


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extra: tuple


class ModelOutputLike(collections.OrderedDict):
    pass


def test_nested_outputs_are_cast_to_fp32():
    class Multi(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            Pair = collections.namedtuple("Pair", "a b")
            return {"out": Output(y, (y, [y, torch.ones(1, dtype=torch.long)])), "pair": Pair(y, y),
                    "mo": ModelOutputLike(logits=y)}

    model = Multi()
    m, _ = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16", accumulate=2)
    out = m(torch.randn(2, 4))
    assert out["out"].logits.dtype == torch.float32
    assert out["out"].extra[0].dtype == torch.float32 and out["out"].extra[1][0].dtype == torch.float32
    assert out["out"].extra[1][1].dtype == torch.long
    assert out["pair"].a.dtype == torch.float32 and type(out["pair"]).__name__ == "Pair"
    assert isinstance(out["mo"], ModelOutputLike) and out["mo"]["logits"].dtype == torch.float32


def test_wrapped_scheduler_steps_once_per_update():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    m, o, s = memwrap.wrap(model, opt, sched, accumulate=4)
    for _ in range(8):
        m(torch.randn(2, 4)).sum().backward()
        o.step()
        s.step()
        o.zero_grad()
    assert o.updates == 2 and opt.param_groups[0]["lr"] == 0.25


def test_scheduler_built_on_wrapped_optimizer_can_be_wrapped_alone():
    model = net()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=1.0), accumulate=2)
    s = memwrap.wrap(torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    for _ in range(4):
        m(torch.randn(2, 4)).sum().backward()
        o.step()
        s.step()
        o.zero_grad()
    assert o.param_groups[0]["lr"] == 0.25


def test_unwrapped_scheduler_changing_lr_inside_window_warns_once():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    m, o = memwrap.wrap(model, opt, accumulate=4)
    with pytest.warns(UserWarning, match="learning rate changed inside an accumulation window") as record:
        for _ in range(12):
            m(torch.randn(2, 4)).sum().backward()
            o.step()
            sched.step()
            o.zero_grad()
    assert len([w for w in record if "inside an accumulation window" in str(w.message)]) == 1


def test_explicit_backward_weights_penalty_terms():
    """A penalty on parameters bypasses the output hooks; memwrap.backward weights the whole loss once."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = net()
    ref = copy.deepcopy(model)

    def penalty(mod):
        return 1e-2 * sum(p.square().sum() for p in mod.parameters())

    (ref(x).square().mean() + penalty(ref)).backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
    for xb in x.split(4):
        memwrap.backward(m(xb).square().mean() + penalty(model), m)
        o.step()
    assert max_rel_err([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]) < 1e-6


def test_plain_backward_with_penalty_is_refused_with_the_fix():
    """It would weight the penalty once per micro-batch (the docs' old warning): refused before any gradient.
    Every kind of path around the outputs is in tests/test_loss_paths.py."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    model = net()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
    with pytest.raises(RuntimeError, match=r"other than through the wrapped model's outputs.*memwrap.backward"):
        (m(x[:4]).square().mean() + 1e-2 * sum(p.square().sum() for p in model.parameters())).backward()
    assert all(p.grad is None for p in model.parameters())


def test_options_from_training_arguments_like_object():
    args = SimpleNamespace(gradient_accumulation_steps=8, fp16=False, bf16=True, tf32=None,
                           gradient_checkpointing=False, optim="adamw_torch", max_grad_norm=1.0)
    opts = memwrap.options_from(args)
    model = net()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), **{k: v for k, v in opts.items() if k != "optim"})
    assert o.gate.accumulate == 8 and m._precision.name == "bf16" and o.max_grad_norm == 1.0


# --- one test per error message ---------------------------------------------------------

def test_error_accumulate_not_positive_int():
    with pytest.raises(ValueError, match="accumulate must be an int >= 1.*accumulate=8"):
        memwrap.wrap(net(), accumulate=0)
    with pytest.raises(ValueError, match="accumulate must be an int"):
        memwrap.wrap(net(), accumulate=2.5)


def test_error_unknown_precision_suggests_closest():
    with pytest.raises(ValueError, match=r"unknown precision 'bf61'.*Did you mean 'bf16'\?.*fp32"):
        memwrap.wrap(net(), precision="bf61")


def test_error_unknown_option_suggests_closest():
    with pytest.raises(TypeError, match=r"unknown option 'acumulate'.*Did you mean 'accumulate'\?"):
        memwrap.wrap(net(), acumulate=4)


def test_error_optimizer_params_not_in_model():
    other = net(1)
    with pytest.raises(ValueError, match="not in the model passed to wrap"):
        memwrap.wrap(net(), torch.optim.SGD(other.parameters(), lr=0.1))


def test_error_wrapping_twice():
    m = memwrap.wrap(net())
    with pytest.raises(ValueError, match="already wrapped by memwrap.*memwrap.unwrap"):
        memwrap.wrap(m)


def test_error_conflicting_hf_alias():
    with pytest.raises(ValueError, match="conflicts with accumulate"):
        memwrap.wrap(net(), accumulate=2, gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="choose one mixed-precision mode"):
        memwrap.wrap(net(), fp16=True, bf16=True)


def test_error_accumulate_without_optimizer():
    with pytest.raises(TypeError, match="needs the model and the optimizer in the same wrap"):
        memwrap.wrap(net(), accumulate=4)


def test_error_loader_without_optimizer():
    with pytest.raises(TypeError, match="data loader needs the optimizer"):
        memwrap.wrap(net(), [1, 2])


def test_error_closure_refused():
    model = net()
    _, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="does not take a closure"):
        o.step(lambda: 0.0)


def test_error_unknown_object():
    with pytest.raises(TypeError, match="does not know what to do with a int"):
        memwrap.wrap(net(), 3)


def test_error_bad_max_grad_norm_and_on_nonfinite_and_count_items():
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        memwrap.wrap(net(), max_grad_norm=-1)
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        memwrap.wrap(net(), on_nonfinite="ignore")
    with pytest.raises(ValueError, match="count_items must be a callable"):
        memwrap.wrap(net(), count_items=3)


def test_error_options_from_object_without_fields():
    with pytest.raises(TypeError, match="none of the TrainingArguments attributes"):
        memwrap.options_from(object())


def test_warning_batchnorm_with_accumulation():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    with pytest.warns(UserWarning, match="BatchNorm.*GroupNorm"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)


def test_error_loading_plain_optimizer_state_into_wrapper():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _, o = memwrap.wrap(model, opt)
    assert isinstance(o, WrappedOptimizer)
    with pytest.raises(ValueError, match="not a memwrap optimizer checkpoint"):
        o.load_state_dict(opt.state_dict())


class LossInside(torch.nn.Module):
    """Hugging Face style: the loss is computed inside forward from the logits and both are returned."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.lin(x)
        return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("use", ["loss", "logits", "both"])
def test_outputs_computed_from_each_other_are_weighted_once(precision, use):
    torch.manual_seed(0)
    model = LossInside()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def total(out, labels):
        own = torch.nn.functional.cross_entropy(out["logits"], labels)
        return {"loss": out["loss"], "logits": own, "both": out["loss"] + own}[use]

    total(ref(x, y), y).backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), precision=precision, accumulate=2)
    for xb, yb in zip(x.split(4), y.split(4)):
        total(m(xb, yb), yb).backward()
    tol = 1e-6 if precision == "fp32" else 2e-2
    assert max_rel_err([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]) < tol


def test_training_in_eval_mode_still_weights_gradients():
    """Frozen BatchNorm / no dropout: users train with model.eval(); the big-batch gradient must still come out."""
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(2))
    model = net()
    ref = copy.deepcopy(model)
    ref(x).square().mean().backward()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.0), accumulate=2)
    m.eval()
    for xb in x.split(4):
        m(xb).square().mean().backward()
        o.step()
    assert o.updates == 1
    assert max_rel_err([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()]) < 1e-6


# --- review findings: each pins a defect that once slipped through --------------------------

def test_compiled_wrapped_model_keeps_per_micro_batch_weights():
    """Weights change between micro-batches (a partial last window); torch.compile must not bake the first one in."""
    gen = torch.Generator().manual_seed(4)
    batches = [torch.randn(3, 4, generator=gen) for _ in range(6)]  # windows of 4 and 2
    model = net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for window in (batches[:4], batches[4:]):
        ref(torch.cat(window)).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    m, o, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, accumulate=4)
    compiled = torch.compile(m, backend="aot_eager")
    for x in loader:
        compiled(x).pow(2).mean().backward()
        o.step()
        o.zero_grad()
    assert o.updates == 2
    assert max_rel_err(model.parameters(), ref.parameters()) < 1e-6


def test_state_dict_round_trip_when_a_child_is_called_module():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module = torch.nn.Linear(2, 2)

    model = Outer()
    m = memwrap.wrap(model)
    keys = list(m.state_dict())
    assert keys == list(model.state_dict()) == ["module.weight", "module.bias"]
    other = Outer()
    m.load_state_dict(other.state_dict())
    assert torch.equal(model.module.weight, other.module.weight)


def test_state_dict_round_trip_under_ddp(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(net())
        m, _ = memwrap.wrap(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), accumulate=2)
        state = m.state_dict()
        assert list(state) == list(ddp.state_dict())
        fresh = net(1)
        m.load_state_dict({f"module.{k}": v for k, v in fresh.state_dict().items()})
        assert torch.equal(ddp.module[0].weight, fresh[0].weight)
        m.load_state_dict(state)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("wrap_loader", [False, True])
def test_per_epoch_scheduler_steps_when_the_epoch_made_an_update(wrap_loader):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    data = [torch.randn(2, 4) for _ in range(10)]  # 10 batches, accumulate=4: the epoch ends mid-window
    if wrap_loader:
        m, o, s, data = memwrap.wrap(model, opt, sched, data, accumulate=4)
    else:
        m, o, s = memwrap.wrap(model, opt, sched, accumulate=4)
    lrs = []
    for _ in range(3):
        for x in data:
            m(x).sum().backward()
            o.step()
            o.zero_grad()
        s.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == [0.5, 0.25, 0.125]


def test_scheduler_state_round_trips_with_its_update_count():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    m, o, s = memwrap.wrap(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), accumulate=2)
    for _ in range(4):
        m(torch.randn(2, 4)).sum().backward()
        o.step()
        s.step()
        o.zero_grad()
    state = s.state_dict()
    assert state["updates_seen"] == 2 and state["scheduler"]["last_epoch"] == 2


def test_step_hooks_registered_on_the_wrapper_fire_once_per_update():
    model = net()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=3)
    calls = []
    o.register_step_pre_hook(lambda opt, args, kwargs: calls.append("pre"))
    o.register_step_post_hook(lambda opt, args, kwargs: calls.append("post"))
    for _ in range(6):
        m(torch.randn(2, 4)).sum().backward()
        o.step()
        o.zero_grad()
    assert calls == ["pre", "post", "pre", "post"]


def test_options_from_drops_the_default_optim_of_training_arguments():
    @dataclasses.dataclass
    class Args:  # shaped like TrainingArguments: optim always has a value, its default means plain AdamW
        gradient_accumulation_steps: int = 1
        optim: str = "adamw_torch"

    assert "optim" not in memwrap.options_from(Args(gradient_accumulation_steps=4))
    assert memwrap.options_from(Args(optim="adamw_bnb_8bit"))["optim"] == "adamw_bnb_8bit"


def test_error_count_items_without_loader():
    model = net()
    with pytest.raises(TypeError, match="count_items .* no loader was given"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2, count_items=len)


def test_error_accumulate_with_optimizer_but_no_model():
    model = net()
    with pytest.raises(TypeError, match="needs the model and the optimizer in the"):
        memwrap.wrap(torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)


def test_error_fp16_with_half_parameters():
    model = net().half()
    with pytest.raises(ValueError, match="already fp16.*precision='bf16'"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16")


def test_error_checkpoint_on_compiled_model():
    model = torch.compile(net(), backend="aot_eager")
    with pytest.raises(ValueError, match="torch.compile"):
        memwrap.wrap(model, checkpoint="auto")


def test_warning_step_twice_per_batch():
    model = net()
    m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=4)
    with pytest.warns(UserWarning, match="without a backward pass"):
        for _ in range(2):
            m(torch.randn(2, 4)).sum().backward()
            o.step()
            o.step()


def test_warning_one_shot_iterator_loader():
    model = net()
    with pytest.warns(UserWarning, match="one-shot iterator"):
        memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), (x for x in [torch.randn(2, 4)]), accumulate=2)


class SparseBag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 4, sparse=True)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.embed(ids)).squeeze(-1)


@pytest.mark.parametrize("make_opt, accumulate", [
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 1),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), 2),
    (lambda ps: torch.optim.Adagrad(ps, lr=0.1), 1),
], ids=["sgd", "sgd-accumulate-2", "adagrad"])
def test_sparse_gradients_train_as_plain_torch_trains_them(make_opt, accumulate):
    ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(1))  # repeated ids: uncoalesced grads
    y = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    ref = SparseBag()
    ref_opt = make_opt(ref.parameters())
    for _ in range(3):  # plain torch, the big batch
        torch.nn.functional.mse_loss(ref(ids), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got = SparseBag()
    m, o = memwrap.wrap(got, make_opt(got.parameters()), accumulate=accumulate)
    norms = []
    for _ in range(3):
        for i, t in zip(ids.chunk(accumulate), y.chunk(accumulate)):
            torch.nn.functional.mse_loss(m(i), t).backward()
            if o.gate.closes_window():
                norms.append(torch.nn.utils.get_total_norm([got.embed.weight.grad.to_dense(), got.head.weight.grad,
                                                            got.head.bias.grad]).item())
            o.step()
            o.zero_grad()
    assert o.updates == 3
    for a, b in zip(ref.parameters(), got.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert o.last_grad_norm == pytest.approx(norms[-1], rel=1e-6)  # the coalesced gradient's norm


def test_clipping_sparse_gradients_is_refused_at_wrap_and_changes_nothing():
    model = SparseBag()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"max_grad_norm=1.0 with sparse gradients \(Embedding\(16, 4, sparse=True\)\)"
                                         r".*no kernel for sparse.*Fix: drop max_grad_norm"):
        memwrap.wrap(model, opt, max_grad_norm=1.0)
    assert not isinstance(opt, WrappedOptimizer) and model.embed.weight.grad is None


def test_parameters_on_meta_train_as_plain_torch():
    # Plain torch runs forward, backward and step on meta tensors (shape checks, tracing); so must a neutral wrap().
    for options in ({}, {"accumulate": 2}, {"max_grad_norm": 1.0}):
        model = torch.nn.Linear(4, 2, device="meta")
        m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), **options)
        for _ in range(2 * options.get("accumulate", 1)):
            m(torch.randn(3, 4, device="meta")).sum().backward()
            o.step()
            o.zero_grad()
        assert o.updates == 2 and o.last_grad_norm is None and model.weight.is_meta


def test_a_wrapper_that_unwrap_took_something_from_refuses_further_use():
    from memwrap.models import GPT, GPTConfig

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=8))
    ids = torch.randint(0, 32, (2, 8))
    m, o = memwrap.wrap(gpt, torch.optim.AdamW(gpt.parameters()), checkpoint="full", step_in_backward=True)
    assert m.checkpoint_report.modules
    inner_model, inner_opt = memwrap.unwrap(m), memwrap.unwrap(o)
    assert memwrap.unwrap(m) is inner_model  # twice: harmless
    with pytest.raises(RuntimeError, match=r"forward on a WrappedModule that memwrap.unwrap\(\) was called on: .*"
                                           r"checkpointing wrap\(\) applied.*Fix: use the GPT that unwrap\(\) returned"):
        m(ids)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) on a WrappedModule"):
        m.zero_grad()
    loss = inner_model(ids, labels=ids).loss
    with pytest.raises(RuntimeError, match=r"memwrap.backward on a WrappedModule"):
        memwrap.backward(loss, m)
    loss.backward()  # the unwrapped objects are the user's own again, and train the plain way
    for call in (o.step, o.zero_grad):
        with pytest.raises(RuntimeError, match=r"on a WrappedOptimizer that memwrap.unwrap\(\) was called on: .*"
                                               r"step-in-backward hooks.*Fix: use the AdamW"):
            call()
    before = gpt.lm_head.weight.detach().clone()
    inner_opt.step()
    assert not torch.equal(before, gpt.lm_head.weight)

    tf32 = memwrap.wrap(net(), precision="tf32")
    memwrap.unwrap(tf32)
    with pytest.raises(RuntimeError, match=r"precision='tf32''s process-wide settings"):
        tf32(torch.ones(1, 4))


def test_unwrap_that_takes_nothing_away_leaves_the_wrapper_working():
    # Reading the inner objects (memwrap.unwrap(optimizer).defaults, ...) must not end a plain wrap's training.
    results = []
    for peek in (False, True):
        model = net()
        m, o = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
        if peek:
            assert memwrap.unwrap(o).defaults["lr"] == 0.1 and memwrap.unwrap(m) is model
        for x in torch.randn(4, 3, 4, generator=torch.Generator().manual_seed(0)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
        results.append(model)
    for a, b in zip(*(r.parameters() for r in results)):
        assert torch.equal(a, b)
