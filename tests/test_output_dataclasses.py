"""Dataclass outputs keep every field through the wrapped model, init=False fields included, with their gradients
weighted as the big batch's (issue 22 item 11)."""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import memwrap


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: Optional[torch.Tensor] = dataclasses.field(default=None, init=False)  # set in forward


@dataclasses.dataclass(frozen=True)
class FrozenOut:
    logits: torch.Tensor
    aux: torch.Tensor = dataclasses.field(init=False)  # computed in __post_init__

    def __post_init__(self):
        object.__setattr__(self, "aux", self.logits.pow(2).sum(-1))


class Net(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.make = torch.nn.Linear(3, 2), make

    def forward(self, x):
        return self.make(self.lin(x))


def set_in_forward(logits):
    out = Out(logits)
    out.aux = logits.pow(2).sum(-1)
    return out


def model_output(logits):
    transformers = pytest.importorskip("transformers")

    @dataclasses.dataclass
    class HFOut(transformers.utils.ModelOutput):
        logits: Optional[torch.Tensor] = None
        aux: Optional[torch.Tensor] = dataclasses.field(default=None, init=False)

    out = HFOut(logits=logits)
    out.aux = logits.pow(2).sum(-1)
    return out


@pytest.mark.parametrize("make", [set_in_forward, FrozenOut, model_output], ids=["set-in-forward", "frozen-post-init",
                                                                                  "ModelOutput"])
def test_init_false_fields_come_back_with_big_batch_gradients(make):
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))

    def loss_of(out):
        return out.logits.mean() + out.aux.mean()

    plain = Net(make)
    loss_of(plain(x)).backward()
    ref = [p.grad.clone() for p in plain.parameters()]

    net = Net(make)
    model, opt = memwrap.wrap(net, torch.optim.SGD(net.parameters(), lr=0.0), accumulate=2)
    for half in x.chunk(2):
        out = model(half)
        assert out.aux is not None, "the init=False field was lost"
        expected = net.make(net.lin(half)).aux
        torch.testing.assert_close(out.aux, expected.float())
        loss_of(out).backward()  # aux's gradient must be weighted like logits'
        opt.step()
    for got, want in zip((p.grad for p in net.parameters()), ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
