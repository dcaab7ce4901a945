"""PostgreSQL through SQLAlchemy: the daemons' and commands' pooled engines.

Store holds an async engine (and, for a dispatcher whose handlers are all
sync, a sync one) and runs the named queries of relay/db/queries/ on them:
the inbox claim and marks, the hung-handler watchdog, retry, status, dead
keys, the schema check. Values travel as bound parameters. Errors pass
through relay.db.errors.translate_errors, so the loops see
DatabaseUnavailable when the server went away.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, NamedTuple

import orjson
import psycopg
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from relay.config import redact_url
from relay.db import connect as pg
from relay.db import namespace, schema
from relay.db.errors import (
    any_driver_error,
    failed_command,
    server_unavailable,
    translate_errors,
)
from relay.db.session import UNBOUNDED, OutboxSession, sort_claimed
from relay.db.sql import claim, query
from relay.db.writer import rows_json
from relay.errors import DatabaseUnavailable
from relay.limits import clean_error
from relay.rows import Failure, InboxRow, NewInboxRow, Reserved

log = logging.getLogger(__name__)

# The engines' URL names only the dialect: each connect is given libpq's
# own URL (see _connect_as_libpq).
_ENGINE_URL = "postgresql+psycopg://"

READ_ONLY = "the database is read only (a failover's demoted writer, or a standby)"

NOTIFY_OUTBOX = "relay_outbox"
NOTIFY_INBOX = "relay_inbox"
TABLES = ("outbox", "inbox")

STATUSES = {
    "outbox": ("pending", "published", "dead"),
    "inbox": ("pending", "processed", "dead"),
}

# The planner settings around a claim (SET LOCAL: they end with the
# transaction); see queries/session.sql.
PLAN_CLAIM = query("plan_claim")
UNPLAN_CLAIM = query("unplan_claim")
PLAN_MARKS = query("plan_marks")

# The receiving transaction's key locks (Store.store_received): advisory
# locks of this class ("rlay"), the second number the key's CRC-32.
KEY_LOCKS = 0x726C6179
# Before its locks: no notification at its commit (schema/008_inbox_quiet.sql).
QUIET = "SELECT set_config('relay.quiet', 'on', true)"


def key_lock(consumer: str, key: str) -> int:
    """The advisory lock number of a consumer's key (a signed int4): the
    same in every process, as PostgreSQL's lock table needs; two keys that
    share one only wait for each other."""
    number = zlib.crc32(f"{consumer}\0{key}".encode("utf-8", "surrogatepass"))
    return number - (1 << 32) if number >= 1 << 31 else number


class InboxClaimed(NamedTuple):
    """An inbox claim's outcome, as relay.db.session.Claimed for the outbox:
    the rows to dispatch, how many wait on rows of their key held by another
    dispatcher, the bytes of the rows returned, and the size of the row the
    byte budget stopped at (None: it did not)."""

    rows: list[InboxRow]
    blocked: int
    used: int
    need: int | None


def statement(sql: str) -> sa.TextClause:
    """A statement assembled at run time from fixed fragments (relay.dead's
    filters); its values are bound parameters like every other's."""
    return sa.text(sql)


@functools.cache
def named(name: str) -> sa.TextClause:
    """The named query (relay.db.sql) as a SQLAlchemy statement, made once."""
    return sa.text(query(name))


class Savepoint:
    """One named savepoint of a transaction, set and rolled back through libpq.

    Set on the driver connection, it is left open into the next set(), and
    moving it on (RELEASE, then SAVEPOINT again) is one round trip of one
    simple-protocol query: SQLAlchemy's begin_nested takes two, and with its
    statement overhead cost more than a one-INSERT handler itself.
    COMMIT ends whatever savepoint is still open. The commands go straight to
    libpq (PQexec, which lets go of the GIL while it waits): through a
    psycopg cursor each would cost more client CPU (docs/inbox.md)."""

    def __init__(self, exec_: Callable[[str], None], name: str) -> None:
        self._exec = exec_
        self._set = query(f"savepoint_{name}_set")
        self._move = query(f"savepoint_{name}_move")
        self._undo = query(f"savepoint_{name}_undo")
        self._release = query(f"savepoint_{name}_release")
        self._open = False

    def set(self) -> None:
        """A fresh savepoint: what ran before it stays, whatever runs next."""
        self._exec(self._move if self._open else self._set)
        self._open = True

    def undo(self) -> None:
        """Roll back what ran since the last set()."""
        self._exec(self._undo)

    @property
    def open(self) -> bool:
        return self._open

    def release_command(self) -> str:
        """The command that ends the savepoint (and any set after it),
        keeping what ran; to be sent with others in one round trip."""
        self._open = False
        return self._release

    def forget(self) -> None:
        """The savepoint was ended by another (set before it) being released."""
        self._open = False


