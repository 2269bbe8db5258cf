"""``wrap(model, optimizer, loader, budget=...)``: plan at the first batch, cut each batch, same maths as the big batch.

References are computed the plain way: one unsplit batch per update, no memwrap. Memory is measured
with the CPU allocator's events (as :func:`memwrap.measure_peak` does), not asserted from predictions.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import gc

import pytest
import torch
from torch import nn

import memwrap
from memwrap.runtime.batch_split import UncuttableBatchError, cut_batch, cut_sizes
from memwrap.techniques.budget.plan import BudgetTooSmallError
from memwrap.memory.measure import allocator_growth, live_bytes
from memwrap.models import build_preset, lm_loss

GPT = dict(n_layer=2, vocab_size=512, n_embd=64, n_head=2, dropout=0.0)


def gpt() -> nn.Module:
    torch.manual_seed(0)
    return build_preset("gpt2-tiny", **GPT)


def lm_batches(count: int, batch: int, seq: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 512, (batch, seq), generator=g), torch.randint(0, 512, (batch, seq), generator=g))
            for _ in range(count)]


def reference(model: nn.Module, batches, loss_of, lr: float = 1e-3) -> nn.Module:
    """Plain training: one update per unsplit batch."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for batch in batches:
        loss_of(model, batch).backward()
        opt.step()
        opt.zero_grad()
    return model


def assert_same_params(a: nn.Module, b: nn.Module, atol: float = 2e-5) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


def allocator_peak(fn, *alive) -> int:
    """Peak live CPU bytes during ``fn()``: bytes alive at the start plus the allocator's running total."""
    gc.collect()
    return live_bytes(*alive) + allocator_growth(fn)


def quiet(options: dict) -> dict:
    return options


# --- the main claim: a batch that does not fit trains within the budget, exactly ------------------------------

