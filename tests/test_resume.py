"""Stopping after any micro-step and resuming reproduces the uninterrupted run; a kill during a save loses nothing."""
import copy
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import memwrap
from tests import resume_worker
from tests.test_state import assert_same

WORKER = Path(__file__).with_name("resume_worker.py")
TOTAL = 17  # micro-steps: crosses an epoch end (11 batches, windows of 3, last window of 2)


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(WORKER.parent.parent), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, str(WORKER), *map(str, args)], check=True, env=env, timeout=120)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = {}
    for precision in ("fp32", "fp16", "dropout"):
        path = tmp_path_factory.mktemp("full") / f"{precision}.pt"
        run(path, precision, 0, TOTAL)
        out[precision] = torch.load(path, weights_only=True)
    return out


@pytest.mark.parametrize("precision,stop_at", [("fp32", 1), ("fp32", 10), ("fp16", 5), ("dropout", 5)])
def test_resume_in_new_process_is_exact(tmp_path, uninterrupted, precision, stop_at):
    first, second = tmp_path / "first.pt", tmp_path / "second.pt"
    run(first, precision, 0, stop_at)
    run(second, precision, stop_at, TOTAL, first)
    resumed = torch.load(second, weights_only=True)
    expected = uninterrupted[precision]
    for key, value in expected["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    assert resumed["optimizer"]["counters"] == expected["optimizer"]["counters"]
    assert resumed["optimizer"]["gate"] == expected["optimizer"]["gate"]
    assert resumed["scheduler"] == expected["scheduler"]


# --- memwrap.save_checkpoint / load_checkpoint: exact with Dropout and a shuffling loader -------------------------

def _scramble_rng():
    """What a new process would have: other global random states than the run that saved."""
    torch.manual_seed(987654)
    random.seed(987654)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module", params=[False, True], ids=["global-rng-order", "generator-order"])
def dropout_run(request):
    job = resume_worker.job("dropout", generator=request.param)
    resume_worker.train(*job, 0, TOTAL)
    return request.param, _params(job[0]), job[1].state_dict()["counters"]


@pytest.mark.parametrize("stop_at", [1, 4, 11, 13])  # mid-window, mid-window later, at the epoch end, next epoch
def test_helper_resumes_dropout_and_shuffled_loader_bit_exactly(tmp_path, dropout_run, stop_at):
    generator, expected, counters = dropout_run
    first = resume_worker.job("dropout", generator=generator)
    epoch = resume_worker.train(*first, 0, stop_at)
    path = memwrap.save_checkpoint(tmp_path / "ckpt.pt", model=first[0], optimizer=first[1], scheduler=first[2],
                                   loader=first[3], extra={"epoch": epoch})
    _scramble_rng()
    second = resume_worker.job("dropout", seed=1, generator=generator)  # other initial weights: all must be loaded
    extra = memwrap.load_checkpoint(path, model=second[0], optimizer=second[1], scheduler=second[2], loader=second[3])
    resume_worker.train(*second, stop_at, TOTAL, extra["epoch"])
    for got, want in zip(_params(second[0]), expected):
        assert torch.equal(got, want)
    assert second[1].state_dict()["counters"] == counters


def test_old_recipe_without_random_states_is_not_exact(tmp_path, dropout_run):
    """The defect: model/optimizer/scheduler/loader state alone does not resume a Dropout model exactly."""
    generator, expected, _ = dropout_run
    first = resume_worker.job("dropout", generator=generator)
    resume_worker.train(*first, 0, 4)
    states = [obj.state_dict() for obj in first]
    _scramble_rng()
    second = resume_worker.job("dropout", generator=generator)
    for obj, state in zip(second, states):
        obj.load_state_dict(state)
    resume_worker.train(*second, 4, TOTAL)
    assert any(not torch.equal(got, want) for got, want in zip(_params(second[0]), expected))


def test_load_checks_everything_before_changing_anything(tmp_path):
    model, opt, sched, loader = resume_worker.job("dropout")
    resume_worker.train(model, opt, sched, loader, 0, 4)
    path = memwrap.save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, scheduler=sched, loader=loader)
    fresh_model, fresh_opt, fresh_sched, fresh_loader = resume_worker.job("dropout", seed=3)
    bad_model = torch.nn.Linear(6, 3)
    before = (_params(fresh_model), fresh_opt.gate.state_dict(), torch.get_rng_state())
    with pytest.raises(ValueError, match="does not match"):
        memwrap.load_checkpoint(path, model=bad_model, optimizer=fresh_opt, scheduler=fresh_sched, loader=fresh_loader)
    with pytest.raises(ValueError, match="no scheduler= was passed"):
        memwrap.load_checkpoint(path, model=fresh_model, optimizer=fresh_opt, loader=fresh_loader)
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh_model), before[0]))
    assert fresh_opt.gate.state_dict() == before[1] and fresh_loader.position == 0
    assert torch.equal(torch.get_rng_state(), before[2])
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ValueError, match="cannot read the checkpoint"):
        memwrap.load_checkpoint(truncated, model=fresh_model, optimizer=fresh_opt, scheduler=fresh_sched, loader=fresh_loader)
    assert all(torch.equal(a, b) for a, b in zip(_params(fresh_model), before[0]))


