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

import functools
import logging
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from relay.db.sql import query

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
    return await psycopg.AsyncConnection.connect(
        conninfo,
        autocommit=True,
        connect_timeout=CONNECT_TIMEOUT,
        application_name=APPLICATION_NAME,
        **settings,
    )


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


def libpq_url(database_url: str) -> str:
    """The libpq form of a database URL: relay's settings may spell the
    scheme postgresql+psycopg://, SQLAlchemy's form."""
    return "postgresql://" + database_url.partition("://")[2]


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