@pytest.mark.slow
def test_gpt_over_budget_trains_within_it_and_equals_the_big_batch():
    batches = lm_batches(3, 16, 64)
    start = gpt()
    # The unsplit batch's measured peak, as memwrap.measure_peak measures it (steady state, AdamW).
    plain = memwrap.measure_peak(copy.deepcopy(start), batches[0], lm_loss, steps=1)["peak"]
    budget = int(plain * 0.45)
    model, opt = copy.deepcopy(start), None
    inner_opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lines = []
    wmodel, opt, loader = memwrap.wrap(model, inner_opt, batches, budget=f"{budget}B")
    opt.budget_plan.log = lines.append
    it = iter(loader)

    def one_update():
        # The loop shape budget= plans (it cannot see the loop): the outputs held through backward and the step.
        while True:
            x, y = next(it)
            out = wmodel(x)
            lm_loss(out, y).backward()
            opt.step()
            opt.zero_grad()
            if opt.did_update:
                return

    one_update()  # plans, applies, and creates the optimizer state
    measured = allocator_peak(one_update, model, inner_opt, batches[1])
    one_update()
    choice = opt.budget_plan.current
    assert plain > budget >= measured, (plain, budget, measured, choice)
    assert choice.micro_batch < 16 and choice.accumulate == -(-16 // choice.micro_batch)
    assert choice.required <= budget
    assert opt.updates == 3 and len(lines) == 1 and "of budget" in lines[0]
    assert loader.budget_plan is opt.budget_plan and opt.budget_plan.plan_seconds > 0
    assert_same_params(model, reference(start, batches, lambda m, b: lm_loss(m(b[0]), b[1])))
    # The predicted step peak is what was measured (same allocator view), within the planner's CPU accuracy.
    assert abs(measured - (choice.peak + choice.batch_rest)) <= 0.1 * measured


# --- batch types -----------------------------------------------------------------------------------------------

class Net(nn.Module):
    """Reads x (and optionally a second input) from any of the batch layouts below."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x, z=None, **unused):
        h = torch.tanh(self.a(x if z is None else x + z))
        return self.b(h).squeeze(-1)


class FakeBatchEncoding(collections.UserDict):
    """Hugging Face's BatchEncoding as the core sees it (a UserDict with per-sample encodings), no transformers."""

    def __init__(self, data=None, encodings=None):
        super().__init__(data or {})
        self._encodings = encodings


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "train"


def _xy(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randn(n, generator=g)


def _layouts(n: int, seed: int) -> dict:
    x, y = _xy(n, seed)
    z = torch.randn(n, 6, generator=torch.Generator().manual_seed(seed + 99))
    return {
        "tensor": x,
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"x": x, "labels": y, "scale": torch.tensor(1.0), "split": "train"},
        "batch_encoding": FakeBatchEncoding({"x": x, "labels": y}, encodings=[f"enc{i}" for i in range(n)]),
        "dataclass": Sample(x, y),
        "nested": {"x": x, "z": z, "extras": {"labels": (y,), "ids": [f"s{i}" for i in range(n)], "tags": ["a", "b"]}},
    }


def _loss(model, kind: str, batch) -> torch.Tensor:
    if kind == "tensor":
        out, y = model(batch), batch.sum(1)
    elif kind in ("tuple", "list"):
        out, y = model(batch[0]), batch[1]
    elif kind in ("dict", "batch_encoding"):
        out, y = model(batch["x"]), batch["labels"]
    elif kind == "dataclass":
        out, y = model(batch.x), batch.y
    else:
        out, y = model(x=batch["x"], z=batch["z"]), batch["extras"]["labels"][0]
    return (out - y).pow(2).mean()


@pytest.mark.parametrize("kind", ["tensor", "tuple", "list", "dict", "batch_encoding", "dataclass", "nested"])
def test_each_batch_type_is_cut_and_trains_as_the_big_batch(kind):
    # accumulate=3 is the user's setting (kept), so 10 samples are cut unevenly: 4 + 3 + 3, weighted 0.4/0.3/0.3;
    # the epoch's last batch has 2 samples: 1 + 1.
    batches = [_layouts(10, seed)[kind] for seed in range(3)] + [_layouts(2, 7)[kind]]
    start = Net()
    model = copy.deepcopy(start)
    seen = []
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                                       budget="1GiB", accumulate=3, checkpoint=None)
    opt.budget_plan.log = None
    for micro in loader:
        seen.append(micro)
        _loss(wmodel, kind, micro).backward()
        opt.step()
        opt.zero_grad()
    assert opt.updates == 4 and len(seen) == 11
    assert type(seen[0]) is type(batches[0])
    assert_same_params(model, reference(start, batches, lambda m, b: _loss(m, kind, b), lr=1e-2), atol=1e-6)
    if kind == "nested":
        extras = seen[0]["extras"]
        assert extras["ids"] == ["s0", "s1", "s2", "s3"] and extras["tags"] == ["a", "b"]  # per-sample vs not
    if kind == "batch_encoding":
        assert seen[1]._encodings == ["enc4", "enc5", "enc6"]
    if kind == "dict":
        assert seen[2]["split"] == "train" and seen[2]["scale"] is batches[0]["scale"]


def test_uneven_cuts_are_weighted_by_true_size_and_count_items():
    sizes = cut_sizes(10, 4)
    assert sizes == [4, 3, 3] and cut_sizes(7, 7) == [7] and cut_sizes(9, 2) == [2, 2, 2, 2, 1]
    x, y = _xy(10, 0)
    parts = cut_batch((x, y), sizes)
    assert [p[0].data_ptr() for p in parts] == [x[i:].data_ptr() for i in (0, 4, 7)]  # views, no copy
    # count_items: the loss is a sum over valid items divided by the window's valid items (the big batch's mean).
    valid = lambda b: int((b[1] > 0).sum())  # noqa: E731
    batches = [_xy(10, s) for s in range(3)]

    def masked(model, b):
        keep = (b[1] > 0).float()
        return ((model(b[0]) - b[1]).pow(2) * keep).sum() / keep.sum().clamp(min=1)

    start = Net()
    model = copy.deepcopy(start)
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                                       budget="1GiB", accumulate=3, checkpoint=None, count_items=valid)
    opt.budget_plan.log = None
    for micro in loader:
        masked(wmodel, micro).backward()
        opt.step()
        opt.zero_grad()
    assert_same_params(model, reference(start, batches, masked, lr=1e-2), atol=1e-6)


