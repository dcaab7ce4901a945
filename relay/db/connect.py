"""The PostgreSQL connections relay opens outside SQLAlchemy's pool.

Each outbox worker's session (relay.db.session.OutboxSession), the inbox
receiver's writer (relay.db.writer, in a process that loads no
SQLAlchemy, so neither does this module) and the LISTEN connection
(relay.db.listener.Listener) are plain psycopg connections in autocommit.
Like the pooled ones, they give up connecting after CONNECT_TIMEOUT seconds
and show in pg_stat_activity as application_name 'relay'.

Behind a pooler (PgBouncer) a connection keeps no session state: in
transaction mode each transaction may run on another server connection, so
neither a prepared statement nor a SET would still be there. relay tells
a pooler from a server by the backend pid: PgBouncer gives its clients a
made-up one, never that of the server process (see docs/pgbouncer.md).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import subprocess
import threading
import time
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.db.sql import query
from relay.errors import ConfigError, DatabaseUnavailable

log = logging.getLogger("relay.pg")

CONNECT_TIMEOUT = 10
APPLICATION_NAME = "relay"

# PgBouncer refuses startup parameters it does not know, `options` among
# them (unless its ignore_startup_parameters lists it).
_REFUSED_PARAMETER = "unsupported startup parameter"

BACKEND_PID = query("backend_pid")


async def connect(conninfo: str, **settings: Any) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection; `settings` go to psycopg's connect (options=...).

    Behind a pooler it prepares no statement (see connect_detecting)."""
    conn, _ = await connect_detecting(conninfo, **settings)
    return conn


async def connect_detecting(
    conninfo: str, **settings: Any
) -> tuple[psycopg.AsyncConnection[Any], bool]:
    """connect(), and whether a pooler stands between relay and the server.

    A pooler that refuses `options` is asked again without them (it would
    not pass them on anyway). Behind a pooler psycopg's own prepared
    statements are turned off (prepare_threshold=None)."""
    try:
        conn = await _connect(conninfo, **settings)
    except psycopg.OperationalError as exc:
        if "options" not in settings or not refused_options(exc):
            raise
        settings = {k: v for k, v in settings.items() if k != "options"}
        conn = await _connect(conninfo, **settings)
    try:
        pooled = await behind_pooler(conn)
    except BaseException:
        await conn.close()
        raise
    if pooled:
        conn.prepare_threshold = None
        noticed_pooler()
    return conn, pooled


async def _connect(conninfo: str, **settings: Any) -> psycopg.AsyncConnection[Any]:
    command = _password_command
    if command is not None:
        settings["password"] = await asyncio.to_thread(command.password)
    try:
        return await psycopg.AsyncConnection.connect(
            conninfo,
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
            application_name=APPLICATION_NAME,
            **settings,
        )
    except psycopg.OperationalError as exc:
        refused_password(exc)
        raise


# -- short-lived credentials (--database-password-command) ---------------------

# How long one output of the password command is used for new connections.
PASSWORD_REUSE_SECONDS = 60.0
PASSWORD_COMMAND_TIMEOUT = 30.0