def _everything(model, opt, sched, loader):
    """Deep copies of every state a load could change, to compare bit for bit."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                          "loader": loader.state_dict(), "grads": [p.grad for p in model.parameters()],
                          "rng": (torch.get_rng_state(), random.getstate())})


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """A checkpoint saved mid-window (partial gradients, a stepped scheduler) in fp32 and in fp16."""
    out = {}
    for precision in ("fp32", "fp16"):
        run_ = resume_worker.job("dropout", precision=precision)
        resume_worker.train(*run_, 0, 4)
        out[precision] = memwrap.save_checkpoint(tmp_path_factory.mktemp("saved") / f"{precision}.pt", model=run_[0],
                                                 optimizer=run_[1], scheduler=run_[2], loader=run_[3])
    return out


def _edited(path, tmp_path, edit):
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, tmp_path / "edited.pt")
    return tmp_path / "edited.pt"


def _set_scale(state):
    state["optimizer"]["scaler"]["scale"] = "x"


def _cut_rng(state):
    state["rng"]["torch"] = state["rng"]["torch"][:100]


# kind: (precision saved, what the loading run changes, an edit of the file, the refusal's words)
MISMATCHES = {
    "model-keys": ("fp32", {"extra_layer": True}, None, r"missing keys.*unexpected keys|does not match"),
    "model-shapes": ("fp32", {"width": 32}, None, r"shape \(16, 6\).*\(32, 6\)"),
    "optimizer-class": ("fp32", {"sgd": True}, None, r"AdamW.*SGD"),
    "scheduler-class": ("fp32", {"step_lr": True}, None, r"LambdaLR.*StepLR"),
    "scaler-into-fp32": ("fp16", {}, None, r"GradScaler.*fp16"),
    "scaler-malformed": ("fp16", {"precision": "fp16"}, _set_scale, r"scaler.*'scale'"),
    "loader-generators": ("fp32", {"generator": True}, None, r"generator"),
    "rng": ("fp32", {}, _cut_rng, r"random state.*torch"),
}


@pytest.mark.parametrize("kind", list(MISMATCHES))
def test_a_refused_load_checkpoint_leaves_every_object_bit_identical(tmp_path, saved_runs, kind):
    """Every check runs before the first load: a refusal (any part) changes neither model, optimizer, scheduler,
    loader nor the random states."""
    precision, change, edit, match = MISMATCHES[kind]
    path = saved_runs[precision] if edit is None else _edited(saved_runs[precision], tmp_path, edit)
    fresh = resume_worker.job("dropout", seed=3, **change)
    resume_worker.train(*fresh, 0, 2)  # a run with state of its own: a partial load would show
    before = _everything(*fresh)
    with pytest.raises(ValueError, match=match) as refusal:
        memwrap.load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2], loader=fresh[3])
    assert "Fix" in str(refusal.value)
    assert_same(_everything(*fresh), before)


def test_a_good_load_after_a_refused_one_is_still_exact(saved_runs):
    fresh = resume_worker.job("dropout", seed=3, step_lr=True)
    with pytest.raises(ValueError):
        memwrap.load_checkpoint(saved_runs["fp32"], model=fresh[0], optimizer=fresh[1], scheduler=fresh[2],
                                loader=fresh[3])
    right = resume_worker.job("dropout", seed=3)
    memwrap.load_checkpoint(saved_runs["fp32"], model=right[0], optimizer=right[1], scheduler=right[2], loader=right[3])
    saved = torch.load(saved_runs["fp32"], weights_only=True)
    assert_same(copy.deepcopy(right[1].state_dict()), saved["optimizer"])
    assert_same(right[0].state_dict(), saved["model"])


def test_plain_torch_objects_are_checked_the_same_way(tmp_path):
    """Not wrapped: torch's own schedulers load any dict, so the class record is what refuses a StepLR into a
    CosineAnnealingLR; an SGD state into AdamW is refused by its per-parameter entries."""
    def plain(sgd=False, cosine=False, seed=0):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if sgd
               else torch.optim.AdamW(model.parameters(), lr=0.1))
        sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4) if cosine
                 else torch.optim.lr_scheduler.StepLR(opt, step_size=2))
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        sched.step()
        return model, opt, sched

    model, opt, sched = plain()
    path = memwrap.save_checkpoint(tmp_path / "plain.pt", model=model, optimizer=opt, scheduler=sched)
    for change, match in [({"cosine": True}, r"StepLR.*CosineAnnealingLR"), ({"sgd": True}, r"AdamW.*SGD")]:
        fresh = plain(seed=1, **change)
        before = copy.deepcopy([part.state_dict() for part in fresh])
        with pytest.raises(ValueError, match=match):
            memwrap.load_checkpoint(path, model=fresh[0], optimizer=fresh[1], scheduler=fresh[2])
        assert_same(copy.deepcopy([part.state_dict() for part in fresh]), before)


# --- a kill during the save ----------------------------------------------------------------------------------

class _SlowToPickle:
    """Stands in for a slow write: pickling it signals the parent, then blocks until the child is killed."""

    def __init__(self, fd):
        self.fd = fd

    def __reduce__(self):
        os.write(self.fd, b"in-save\n")
        time.sleep(60)
        return (int, (0,))


def _killed_mid_save(save):
    """Fork a child that runs save(); SIGKILL it once it is inside the save; return its exit signal."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            save(_SlowToPickle(write))
        finally:
            os._exit(1)
    os.close(write)
    with os.fdopen(read) as pipe:
        assert pipe.readline() == "in-save\n"
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status)