def test_non_per_sample_entries_pass_or_are_refused_by_name():
    x, y = _xy(8, 0)
    with pytest.raises(UncuttableBatchError, match=r"batch\['pos'\] is a tensor of shape \(5,\)"):
        cut_batch({"x": x, "pos": torch.arange(5)}, [4, 4])
    with pytest.raises(UncuttableBatchError, match="holds no tensor with a sample"):
        cut_batch({"n": 3}, [1])
    model = Net()
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), [["a", "b"]], budget="1GiB")
    with pytest.raises(UncuttableBatchError, match="Fix: make the loader yield tensors"):
        next(iter(loader))


# --- shapes: re-plan once for a bigger shape, cached otherwise --------------------------------------------------

@pytest.mark.slow
def test_a_bigger_shape_replans_once_and_repeated_shapes_never(monkeypatch):
    calls = []
    real_plan = memwrap.plan

    def counting_plan(*args, **kwargs):
        calls.append(kwargs["global_batch"])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(memwrap, "plan", counting_plan)
    short, long = lm_batches(1, 8, 16, seed=1), lm_batches(1, 8, 64, seed=2)  # 4x the tokens per sample
    batches = short + long + short + long + short
    start = gpt()
    model = copy.deepcopy(start)
    lines = []
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batches,
                                       budget="6MiB", checkpoint=None, margin=(0.05, 0))
    opt.budget_plan.log = lines.append
    per_batch = []
    for x, y in loader:
        per_batch.append(opt.budget_plan.current.micro_batch)
        lm_loss(wmodel(x), y).backward()
        opt.step()
        opt.zero_grad()
    planner = opt.budget_plan
    assert len(planner.plans) == 2 and len(lines) == 2  # the first batch, then the first longer one: once
    assert planner.plans[0].shapes != planner.plans[1].shapes
    assert planner.plans[1].micro_batch < planner.plans[0].micro_batch  # longer sequences: smaller micro-batch
    n_calls = len(calls)
    assert opt.updates == 5 and planner.plan_seconds > 0
    # The short batches after the long one keep the plan in force (it covers them): no switching back and forth.
    assert planner.current is planner.plans[1]
    assert_same_params(model, reference(start, batches, lambda m, b: lm_loss(m(b[0]), b[1])))
    assert n_calls == len(calls)


# --- bad input ---------------------------------------------------------------------------------------------------

def _setup():
    model = Net()
    return model, torch.optim.AdamW(model.parameters()), [_xy(8, 0)]


@pytest.mark.parametrize("budget, match", [
    ("22", "has no unit"), (24, "read as 24 bytes"), ("-1GiB", "cannot read budget"), (0, "must be positive"),
    ("1KiB", "smaller than the model's parameters alone"),
])
def test_bad_budgets_are_refused_before_anything_changes(budget, match):
    model, opt, loader = _setup()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=match):
        memwrap.wrap(model, opt, loader, budget=budget)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_budget_needs_a_loader_and_margin_needs_a_budget():
    model, opt, loader = _setup()
    with pytest.raises(ValueError, match=r"no loader was given.*memwrap.wrap\(model, optimizer, loader"):
        memwrap.wrap(model, opt, budget="1GiB")
    with pytest.raises(ValueError, match="margin= applies to budget="):
        memwrap.wrap(model, opt, loader, margin=0.1)
    with pytest.raises(ValueError, match="budget_may_change=.*is not valid"):
        memwrap.wrap(model, opt, loader, budget="1GiB", budget_may_change=("batch",))
    with pytest.raises(ValueError, match="an option you set stays as set"):
        memwrap.wrap(model, opt, loader, budget="1GiB", precision="bf16", budget_may_change=("precision",))


