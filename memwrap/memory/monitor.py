"""MemoryMonitor: per-update peak memory during real training, instead of sprinkling
``print(torch.cuda.memory_allocated())`` through the loop.

On CUDA it reads the caching allocator's statistics (peak allocated and reserved since the last
record, then resets the peaks); on CPU it reads the process's resident memory from ``/proc``
(current RSS and the high-water mark, which it resets through ``/proc/self/clear_refs`` when the
kernel allows it).

Example:
    >>> monitor = MemoryMonitor(every=1, log=None)
    >>> for _ in range(3):
    ...     monitor.step()          # standalone; memwrap.wrap(..., monitor=k) calls on_update itself
    >>> len(monitor.records)
    3
"""
from __future__ import annotations

import os
import resource
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from memwrap.memory.budget import format_bytes

__all__ = ["MemoryMonitor", "process_memory"]


def _read_status() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def process_memory() -> dict[str, int]:
    """Resident set size of this process now (``rss``) and its high-water mark (``peak``), in bytes.

    Example:
        >>> process_memory()["rss"] > 0
        True
    """
    status = _read_status()
    rss = status.get("VmRSS")
    peak = status.get("VmHWM")
    if rss is None:  # no /proc (macOS): ru_maxrss is the peak, in bytes on macOS and KiB on Linux
        peak = rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if os.uname().sysname == "Darwin" else 1024)
    return {"rss": rss, "peak": peak if peak is not None else rss}


def reset_process_peak() -> bool:
    """Reset the RSS high-water mark (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class MemoryMonitor:
    """Record peak memory every ``every`` optimizer updates.

    Args:
        every: record one update out of ``every``.
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"`` or None (CUDA when available, else CPU).
        log: called with one line per record (``print`` by default, None for silence).

    Use ``memwrap.wrap(model, optimizer, monitor=k)`` (the wrapped optimizer calls
    :meth:`on_update` after each real update), or call :meth:`step` yourself after each update.
    :meth:`summary` gives the table at the end.

    Example:
        >>> m = MemoryMonitor(every=2, log=None)
        >>> m.on_update(1); m.on_update(2)
        >>> [r["update"] for r in m.records]
        [2]
    """

    def __init__(self, every: int = 1, device: str | torch.device | None = None,
                 log: Callable[[str], Any] | None = print):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (record one update in every k), got {every!r}.")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"MemoryMonitor reads CUDA allocator statistics or process memory; device "
                             f"{str(self.device)!r} is neither. Fix: device='cuda' or device='cpu'.")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            # Otherwise every record would read zeros and look like a model that uses no memory.
            raise ValueError(f"MemoryMonitor(device={str(self.device)!r}): CUDA is not available in this process "
                             f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}). Fix: "
                             f"device='cpu' (process memory) or device=None (CUDA when available, else CPU).")
        self.every = every
        self.log = log
        self.records: list[dict[str, Any]] = []
        self.count = 0
        self._t0 = time.perf_counter()
        self.expected: dict[str, Any] | None = None  # the budget plan's prediction (set by expect())
        self._reset_peaks()

    def expect(self, peak: int, budget: int, plan: str = "") -> None:
        """Compare each record with a plan: its predicted peak and the budget (``wrap(budget=...)`` calls this).

        Each record then carries ``predicted`` and ``budget`` and its line says how the measured peak compares.
        On CUDA the measured figure is ``max_memory_allocated`` (what the plan predicts); on CPU it is the
        process's peak RSS, which also counts the Python runtime and libraries, so it reads above the prediction.

        Example:
            >>> m = MemoryMonitor(log=None); m.expect(2**30, 2**31)
            >>> m.on_update(1); m.records[0]["budget"]
            2147483648
        """
        self.expected = {"predicted": int(peak), "budget": int(budget), "plan": plan}

    def _reset_peaks(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.device.type == "cpu":
            reset_process_peak()

    def _read(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {"peak_allocated": torch.cuda.max_memory_allocated(self.device),
                    "peak_reserved": torch.cuda.max_memory_reserved(self.device),
                    "allocated": torch.cuda.memory_allocated(self.device)}
        mem = process_memory()
        return {"peak_rss": mem["peak"], "rss": mem["rss"]}

    def on_update(self, update_index: int) -> None:
        """Called after optimizer update number ``update_index`` (1-based); records every ``every``-th."""
        self.count = int(update_index)
        if update_index % self.every:
            return
        record = {"update": int(update_index), "time_s": round(time.perf_counter() - self._t0, 3), **self._read()}
        if self.expected is not None:
            record.update(predicted=self.expected["predicted"], budget=self.expected["budget"])
        self.records.append(record)
        self._reset_peaks()
        if self.log is not None:
            self.log(self._line(record))

    def step(self) -> None:
        """Standalone use: count one update and record it when due."""
        self.on_update(self.count + 1)

    @staticmethod
    def _line(r: dict[str, Any]) -> str:
        plan = ""
        if "predicted" in r:
            measured = r.get("peak_allocated", r.get("peak_rss"))
            plan = (f"; plan predicted {format_bytes(r['predicted'])} ({measured / max(r['predicted'], 1):.2f}x), "
                    f"budget {format_bytes(r['budget'])} ({'within' if measured <= r['budget'] else 'OVER'})")
        if "peak_allocated" in r:
            return (f"[memwrap] update {r['update']}: peak allocated {format_bytes(r['peak_allocated'])}, "
                    f"peak reserved {format_bytes(r['peak_reserved'])}{plan}")
        return f"[memwrap] update {r['update']}: peak RSS {format_bytes(r['peak_rss'])}, RSS {format_bytes(r['rss'])}{plan}"

    def summary(self) -> str:
        """A plain-text table of the records, with the overall maximum.

        Example:
            >>> print(MemoryMonitor(log=None).summary())
            no memory records (MemoryMonitor saw no update yet)
        """
        if not self.records:
            return "no memory records (MemoryMonitor saw no update yet)"
        cuda = "peak_allocated" in self.records[0]
        cols = ("peak_allocated", "peak_reserved", "allocated") if cuda else ("peak_rss", "rss")
        head = ["update", "time_s", *cols]
        rows = [[str(r["update"]), f"{r['time_s']:.1f}", *(format_bytes(r[c]) for c in cols)] for r in self.records]
        rows.append(["max", "", *(format_bytes(max(r[c] for r in self.records)) for c in cols)])
        widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:>{w}}}" for w in widths)
        lines = [f"memory on {self.device} (every {self.every} update(s))", fmt.format(*head),
                 fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in rows]
        return "\n".join(lines)

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every, "count": self.count, "device": str(self.device),
                "records": [dict(r) for r in self.records], "elapsed_s": time.perf_counter() - self._t0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the records and the clock; the ``every`` of this run (the one passed now) is kept."""
        if int(state["every"]) != self.every:
            warnings.warn(f"the memory monitor was saved with every={state['every']}; this run logs every "
                          f"{self.every} updates, as asked.", stacklevel=2)
        self.count = int(state["count"])
        self.records = [dict(r) for r in state["records"]]
        # time_s keeps counting from where the saved run stopped instead of going back to 0
        self._t0 = time.perf_counter() - float(state.get("elapsed_s", 0.0))
