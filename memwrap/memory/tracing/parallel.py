"""Two independent traces at once: the extrapolation's depth-``a`` trace in a forked process, depth ``b`` here.

An extrapolated estimate traces the block stack truncated to ``a`` and to ``b`` blocks; the two traces share
nothing, so on a machine with a second core the first runs in a child process forked for it while this process runs
the second, and the estimate costs the longer of the two instead of their sum. Fork (not spawn) because the child
then has the model, the batch and the options as they are here, with nothing pickled but the result.

The child is a helper, never a dependency: it runs with one torch thread, sends back its result (pickled) or
its error, and exits without running this process's exit handlers. It never changes its thread count again
(OpenMP's thread pool does not survive fork: a parallel region at more threads hangs the child), so a
kernel-workspace probe, which measures at the step's thread count, is refused there and reported as its error.
When it fails, sends nothing in time, or cannot be started (no ``os.fork``, not Linux, one core, CUDA already
initialised here, ``MEMWRAP_TRACE_WORKERS=0``, or this process is itself such a child), the first trace runs here
after the second, as it did before: the results are the same either way, and so are the errors, which are raised
here.

Example:
    >>> both(lambda: 1 + 1, lambda: 2 + 2)
    (2, 4)
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from memwrap.memory.tracing import workspace

__all__ = ["both", "enabled"]

_IN_CHILD = False
# A child that has sent nothing this long after the second trace finished (and at least 3x that trace's time) is
# given up on: the first trace runs here instead.
MIN_WAIT_S = 30.0


def enabled() -> bool:
    """Whether :func:`both` forks: Linux with ``os.fork``, at least two usable cores, CUDA not initialised in this
    process, not already in a child, and not ``MEMWRAP_TRACE_WORKERS=0``.

    Example:
        >>> isinstance(enabled(), bool)
        True
    """
    if _IN_CHILD or not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    if not workspace.switch("MEMWRAP_TRACE_WORKERS"):
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if cores < 2:
        return False
    # A CUDA context does not survive fork; the traces are fake CPU traces, but nothing in a child may touch CUDA.
    return not (torch.cuda.is_available() and torch.cuda.is_initialized())


def _child(first: Callable[[], Any], write_fd: int) -> None:
    global _IN_CHILD
    _IN_CHILD = True
    status = 1
    try:
        # The parent uses the other core. Kernel workspaces are still measured at the step's thread count: oneDNN's
        # scratchpads are per thread (a bf16 matmul's differed between the child and a trace in the parent).
        workspace.training_threads(torch.get_num_threads())
        torch.set_num_threads(1)
        # ... and never switches back: a probe that needs the step's threads is refused, and the parent traces.
        workspace.pin_threads()
        try:
            result = first()
            if workspace.probes_refused():  # even if the traced code swallowed the refusal, the trace lacks it
                raise workspace.ThreadsPinned("a kernel workspace probe needs the step's thread count")
            payload = pickle.dumps(("ok", result, _counters()))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which runs the trace itself
            payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", {}))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
        status = 0
    except BaseException:  # noqa: BLE001 - a child never raises into the code it was forked from
        pass
    finally:
        os._exit(status)


def _counters() -> dict[str, int]:
    # The kernel-workspace probes the child made count in this process too (what tests and reports read).
    return {"probes": workspace._probes["count"]}


def _read(fd: int, deadline: float) -> bytes | None:
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def both(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """``(first(), second())``, with ``first`` in a forked child while ``second`` runs here when :func:`enabled`.

    An error of ``second`` is raised as it is (the child is stopped); an error of ``first`` is raised here too,
    by running ``first`` here once the child reports it failed.

    Example:
        >>> both(lambda: "a", lambda: "b")
        ('a', 'b')
    """
    if not enabled():
        return first(), second()
    before = workspace._probes["count"]
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return first(), second()
    if pid == 0:
        os.close(read_fd)
        _child(first, write_fd)
    os.close(write_fd)
    got = None
    try:
        start = time.monotonic()
        out_second = second()
        took = time.monotonic() - start
        data = _read(read_fd, time.monotonic() + max(MIN_WAIT_S, 3 * took))
        if data:
            try:
                got = pickle.loads(data)
            except Exception:  # noqa: BLE001 - a damaged result: run it here
                got = None
    finally:
        os.close(read_fd)
        _reap(pid, got is None)
    if got is not None and got[0] == "ok":
        counted = got[2].get("probes")
        if counted is not None:  # the child's counter started from ours
            workspace._probes["count"] += max(0, counted - before)
        return got[1], out_second
    return first(), out_second


def _reap(pid: int, kill: bool) -> None:
    if kill:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