def test_accumulate_that_contradicts_the_budget_is_refused_before_any_step():
    batches = lm_batches(2, 16, 64)
    model = gpt()
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), batches, budget="6MiB",
                                       accumulate=1, checkpoint=None, margin=(0.05, 0))
    with pytest.raises(ValueError, match="accumulate=1 contradicts budget=6.00 MiB.*Fix: drop accumulate="):
        next(iter(loader))
    assert opt.updates == 0 and all(p.grad is None for p in model.parameters())


def test_a_batch_that_fits_at_no_micro_batch_says_the_smallest_budget_that_works():
    batches = lm_batches(1, 4, 64)
    model = gpt()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), batches,
                                       budget=f"{params + 4096}B", checkpoint=None)
    with pytest.raises(BudgetTooSmallError, match=r"even at micro-batch 1.*Smallest budget that works: .*"
                                                   r"budget='\d+MiB'.*budget_may_change"):
        next(iter(loader))
    assert opt.updates == 0


def _sgd_momentum_run(budget_of_plain: float):
    """A 32-256-256-8 MLP trained with SGD(momentum=0.9) under budget=: (plain peak, budget, measured, planner,
    model, optimizer, batches); one momentum buffer per parameter is state the registry's "sgd" does not hold."""
    torch.manual_seed(0)
    start = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(512, 32, generator=g), torch.randn(512, 8, generator=g)) for _ in range(3)]
    mse = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()  # noqa: E731
    plain_model = copy.deepcopy(start)
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.05, momentum=0.9)

    def plain_update(b):
        mse(plain_model, b).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    plain_update(batches[0])
    plain = allocator_peak(lambda: plain_update(batches[1]), plain_model, plain_opt, batches[1])
    plain_update(batches[2])
    model = copy.deepcopy(start)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    budget = int(plain * budget_of_plain)
    wmodel, opt, loader = memwrap.wrap(model, inner, batches, budget=f"{budget}B", checkpoint=None)
    opt.budget_plan.log = None
    it = iter(loader)

    def one_update():
        while True:
            micro = next(it)
            mse(wmodel, micro).backward()
            opt.step()
            opt.zero_grad()
            if opt.did_update:
                return

    one_update()
    measured = allocator_peak(one_update, model, inner, batches[1])
    one_update()
    return plain, budget, measured, opt.budget_plan, model, inner, plain_model


def test_budget_plans_your_optimizer_as_built_momentum_state_included():
    from memwrap.plugin.state_size import measure_state_bytes

    plain, budget, measured, planner, model, inner, plain_model = _sgd_momentum_run(0.8)
    choice = planner.current
    # The plan counted SGD(momentum=0.9)'s momentum buffers (the registry's "sgd" holds none): exactly a real step's.
    assert choice.candidate.estimate.state["optimizer_state"] == measure_state_bytes(inner) > 300_000
    assert choice.accumulate > 1 and plain > budget >= measured, (plain, budget, measured, choice)
    assert_same_params(model, plain_model, atol=1e-6)  # and the update is the unsplit batch's, momentum and all


