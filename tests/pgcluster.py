"""PostgreSQL servers of the tests' own, started from the installed binaries.

The shared server runs with trust authentication and no TLS; the tests of
managed-database behaviour need what it cannot give: password
authentication (rotating credentials), TLS with certificates of a CA the
test makes (openssl), and a primary with a streaming standby to fail over
to (initdb, pg_basebackup, pg_ctl promote). Each server has its own data
directory and port; PostgreSQL refuses to run as root, so the binaries run
as the `postgres` user (runuser), in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.conftest import free_port, wait_until

_BINS = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
BIN = Path(_BINS[-1]) if _BINS else None

# Tests that start servers of their own run on one worker under pytest-xdist
# (each module's servers start once, and not beside another module's).
OWN_SERVER_TESTS = pytest.mark.xdist_group("own_servers")


def require_binaries() -> Path:
    """The directory of PostgreSQL's binaries; fails under CI, skips elsewhere."""
    if BIN is None or shutil.which("runuser") is None or os.geteuid() != 0:
        message = "a PostgreSQL server of the tests' own needs its binaries, runuser and root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return BIN


def _as_postgres(*args: str | Path, timeout: float = 120) -> str:
    done = subprocess.run(
        ["runuser", "-u", "postgres", "--", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done.stdout


def own_directory(prefix: str) -> Path:
    """A new directory under /tmp that the postgres user owns."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    shutil.chown(path, "postgres", "postgres")
    return path


class Cluster:
    """One PostgreSQL server: a data directory and a port on 127.0.0.1.

    Its superuser `postgres` logs in without a password from 127.0.0.1 (the
    tests' admin connections); every other role must give its password
    (scram-sha-256), over TLS when the server has it on."""

    def __init__(self, base: Path, name: str) -> None:
        self.base = base
        self.data = base / name
        self.port = free_port()
        self.log = base / f"{name}.log"

    @property
    def bin(self) -> Path:
        return require_binaries()

    def url(self, dbname: str = "postgres", user: str = "postgres", **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}" + (
            f"?{query}" if query else ""
        )

    def initdb(self, *, settings: dict[str, str] | None = None) -> None:
        _as_postgres(
            self.bin / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "-E", "UTF8"
        )
        self.configure(
            {
                "listen_addresses": "'127.0.0.1'",
                "port": str(self.port),
                "unix_socket_directories": f"'{self.base}'",
                "fsync": "off",
                "full_page_writes": "off",
                "wal_level": "replica",
                "max_wal_senders": "5",
                "hot_standby": "on",
                **(settings or {}),
            }
        )
        self.write(
            "pg_hba.conf",
            "local all all trust\n"
            "host all postgres 127.0.0.1/32 trust\n"
            "host replication postgres 127.0.0.1/32 trust\n"
            "host all all 127.0.0.1/32 scram-sha-256\n",
        )

    def configure(self, settings: dict[str, str]) -> None:
        """Append settings to postgresql.conf (the last one of a name wins)."""
        with (self.data / "postgresql.conf").open("a") as conf:
            for name, value in settings.items():
                conf.write(f"{name} = {value}\n")

    def write(self, name: str, text: str) -> None:
        path = self.data / name
        path.write_text(text)
        shutil.chown(path, "postgres", "postgres")

    def start(self) -> None:
        _as_postgres(
            self.bin / "pg_ctl", "-D", self.data, "-l", self.log, "-w", "-t", "60", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            _as_postgres(self.bin / "pg_ctl", "-D", self.data, "-m", mode, "-w", "stop", timeout=60)

    def promote(self) -> None:
        _as_postgres(self.bin / "pg_ctl", "-D", self.data, "-w", "promote")

    def standby(self, name: str) -> Cluster:
        """A streaming standby of this server (pg_basebackup -R), started."""
        other = Cluster(self.base, name)
        _as_postgres(
            self.bin / "pg_basebackup",
            "-h",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-U",
            "postgres",
            "-D",
            other.data,
            "-R",
            "-X",
            "stream",
            "--checkpoint=fast",
        )
        other.configure({"port": str(other.port)})
        # pg_basebackup -R wrote a primary_conninfo to postgresql.auto.conf,
        # which is read last: the standby's name for synchronous_standby_names
        # goes there.
        with (other.data / "postgresql.auto.conf").open("a") as conf:
            conf.write(
                f"primary_conninfo = 'host=127.0.0.1 port={self.port} user=postgres "
                f"application_name={name}'\n"
                # Promoted, it has no standby of its own to wait for.
                "synchronous_standby_names = ''\n"
            )
        other.start()
        return other

    def connect(self, dbname: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.url(dbname), autocommit=True, connect_timeout=5)

    def execute(self, sql: str, dbname: str = "postgres") -> list[tuple]:
        with self.connect(dbname) as conn:
            cursor = conn.execute(sql)
            return cursor.fetchall() if cursor.description else []

    def wait_writable(self, timeout: float = 60) -> None:
        def writable() -> bool:
            with contextlib.suppress(psycopg.Error):
                return self.execute("SELECT NOT pg_is_in_recovery()")[0][0]
            return False

        wait_until(writable, timeout=timeout, interval=0.1, message=f"server on {self.port}")


@contextlib.contextmanager
def cluster(prefix: str, **settings: str) -> Iterator[Cluster]:
    """A server of its own, initialised with `settings`, started; removed after."""
    require_binaries()
    base = own_directory(prefix)
    server = Cluster(base, "main")
    try:
        server.initdb(settings=settings)
        server.start()
        yield server
    finally:
        server.stop("immediate")
        shutil.rmtree(base, ignore_errors=True)


# --------------------------------------------------------------------------
# Certificates (openssl): a CA, and certificates it signs
# --------------------------------------------------------------------------


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


class Certificates:
    """A CA of the test's own in `directory`, and certificates it signs."""

    def __init__(self, directory: Path, name: str = "ca") -> None:
        self.directory = directory
        self.ca_key = directory / f"{name}.key"
        self.ca = directory / f"{name}.crt"
        _openssl(
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", self.ca_key, "-out", self.ca, "-subj", f"/CN=relay test {name}",
        )  # fmt: skip

    def issue(
        self, name: str, *, dns: str = "localhost", ip: str | None = None
    ) -> tuple[Path, Path]:
        """A certificate for the names given, signed by this CA: (cert, key)."""
        key, csr, cert = (self.directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        extensions = self.directory / f"{name}.ext"
        names = [f"DNS:{dns}"] + ([f"IP:{ip}"] if ip else [])
        extensions.write_text(f"subjectAltName={','.join(names)}\n")
        _openssl(
            "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
            "-subj", f"/CN={dns}",
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.ca, "-CAkey", self.ca_key,
            "-CAcreateserial", "-days", "2", "-out", cert, "-extfile", extensions,
        )  # fmt: skip
        for path in (key, cert):
            path.chmod(0o644)
        return cert, key
