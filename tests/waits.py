"""Waiting for a process that starts slowly on a busy machine, and not for one that is stuck.

A fixed deadline on a daemon's start fails a test whenever the machine is
busy (CI's may be: issue 41); wait_while_progressing waits as long as the
process keeps working. Imports nothing of the tests' (bench/ uses
tests/pgbouncer.py, which uses this).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cpu_ticks(pid: int) -> int:
    """The CPU time (clock ticks) a process, its reaped children and its
    running children have used so far; -1 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    ticks = sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return ticks + sum(max(cpu_ticks(int(child)), 0) for child in children)


def wait_while_progressing(
    done: Callable[[], Any],
    proc: subprocess.Popen[bytes],
    *,
    quiet: float = 15.0,
    what: str = "condition",
    log: Callable[[], str] = lambda: "",
    longest: float | None = None,
) -> Any:
    """Until done() is true, for as long as `proc` is alive and making
    progress: it fails once the process has exited, or has gone `quiet`
    seconds using no CPU and writing nothing to its log, or after `longest`
    seconds in all (4 x quiet unless given). A fixed deadline fails a daemon
    that a busy machine starts slowly; this one fails a daemon that is stuck
    as soon, and one still working not at all."""
    started = last = time.monotonic()
    longest = 4 * quiet if longest is None else longest
    seen = (cpu_ticks(proc.pid), len(log()))
    while not (value := done()):
        if proc.poll() is not None:
            if value := done():  # what it did just before it exited
                return value
            raise AssertionError(f"the process exited {proc.returncode} before {what}:\n{log()}")
        now = time.monotonic()
        progress = (cpu_ticks(proc.pid), len(log()))
        if progress != seen:
            seen, last = progress, now
        if now - last > quiet or now - started > longest:
            raise AssertionError(
                f"{what} not reached in {now - started:.1f}s (the process made no progress "
                f"in its last {now - last:.1f}s; allowed: {quiet:g}s quiet, "
                f"{longest:g}s in all):\n{log()}"
            )
        time.sleep(0.05)
    return value
