"""Run part of a training job in its own process; used by test_resume.py.

usage: python resume_worker.py OUT PRECISION START STOP [CHECKPOINT_IN]
Trains micro-steps [START, STOP) of a fixed job and saves model, optimizer and loader state to OUT.
"""
import sys

import torch

import memwrap

N_BATCHES, ACCUMULATE = 11, 3


def job(precision):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(N_BATCHES)]
    return memwrap.wrap(model, opt, sched, data, precision=precision, accumulate=ACCUMULATE, max_grad_norm=1.0)


def main(out, precision, start, stop, checkpoint=None):
    model, opt, sched, loader = job(precision)
    epoch = 0
    if checkpoint:
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        epoch = state["epoch"]
    step = start
    while step < stop:
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            step += 1
            if step == stop:
                break
        else:
            epoch += 1
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "loader": loader.state_dict(), "epoch": epoch}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