def _small_job():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=0.1), [torch.randn(2, 4) for _ in range(5)],
                        accumulate=2)


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@needs_fork
def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    model, opt, loader = _small_job()
    path = tmp_path / "ckpt.pt"
    memwrap.save_checkpoint(path, model=model, optimizer=opt, loader=loader, extra={"n": 1})
    sig = _killed_mid_save(lambda slow: memwrap.save_checkpoint(path, model=model, optimizer=opt, loader=loader,
                                                                extra={"n": 2, "slow": slow}))
    assert sig == signal.SIGKILL
    assert (tmp_path / ".ckpt.pt.tmp").exists()  # the kill did land inside the save
    model2, opt2, loader2 = _small_job()
    assert memwrap.load_checkpoint(path, model=model2, optimizer=opt2, loader=loader2) == {"n": 1}
    memwrap.save_checkpoint(path, model=model, optimizer=opt, loader=loader, extra={"n": 3})  # reuses the temp name
    assert not (tmp_path / ".ckpt.pt.tmp").exists()
    assert memwrap.load_checkpoint(path, model=model2, optimizer=opt2, loader=loader2)["n"] == 3


@needs_fork
def test_plain_torch_save_killed_mid_save_loses_the_checkpoint(tmp_path):
    """The FAQ's old recipe, killed at the same point: the only checkpoint is gone (why the helper exists)."""
    model, opt, loader = _small_job()
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict()}, path)
    _killed_mid_save(lambda slow: torch.save({"model": model.state_dict(), "slow": slow}, path))
    with pytest.raises(Exception):
        torch.load(path, weights_only=True)


@needs_fork
def test_sigkill_at_random_times_always_leaves_a_loadable_checkpoint(tmp_path):
    model, opt, loader = _small_job()
    path = tmp_path / "ckpt.pt"
    blob = torch.randn(2_000_000)  # 8 MB: the write takes long enough for kills to land inside it
    memwrap.save_checkpoint(path, model=model, optimizer=opt, loader=loader, extra={"n": 0, "blob": blob})
    rnd = random.Random(7)
    seen, mid_save = set(), 0
    for _ in range(8):
        pid = os.fork()
        if pid == 0:
            try:
                for n in range(1, 10_000):
                    memwrap.save_checkpoint(path, model=model, optimizer=opt, loader=loader, extra={"n": n, "blob": blob})
            finally:
                os._exit(1)
        time.sleep(rnd.uniform(0.0, 0.4))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        mid_save += (tmp_path / ".ckpt.pt.tmp").exists()
        model2, opt2, loader2 = _small_job()
        extra = memwrap.load_checkpoint(path, model=model2, optimizer=opt2, loader=loader2)
        assert torch.equal(extra["blob"], blob)
        seen.add(extra["n"])
    assert mid_save >= 1  # some kills landed inside a save
    assert len(seen) > 1  # the children did complete saves between kills: the file really was being replaced
