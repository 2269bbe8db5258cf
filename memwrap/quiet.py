"""Quieting the output of libraries memwrap calls on its own, and only that output.

memwrap runs torch's profiler to measure CPU peaks and imports optional libraries (torchao) for the candidates
that need them; the user asked for neither, so their log lines (kineto's ``USDT ... profiler_start``, torchao's
"Failed to load _C_mxfp8", torch's ``_pytree`` deprecation) are held back. The user's own output is never: the
native filter covers only memwrap's own calls into the profiler (not the code measured between them) and writes
back every line that is not one of kineto's; the log levels are raised only during memwrap's import of the
library, and put back after.

Example:
    >>> with quiet_loggers("torchao"):
    ...     pass
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator

__all__ = ["quiet_loggers", "quiet_native_stderr", "KINETO_LINE"]

# kineto's own log lines: "USDT:2026-12-01 23:49:12 17313:17313 SyncActivityProfilerHandler.cpp:52] profiler_start".
# Its warnings and errors are kept: they would say that a measurement went wrong.
KINETO_LINE = re.compile(rb"^(USDT|STAGE|INFO|VERBOSE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+\.cpp:\d+\] ")


@contextlib.contextmanager
def quiet_native_stderr(drop: re.Pattern = KINETO_LINE) -> Iterator[None]:
    """Within the block, what is written to file descriptor 2 (native code included) is held back; at its end the
    lines matching ``drop`` are discarded and the rest is written to stderr, in order.

    Wrap only memwrap's own calls into a library (e.g. ``profiler.start()``), never the user's code.

    Example:
        >>> with quiet_native_stderr():
        ...     pass
    """
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, AttributeError, ValueError):  # no file descriptor 2 to redirect: nothing to quiet
        yield
        return
    held = tempfile.TemporaryFile()
    try:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
            os.dup2(saved, 2)
        held.seek(0)
        kept = b"".join(line for line in held.read().splitlines(keepends=True) if not drop.match(line))
        if kept:
            os.write(2, kept)
    finally:
        os.close(saved)
        held.close()


@contextlib.contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """Within the block, the loggers ``names`` (and their children that set no level of their own) log only at
    ``level`` and above; their levels are restored at its end.

    For memwrap's import of an optional library, whose import-time warnings are about kernels and deprecations
    memwrap's use does not touch.

    Example:
        >>> before = logging.getLogger("torchao").level
        >>> with quiet_loggers("torchao"):
        ...     logging.getLogger("torchao").level
        40
        >>> logging.getLogger("torchao").level == before
        True
    """
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(level, lg.getEffectiveLevel()))
    try:
        yield
    finally:
        for lg, before in zip(loggers, levels):
            lg.setLevel(before)
