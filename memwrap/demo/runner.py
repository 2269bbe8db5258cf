"""``memwrap demo``: plan under a memory budget, then train a built-in GPT plain and planned.

What it does, in order:

1. predicts the peak memory of plain training (fp32, AdamW, one big batch) with
   :func:`memwrap.estimate`, and sets a budget below it (default: 60% of that peak), so that
   plain training does not fit;
2. asks :func:`memwrap.plan` for the fastest configuration (micro-batch x accumulation,
   checkpoint policy, precision, optimizer) whose predicted peak fits the budget;
3. trains the same initial weights on the same batches of an embedded text (byte tokens, no
   download) twice: a plain hand-written loop, and the same loop over the same global batches with
   ``memwrap.wrap(model, optimizer, loader, budget=...)``, which plans again at the first batch
   and yields micro-batches that fit (it reports the plan it chose);
4. measures both: the peak of one update by category with torch's ``MemTracker`` on the real
   tensors, and the allocator peak with :func:`memwrap.memory.measure_peak`; prints them next
   to the predictions with step time and loss, and writes a PNG.

It exits with status 1 if a measured peak is more than 10% away from its prediction.

Example:
    >>> from memwrap.cli import main
    >>> main(["demo", "--steps", "4", "--batch", "4", "--seq", "32", "--out", "demo.png"])  # doctest: +SKIP
    0
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import torch

from memwrap.plugin.registry import create_optimizer
from memwrap.runtime.module import WrappedModule
from memwrap.runtime.optimizer import WrappedOptimizer

__all__ = ["register", "run", "Batches", "RunResult", "TOLERANCE"]

TOLERANCE = 0.10  # measured peaks must be within 10% of the predictions
_LM = "lm"


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``demo`` subcommand to the ``memwrap`` parser.

    Example:
        >>> from memwrap.cli import build_parser
        >>> build_parser().parse_args(["demo", "--steps", "5"]).steps
        5
    """
    p = subparsers.add_parser(
        "demo", help="plan under a memory budget, then train a built-in GPT plain and planned, and compare",
        description="Predict the memory of plain training of a built-in GPT, pick a configuration that fits a "
                    "smaller budget, train both on an embedded text, and print predicted vs measured peak memory "
                    "by category, step time and loss. Writes a PNG.")
    p.add_argument("--preset", default="gpt2-tiny", help="text model preset from memwrap.models (default gpt2-tiny; "
                                                         "llama-tiny is the other CPU-sized one)")
    p.add_argument("--budget", default="60%", help="memory budget: a size (100MiB, 24GB) or a percentage of the "
                                                   "plain run's predicted peak (default 60%%)")
    p.add_argument("--steps", type=int, default=20, help="optimizer updates per run (default 20, at least 3)")
    p.add_argument("--batch", type=int, default=8, help="global batch: sequences per optimizer update (default 8)")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--precisions", default=None, help="comma-separated precisions the plan may use (default fp32 on "
                                                      "CPU, where bf16 is slow; bf16,fp32 on CUDA)")
    p.add_argument("--checkpoints", default="none,selective,full",
                   help="comma-separated checkpoint policies the plan may use (default none,selective,full)")
    p.add_argument("--optimizers", default="adamw", help="comma-separated optimizers the plan may use (default "
                                                         "adamw, so both runs do the same maths)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and of the batch order")
    p.add_argument("--out", default="memwrap-demo.png", help="PNG to write (default ./memwrap-demo.png)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(func=run)
    return p


class Batches:
    """Deterministic language-model batches cut from a token stream.

    Update ``step`` uses ``batch`` windows of ``seq + 1`` tokens at offsets drawn from a
    generator seeded with ``(seed, step)``; micro-batch ``i`` of size ``m`` is rows
    ``i*m .. (i+1)*m`` of that global batch, as fresh tensors. So a run with accumulation sees
    exactly the sequences of a run without.

    Example:
        >>> b = Batches(torch.arange(100), batch=4, seq=8)
        >>> x, y = b.micro(0, 0, 4)
        >>> bool((x[:, 1:] == y[:, :-1]).all()), tuple(x.shape)
        (True, (4, 8))
    """

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int, seed: int = 0):
        if tokens.numel() < seq + 2:
            raise ValueError(f"the corpus has {tokens.numel()} tokens; --seq {seq} needs at least {seq + 2}.")
        self.tokens, self.batch, self.seq, self.seed = tokens, batch, seq, seed

    def offsets(self, step: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        return torch.randint(0, self.tokens.numel() - self.seq - 1, (self.batch,), generator=gen)

    def micro(self, step: int, index: int, size: int, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        starts = self.offsets(step)[index * size:(index + 1) * size]
        rows = torch.stack([self.tokens[s:s + self.seq + 1] for s in starts.tolist()])
        return rows[:, :-1].contiguous().to(device), rows[:, 1:].contiguous().to(device)


@dataclasses.dataclass
class RunResult:
    """One training run: the loss and wall time of every update, and the measured memory."""

    label: str
    options: dict[str, Any]
    micro_batch: int
    accumulate: int
    losses: list[float]
    seconds: list[float]
    tracked: dict[str, int]  # MemTracker snapshot (bytes per category) at the peak of the last update
    allocator: dict[str, Any] | None = None  # measure_peak() result
    budget_plan: Any = None  # the planned run: the memwrap.techniques.budget.plan.BudgetChoice that budget= made

    @property
    def step_time(self) -> float:
        """Median seconds per update, without the first (warm-up) and last (measured) updates."""
        inner = self.seconds[1:-1] or self.seconds
        return statistics.median(inner)


def _parse_list(text: str | None) -> list[str] | None:
    return None if text is None else [t.strip() for t in text.split(",") if t.strip()]


def _checkpoints(text: str) -> list[Any]:
    return [None if c.lower() in ("none", "no", "off") else c for c in _parse_list(text)]


def _micro_batches(batch: int) -> list[int]:
    # Powers of two down to 1 (plus the whole batch): each size costs one trace, and the smallest
    # micro-batches are what make tight budgets fit.
    return [m for m in range(1, batch + 1) if batch % m == 0 and (m & (m - 1) == 0 or m == batch)]


def _budget(text: str, plain_peak: int) -> tuple[int, str]:
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory import format_bytes, parse_budget

    text = str(text).strip()
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"--budget {text!r}: a percentage must be a number followed by %, e.g. 60%.") from None
        if not 0 < frac:
            raise ValueError(f"--budget {text!r} must be a positive percentage of the plain peak, e.g. 60%.")
        value = int(plain_peak * frac) // 2**20 * 2**20 or int(plain_peak * frac)
        return value, f"{format_bytes(value)} ({text} of the plain run's predicted peak)"
    value = parse_budget(text)
    return value, f"{format_bytes(value)} (given)"


def _validate(args: argparse.Namespace):
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import PRESETS, get_preset

    spec = get_preset(args.preset)  # ValueError names the valid presets
    if spec.kind != _LM:
        lm = [n for n, s in PRESETS.items() if s.kind == _LM]
        raise ValueError(f"preset {args.preset!r} is a {spec.kind} model; the demo trains a language model. "
                         f"Valid: {', '.join(lm)}.")
    if args.steps < 3:
        raise ValueError(f"--steps {args.steps}: use at least 3 (one warm-up, one timed, one measured update).")
    if args.batch < 1:
        raise ValueError(f"--batch {args.batch}: the global batch must be at least 1.")
    if not 1 <= args.seq <= spec.default_seq_len:
        raise ValueError(f"--seq {args.seq}: preset {args.preset!r} takes 1 to {spec.default_seq_len} tokens.")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA device; use --device cpu.")
    return spec


def _track_update(model, optimizer, micro_batches, step_fn) -> dict[str, int]:
    """Run one update under torch's MemTracker on the real tensors; bytes per category at its peak."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.tracing.trace import CATEGORIES

    names = dict(zip((_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT, _MemRefType.ACT,
                      _MemRefType.TEMP, _MemRefType.OTH), CATEGORIES))
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *[t for mb in micro_batches for t in mb])
    with tracker:
        for i, mb in enumerate(micro_batches):
            if i:
                tracker.reset_mod_stats()  # MemTracker allows one root forward per reset
            step_fn(mb)
    device = next(model.parameters()).device
    snap = next((s for d, s in tracker.get_tracker_snapshot("peak").items() if d.type == device.type), {})
    out = {names[k]: int(v) for k, v in snap.items() if k in names}
    out["total"] = sum(out.values())
    return out


def train(label: str, factory, state: dict, options: dict[str, Any], accumulate: int, data: Batches, steps: int,
          lr: float, device: str, progress=None) -> RunResult:
    """Train ``steps`` updates from ``state``; ``options`` empty = a plain loop without memwrap.

    With ``options["budget"]`` the loop is fed by the loader of global batches wrapped with
    ``memwrap.wrap(model, optimizer, loader, budget=...)``: memwrap plans the micro-batch at the first batch
    and yields micro-batches; the loop body is the same. The run then reports the plan it chose.
    The last update runs under MemTracker (real tensors) to measure memory by category.

    Example:
        >>> from memwrap.models import get_preset
        >>> spec = get_preset("gpt2-tiny")
        >>> r = train("plain", spec.factory, spec.factory().state_dict(), {}, 1,
        ...           Batches(torch.arange(300) % 256, 2, 16), 3, 1e-3, "cpu")  # doctest: +SKIP
    """
    import memwrap
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import lm_loss

    model = factory().to(device)
    model.load_state_dict(state)
    model.train()
    optimizer = create_optimizer("adamw", model, lr=lr)
    if "budget" in options:
        return _train_budget(label, model, optimizer, options, data, steps, device, progress)
    if options:
        # The two lines memwrap adds to a loop; everything below is the unchanged loop.
        model, optimizer = memwrap.wrap(model, optimizer, **options)
    micro = data.batch // accumulate
    losses: list[float] = []
    seconds: list[float] = []
    tracked: dict[str, int] = {}

    def step(mb):
        x, y = mb
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for update in range(steps):
        mbs = [data.micro(update, i, micro, device) for i in range(accumulate)]
        start = time.perf_counter()
        if update == steps - 1:
            values: list[torch.Tensor] = []
            # The inner objects, read directly: memwrap.unwrap() would also remove the checkpointing.
            inner_model = model.module if isinstance(model, WrappedModule) else model
            inner_opt = optimizer.optimizer if isinstance(optimizer, WrappedOptimizer) else optimizer
            tracked = _track_update(inner_model, inner_opt, mbs, lambda mb: values.append(step(mb)))
        else:
            values = [step(mb) for mb in mbs]
        if device != "cpu":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(float(torch.stack(values).mean()))
        del mbs, values
        if progress is not None:
            progress(label, update + 1, steps, losses[-1])
    return RunResult(label, dict(options), micro, accumulate, losses, seconds, tracked)


def _train_budget(label, model, optimizer, options, data: Batches, steps: int, device: str, progress) -> RunResult:
    """The planned run: global batches in, ``budget=`` cuts them; the loop body is the plain one."""
    import memwrap
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import lm_loss

    inner_model, inner_opt = model, optimizer
    global_batches = [data.micro(update, 0, data.batch, device) for update in range(steps)]
    # The two lines memwrap adds to a loop (here with the loader); everything below is the unchanged loop.
    model, optimizer, loader = memwrap.wrap(model, optimizer, global_batches, **options)
    optimizer.budget_plan.log = None  # the demo prints the plan itself
    losses: list[float] = []
    seconds: list[float] = []
    tracked: dict[str, int] = {}
    batches = iter(loader)

    def step(mb):
        x, y = mb
        loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for update in range(steps):
        start = time.perf_counter()
        values: list[torch.Tensor] = []
        if update == steps - 1:  # the window's micro-batches (views of the global batch) under MemTracker
            mbs = [next(batches) for _ in range(optimizer.budget_plan.current.accumulate)]
            tracked = _track_update(inner_model, inner_opt, mbs, lambda mb: values.append(step(mb)))
            del mbs
        else:
            while not values or not optimizer.did_update:  # one update: the micro-batches of one global batch
                values.append(step(next(batches)))
        if device != "cpu":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(float(torch.stack(values).mean()))
        if progress is not None:
            progress(label, update + 1, steps, losses[-1])
    c = optimizer.budget_plan.current
    chosen = {"precision": c.precision, "accumulate": c.accumulate}
    if c.checkpoint is not None:
        chosen["checkpoint"] = c.checkpoint
    return RunResult(label, chosen, c.micro_batch, c.accumulate, losses, seconds, tracked, budget_plan=c)


def run(args: argparse.Namespace) -> int:
    """Execute ``memwrap demo``; returns 0, 1 if a measured peak is off its prediction by > 10%, 2 on bad input,
    3 if nothing fits the budget."""
    # import cost: the demo.
    from memwrap.demo.corpus import CORPUS, corpus_tokens
    # import cost: the demo.
    from memwrap.demo.report import Progress, plan_summary, plot_demo, results_table
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory import estimate, format_bytes, measure_peak, plan
    # import cost: memwrap.memory's package loads the planner.
    from memwrap.memory.search.planner import Margin
    # import cost: the built-in models, needed only by presets.
    from memwrap.models import lm_loss

    try:
        spec = _validate(args)
        data = Batches(corpus_tokens(), args.batch, args.seq, args.seed)
        precisions = _parse_list(args.precisions) or (["bf16", "fp32"] if args.device.startswith("cuda") else ["fp32"])
        checkpoints, optimizers = _checkpoints(args.checkpoints), _parse_list(args.optimizers)
    except ValueError as exc:
        print(f"memwrap demo: {exc}", file=sys.stderr)
        return 2
    say = (lambda *a: None) if args.quiet else print
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    factory = spec.factory
    say(f"memwrap demo: {spec.name} ({spec.params / 1e6:.2f}M parameters), global batch {args.batch} x {args.seq} "
        f"tokens, {args.steps} updates per run, {args.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads")
    say(f"data: {len(CORPUS.encode())} bytes of embedded text, byte-level tokens; both runs see the same batches "
        f"and start from the same weights\n")

    # 1. predict plain training, set the budget, plan.
    plain_est = estimate(factory, data.micro(0, 0, args.batch), loss_fn=lm_loss)
    try:
        budget, budget_text = _budget(args.budget, plain_est.peak)
    except ValueError as exc:
        print(f"memwrap demo: {exc}", file=sys.stderr)
        return 2
    say(f"1. plan\n   plain training (fp32, AdamW, batch {args.batch}, no accumulation or checkpointing) is predicted "
        f"to peak at {format_bytes(plain_est.peak)}")
    say(f"   budget: {budget_text}" + ("; on CPU the budget is simulated: runs are checked against it, not "
                                       "limited by it" if args.device == "cpu" else ""))
    progress = Progress(args.quiet)
    # The planner calls make_batch under a fake-tensor mode, where indexing by tensor values is impossible:
    # cut the real micro-batches first.
    first = {m: data.micro(0, 0, m) for m in range(1, args.batch + 1) if args.batch % m == 0}
    try:
        the_plan = plan(factory, first.__getitem__, budget=budget, global_batch=args.batch,
                        loss_fn=lm_loss, precisions=precisions, checkpoints=checkpoints, optimizers=optimizers,
                        # The demo lets the plan choose among the precisions it lists (the report says so), ranked by
                        # speed, rather than keeping fp32 first.
                        keep_precision=None if len(precisions) > 1 else precisions[0],
                        micro_batches=_micro_batches(args.batch), margin=Margin(0.05, 0), progress=progress.plan)
    except (ValueError, TypeError, ImportError) as exc:
        progress.close()
        print(f"memwrap demo: {exc}", file=sys.stderr)
        return 2
    progress.close()
    phases = {"plan_s": time.perf_counter() - t_start}
    say(plan_summary(the_plan))
    best = the_plan.best
    if best is None:
        need = the_plan.smallest.required
        pct = int(100 * need / plain_est.peak)
        while _budget(f"{pct}%", plain_est.peak)[0] < need:  # the budget is rounded: find the first that holds
            pct += 1
        say(f"\nnothing fits in {format_bytes(budget)}: the smallest configuration needs {format_bytes(need)} "
            f"with the demo's 5% margin. Fix: --budget {pct}% or more.")
        return 3
    say("")

    # 2. train plain and planned from the same weights on the same batches.
    state = copy.deepcopy(factory().state_dict())
    # The planned run keeps the global batch on the loop: budget= plans it again at its first batch, the same
    # search (micro-batch x checkpoint policy; precision/optimizer only when more than one is allowed).
    may = tuple(name for name, values in (("precision", precisions), ("optim", optimizers)) if len(values) > 1)
    budget_options = {"budget": budget, "margin": (0.05, 0), **({"budget_may_change": may} if may else {})}
    say(f"2. train {args.steps} updates plain, then {args.steps} with the same loop over global batches of "
        f"{args.batch} after memwrap.wrap(model, optimizer, loader, budget={format_bytes(budget)!r}, margin=(0.05, 0))")
    runs = []
    for label, options, accumulate in (("plain", {}, 1), ("planned", budget_options, None)):
        runs.append(train(label, factory, state, options, accumulate, data, args.steps, args.lr, args.device,
                          progress.train))
        progress.close()
    chosen = runs[1].budget_plan
    say(f"   budget= chose: micro-batch {chosen.micro_batch} x accumulate {chosen.accumulate}, checkpoint "
        f"{chosen.checkpoint or 'none'}, precision {chosen.precision} (planned in {chosen.plan_seconds:.1f} s; "
        f"predicted {format_bytes(chosen.peak)} + margin {format_bytes(chosen.margin)} of {format_bytes(budget)})")
    best = chosen.candidate
    phases["train_s"] = sum(sum(r.seconds) for r in runs)

    # 3. measure the allocator peak of one steady-state update of each configuration.
    estimates = [plain_est, best.estimate]
    for r in runs:
        r.allocator = measure_peak(factory, data.micro(0, 0, r.micro_batch), lm_loss, steps=1, device=args.device,
                                   **r.options)
    phases["total_s"] = time.perf_counter() - t_start
    report = _summary(args, spec, budget, best, runs, estimates, phases)
    say("\n3. results\n" + results_table(report))
    if args.out:
        written = plot_demo(report, args.out)
        say(f"\nplot: {written}" if written else "\nplot skipped: matplotlib is not installed (pip install matplotlib)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1, default=repr)
    if not report["within_tolerance"]:
        print(f"memwrap demo: a measured peak is more than {TOLERANCE:.0%} away from its prediction "
              f"(ratios {[round(r['ratio'], 3) for r in report['runs']]}); please report this.", file=sys.stderr)
        return 1
    return 0


def _summary(args, spec, budget, best, runs: list[RunResult], estimates, phases: dict[str, float]) -> dict[str, Any]:
    rows = []
    for r, est in zip(runs, estimates):
        measured = r.allocator["peak"]
        rows.append({
            "label": r.label, "options": r.options, "micro_batch": r.micro_batch, "accumulate": r.accumulate,
            "predicted": dict(est.breakdown, total=est.peak), "tracked": r.tracked,
            "measured_peak": measured, "measure_method": r.allocator["method"],
            "ratio": measured / est.peak, "tracked_ratio": r.tracked.get("total", 0) / est.peak,
            "fits_budget": measured <= budget, "step_time_s": r.step_time, "seconds": r.seconds,
            "losses": r.losses,
        })
    plain, planned = runs
    diff = max(abs(a - b) for a, b in zip(plain.losses, planned.losses))
    return {"preset": spec.name, "params": spec.params, "batch": args.batch, "seq": args.seq, "steps": args.steps,
            "device": args.device, "budget": budget, "plan_label": best.label, "plan_code": best.options,
            "runs": rows, "max_loss_diff": diff, "time_ratio": planned.step_time / plain.step_time,
            "within_tolerance": all(abs(r["ratio"] - 1) <= TOLERANCE for r in rows),
            "tolerance": TOLERANCE, "seconds": phases["total_s"], "phases": phases, "torch": torch.__version__,
            "threads": torch.get_num_threads()}
