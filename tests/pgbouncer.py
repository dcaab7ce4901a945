"""A PgBouncer of the tests' own (Debian's `pgbouncer` package), in front
of the test PostgreSQL: its own port, config and auth file in a temporary
directory, stopped afterwards. PgBouncer refuses to run as root; as root
it is started with `-u postgres` (or nobody), which reads the files."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import PG_HOST, PG_PORT, PG_USER, _reachable, free_port


class PgBouncer:
    def __init__(self, pool_mode: str) -> None:
        self.pool_mode = pool_mode
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"relay-pgbouncer-{pool_mode}-"))
        self.dir.chmod(0o755)
        auth = self.dir / "users.txt"
        auth.write_text(f'"{PG_USER}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        # Every database name goes to the test server (each test makes its
        # own); the client's `options` are refused, as by default.
        ini.write_text(f"""[databases]
* = host={PG_HOST} port={PG_PORT}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {auth}
admin_users = {PG_USER}
pool_mode = {pool_mode}
max_client_conn = 1000
default_pool_size = 60
logfile =
pidfile =
""")
        for path in (auth, ini):
            path.chmod(0o644)
        command = [shutil.which("pgbouncer") or "pgbouncer", str(ini)]
        if os.geteuid() == 0:
            command[1:1] = ["-u", _unprivileged_user()]
        self.log = open(self.dir / "pgbouncer.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while not _reachable("127.0.0.1", self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"pgbouncer did not start: {self.read_log()}")
            time.sleep(0.05)

    def url(self, direct_url: str) -> str:
        """`direct_url` (a test database's) through this PgBouncer."""
        return direct_url.replace(f"@{PG_HOST}:{PG_PORT}/", f"@127.0.0.1:{self.port}/")

    def read_log(self) -> str:
        return (self.dir / "pgbouncer.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _unprivileged_user() -> str:
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise AssertionError("no unprivileged user to run pgbouncer as")
