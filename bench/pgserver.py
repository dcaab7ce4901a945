"""A PostgreSQL server of the benchmark's own, with the server's default settings.

Issue 24's scenarios are judged "with PostgreSQL's default server settings":
autovacuum on, its default naptime and thresholds. The machine's shared
server need not have them (the one here runs with `autovacuum = off`), and
its settings are not the benchmark's to change. So those scenarios start a
cluster of their own: `initdb` into a temporary directory, `pg_ctl start` on
a free port, nothing set but where to listen; stopped and removed at the end.

    python -m bench.pgserver     # start one, print its URL, wait for Ctrl-C
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from bench.common import BenchError, free_port


def _bindir() -> Path:
    """The newest PostgreSQL's binaries (Debian keeps them out of PATH)."""
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if not versions:
        raise BenchError("no PostgreSQL server binaries (pg_ctl) on this machine")
    return versions[-1].parent


def _as_server_user(argv: Sequence[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run as `postgres` then."""
    if os.geteuid() != 0:
        return list(argv)
    return ["runuser", "-u", "postgres", "--", *argv]


class OwnPostgres:
    """One throwaway cluster. `url` has no database name (as bench.common.PG_URL)."""

    def __init__(self, settings: Sequence[str] = ()) -> None:
        # Server settings beyond the defaults (`max_connections=1000`), for
        # the scenarios that need them (bench.sources); none for issue 24's.
        self.settings = list(settings)
        self.bindir = _bindir()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="relay-bench-pg-"))
        self.data = self.dir / "data"
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(_as_server_user(argv), capture_output=True, text=True)
        if done.returncode != 0:
            raise BenchError(
                f"{Path(argv[0]).name} failed ({done.returncode}): "
                f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )

    def start(self) -> None:
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
        self._run(
            str(self.bindir / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--locale=C.UTF-8",
            "--no-sync",
        )
        # Only where to listen: every other setting is the server's default.
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D",
            str(self.data),
            "-w",
            "-t",
            "60",
            "-l",
            str(self.dir / "server.log"),
            "-o",
            f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.dir}"
            + "".join(f" -c {setting}" for setting in self.settings),
            "start",
        )

    def stop(self) -> None:
        with contextlib.suppress(BenchError):
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.asynccontextmanager
async def own_postgres(settings: Sequence[str] = ()) -> AsyncIterator[OwnPostgres]:
    server = OwnPostgres(settings)
    try:
        await asyncio.to_thread(server.start)
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def main() -> None:
    # SIGTERM too (a background job started by a script ignores SIGINT).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server = OwnPostgres()
    server.start()
    try:
        print(server.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
