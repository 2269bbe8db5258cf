"""Output of ``memwrap demo``: the progress bar, the results table and the PNG.

rich and matplotlib are imported only here, inside the functions that use them, and both are
optional: without rich the progress is plain lines, without matplotlib the PNG is skipped.

Example:
    >>> from memwrap.demo.report import mib
    >>> mib(3 * 2**20)
    '3.00'
"""
from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress", "plan_summary", "results_table", "plot_demo", "mib", "ROWS"]

# (key in the predicted/tracked dicts, label)
ROWS = (("parameters", "parameters"), ("buffers", "buffers"), ("gradients", "gradients"),
        ("optimizer_state", "optimizer state"), ("activations", "activations"), ("temporaries", "temporaries"),
        ("other", "other (batch)"))


def mib(n: float) -> str:
    """Bytes as MiB with two decimals (the demo's unit)."""
    return f"{n / 2**20:.2f}"


class Progress:
    """Progress on stderr: a rich bar when rich is installed and stderr is a terminal, plain lines otherwise."""

    def __init__(self, quiet: bool = False):
        self.quiet, self.bar, self.task, self.t0 = quiet, None, None, time.perf_counter()
        self._rich = False
        if quiet or not sys.stderr.isatty():
            return
        try:
            import rich.progress  # noqa: F401
        except ImportError:
            return
        self._rich = True

    def _start(self, description: str, total: int) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

        self.bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=Console(stderr=True), transient=True)
        self.bar.start()
        self.task = self.bar.add_task(description, total=total)

    def _update(self, description: str, done: int, total: int, plain_every: int) -> None:
        if self.quiet:
            return
        if self._rich:
            if self.bar is None:
                self._start(description, total)
            self.bar.update(self.task, completed=done, total=total, description=description)
            return
        if done == total or done % plain_every == 0:
            print(f"   [{time.perf_counter() - self.t0:6.1f}s] {description}: {done}/{total}", file=sys.stderr,
                  flush=True)

    def plan(self, done: int, total: int, label: str) -> None:
        """Callback for :func:`memwrap.plan` (``progress=``): called before and after each trace."""
        if label.rpartition(": ")[2].startswith("traced ") and done < total:  # after any "stage ...: " prefix
            return  # the next "tracing ..." call reports the same count
        self._update(f"planning: {label}", done, total, 1)

    def train(self, label: str, done: int, total: int, loss: float) -> None:
        """Callback of the demo's training loop."""
        self._update(f"training {label} (loss {loss:.3f})", done, total, max(1, total // 4))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        self.bar = self.task = None


def plan_summary(plan: Any, limit: int = 8) -> str:
    """The plan's candidates in MiB (the demo's scale), ranked as the planner ranks them, and its verdict."""
    lines = [f"   {'#':>2}  {'candidate':<28}{'peak MiB':>10}{'+margin':>10}{'fits':>6}{'cost':>8}"]
    for i, c in enumerate(plan.candidates[:limit], 1):
        lines.append(f"   {i:>2}  {c.label:<28}{mib(c.estimate.peak):>10}{mib(c.required):>10}"
                     f"{'yes' if c.fits else 'no':>6}{c.cost:>7.2f}x")
    if len(plan.candidates) > limit:
        lines.append(f"   ... {len(plan.candidates) - limit} more")
    lines += ["   cost = predicted step time on the planner's reference GPU, relative to the fastest candidate", "",
              "   " + plan.verdict, "", *("   " + line for line in plan.code().splitlines())]
    return "\n".join(lines)


def results_table(report: dict[str, Any]) -> str:
    """The demo's results as a plain-text table: memory by category (MiB), peaks, time, loss."""
    plain, planned = report["runs"]
    heads = [f"plain ({plain['micro_batch']}x1)", f"planned ({report['plan_label']})"]
    w0, w = 26, 12
    lines = [f"   {'memory at the peak, MiB':<{w0}}" + "".join(f"{h:^{2 * w}}" for h in heads),
             f"   {'':<{w0}}" + "".join(f"{'predicted':>{w}}{'measured':>{w}}" for _ in heads)]
    for key, label in ROWS:
        vals = [(r["predicted"].get(key, 0), r["tracked"].get(key, 0)) for r in report["runs"]]
        if not any(a or b for a, b in vals):
            continue
        lines.append(f"   {label:<{w0}}" + "".join(f"{mib(a):>{w}}{mib(b):>{w}}" for a, b in vals))
    lines.append(f"   {'peak (MemTracker, real)':<{w0}}" + "".join(
        f"{mib(r['predicted']['total']):>{w}}{mib(r['tracked'].get('total', 0)):>{w}}" for r in report["runs"]))
    lines.append(f"   {'peak (CPU/CUDA allocator)':<{w0}}" + "".join(
        f"{mib(r['predicted']['total']):>{w}}{mib(r['measured_peak']):>{w}}" for r in report["runs"]))
    lines.append(f"   {'measured / predicted':<{w0}}" + "".join(f"{'':>{w}}{r['ratio']:>{w}.4f}" for r in report["runs"]))
    lines.append(f"   {'fits the budget':<{w0}}" + "".join(
        f"{mib(report['budget']):>{w}}{'yes' if r['fits_budget'] else 'no':>{w}}" for r in report["runs"]))
    lines.append(f"   {'s / update (median)':<{w0}}" + "".join(f"{'':>{w}}{r['step_time_s']:>{w}.3f}"
                                                              for r in report["runs"]))
    lines.append(f"   {'loss: first -> last':<{w0}}" + "".join(
        f"{'':>{w - 8}}{r['losses'][0]:>8.4f}{'-> ' + format(r['losses'][-1], '.4f'):>{w}}" for r in report["runs"]))
    ok = "yes" if report["within_tolerance"] else "NO"
    lines += [
        "",
        f"   predicted vs measured peak within {report['tolerance']:.0%}: {ok} (allocator ratios "
        f"{', '.join(format(r['ratio'], '.4f') for r in report['runs'])}; MemTracker ratios "
        f"{', '.join(format(r['tracked_ratio'], '.4f') for r in report['runs'])})",
        f"   planned / plain: peak {planned['measured_peak'] / plain['measured_peak']:.2f}x, step time "
        f"{report['time_ratio']:.2f}x; largest loss difference over {report['steps']} updates "
        f"{report['max_loss_diff']:.2e} (same batches, same initial weights)",
        f"   demo time {report['seconds']:.1f} s (planning {report['phases']['plan_s']:.1f} s, training "
        f"{report['phases']['train_s']:.1f} s, the rest measuring)",
    ]
    return "\n".join(lines)


def plot_demo(report: dict[str, Any], path: str) -> str | None:
    """Three panels: memory by category (predicted bars, measured markers, budget line), loss, step time.

    Returns the path written, or None when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    names = ["plain", f"planned\n{report['plan_label']}"]
    fig, (ax_m, ax_l, ax_t) = plt.subplots(1, 3, figsize=(14, 4.6), gridspec_kw={"width_ratios": [1.2, 1.6, 0.8]})
    bottom = [0.0] * len(runs)
    for key, label in ROWS:
        vals = [r["predicted"].get(key, 0) / 2**20 for r in runs]
        if any(vals):
            ax_m.bar(names, vals, bottom=bottom, label=label, width=0.55)
            bottom = [a + b for a, b in zip(bottom, vals)]
    ax_m.scatter(names, [r["measured_peak"] / 2**20 for r in runs], color="black", marker="D", zorder=3,
                 label="measured peak (allocator)")
    ax_m.axhline(report["budget"] / 2**20, color="red", linestyle="--", label="budget")
    ax_m.set_ylim(0, 1.45 * max(max(bottom), report["budget"] / 2**20))  # room for the legend
    ax_m.set_ylabel("MiB at the peak")
    ax_m.set_title(f"{report['preset']}: predicted by category, measured")
    ax_m.legend(fontsize=7, loc="upper center", ncol=2)
    for r, name in zip(runs, names):
        ax_l.plot(range(1, len(r["losses"]) + 1), r["losses"], label=name.replace("\n", " "),
                  linestyle="-" if r["label"] == "plain" else "--")
    ax_l.set_xlabel("update")
    ax_l.set_ylabel("training loss")
    ax_l.set_title(f"same batches, same start: max |diff| {report['max_loss_diff']:.1e}")
    ax_l.legend(fontsize=8)
    ax_t.bar(names, [r["step_time_s"] for r in runs], color=["tab:blue", "tab:orange"], width=0.55)
    ax_t.set_ylabel("seconds per update (median)")
    ax_t.set_title(f"{report['device']}, {report['threads']} threads")
    fig.suptitle(f"memwrap demo: global batch {report['batch']} x {report['seq']} tokens, {report['steps']} updates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