def _exec(pgconn: Any, command: str) -> None:
    """One simple-protocol query straight through libpq (several commands
    separated by semicolons are one round trip; rows a SELECT returns are
    dropped)."""
    result = pgconn.exec_(command.encode())
    if result.status in (psycopg.pq.ExecStatus.COMMAND_OK, psycopg.pq.ExecStatus.TUPLES_OK):
        return
    message = (result.error_message or pgconn.error_message).decode(errors="replace")
    raise failed_command(
        command, message, connection_bad=pgconn.status == psycopg.pq.ConnStatus.BAD
    )


class HandlerSavepoints:
    """The savepoints of one batch's transaction (see Dispatcher._run_handlers):
    `batch` for many handlers at once, `handler` around one handler run,
    set through libpq (`pgconn`, see _pgconn)."""

    def __init__(self, pgconn: Any, *, after_claim: bool = False) -> None:
        self._pgconn = pgconn
        self.batch = Savepoint(self._exec, "batch")
        self.handler = Savepoint(self._exec, "handler")
        # after_claim: the claim's planner settings are still on
        # (Store.claim_inbox with unplan=False); the first command sent here
        # turns them off on its way, before any handler runs.
        self._prefix = UNPLAN_CLAIM + "; " if after_claim else ""

    def _exec(self, command: str) -> None:
        prefix, self._prefix = self._prefix, ""
        _exec(self._pgconn, prefix + command)

    def before_marks(self) -> None:
        """Ready the transaction for the batch's marks, in one round trip.

        - End the savepoints, so that the marks run in the transaction
          itself. A row this transaction locked (the claim's FOR UPDATE) and
          then updated from inside a savepoint gets a MultiXact as its xmax,
          and an index scan never takes a MultiXact's row version for surely
          dead: its entries in the pending and per-key indexes stay live for
          every claim to visit in the heap until a vacuum, and the claim's
          walk to the lowest pending row grows through a backlog
          (docs/backlog.md).
        - Plan the marks for the table as it is now (`plan_marks`)."""
        commands = []
        if self.batch.open:
            commands.append(self.batch.release_command())  # ends relay_handler too
            self.handler.forget()
        if self.handler.open:
            commands.append(self.handler.release_command())
        commands.append(PLAN_MARKS)
        self._exec("; ".join(commands))

    def aborted(self) -> bool:
        """Did a statement fail in the transaction (no round trip)?"""
        return bool(self._pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR)


def _pgconn(conn: sa.Connection) -> Any:
    """libpq's connection under a sync Connection of either engine: psycopg's
    own on the sync engine; inside run_sync on the async engine, that of the
    dispatcher's event loop, which is idle while the batch runs."""
    driver = conn.connection.driver_connection
    assert driver is not None, "a Connection in a transaction has its driver connection"
    return driver.pgconn


def _url_options(conninfo: str) -> list[str]:
    """The `options` a libpq URL gives (`?options=-csearch_path%3Dapp`), if any."""
    value = conninfo_to_dict(conninfo).get("options")
    return [str(value)] if value else []


