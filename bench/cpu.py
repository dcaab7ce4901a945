"""Measuring the processes of a run from /proc: the CPU one process spent,
the processes of a server (by name) or of a daemon's tree, and which client
owns which PostgreSQL backend. The scenarios (bench.where, bench.kafka,
bench.reference) read their figures through these."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
from pathlib import Path

from bench.common import descendants

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def pids_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                comm = Path(f"/proc/{entry}/comm").read_text().strip()
                # "name*": a prefix (Tansu's binary carries its version).
                if comm == name or (name.endswith("*") and comm.startswith(name[:-1])):
                    found.append(int(entry))
            except OSError:
                pass
    return found


def client_of_backends(database: str) -> dict[int, int]:
    """{postgres backend pid: pid of the client process at the other end}
    for the backends of `database`, from their "127.0.0.1(PORT)" titles and
    `ss -tnp` (the client's port)."""
    owners: dict[int, int] = {}
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(
            ["ss", "-tnpH"], capture_output=True, text=True, timeout=10
        ).stdout.splitlines():
            parts = line.split()
            match = re.search(r"pid=(\d+)", line)
            if len(parts) >= 5 and match and parts[4].endswith(":5432"):
                owners[int(parts[3].rsplit(":", 1)[1])] = int(match.group(1))
    found = {}
    for pid in pids_named("postgres"):
        match = re.search(rf"{re.escape(database)} 127\.0\.0\.1\((\d+)\)", _cmdline(pid))
        if match and int(match.group(1)) in owners:
            found[pid] = owners[int(match.group(1))]
    return found


def _cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


class ServerCpu:
    """CPU of every process of a server since start(), the ones that began
    or ended since counted too (the last value seen, sampled every 0.5 s)."""

    def __init__(self, name: str, only: str = "") -> None:
        self.name = name
        self.only = only  # a text its command line must hold (a database name)
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}

    def pids(self) -> list[int]:
        found = pids_named(self.name)
        if self.only:
            found = [p for p in found if self.only in _cmdline(p)]
        return found

    def start(self) -> None:
        self.first = {p: cpu_seconds(p) for p in self.pids()}
        self.last = dict(self.first)

    def sample(self) -> None:
        for pid in self.pids():
            self.last[pid] = cpu_seconds(pid) or self.last.get(pid, 0.0)

    def used(self) -> float:
        return sum(v - self.first.get(p, 0.0) for p, v in self.last.items())

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(0.5)


class TreeCpu:
    """The last CPU seen of each process in a tree, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        for pid in [self.pid, *descendants(self.pid)]:
            seconds = cpu_seconds(pid)
            if seconds:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    label = " ".join(c.decode(errors="replace") for c in cmd[:3])[-60:]
                except OSError:
                    label = str(pid)
                self.seen[pid] = (label, seconds)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(0.2)