class Plain(nn.Module):
    """forward(x) only: model(**batch) does not bind, the loop feeds model(batch["ids"])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(32, 256), nn.Linear(256, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_dict_batches_fed_by_hand_are_planned_as_the_loop_calls_the_model():
    # Issue 22 item 26: the planner traced model(**batch) and refused ("unexpected keyword argument 'ids'"). The
    # first window starts with one sample; the model's first call says how the loop feeds it.
    g = torch.Generator().manual_seed(3)
    batches = [{"ids": torch.randn(n, 32, generator=g), "labels": torch.randn(n, 8, generator=g), "tag": "train"}
               for n in (256, 256, 200)]
    loss = lambda m, b: (m(b["ids"]) - b["labels"]).pow(2).mean()  # noqa: E731
    plain = Plain()
    budget = int(allocator_peak(lambda: loss(plain, batches[0]).backward(), plain, batches[0]) * 0.8)
    model = Plain()
    # SGD: its update is linear in the gradient, so the comparison with the unsplit batch is tight (Adam's
    # normalisation turns summation-order noise in near-zero gradients into full-size steps).
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), batches,
                                       budget=f"{budget}B", checkpoint=None)
    opt.budget_plan.log = None
    sizes = []
    for micro in loader:
        sizes.append(micro["ids"].shape[0])
        loss(wmodel, micro).backward()
        opt.step()
        opt.zero_grad()
    planner = opt.budget_plan
    assert planner.feed.args == (("entry", "batch['ids']"),) and not planner.feed.kwargs
    assert opt.updates == 3 and planner.current.accumulate > 1 and sizes[0] == 1 and sum(sizes) == 712
    ref = Plain()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for b in batches:
        loss(ref, b).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert_same_params(model, ref, atol=1e-6)
    # A call on a tensor that is no entry of the batch cannot be traced as the loop makes it: refused, named.
    model = Plain()
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), batches, budget=f"{budget}B")
    opt.budget_plan.log = None
    with pytest.raises(UncuttableBatchError, match="model's argument 0 is a tensor of shape \\(1, 32\\) that is none"):
        for micro in loader:
            wmodel(micro["ids"] * 2)


# --- ranks: one plan for all ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_ranks_under_torchrun_adopt_the_most_conservative_plan(tmp_path):
    import json

    from test_distributed import ROOT, torchrun

    torchrun(ROOT / "tests" / "budget_worker.py", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert "error" not in r, r.get("traceback")
    # Alone, rank 0 (short sequences) would take a bigger micro-batch than rank 1; both use rank 1's.
    assert ranks[0]["proposed"] > ranks[1]["proposed"]
    assert ranks[0]["micro_batch"] == ranks[1]["micro_batch"] == ranks[1]["proposed"] < 16
    assert ranks[0]["micro"] == ranks[1]["micro"] == 2 * ranks[0]["accumulate"]
    assert all(r["updates"] == 2 and r["plans"] == 1 for r in ranks)
    assert max(r["diff"] for r in ranks) < 1e-6  # the DDP mean of both ranks' big batches, exactly


# --- opt-in: precision and optimizer change only when nothing keeping them fits -----------------------------------

def _wide_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))


def _wide_data():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 512, generator=g), torch.randn(8, 1, generator=g)) for _ in range(2)]


def _train_wide(**options):
    model = _wide_net()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # 3.3x the parameters: AdamW in fp32 needs 4x (weights, gradients, two moments) at any micro-batch.
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), _wide_data(),
                                       budget=f"{int(params * 3.3)}B", checkpoint=None, **options)
    opt.budget_plan.log = None
    for x, y in loader:
        (wmodel(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_precision_changes_only_with_the_opt_in_and_only_when_needed():
    with pytest.raises(BudgetTooSmallError, match="dominated by optimizer_state.*budget_may_change"):
        _train_wide()
    pytest.importorskip("optimi")
    model, opt = _train_wide(budget_may_change=("precision",))
    choice = opt.budget_plan.current
    assert choice.precision != "fp32" and choice.optim == "adamw" and opt.updates == 2
    assert next(model.parameters()).dtype == torch.bfloat16 and choice.required <= opt.budget_plan.budget


@pytest.mark.slow
def test_optimizer_changes_only_with_the_opt_in():
    model, opt = _train_wide(budget_may_change=("optim",))
    choice = opt.budget_plan.current
    assert choice.optim != "adamw" and choice.precision == "fp32" and opt.updates == 2
    assert not isinstance(opt.optimizer, torch.optim.AdamW) and choice.required <= opt.budget_plan.budget


# --- Hugging Face Trainer: per-device batch size and accumulation from the plan, global batch kept -----------------

@pytest.mark.slow
def test_trainer_kwargs_with_budget_set_the_split_and_train_like_the_big_batch(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Trainer

    from memwrap.integrations.transformers.trainer import memwrap_trainer_kwargs
    from tests.hf_helpers import hf_args, tiny_llama

    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    sample = {"input_ids": ids[:8], "labels": ids[:8]}
    whole = memwrap.estimate(tiny_llama(), sample).peak

    def run(budget):
        model = tiny_llama()
        args = hf_args(tmp_path, per_device_train_batch_size=8, gradient_accumulation_steps=1, max_steps=2,
                       optim="adamw_torch")
        extra = {}
        if budget is not None:
            lines = []
            import builtins

            real_print, builtins.print = builtins.print, lines.append
            try:
                extra = memwrap_trainer_kwargs(model, args, budget=f"{budget}B", batch=sample, checkpoint=False)
            finally:
                builtins.print = real_print
            assert len(lines) == 1 and "budget plan" in lines[0]
        Trainer(model=model, args=args, train_dataset=data, **extra).train()
        return model, args

    planned, args = run(int(whole * 0.8))
    choice = planned.memwrap_budget_plan
    assert args.per_device_train_batch_size == choice.micro_batch < 8
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 8  # the global batch is kept
    assert choice.required <= int(whole * 0.8) and choice.checkpoint is False
    plain, _ = run(None)
    assert_same_params(planned, plain, atol=1e-5)


# --- Lightning: the callback takes the same budget ---------------------------------------------------------------

@pytest.mark.slow
def test_lightning_callback_with_budget_sets_the_split_and_trains_like_the_big_batch():
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader

    from memwrap.integrations.lightning.callback import MemwrapCallback

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(32, 32, 8, generator=g), torch.randn(32, generator=g)
    data = list(zip(xs, ys))

    class Module(L.LightningModule):
        def __init__(self, batch_size):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 1))
            self.batch_size = batch_size

        def forward(self, x):
            return self.net(x).mean(dim=(1, 2))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return (self(x) - y).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size() if callable(self.batch_size) else self.batch_size)

    def fit(module, callbacks):
        L.Trainer(max_steps=2, accelerator="cpu", callbacks=callbacks, enable_progress_bar=False, logger=False,
                  enable_model_summary=False, enable_checkpointing=False).fit(module)
        return module

    whole = memwrap.estimate(Module(16).net, (xs[:16], ys[:16]), loss_fn=lambda o, t: o.pow(2).mean()).peak
    cb = MemwrapCallback(budget=f"{int(whole * 0.6)}B", batch=(xs[:16], ys[:16]), checkpoint=False)
    planned = fit(Module(lambda: cb.micro_batch), [cb])
    assert cb.micro_batch < 16 and cb.micro_batch * cb.budget_plan.accumulate == 16  # the global batch is kept
    assert cb.budget_plan.required <= int(whole * 0.6) and planned.trainer.accumulate_grad_batches == 16 // cb.micro_batch
    plain = fit(Module(16), [])
    assert_same_params(planned, plain, atol=1e-6)
    with pytest.raises(ValueError, match="must be positive|cannot read budget"):
        MemwrapCallback(budget="-1GiB", batch=(xs, ys))
    with pytest.raises(ValueError, match="give both"):
        MemwrapCallback(budget="1GiB")


def test_save_and_resume_between_updates_continues_exactly(tmp_path):
    batches = [_xy(10, s) for s in range(4)]
    loss = lambda m, b: (m(b[0]) - b[1]).pow(2).mean()  # noqa: E731

    # A budget under the unsplit step's peak: the plan's accumulate (not given by the user) is what is saved. (The
    # user's AdamW is not the registry's fused one: its step holds more temporaries, which the plan counts.)
    budget = int(memwrap.estimate(Net(), batches[0], loss_fn=lambda o, t: (o - t).pow(2).mean()).peak * 0.9)

    def setup():
        model = Net()
        wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                                           budget=f"{budget}B", checkpoint=None)
        opt.budget_plan.log = None
        return model, wmodel, opt, loader

    model, wmodel, opt, loader = setup()
    for micro in loader:
        loss(wmodel, micro).backward()
        opt.step()
        opt.zero_grad()
        if opt.updates == 2 and opt.did_update:
            memwrap.save_checkpoint(tmp_path / "ckpt.pt", model=wmodel, optimizer=opt, loader=loader)
            break
    model2, wmodel2, opt2, loader2 = setup()
    memwrap.load_checkpoint(tmp_path / "ckpt.pt", model=wmodel2, optimizer=opt2, loader=loader2)
    for micro in loader2:
        loss(wmodel2, micro).backward()
        opt2.step()
        opt2.zero_grad()
    assert opt2.updates == 4 and opt2.budget_plan.current.accumulate > 1
    assert_same_params(model2, reference(Net(), batches, loss, lr=1e-2), atol=1e-6)


def test_saving_inside_a_budget_window_is_refused_and_writes_nothing(tmp_path):
    # Measured before the refusal: the save went through, and the resumed loader stopped with "plan_window called in
    # the middle of a window" (its position counts whole batches, and the restored optimizer was inside one).
    batches = [_xy(10, s) for s in range(2)]
    budget = int(memwrap.estimate(Net(), batches[0], loss_fn=lambda o, t: (o - t).pow(2).mean()).peak * 0.9)
    model = Net()
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), batches,
                                       budget=f"{budget}B", checkpoint=None)
    opt.budget_plan.log = None
    path = tmp_path / "ckpt.pt"
    for micro in loader:
        (wmodel(micro[0]) - micro[1]).pow(2).mean().backward()
        opt.step()
        assert opt.budget_plan.current.accumulate > 1
        with pytest.raises(ValueError, match=r"middle of a budget= window \(after micro-batch 1 of .*Nothing was written"):
            memwrap.save_checkpoint(path, model=wmodel, optimizer=opt, loader=loader)
        assert not path.exists() and not list(tmp_path.iterdir())
        # A state_dict saved by hand at that moment is refused when loaded, before anything changes.
        mid = opt.state_dict()
        break
    model2 = Net()
    _, opt2, _ = memwrap.wrap(model2, torch.optim.AdamW(model2.parameters(), lr=1e-2), batches, budget=f"{budget}B",
                              checkpoint=None)
    before = opt2.state_dict()
    with pytest.raises(ValueError, match="middle of a budget= window.*save between updates"):
        opt2.load_state_dict(mid)
    assert opt2.state_dict()["gate"] == before["gate"]


def test_cuts_are_even_and_reassemble_the_batch():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 40), st.integers(1, 40))
    def check(total, micro):
        sizes = cut_sizes(total, micro)
        assert sum(sizes) == total and max(sizes) <= micro and max(sizes) - min(sizes) <= 1
        assert len(sizes) == -(-total // micro)
        x = torch.arange(total * 2).view(total, 2)
        parts = cut_batch({"x": x, "meta": "m"}, sizes)
        assert torch.equal(torch.cat([p["x"] for p in parts]), x) and all(p["meta"] == "m" for p in parts)

    check()


def test_monitor_records_compare_with_the_plan():
    model = Net()
    wmodel, opt, loader = memwrap.wrap(model, torch.optim.AdamW(model.parameters()), [_xy(8, 0)], budget="1GiB",
                                       checkpoint=None, monitor=1)
    opt.budget_plan.log = None
    opt.monitor.log = None
    for x, y in loader:
        (wmodel(x) - y).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    record = opt.monitor.records[-1]
    choice = opt.budget_plan.current
    assert record["predicted"] == choice.peak + choice.batch_rest and record["budget"] == 2**30
    assert "plan predicted" in opt.monitor._line(record) and "budget 1.00 GiB" in opt.monitor._line(record)