def _connect_as_libpq(engine: sa.Engine, conninfo: str) -> None:
    """Connect `engine` with libpq's URL `conninfo` and the password
    command's password (relay.db.connect); on each new connection find out
    whether a pooler is between: if so, psycopg prepares no statement on it,
    and backend_pid() knows no pid for it. A pooler that refuses the
    `options` startup parameter is asked again without them. An answer of a
    server that cannot take writes now invalidates the connection."""

    @sa.event.listens_for(engine, "do_connect")
    def connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        # libpq's own URL (several hosts, TLS parameters), which
        # SQLAlchemy's URL cannot hold; the password command's password.
        cargs = [conninfo, *cargs[1:]]
        password = pg.current_password()
        if password is not None:
            cparams = {**cparams, "password": password}
        try:
            return dialect.connect(*cargs, **cparams)
        except psycopg.OperationalError as exc:
            pg.refused_password(exc)
            if "options" not in cparams or not pg.refused_options(exc):
                raise
            return dialect.connect(*cargs, **{k: v for k, v in cparams.items() if k != "options"})

    @sa.event.listens_for(engine, "handle_error")
    def failing_over(context: Any) -> None:
        # A server that answers read only, or that it is shutting down,
        # keeps that session so: SQLAlchemy throws the connection (and the
        # pool's others, all on that server) away as for a lost one.
        if server_unavailable(context.original_exception):
            context.is_disconnect = True

    @sa.event.listens_for(engine, "connect")
    def detect(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(pg.BACKEND_PID)
            row = cursor.fetchone()
        finally:
            cursor.close()
        dbapi_connection.rollback()
        # psycopg's own (sync engine) or under SQLAlchemy's async adapter
        driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
        pooled = pg.pooled_pid(driver.info.backend_pid, row[0] if row else None)
        record.info["relay_pooled"] = pooled
        if pooled:
            driver.prepare_threshold = None
            pg.noticed_pooler()


def _set_search_path_per_transaction(engine: sa.Engine, schema: str) -> None:
    """Behind a pooler, where the search_path of the startup options does not
    reach the server (and a session SET would not reach the next
    transaction), begin each transaction of `engine` with SET LOCAL
    search_path: one round trip more per transaction, only there. Not on
    an AUTOCOMMIT connection (the vacuum's), which names its table in full."""
    set_path = namespace.set_local(schema)

    @sa.event.listens_for(engine, "begin")
    def begin(conn: sa.Connection) -> None:
        if conn.info.get("relay_pooled"):
            conn.info["relay_path_due"] = True

    @sa.event.listens_for(engine, "before_cursor_execute")
    def before(
        conn: sa.Connection,
        cursor: Any,
        statement: str,
        parameters: Any,
        context: Any,
        executemany: bool,
    ) -> None:
        if not conn.info.pop("relay_path_due", False):
            return
        if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            cursor.execute(set_path)


class Store:
    """The relay's view of PostgreSQL: an async engine and named queries.

    With `schema` (--schema), relay's tables are that schema's: its
    connections' search_path starts with it (relay.db.namespace)."""

    def __init__(
        self,
        database_url: str,
        *,
        pool_size: int = 5,
        sync: bool = False,
        schema: str | None = None,
    ) -> None:
        self.database_url = database_url
        # libpq parses the URL (several hosts, TLS parameters); SQLAlchemy's
        # URL cannot hold several hosts, so its engines get this one instead.
        self._conninfo = pg.libpq_url(database_url)
        self.schema = schema
        # The schema the tables were found in (locate()): --schema, or where
        # the search_path led.
        self.located: str | None = schema
        # JIT compiles the claim for far longer than the claim runs without
        # it, because its cost estimate is large (docs/outbox.md). Options given in the URL
        # (`?options=-csearch_path%3Dapp`) are kept; --schema's search_path comes after them.
        self.session_options = [*_url_options(self._conninfo), "-c jit=off"]
        if schema is not None:
            self.session_options.append(namespace.path_option(schema))
        options: dict[str, Any] = {
            "pool_size": pool_size,
            "max_overflow": pool_size,
            "pool_pre_ping": True,
            "pool_recycle": 3600,
            "connect_args": {
                "connect_timeout": pg.CONNECT_TIMEOUT,
                "application_name": pg.APPLICATION_NAME,
                "options": " ".join(self.session_options),
            },
        }
        self.engine: AsyncEngine = create_async_engine(_ENGINE_URL, **options)
        # The same database through psycopg's blocking connection, for a
        # dispatcher whose handlers are all sync (see relay.inbox.Dispatcher).
        self.sync_engine: sa.Engine | None = (
            sa.create_engine(_ENGINE_URL, **options) if sync else None
        )
        for engine in (self.engine.sync_engine, self.sync_engine):
            if engine is not None:
                _connect_as_libpq(engine, self._conninfo)
                if schema is not None:
                    _set_search_path_per_transaction(engine, schema)

    @staticmethod
    @functools.cache
    def _claim_inbox(on_dead: str, server_version: int) -> sa.TextClause:
        """The inbox claim under `on_dead`, for the server's version."""
        return sa.text(claim("inbox", on_dead, server_version))

    def __repr__(self) -> str:
        return f"Store({redact_url(self.database_url)!r})"

    @property
    def conninfo(self) -> str:
        """A libpq URL for plain psycopg connections (LISTEN)."""
        return self._conninfo

    async def close(self) -> None:
        await self.engine.dispose()
        if self.sync_engine is not None:
            self.sync_engine.dispose()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncConnection]:
        """A connection in a transaction: committed on success, rolled back on error."""
        with translate_errors():
            async with self.engine.begin() as conn:
                yield conn

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[AsyncConnection]:
        """A connection outside an explicit transaction (reads)."""
        with translate_errors():
            async with self.engine.connect() as conn:
                yield conn

    @contextlib.contextmanager
    def sync_transaction(self) -> Iterator[sa.Connection]:
        """transaction() on the sync engine (a Store made with sync=True)."""
        assert self.sync_engine is not None, "a Store(sync=True) has a sync engine"
        with translate_errors(), self.sync_engine.begin() as conn:
            yield conn

    async def notify(self, channel: str, payload: str) -> None:
        """A notification on `channel`, sent through the database URL."""
        async with self.transaction() as conn:
            await conn.execute(named("notify"), {"channel": channel, "payload": payload})

    async def ping(self) -> None:
        async with self.connection() as conn:
            if await conn.scalar(named("ping")) == "on":
                # A session that began read only stays so: the next ping
                # must come from a new connection.
                await conn.invalidate()
                raise DatabaseUnavailable(READ_ONLY)

    async def check_schema(self) -> None:
        """SchemaError unless the tables exist at the version this relay knows
        (with --schema: in that schema, not merely on the search_path)."""
        version_table = namespace.qualified("relay_schema_version", self.schema)
        async with self.connection() as conn:
            version = None
            if await conn.scalar(named("schema_table_exists"), {"table": version_table}):
                version = await conn.scalar(schema.CHECK_VERSION_SQL)
                self.located = await conn.scalar(named("schema_of"), {"table": version_table})
        schema.check_version(version)

    async def locate(self) -> str | None:
        """The schema relay's tables are in: --schema, else where the
        search_path finds them (None: not there yet). Names the channels
        and advisory locks (relay.db.namespace)."""
        if self.located is None:
            async with self.connection() as conn:
                self.located = await conn.scalar(
                    named("schema_of"), {"table": "relay_schema_version"}
                )
        return self.located

    async def channel(self, base: str) -> str:
        """The notification channel `base` (NOTIFY_OUTBOX, NOTIFY_INBOX) of
        relay's tables here."""
        return namespace.channel(base, await self.locate())

    def table(self, name: str) -> str:
        """`name` (outbox, inbox) schema-qualified under --schema, for the
        statements that run outside a transaction (VACUUM), where a
        search_path set per transaction cannot reach."""
        return namespace.qualified(name, self.schema)

    async def apply_schema(self) -> list[str]:
        """Create or upgrade the tables (with --schema: the schema too);
        returns the names of the files applied."""
        async with self.transaction() as conn:
            return await conn.run_sync(schema.apply, self.schema)

    # -- outbox --------------------------------------------------------------

    def outbox_session(self, on_dead: str, shares: int = 1) -> OutboxSession:
        """A connection of its own for one outbox worker of a relay whose
        workers split the keys in `shares` (see OutboxSession)."""
        return OutboxSession(
            self.conninfo,
            self.session_options,
            on_dead,
            shares,
            schema=self.schema,
            located=self.located,
        )

    # -- inbox -----------------------------------------------------------------

    # The dispatcher's batch is sync code, run on a sync Connection of either
    # engine (inside AsyncConnection.run_sync on the async one): these take one.

    def claim_inbox(
        self,
        conn: sa.Connection,
        consumer: str,
        limit: int,
        on_dead: str,
        worker: int = 0,
        workers: int = 1,
        *,
        unplan: bool = True,
        budget: int = UNBOUNDED,
        alone: bool = True,
    ) -> InboxClaimed:
        """Lock due rows of a consumer, of this worker's share of the keys;
        returns the dispatchable ones, how many wait on rows of their key
        held by another dispatcher, the bytes of the rows returned and the
        size of a row the budget stopped at (as OutboxSession.claim: at most
        `budget` bytes, a larger first row alone when `alone`). With
        unplan=False the claim's planner settings stay on, for
        handler_savepoints(after_claim=True) to turn off in its first round
        trip."""
        params = {
            "consumer": consumer,
            "limit": limit,
            "worker": worker,
            "workers": workers,
            "budget": budget,
            "alone": int(alone),
        }
        pgconn = _pgconn(conn)
        with translate_errors():
            # The planner settings go straight through libpq, with the BEGIN
            # psycopg would send on its own (one round trip for both):
            # psycopg sees the transaction open and sends none.
            idle = pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            _exec(pgconn, f"BEGIN; {PLAN_CLAIM}" if idle else PLAN_CLAIM)
            found = conn.execute(self._claim_inbox(on_dead, pgconn.server_version), params).all()
            if unplan:
                # Handlers share this transaction: give them the default planner.
                _exec(pgconn, UNPLAN_CLAIM)
        fields, blocked, used, need = sort_claimed(found)
        return InboxClaimed([InboxRow._make(row) for row in fields], blocked, used, need)

    def store_received(
        self,
        conn: sa.Connection,
        consumer: str,
        rows: Sequence[NewInboxRow],
        statuses: Sequence[str],
        on_dead: str,
        reserved: Reserved,
    ) -> dict[str, str]:
        """Begin the receiving transaction (--dispatch received): lock the
        batch's keys, in order, and insert its new rows as inbox_insert_received
        says (a row given as `processed` stays so unless its key has a row
        waiting for the dispatchers), with the `seq` values reserved for
        them (reserve_seqs), unless another transaction on their keys has
        handled a row numbered after them since: then numbered anew, after
        it (inbox_insert_received); returns the new rows' statuses, by id.
        Raises Refused for a value PostgreSQL will not take (the
        transaction is then aborted), DatabaseUnavailable when it is away or
        the statement failed otherwise (a deadlock with another process's
        transaction on a redelivered message)."""
        keys = sorted({row.key for row in rows if row.key is not None})
        locks = sorted({key_lock(consumer, key) for key in keys})
        commands = [QUIET]
        if locks:
            numbers = ",".join(map(str, locks))
            commands.append(
                f"SELECT pg_advisory_xact_lock({KEY_LOCKS}, n) "
                f"FROM unnest(CAST(ARRAY[{numbers}] AS int4[])) AS n"
            )
        pgconn = _pgconn(conn)
        with translate_errors(any_driver_error):
            idle = pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
            _exec(pgconn, "; ".join(["BEGIN", *commands] if idle else commands))
            params = {
                "consumer": consumer,
                "rows": rows_json(rows, statuses, reserved.seqs),
                "since": reserved.at,
                "low": reserved.seqs[0],
                "keys": orjson.dumps(keys).decode(),
            }
            result = conn.execute(self._insert_received(on_dead), params)
            return {message_id: status for message_id, status in result}  # noqa: C416

    async def reserve_seqs(self, count: int) -> Reserved:
        """`count` values of the inbox's `seq`, ascending, and when: a
        received batch stored in parts side by side (relay.inbox.Handing)
        keeps the order of arrival in `seq`, as one INSERT would."""
        with translate_errors():
            async with self.connection() as conn:
                result = (await conn.execute(named("inbox_reserve_seqs"), {"count": count})).all()
                return Reserved([seq for seq, _ in result], result[0][1])

    @staticmethod
    @functools.cache
    def _insert_received(on_dead: str) -> sa.TextClause:
        return sa.text(
            query("inbox_insert_received").replace("{held}", query(f"inbox_held_{on_dead}"))
        )

    def hold_received(self, conn: sa.Connection, consumer: str, ids: Sequence[str]) -> None:
        """Rows the receiving transaction stored `processed` whose handlers
        did not run (an earlier row of their key failed): pending."""
        if ids:
            with translate_errors():
                conn.execute(
                    named("inbox_hold"),
                    {"consumer": consumer, "ids": orjson.dumps(list(ids)).decode()},
                )

    def wake_dispatchers(self, conn: sa.Connection) -> None:
        """Notify the inbox's dispatchers at this transaction's commit (a
        quiet one, see store_received, that stored rows for them)."""
        with translate_errors():
            conn.execute(
                named("notify_wake"),
                {"channel": NOTIFY_INBOX, "table": self.table("inbox")},
            )

    def mark_processed(self, conn: sa.Connection, consumer: str, ids: Sequence[str]) -> None:
        if ids:
            with translate_errors():
                conn.execute(
                    named("inbox_mark_processed"),
                    {"consumer": consumer, "ids": orjson.dumps(list(ids)).decode()},
                )

    def mark_inbox_failed(
        self,
        conn: sa.Connection,
        consumer: str,
        failures: Sequence[tuple[InboxRow, Failure, float]],
        max_attempts: int,
    ) -> dict[str, str]:
        """Record failed handler runs; returns each row's new status."""
        if not failures:
            return {}
        params = {
            "consumer": consumer,
            "ids": [row.message_id for row, _, _ in failures],
            "errors": [clean_error(f.error) for _, f, _ in failures],
            "delays": [delay for _, _, delay in failures],
            "permanent": [f.permanent for _, f, _ in failures],
            "max_attempts": max_attempts,
        }
        with translate_errors():
            result = conn.execute(named("inbox_mark_failed"), params)
            # Not dict(result): a Result has keys() (its column names), so
            # dict() would take it for a mapping.
            return {row_id: status for row_id, status in result}  # noqa: C416

    async def fail_hung_handler(
        self,
        pid: int | None,
        consumer: str,
        rows: Sequence[tuple[InboxRow, float]],
        error: str,
        max_attempts: int,
        *,
        received: Sequence[NewInboxRow] = (),
    ) -> list[str]:
        """End the transaction of a hung handler (backend `pid`: the
        dispatcher's own connection), then record the failed attempt of its
        rows (each with its backoff delay: one row for a handler, those of
        the call for a batch handler); the UPDATE waits for the row lock the
        ended transaction held, and does nothing if the row was finished
        meanwhile. Returns the new statuses.

        A receiving transaction's handler (--dispatch received) hung before
        its batch was stored: `received`, the batch, is stored first as the
        stored path would have (each row as received, in order), so that
        the hung rows' attempt is counted and the messages of their keys
        stay in order behind them when the broker delivers the batch again."""
        statuses: list[str] = []
        async with self.transaction() as conn:
            await conn.execute(named("lock_timeout"), {"timeout": "10s"})
            if pid is not None:
                await conn.execute(named("terminate_backend"), {"pid": pid})
            if received:
                await conn.execute(
                    named("inbox_insert"), {"consumer": consumer, "rows": rows_json(received)}
                )
            for row, delay in rows:
                params = {
                    "consumer": consumer,
                    "id": row.message_id,
                    "attempts": row.attempts,
                    "error": error,
                    "delay": delay,
                    "max_attempts": max_attempts,
                }
                status = await conn.scalar(named("inbox_mark_hung"), params)
                if status is not None:
                    statuses.append(status)
        return statuses

    # -- status --------------------------------------------------------------

    async def status(self) -> dict[str, dict[str, Any]]:
        """Counts per status and the oldest pending age, for both tables."""
        report: dict[str, dict[str, Any]] = {}
        async with self.connection() as conn:
            for table, statuses in STATUSES.items():
                counts = dict.fromkeys(statuses, 0)
                for status, count in await conn.execute(named(f"status_counts_{table}")):
                    counts[status] = count
                age = await conn.scalar(named(f"oldest_pending_{table}"))
                report[table] = {**counts, "oldest_pending_seconds": age}
        return report

    async def dead_keys(
        self, limit: int = 20
    ) -> dict[str, list[tuple[str | None, list[str], int]]]:
        """Per table: (consumer or None, the first `limit` keys with a dead
        row, how many such keys there are), for `relay status`."""
        report: dict[str, list[tuple[str | None, list[str], int]]] = {}
        async with self.connection() as conn:
            for table in TABLES:
                scopes: dict[str | None, tuple[list[str], int]] = {}
                result = await conn.execute(named(f"dead_keys_{table}"), {"limit": limit})
                for consumer, key, total in result:
                    keys, _ = scopes.setdefault(consumer, ([], total))
                    keys.append(key)
                report[table] = [(c, keys, total) for c, (keys, total) in scopes.items()]
        return report

    def inbox_body(self, conn: sa.Connection, consumer: str, message_id: str) -> bytes | None:
        """The raw body kept for an inbox row whose body was not JSON."""
        with translate_errors():
            body = conn.execute(
                named("inbox_body"), {"consumer": consumer, "id": message_id}
            ).scalar()
        return bytes(body) if body is not None else None

    def handler_savepoints(
        self, conn: sa.Connection, *, after_claim: bool = False
    ) -> HandlerSavepoints:
        """Savepoints for the handlers of the batch in `conn`'s transaction
        (after_claim: see claim_inbox)."""
        return HandlerSavepoints(_pgconn(conn), after_claim=after_claim)

    def backend_pid(self, conn: sa.Connection) -> int | None:
        """The PostgreSQL backend pid of a connection in a transaction (no
        round trip). Behind a pooler, which gives its clients a made-up pid,
        one round trip asks the server process that holds the transaction
        (in transaction mode another may hold the next)."""
        if conn.connection.info.get("relay_pooled"):
            with translate_errors():
                pid = conn.exec_driver_sql(pg.BACKEND_PID).scalar()
            return int(pid) if pid is not None else None
        info = getattr(conn.connection.driver_connection, "info", None)
        return getattr(info, "backend_pid", None)


