"""Host-device synchronisations: the wrapped loop adds at most one per optimizer update over the hand-written loop.

A sync is counted where the host waits for a device value: ``aten._local_scalar_dense`` (``.item()``, ``float(t)``,
``bool(t)``) and every op whose output shape or value the host needs (torch tags them ``data_dependent_output`` or
``dynamic_output_shape``: ``nonzero``, ``masked_select``, ``equal``, ...). They are counted under a
``TorchDispatchMode`` (below autograd, so the backward's ops count too) on CPU, where the ops are the same as on a GPU.
Each mode is compared with the loop a user would write by hand for the same maths.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import memwrap
from memwrap.plugin.registry import ConversionWarning
from memwrap.testing import RegressionModel, regression_batch

SYNC_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
UPDATES = 3


class CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(tag in func.tags for tag in SYNC_TAGS):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def batches(accumulate):
    ids, y = regression_batch(n=16 * accumulate)
    return list(zip(ids.chunk(accumulate), y.chunk(accumulate)))


def count(run_update):
    run_update()  # warm-up: optimizer state and the scaler's lazy state exist, as in a long run
    with CountSyncs() as counter:
        for _ in range(UPDATES):
            run_update()
    return counter.ops


def hand_loop(mode):
    """The loop without memwrap, same maths: returns a function running one optimizer update."""
    torch.manual_seed(0)
    model = RegressionModel()
    accumulate = 2 if mode in ("accumulate", "clipping+accumulate") else 1
    data = batches(accumulate)
    autocast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)
    if mode == "bf16-true":
        optimi = pytest.importorskip("optimi")
        model = model.to(torch.bfloat16)
        opt = optimi.AdamW(model.parameters(), lr=1e-3, kahan_sum=True)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    if mode == "step_in_backward":  # PyTorch's tutorial: one optimizer per parameter, stepped from a hook
        per_param = {p: torch.optim.AdamW([p], lr=1e-3) for p in model.parameters()}

        def hook(p):
            per_param[p].step()
            per_param[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def update():
        for ids, y in data:
            with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
                loss = F.mse_loss(model(ids).float(), y) / accumulate
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
        if mode == "step_in_backward":
            return
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            if mode in ("clipping", "clipping+accumulate"):
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        opt.zero_grad()

    return update


WRAP_OPTIONS = {
    "plain": {},
    "accumulate": {"accumulate": 2},
    "fp16": {"precision": "fp16"},
    "bf16": {"precision": "bf16"},
    "clipping": {"max_grad_norm": 1.0},
    "step_in_backward": {"step_in_backward": True},
    "bf16-true": {"precision": "bf16-true"},
    # The norm pass (memwrap.techniques.norm_pass): its one sync reads the window's total norm (finite?) before the
    # second pass steps; compared with the hand-written clipped / loss-scaled loop (HAND_MODE).
    "step_in_backward+clipping": {"step_in_backward": True, "max_grad_norm": 1.0},
    "step_in_backward+clipping+accumulate": {"step_in_backward": True, "max_grad_norm": 1.0, "accumulate": 2},
    "step_in_backward+fp16": {"step_in_backward": True, "precision": "fp16"},
}
# The hand-written loop each wrapped mode is compared with, where its name is not one of hand_loop's modes.
HAND_MODE = {"step_in_backward+clipping": "clipping", "step_in_backward+clipping+accumulate": "clipping+accumulate",
             "step_in_backward+fp16": "fp16"}


def wrapped_loop(mode):
    torch.manual_seed(0)
    model = RegressionModel()
    options = WRAP_OPTIONS[mode]
    if mode == "bf16-true":
        pytest.importorskip("optimi")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConversionWarning)  # bf16-true: AdamW -> optimi's Kahan AdamW
        m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **options)
    data = batches(options.get("accumulate", 1))

    def update():
        for ids, y in data:
            F.mse_loss(m(ids), y).backward()
            o.step()
            o.zero_grad()
        assert o.did_update

    return update, o


@pytest.mark.parametrize("mode", list(WRAP_OPTIONS))
def test_at_most_one_sync_per_update_over_the_hand_written_loop(mode):
    hand = count(hand_loop(HAND_MODE.get(mode, mode)))
    update, opt = wrapped_loop(mode)
    wrapped = count(update)
    assert len(wrapped) - len(hand) <= UPDATES, (mode, sorted(hand), sorted(wrapped))
    assert opt.updates == UPDATES + 1
    norm = getattr(getattr(opt, "step_in_backward", None), "norm", None)
    if mode in HAND_MODE:  # the norm pass ran in every update's last backward (the sync counted is its own)
        assert norm is not None and norm.first_passes == UPDATES + 1


def test_last_grad_norm_costs_a_sync_only_when_read():
    torch.manual_seed(0)
    model = RegressionModel()
    m, o = memwrap.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=0.01)
    ids, y = regression_batch()
    F.mse_loss(m(ids), y).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    with CountSyncs() as counter:
        o.step()  # clips, checks finiteness and steps: one sync, the check's
        o.zero_grad()
    assert len(counter.ops) <= len(count_inner_step_syncs()) + 1, counter.ops
    with CountSyncs() as counter:
        norm = o.last_grad_norm
    assert len(counter.ops) == 1 and isinstance(norm, float)
    assert norm == pytest.approx(expected, rel=1e-6) and norm > 0.01  # before clipping
    with CountSyncs() as counter:
        assert o.last_grad_norm == norm  # read once, remembered
    assert counter.ops == []


def count_inner_step_syncs():
    """Syncs of one plain AdamW step on the same model (torch's single-tensor AdamW reads its step count)."""
    torch.manual_seed(0)
    model = RegressionModel()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, y = regression_batch()
    F.mse_loss(model(ids), y).backward()
    with CountSyncs() as counter:
        opt.step()
    return counter.ops
