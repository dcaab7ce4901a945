"""A PgBouncer of the tests' own (Debian's `pgbouncer` package), in front
of the test PostgreSQL: its own port, config and auth file in a temporary
directory, stopped afterwards. PgBouncer refuses to run as root; as root
it is started with `-u postgres` (or nobody), which reads the files."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

from tests.waits import wait_while_progressing


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """Also used by bench/pgbouncer.py; it imports nothing of the tests'."""

    def __init__(
        self,
        pool_mode: str,
        pg_host: str = "127.0.0.1",
        pg_port: int = 5432,
        pg_user: str = "postgres",
    ) -> None:
        self.pool_mode = pool_mode
        self.pg_host, self.pg_port, self.pg_user = pg_host, pg_port, pg_user
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"relay-pgbouncer-{pool_mode}-"))
        self.dir.chmod(0o755)
        self._start()

    def _start(self) -> None:
        """Start pgbouncer and wait until it answers on its admin console:
        a port found free can be taken by another process before pgbouncer
        binds it, and then something else would answer a mere connect. On
        such a race (pgbouncer exits at once), try again on a new port."""
        for _ in range(3):
            self._write_config()
            command = [shutil.which("pgbouncer") or "pgbouncer", str(self.dir / "pgbouncer.ini")]
            if os.geteuid() == 0:
                command[1:1] = ["-u", _unprivileged_user()]
            self.log = open(self.dir / "pgbouncer.log", "ab")  # noqa: SIM115 - closed in stop()
            self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
            with contextlib.suppress(AssertionError):  # exited (a port race) or stuck
                wait_while_progressing(
                    self._answers,
                    self.proc,
                    quiet=15,
                    what="pgbouncer answering",
                    log=self.read_log,
                )
                return
            self._terminate()
            self.port = _free_port()
        log = self.read_log()
        shutil.rmtree(self.dir, ignore_errors=True)
        raise AssertionError(f"pgbouncer did not start: {log}")

    def _write_config(self) -> None:
        auth = self.dir / "users.txt"
        auth.write_text(f'"{self.pg_user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        # Every database name goes to the test server (each test makes its
        # own). In session mode the client's `options` are refused, as by
        # default; in transaction mode ignored, as many set it up: relay
        # must find the pooler either way.
        ignored = "options" if self.pool_mode == "transaction" else ""
        ini.write_text(f"""[databases]
* = host={self.pg_host} port={self.pg_port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {auth}
admin_users = {self.pg_user}
pool_mode = {self.pool_mode}
ignore_startup_parameters = {ignored}
max_client_conn = 1000
default_pool_size = 60
logfile =
pidfile =
""")
        for path in (auth, ini):
            path.chmod(0o644)

    def _answers(self) -> bool:
        """Whether this pgbouncer, and not another server on its port, answers."""
        try:
            with psycopg.connect(
                host="127.0.0.1",
                port=self.port,
                user=self.pg_user,
                dbname="pgbouncer",
                autocommit=True,
                connect_timeout=2,
            ) as conn:
                return conn.execute("SHOW VERSION").fetchone() is not None
        except psycopg.Error:
            return False

    def ensure_running(self) -> str | None:
        """Start pgbouncer again on its port if it has exited; return its
        log up to then, or None when it was running. The tests are about
        relay behind a pooler, not about the pooler's own life."""
        if self.proc.poll() is None:
            return None
        log = self.read_log()
        self._terminate()
        self._start()
        return log

    def url(self, direct_url: str) -> str:
        """`direct_url` (a test database's) through this PgBouncer."""
        return direct_url.replace(f"@{self.pg_host}:{self.pg_port}/", f"@127.0.0.1:{self.port}/")

    def read_log(self) -> str:
        return (self.dir / "pgbouncer.log").read_text(errors="replace")

    def _terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise AssertionError("no unprivileged user to run pgbouncer as")
