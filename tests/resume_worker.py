"""Run part of a training job in its own process; used by test_resume.py.

usage: python resume_worker.py OUT MODE START STOP [CHECKPOINT_IN]
Trains micro-steps [START, STOP) of a fixed job and saves model, optimizer and loader state to OUT.
MODE is a precision ("fp32", "fp16": a deterministic model, saved the FAQ's old way with torch.save) or
"dropout" (Dropout and a shuffling DataLoader, saved with memwrap.save_checkpoint / load_checkpoint).
"""
import random
import sys

import torch

import memwrap

N_BATCHES, ACCUMULATE = 11, 3


class Augmented(torch.utils.data.Dataset):
    """Random augmentation drawn in the main process from torch's and Python's global generators."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        x, y = self.samples[index]
        return x * random.uniform(0.9, 1.1) + 0.01 * torch.randn(x.shape), y


def job(mode, seed=0, generator=False, *, width=16, extra_layer=False, sgd=False, step_lr=False, precision=None):
    """The fixed job; the keyword-only arguments change one piece (for the refused-load tests)."""
    torch.manual_seed(seed)
    random.seed(seed)
    layers = [torch.nn.Linear(6, width), torch.nn.GELU(), torch.nn.Linear(width, 2)]
    if extra_layer:
        layers.append(torch.nn.Linear(2, 2))
    if mode == "dropout":
        layers.insert(2, torch.nn.Dropout(0.3))
    model = torch.nn.Sequential(*layers)
    opt = (torch.optim.SGD if sgd else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    sched = (torch.optim.lr_scheduler.StepLR(opt, step_size=2) if step_lr
             else torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)))
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(N_BATCHES)]
    precision = precision or mode
    if mode == "dropout":
        # Shuffled: the order of each epoch is drawn from the global RNG (or generator=) when the epoch starts.
        samples = Augmented([(x[i], y[i]) for x, y in data for i in range(4)])
        data = torch.utils.data.DataLoader(samples, batch_size=4, shuffle=True,
                                           generator=torch.Generator().manual_seed(5) if generator else None)
        precision = "fp32" if precision == "dropout" else precision
    return memwrap.wrap(model, opt, sched, data, precision=precision, accumulate=ACCUMULATE, max_grad_norm=1.0)


def train(model, opt, sched, loader, start, stop, epoch=0):
    """Micro-steps [start, stop); returns the epoch counter (an epoch stopped by `break` is not counted)."""
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
    return epoch


def main(out, mode, start, stop, checkpoint=None):
    model, opt, sched, loader = job(mode)
    epoch = 0
    if checkpoint and mode == "dropout":
        epoch = memwrap.load_checkpoint(checkpoint, model=model, optimizer=opt, scheduler=sched, loader=loader)["epoch"]
    elif checkpoint:
        state = torch.load(checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        epoch = state["epoch"]
    epoch = train(model, opt, sched, loader, start, stop, epoch)
    if mode == "dropout":
        memwrap.save_checkpoint(out, model=model, optimizer=opt, scheduler=sched, loader=loader, extra={"epoch": epoch})
        return
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "loader": loader.state_dict(), "epoch": epoch}, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])