# A retried inbox row that looks like a claim check pointer (payload,
# headers as JSON texts) -> None (leave it), its (payload, headers) once its
# object is fetched, or why it could not be (relay.claimcheck.retry.Restore).
Restore = Callable[[str | None, str], Awaitable[tuple[str, str] | str | None]]


async def retry_in(
    conn: AsyncConnection,
    table: str,
    *,
    ids: Sequence[str],
    all_dead: bool,
    consumer: str | None = None,
    restore: Restore | None = None,
) -> int:
    """The retry of `relay retry` in the caller's transaction: dead (or the
    given) rows back to pending with attempts reset, then a wake-up for the
    daemons; returns how many rows. Inbox rows kept as claim check pointers
    get their object's bytes first (through `restore`,
    relay.claimcheck.retry.Restore); one that still cannot be read stays
    dead, with why in last_error."""
    params: dict[str, Any] = {"ids": list(ids), "all_dead": all_dead}
    if table == "inbox":
        params["consumer"] = consumer
        if restore is not None:
            await _restore_claim_checks(conn, params, restore)
    result = await conn.execute(named(f"retry_{table}"), params)
    await conn.execute(named("notify_wake"), {"channel": f"relay_{table}", "table": table})
    return result.rowcount


async def _restore_claim_checks(
    conn: AsyncConnection, params: dict[str, Any], restore: Restore
) -> None:
    """Replace the pointer of each claim checked row about to be retried
    with its object's bytes (`restore`); note why in last_error where that
    cannot be done (the retry then leaves that row dead)."""
    rows = (await conn.execute(named("inbox_claim_checks"), params)).all()
    for consumer, message_id, payload, headers in rows:
        where_ = {"consumer": consumer, "message_id": message_id}
        restored = await restore(payload, headers)
        if restored is None:
            continue
        if isinstance(restored, tuple):
            text, new_headers = restored
            await conn.execute(
                named("inbox_claim_check_fetched"),
                {**where_, "payload": text, "headers": new_headers},
            )
            continue
        log.warning("%s (message_id %r)", restored, message_id)
        await conn.execute(named("inbox_claim_check_unfetched"), {**where_, "error": restored})
