"""Tables and plots of plans: plain text (or rich, when installed) and matplotlib bar charts.

matplotlib and rich are imported only inside the functions that draw with them.

Example:
    >>> from memwrap.memory.search.report import gib
    >>> gib(3 * 2**30)
    '3.00'
"""
from __future__ import annotations

from typing import Any

from memwrap.memory.budget import format_bytes, unit_for

__all__ = ["plan_rows", "plan_table", "plan_legend", "print_plan", "plot_plan", "gib", "table_unit", "TABLE_COLUMNS"]

# Device memory at the peak by category, the peak and margin, then what the step keeps off the device (not in the
# peak, but a decision needs it: paged optimizer state needs host RAM when it spills, offloaded activations do).
TABLE_COLUMNS = ("#", "candidate", "params", "grads", "opt state", "activations", "temp+other", "peak GiB",
                 "+margin", "opt paged/host", "act offloaded", "fits", "cost")
_FITS = TABLE_COLUMNS.index("fits")


def gib(n: int | float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{n / 2**30:.2f}"


def table_unit(plan: Any) -> tuple[str, int]:
    """The report's one memory unit (columns, header, verdict): the largest in which the biggest predicted
    peak is at least 1, so a small model's table does not read 0.00 everywhere.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> table_unit(NS(candidates=[NS(estimate=NS(peak=300 * 2**20))]))
        ('MiB', 1048576)
    """

    return unit_for(max((max(c.estimate.peak, _off_device_state(c.estimate), getattr(c.estimate, "offloaded", 0))
                         for c in plan.candidates), default=0))


def _off_device_state(estimate: Any) -> int:
    """Optimizer state kept off the device: paged (CUDA unified memory) plus host RAM."""
    return getattr(estimate, "paged_state", 0) + getattr(estimate, "host_state", 0)


def _in(plan: Any, n: int | float) -> str:
    """``n`` bytes in the plan's unit, with the unit: ``'8192.00 MiB'``."""

    return format_bytes(n, unit=table_unit(plan)[0])


def _header(plan: Any, candidates: bool = True) -> str:
    count = f"{len(plan.candidates)} candidates, " if candidates else ""
    tc = getattr(plan, "trace_cache", None) or {}
    cache = f" ({tc['read']} traces read from the cache, {tc['traced']} traced)" if tc.get("read") else ""
    return (f"memwrap plan: budget {_in(plan, plan.budget)}, global batch {plan.global_batch}, {count}margin "
            f"{plan.margin.fraction:.0%} of peak + {_in(plan, plan.margin.fixed)}, planned in {plan.seconds:.1f} s"
            f"{cache}")


def _hidden_line(plan: Any, limit: int | None) -> list[str]:
    if limit is None or len(plan.candidates) <= limit:
        return []
    return [f"... {len(plan.candidates) - limit} more candidates not shown ({limit} of {len(plan.candidates)}): "
            f"--top all shows every one (--json writes them all)"]


def table_columns(unit: str = "GiB") -> tuple[str, ...]:
    return tuple(f"peak {unit}" if c == "peak GiB" else c for c in TABLE_COLUMNS)


def plan_rows(plan: Any) -> list[list[str]]:
    """One row of strings per candidate, in rank order (columns: :data:`TABLE_COLUMNS`)."""
    size = table_unit(plan)[1]

    def u(n: int | float) -> str:
        return f"{n / size:.2f}"

    rows = []
    for i, c in enumerate(plan.candidates, 1):
        b = c.estimate.breakdown
        g = b.get  # sharded estimates add categories (memwrap.memory.sharded.trace): folded into the nearest column
        rows.append([str(i), c.label, u(b["parameters"] + b["buffers"] + g("unsharded_parameters", 0)),
                     u(b["gradients"] + g("unsharded_gradients", 0) + g("gradient_buckets", 0)),
                     u(b["optimizer_state"]), u(b["activations"]),
                     u(b["temporaries"] + b["other"] + g("all_gather", 0) + g("reduce_scatter", 0)),
                     u(c.estimate.peak), u(c.margin), u(_off_device_state(c.estimate)), u(c.estimate.offloaded),
                     "yes" if c.fits else "no", f"{c.cost:.2f}x"])
    return rows


# Each word a candidate's label can hold that is not an option value as wrap() spells it, with what it means.
_LABEL_WORDS = (
    (r"^(fsdp2|ddp)x\d+ ", "fsdp2xN / ddpxN", "sharded over N GPUs with FSDP2 / replicated with DDP (the figures are "
                                              "one GPU's)"),
    (r" no-ckpt ", "no-ckpt", "no activation checkpointing (checkpoint=None)"),
    (r" \+sib\b", "+sib", "step_in_backward=True: each parameter's update runs in backward, its gradient freed at once"),
    (r" \+chunked\d+", "+chunkedN", "chunked_loss=N: the LM-head loss computed in chunks of N tokens, the full logits "
                                    "never held"),
    (r" \+chunked(\s|$)", "+chunked", "chunked_loss=True: the LM-head loss computed in chunks, the full logits never "
                                      "held"),
    (r" uncompensated\b", "uncompensated", "compensation='none': bf16 weights updated without Kahan summation or an "
                                           "fp32 copy (the update rounds to bf16)"),
)


def plan_legend(plan: Any, limit: int | None = None) -> list[str]:
    """The lines that define every column and every abbreviation of the shown candidates' labels.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> plan_legend(NS(candidates=[NS(label="2x1 bf16 no-ckpt adamw +sib")]))[-1].split()[0]
        '+sib'
    """
    import re

    labels = [c.label for c in plan.candidates[:limit]]
    words = [
        ("candidate", "micro-batch x accumulation steps, precision, checkpoint policy, optimizer (as wrap() spells "
                      "them), then the techniques below"),
        ("params ... temp+other", "device memory by category at the predicted peak (params with buffers; opt state: "
                                  "optimizer state in device memory)"),
        ("+margin", "kept free beyond the peak (--margin, --margin-bytes)"),
        ("opt paged/host", "optimizer state off the device, not in the peak: paged (CUDA unified memory, spills to "
                           "host RAM, which must hold it) or in host RAM"),
        ("act offloaded", "activations saved in host RAM (checkpoint='offload'), not in the peak"),
        ("cost", "predicted step time relative to the fastest candidate"),
    ]
    for pattern, word, meaning in _LABEL_WORDS:
        if any(re.search(pattern, label if pattern.startswith("^") else f" {label} ") for label in labels):
            words.append((word, meaning))
    width = max(len(w) for w, _ in words)
    lines = ["legend:"] + [f"  {w:<{width}}  {meaning}" for w, meaning in words]
    return lines


def plan_table(plan: Any, limit: int | None = None) -> str:
    """The plan as a plain-text table, its verdict and the code to paste.

    Memory columns are the categories at the peak, in the unit of :func:`table_unit`; ``cost`` is the predicted step time
    relative to the fastest candidate (see :mod:`memwrap.memory.search.cost`).
    """
    rows = plan_rows(plan)[:limit]
    columns = table_columns(table_unit(plan)[0])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" if i == 1 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines = [_header(plan), fmt.format(*columns), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    lines += _hidden_line(plan, limit)
    lines += plan_legend(plan, limit)
    lines += _skipped_lines(plan)
    lines += ["", plan.verdict] + ([plan.sharding] if getattr(plan, "sharding", "") else []) + _loop_line(plan)
    lines += ["", plan.code()]
    return "\n".join(lines)


def _loop_line(plan: Any) -> list[str]:
    """Which loop shape the peaks assume (``plan(keep_outputs=...)``, ``memwrap plan --drop-outputs``)."""
    if not plan.candidates:
        return []
    if plan.candidates[0].estimate.keep_outputs:
        return ["Loop: planned for a loop that keeps the model's outputs through backward (outputs = model(**batch); "
                "outputs.loss.backward()); if yours drops them (loss = model(**batch).loss, Trainer), "
                "keep_outputs=False / --drop-outputs plans less."]
    return ["Loop: planned for a loop that drops the model's outputs once the loss is computed (loss = "
            "model(**batch).loss, Trainer); a loop that keeps them through backward needs more."]


def _skipped_lines(plan: Any, shown: int = 6, width: int = 200) -> list[str]:
    """One line per kind of reason, most frequent first, with how many candidates it left out.

    Candidates that cannot run on this model, those left out by a bound (weights, or weights, gradients and state,
    over the budget), optimizers refused under a layout, and notes on the search space (memwrap.memory.search.techniques).
    Reasons that differ only in numbers or in parentheses (sizes, optimizer names) are one kind; the first one of
    each kind is shown, cut at ``width`` characters.
    """
    if not plan.skipped:
        return []
    import re

    kinds: dict[str, list[str]] = {}
    for _, why in plan.skipped:
        first = re.split(r"\.\s+(?=[A-Z])", why)[0]  # the first sentence ("optimizers=... / --optimizers" stays)
        key = re.sub(r"\([^()]*\)|\b\w*\d[\w.]*", "#", first)  # sizes, counts, names such as Lion32bit
        kinds.setdefault(key, []).append(first)
    ranked = sorted(kinds.values(), key=len, reverse=True)
    lines = [f"skipped {len(plan.skipped)} candidate(s) (not traced):"]
    for reasons in ranked[:shown]:
        text = reasons[0] if len(reasons[0]) <= width else reasons[0][:width - 3] + "..."
        others = len(set(reasons)) - 1
        lines.append(f"  {len(reasons):>5}  {text}" + (f"  [and {others} more like it]" if others else ""))
    if len(ranked) > shown:
        lines.append(f"  ... {len(ranked) - shown} more kind(s) of reason; --json lists every skipped candidate")
    return lines


def print_plan(plan: Any, console: Any = None, limit: int | None = None) -> None:
    """Print the plan with rich when it is installed, as plain text otherwise (the first ``limit`` rows)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(plan_table(plan, limit=limit))
        return
    console = console or Console()
    table = Table(title=_header(plan))
    for i, col in enumerate(table_columns(table_unit(plan)[0])):
        # the candidate's name and its cost are read as wholes: never wrapped or cut on a narrow terminal
        table.add_column(col, justify="left" if i == 1 else "right", no_wrap=col in ("candidate", "cost"))
    for row in plan_rows(plan)[:limit]:
        style = None if row[_FITS] == "yes" else "dim"
        table.add_row(*row, style=style)
    console.print(table)
    for line in _hidden_line(plan, limit) + plan_legend(plan, limit):
        console.print(line, markup=False, highlight=False)
    for line in _skipped_lines(plan):
        console.print(line, markup=False)
    console.print(plan.verdict)
    if getattr(plan, "sharding", ""):
        console.print(plan.sharding)
    # soft_wrap: the two lines to paste must stay two lines, whatever the terminal's width
    console.print(plan.code(), markup=False, highlight=False, soft_wrap=True)


def plot_order(plan: Any) -> str:
    """How the candidates are ordered, in words, for titles: it depends on whether anything fits.

    Example:
        >>> from types import SimpleNamespace as NS
        >>> plot_order(NS(fits=False, keep_optim="adamw"))
        'nothing fits: ranked by memory needed'
    """
    if not plan.fits:
        return "nothing fits: ranked by memory needed"
    keep = getattr(plan, "keep_optim", None)
    first = f"those keeping {keep} first, " if keep else ""
    return f"fitting ones {first}by predicted step time, then the others by memory needed"


def plot_plan(plan: Any, path: str, limit: int | None = None) -> str:
    """Stacked bars of the peak by category per candidate, the margin on top, and the budget line.

    All candidates are drawn unless ``limit`` is given; the title then says how many are shown.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = plan.candidates[:limit]
    unit, size = table_unit(plan)
    cats = [("parameters", "params+buffers"), ("gradients", "gradients"), ("optimizer_state", "optimizer state"),
            ("activations", "activations"), ("temporaries", "temporaries+other")]
    fig, ax = plt.subplots(figsize=(max(8, 0.32 * len(cands) + 3), 5.5))
    x = range(len(cands))
    bottom = [0.0] * len(cands)
    for key, label in cats:
        vals = []
        for c in cands:
            b = c.estimate.breakdown
            v = b[key] + (b["buffers"] if key == "parameters" else 0) + (b["other"] if key == "temporaries" else 0)
            vals.append(v / size)
        ax.bar(x, vals, bottom=bottom, label=label)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax.bar(x, [c.margin / size for c in cands], bottom=bottom, label="margin", color="none", edgecolor="grey",
           hatch="//")
    ax.axhline(plan.budget / size, color="red", linestyle="--", label=f"budget {_in(plan, plan.budget)}")
    ax.set_xticks(list(x))
    ax.set_xticklabels([("* " if c.fits else "") + c.label for c in cands], rotation=75, ha="right", fontsize=7)
    ax.set_ylabel(f"{unit} at the peak")
    shown = (f"first {len(cands)} of {len(plan.candidates)} candidates" if len(cands) < len(plan.candidates)
             else f"all {len(cands)} candidates")
    ax.set_title(f"memwrap plan: predicted peak by category (* = fits), {plot_order(plan)}; {shown}")
    ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