class PasswordCommand:
    """--database-password-command: a shell command whose standard output,
    stripped, is the password of every connection relay opens.

    Run when a connection is opened and its last output is older than
    PASSWORD_REUSE_SECONDS (an RDS IAM token lives 15 minutes, a Vault lease
    longer), and again after the server refused a password. A command that
    fails or prints nothing is DatabaseUnavailable: waited out like an
    unreachable database. Thread-safe: the sync engine's connects run in
    dispatcher threads."""

    def __init__(self, command: str) -> None:
        self.command = command
        self._lock = threading.Lock()
        self._password: str | None = None
        self._at = 0.0

    def password(self) -> str:
        with self._lock:
            now = time.monotonic()
            if self._password is None or now - self._at >= PASSWORD_REUSE_SECONDS:
                self._password = self._run()
                self._at = now
            return self._password

    def forget(self) -> None:
        """The server refused the password: run the command before the next connect."""
        with self._lock:
            self._password = None

    def _run(self) -> str:
        try:
            done = subprocess.run(
                ["/bin/sh", "-c", self.command],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=PASSWORD_COMMAND_TIMEOUT,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise DatabaseUnavailable(f"--database-password-command did not run: {exc}") from exc
        password = done.stdout.decode(errors="replace").strip()
        if done.returncode != 0:
            said = done.stderr.decode(errors="replace").strip().splitlines()
            raise DatabaseUnavailable(
                f"--database-password-command exited {done.returncode}"
                + (f": {said[-1][:200]}" if said else "")
            )
        if not password:
            raise DatabaseUnavailable("--database-password-command printed no password")
        return password


_password_command: PasswordCommand | None = None


def use_password_command(command: str | None) -> None:
    """Install (or, with None, remove) the password command for every
    connection this process opens: the pooled engines, the outbox sessions,
    the inbox writer and LISTEN. Once per process, by the CLI (and the
    inbox's receiver process, from its settings)."""
    global _password_command
    _password_command = PasswordCommand(command) if command else None


def password_command() -> PasswordCommand | None:
    return _password_command


def current_password() -> str | None:
    """The password command's password (blocking), or None without one."""
    command = _password_command
    return command.password() if command is not None else None


_AUTH_FAILED = ("password authentication failed", "PAM authentication failed")


def refused_password(exc: BaseException) -> None:
    """After the server refused the password, the command runs again before
    the next connect (its token may have expired meanwhile)."""
    command = _password_command
    if command is not None and any(text in str(exc) for text in _AUTH_FAILED):
        command.forget()


# -- TLS: a certificate that does not verify is bad configuration --------------

_TLS_REFUSALS = (
    "certificate verify failed",
    "does not match host name",
    "root certificate file",
    "could not load private key file",
    "could not read root certificate file",
    "could not open certificate file",
    "certificate present, but not private key file",
    "private key file",
    "could not set SSL protocol",
    "invalid sslmode value",
    "server does not support SSL, but SSL was required",
)


def tls_refusal(exc: BaseException) -> str | None:
    """The first line of a connect error that no retry can mend: the
    server's certificate did not verify against the CA or the host name, a
    certificate file is missing, an sslmode the server cannot give. None
    for any other error."""
    text = str(exc).strip()
    if not any(marker in text for marker in _TLS_REFUSALS):
        return None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in lines:
        if any(marker in line for marker in _TLS_REFUSALS):
            return line
    return lines[0] if lines else type(exc).__name__


def refused_options(exc: BaseException) -> bool:
    """Did a pooler refuse the `options` startup parameter?"""
    return _REFUSED_PARAMETER in str(exc) and "options" in str(exc)


def pooled_pid(client_pid: int, server_pid: int | None) -> bool:
    """Is the pid the client was given at connect not that of the server
    process that answers? Then something (a pooler) stands between them."""
    return server_pid is not None and server_pid != client_pid


@functools.cache
def noticed_pooler() -> None:
    """Say once per process that a pooler was found, and what it changes."""
    log.info(
        "the database connection goes through a pooler (PgBouncer?): relay keeps "
        "no prepared statements or session settings on it"
    )


async def behind_pooler(conn: psycopg.AsyncConnection[Any]) -> bool:
    """One round trip: is this connection a pooler's rather than a server's?"""
    cursor = await conn.execute(BACKEND_PID)
    row = await cursor.fetchone()
    return pooled_pid(conn.info.backend_pid, row[0] if row else None)


async def check_tls(database_url: str, what: str = "--database-url") -> None:
    """Connect once, as a daemon starts: ConfigError when TLS refuses (the
    server's certificate does not verify against sslrootcert or the host
    name, a certificate file cannot be read), which no retry mends. Any
    other failure is left to the daemon's loops, which wait it out."""
    try:
        conn = await _connect(libpq_url(database_url))
    except Exception as exc:
        reason = tls_refusal(exc)
        if reason is not None:
            raise ConfigError(f"{what}: TLS failed: {reason}") from None
        return
    await conn.close()


def libpq_url(database_url: str) -> str:
    """The libpq form of a database URL: relay's settings may spell the
    scheme postgresql+psycopg://, SQLAlchemy's form. A URL naming several
    hosts asks for the one that takes writes (target_session_attrs
    read-write) unless it says otherwise: relay only ever writes."""
    url = "postgresql://" + database_url.partition("://")[2]
    return with_writer_preference(url)


def several_hosts(conninfo: str) -> bool:
    """Does the libpq URL or conninfo name more than one host?"""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return False
    return "," in str(params.get("host") or params.get("hostaddr") or "")


def with_writer_preference(url: str) -> str:
    """`url` with target_session_attrs=read-write when it names several
    hosts and no target_session_attrs of its own."""
    if not several_hosts(url) or "target_session_attrs" in conninfo_to_dict(url):
        return url
    return url + ("&" if "?" in url else "?") + "target_session_attrs=read-write"


async def create_database_if_missing(database_url: str) -> str | None:
    """The database of `database_url`, created when it does not exist yet
    (through the server's `postgres` database, as createdb does); its name
    if created. Any other failure is left to the usual connect to report.
    (`relay demo`'s.)"""
    conninfo = libpq_url(database_url)
    name = conninfo_to_dict(conninfo).get("dbname")
    try:
        conn = await psycopg.AsyncConnection.connect(conninfo, connect_timeout=CONNECT_TIMEOUT)
    except psycopg.OperationalError as exc:
        if not name or f'database "{name}" does not exist' not in str(exc):
            return None
    else:
        await conn.close()
        return None
    try:
        async with await psycopg.AsyncConnection.connect(
            make_conninfo(conninfo, dbname="postgres"),
            autocommit=True,
            connect_timeout=CONNECT_TIMEOUT,
        ) as admin:
            await admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(name))))
    except psycopg.Error:
        return None  # no right to, or made meanwhile: the connect that follows says
    return str(name)
