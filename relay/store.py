"""PostgreSQL: the module that talks to the database on the relay's behalf.

Every query the daemons and commands run is named here, but for the
receiver's one INSERT (relay.receiving, whose process does without
SQLAlchemy). Values travel as bound parameters, except in OutboxSession's
EXECUTEs, which carry only integers and the UUIDs its claim returned.
Driver errors that mean "the server went away" become DatabaseUnavailable
at this boundary, so the loops catch one class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import orjson
import psycopg
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from relay import pg, schema
from relay.config import redact_url
from relay.errors import DatabaseUnavailable
from relay.limits import clean_error
from relay.rows import Failure, InboxRow, OutboxRow

log = logging.getLogger(__name__)

NOTIFY_OUTBOX = "relay_outbox"
NOTIFY_INBOX = "relay_inbox"


# --------------------------------------------------------------------------
# Queries
# --------------------------------------------------------------------------

# Claim due outbox rows in seq order, keeping per-key order:
# - the inner filter skips rows that wait behind an earlier row of their key
#   which is not due yet (backoff, delay), has failed before (a key whose
#   head failed goes head first and alone until the head is published or
#   dead) or, under --on-dead block, is dead;
# - the outer filter marks rows `blocked` whose key has an earlier pending
#   row that another relay holds right now: they stay pending, and the
#   relay holding the key's head publishes them later.
# The workers of one relay split the keys between them by ranges of their
# hash (keyless rows by the hash of their id), so they never wait on each
# other; the pending index holds that hash, so a worker passes over the
# other workers' rows without reading them from the table. `{dead}` is the
# --on-dead policy; $1 is the batch size, $2 the worker and $3 how many
# there are.
#
# Every pending row has seq >= `low`, the lowest pending seq in the
# statement's snapshot: the main scan and the per-key probes start there.
# Without it, each probe walked its key's index entries from the first:
# those of every row of the key finished since the last vacuum, dead but
# still in the index, so a message cost more the more had gone before it
# in a backlog (docs/backlog.md). Only `low` itself still walks the dead
# entries left of the lowest pending row, once per claim.
_CLAIM_OUTBOX = """
WITH low AS MATERIALIZED (
    SELECT coalesce(min(seq), 0) AS seq FROM outbox WHERE status = 'pending'
), locked AS (
    SELECT o.id, o.seq, o.topic, o.key, o.type, o.payload, o.headers, o.created_at, o.attempts
    FROM outbox o
    WHERE o.status = 'pending' AND o.seq >= (SELECT seq FROM low)
      AND (hashtext(coalesce(o.key, o.id::text)) & 2147483647) >= ($2::bigint << 31) / $3
      AND (hashtext(coalesce(o.key, o.id::text)) & 2147483647) < (($2::bigint + 1) << 31) / $3
      AND o.available_at <= now()
      AND (o.key IS NULL OR (
          NOT EXISTS (
              SELECT 1 FROM outbox e
              WHERE e.key = o.key AND e.seq >= (SELECT seq FROM low) AND e.seq < o.seq
                AND e.status <> 'published' AND e.status <> 'dead'
                AND (e.available_at > now() OR e.attempts > 0))
          {dead}))
    ORDER BY o.seq
    LIMIT $1
    FOR UPDATE SKIP LOCKED
)
SELECT l.id::text AS id, l.seq, l.topic, l.key, l.type, l.payload::text AS payload,
       l.headers::text AS headers, l.created_at, l.attempts,
       l.key IS NOT NULL AND EXISTS (
           SELECT 1 FROM outbox e
           WHERE e.key = l.key AND e.seq >= (SELECT seq FROM low) AND e.seq < l.seq
             AND e.status <> 'published' AND e.status <> 'dead'
             AND e.id NOT IN (SELECT id FROM locked)) AS blocked
FROM locked l
ORDER BY l.seq
"""

_DEAD_BLOCKS = {
    "skip": "",
    "block": """AND NOT EXISTS (
              SELECT 1 FROM outbox d
              WHERE d.key = o.key AND d.seq < o.seq AND d.status = 'dead')""",
}

# Without statistics (a table bulk-loaded a moment ago, autovacuum off) the
# planner may sort every pending row before the LIMIT, or probe each key
# with a full scan; walking the seq index and probing the per-key indexes is
# right at any size. (The probes spell "pending" as "neither finished nor
# dead" so that only the per-key indexes match them.) SET LOCAL ends with
# the transaction; the outbox workers' connections set them for the session.
# (jit too, which the session options turn off, but not behind a pooler.)
PLAN_CLAIM = (
    "SET LOCAL jit = off; SET LOCAL enable_sort = off; SET LOCAL enable_bitmapscan = off; "
    "SET LOCAL enable_seqscan = off"
)
UNPLAN_CLAIM = (
    "SET LOCAL enable_sort = on; SET LOCAL enable_bitmapscan = on; "
    "SET LOCAL enable_seqscan = on"
)

# On the outbox workers' connections (OutboxSession), where the planner
# settings of PLAN_CLAIM hold for the session. Commits there need no flush
# to disk (synchronous_commit off): all they record is that rows went out,
# and a mark that a server crash loses only publishes those rows again
# (at least once, same message id).
OUTBOX_SESSION_OPTIONS = [
    "-c enable_sort=off", "-c enable_bitmapscan=off", "-c enable_seqscan=off",
    "-c synchronous_commit=off",
]
# The same settings for one transaction, where a pooler is between: jit
# off too (see Store.session_options).
_POOLED_SESSION = "; ".join(
    "SET LOCAL " + option.removeprefix("-c ").replace("=", " = ")
    for option in ["-c jit=off", *OUTBOX_SESSION_OPTIONS])
_UUID_LIST = re.compile(r"[0-9a-fA-F,-]*").fullmatch
MARK_PUBLISHED = (
    "UPDATE outbox SET status = 'published', published_at = now(), last_error = NULL "
    "WHERE id = ANY($1)"
)

# One statement for every failure of a batch. `permanent` rows (retrying
# cannot help) go dead at once; the rest wait `delay` seconds.
MARK_OUTBOX_FAILED = """
UPDATE outbox AS o SET
    attempts = o.attempts + 1,
    last_error = f.error,
    available_at = now() + make_interval(secs => f.delay),
    status = CASE WHEN f.permanent OR o.attempts + 1 >= %(max_attempts)s
                  THEN 'dead' ELSE 'pending' END
FROM unnest(CAST(%(ids)s AS uuid[]), CAST(%(errors)s AS text[]),
            CAST(%(delays)s AS float8[]), CAST(%(permanent)s AS bool[]))
     AS f(id, error, delay, permanent)
WHERE o.id = f.id
RETURNING o.id::text, o.status
"""

# -- inbox -------------------------------------------------------------------

# The inbox twin of the outbox claim (see _CLAIM_OUTBOX), per consumer.
_CLAIM_INBOX = """
WITH low AS MATERIALIZED (
    SELECT coalesce(min(seq), 0) AS seq FROM inbox
    WHERE consumer = :consumer AND status = 'pending'
), locked AS (
    SELECT i.message_id, i.seq, i.topic, i.key, i.type, i.payload, i.headers, i.attempts
    FROM inbox i
    WHERE i.consumer = :consumer AND i.status = 'pending' AND i.seq >= (SELECT seq FROM low)
      AND (hashtext(coalesce(i.key, i.message_id)) & 2147483647)
          >= (CAST(:worker AS bigint) << 31) / :workers
      AND (hashtext(coalesce(i.key, i.message_id)) & 2147483647)
          < ((CAST(:worker AS bigint) + 1) << 31) / :workers
      AND i.available_at <= now()
      AND (i.key IS NULL OR (
          NOT EXISTS (
              SELECT 1 FROM inbox e
              WHERE e.consumer = i.consumer AND e.key = i.key
                AND e.seq >= (SELECT seq FROM low) AND e.seq < i.seq
                AND e.status <> 'processed' AND e.status <> 'dead'
                AND (e.available_at > now() OR e.attempts > 0))
          {dead}))
    ORDER BY i.seq
    LIMIT :limit
    FOR UPDATE SKIP LOCKED
)
SELECT l.message_id, l.seq, l.topic, l.key, l.type, l.payload::text AS payload,
       l.headers::text AS headers, l.attempts,
       l.key IS NOT NULL AND EXISTS (
           SELECT 1 FROM inbox e
           WHERE e.consumer = :consumer AND e.key = l.key
             AND e.seq >= (SELECT seq FROM low) AND e.seq < l.seq
             AND e.status <> 'processed' AND e.status <> 'dead'
             AND e.message_id NOT IN (SELECT message_id FROM locked)) AS blocked
FROM locked l
ORDER BY l.seq
"""

_INBOX_DEAD_BLOCKS = {
    "skip": "",
    "block": """AND NOT EXISTS (
              SELECT 1 FROM inbox d
              WHERE d.consumer = i.consumer AND d.key = i.key AND d.seq < i.seq
                AND d.status = 'dead')""",
}

# The ids travel as one JSON array: a text[] parameter costs the dispatcher
# psycopg's array quoting of every id.
MARK_PROCESSED = sa.text(
    "UPDATE inbox SET status = 'processed', processed_at = now(), last_error = NULL "
    "WHERE consumer = :consumer "
    "AND message_id = ANY(ARRAY(SELECT json_array_elements_text(CAST(:ids AS json))))"
)

MARK_INBOX_FAILED = sa.text("""
UPDATE inbox AS i SET
    attempts = i.attempts + 1,
    last_error = f.error,
    available_at = now() + make_interval(secs => f.delay),
    status = CASE WHEN f.permanent OR i.attempts + 1 >= :max_attempts
                  THEN 'dead' ELSE 'pending' END
FROM unnest(CAST(:ids AS text[]), CAST(:errors AS text[]),
            CAST(:delays AS float8[]), CAST(:permanent AS bool[]))
     AS f(id, error, delay, permanent)
WHERE i.consumer = :consumer AND i.message_id = f.id
RETURNING i.message_id, i.status
""")

# A retried row whose body was not JSON: its handler gets the raw bytes too.
INBOX_BODY = sa.text("SELECT body FROM inbox WHERE consumer = :consumer AND message_id = :id")

# -- retry ---------------------------------------------------------------------

RETRY = {
    "outbox": sa.text(
        "UPDATE outbox SET status = 'pending', attempts = 0, available_at = now() "
        "WHERE (id = ANY(CAST(:ids AS uuid[])) OR (:all_dead AND status = 'dead'))"
    ),
    "inbox": sa.text(
        "UPDATE inbox SET status = 'pending', attempts = 0, available_at = now() "
        "WHERE (message_id = ANY(:ids) OR (:all_dead AND status = 'dead')) "
        "AND (CAST(:consumer AS text) IS NULL OR consumer = :consumer)"
    ),
}
NOTIFY = sa.text("SELECT pg_notify(:channel, '')")
NOTIFY_PAYLOAD = sa.text("SELECT pg_notify(:channel, :payload)")


SCHEMA_TABLE_EXISTS = sa.text("SELECT to_regclass('relay_schema_version') IS NOT NULL")

STATUS_COUNTS = {
    "outbox": sa.text(
        "SELECT status, count(*) FROM outbox GROUP BY status"
    ),
    "inbox": sa.text(
        "SELECT status, count(*) FROM inbox GROUP BY status"
    ),
}
OLDEST_PENDING = {
    "outbox": sa.text(
        "SELECT extract(epoch FROM now() - min(created_at))::float8 "
        "FROM outbox WHERE status = 'pending'"
    ),
    "inbox": sa.text(
        "SELECT extract(epoch FROM now() - min(received_at))::float8 "
        "FROM inbox WHERE status = 'pending'"
    ),
}
STATUSES = {
    "outbox": ("pending", "published", "dead"),
    "inbox": ("pending", "processed", "dead"),
}

# Keys that have a dead row, which under --on-dead block holds back every
# later row of the key: per table, and per consumer for the inbox; the
# first `limit` keys (oldest dead row first) and how many there are.
DEAD_KEYS = {
    "outbox": sa.text("""
SELECT NULL::text AS consumer, key, count(*) OVER () AS total
FROM (SELECT key, min(seq) AS first FROM outbox
      WHERE status = 'dead' AND key IS NOT NULL GROUP BY key) d
ORDER BY first
LIMIT :limit
"""),
    "inbox": sa.text("""
SELECT consumer, key, total FROM (
    SELECT consumer, key, count(*) OVER (PARTITION BY consumer) AS total,
           row_number() OVER (PARTITION BY consumer ORDER BY first) AS n
    FROM (SELECT consumer, key, min(seq) AS first FROM inbox
          WHERE status = 'dead' AND key IS NOT NULL GROUP BY consumer, key) d
) t
WHERE n <= :limit
ORDER BY consumer, n
"""),
}

# The dispatcher's watchdog: end the transaction of a hung handler (its row
# locks go with it) so its failed attempt can be recorded. Only ever given
# the pid of the dispatcher's own connection.
TERMINATE_BACKEND = sa.text("SELECT pg_terminate_backend(:pid)")
MARK_HUNG = sa.text("""
UPDATE inbox SET
    attempts = attempts + 1,
    last_error = :error,
    available_at = now() + make_interval(secs => :delay),
    status = CASE WHEN attempts + 1 >= :max_attempts THEN 'dead' ELSE 'pending' END
WHERE consumer = :consumer AND message_id = :id AND status = 'pending' AND attempts = :attempts
RETURNING status
""")
LOCK_TIMEOUT = sa.text("SELECT set_config('lock_timeout', :timeout, true)")


def _is_disconnect(exc: BaseException) -> bool:
    if isinstance(exc, sa_exc.DBAPIError):
        return bool(exc.connection_invalidated) or isinstance(
            exc.orig, psycopg.OperationalError
        )
    return isinstance(exc, (psycopg.OperationalError, OSError, sa_exc.InterfaceError))


class Savepoint:
    """One named savepoint of a transaction, set and rolled back through libpq.

    Set on the driver connection, it is left open into the next set(), and
    moving it on (RELEASE, then SAVEPOINT again) is one round trip of one
    simple-protocol query: SQLAlchemy's begin_nested takes two, and with its
    statement overhead cost more than a one-INSERT handler itself.
    COMMIT ends whatever savepoint is still open. The commands go straight to
    libpq (PQexec, which lets go of the GIL while it waits): through a
    psycopg cursor each would cost more client CPU (docs/inbox.md)."""

    def __init__(self, pgconn: Any, name: str) -> None:
        self._pgconn = pgconn
        self._set = f"SAVEPOINT {name}"
        self._move = f"RELEASE SAVEPOINT {name}; SAVEPOINT {name}"
        self._undo = f"ROLLBACK TO SAVEPOINT {name}"
        self._release = f"RELEASE SAVEPOINT {name}"
        self._open = False

    def set(self) -> None:
        """A fresh savepoint: what ran before it stays, whatever runs next."""
        self._exec(self._move if self._open else self._set)
        self._open = True

    def undo(self) -> None:
        """Roll back what ran since the last set()."""
        self._exec(self._undo)

    def release(self) -> None:
        """End the savepoint (and any set after it), keeping what ran."""
        if self._open:
            self._exec(self._release)
            self._open = False

    def _exec(self, command: str) -> None:
        result = self._pgconn.exec_(command.encode())
        if result.status == psycopg.pq.ExecStatus.COMMAND_OK:
            return
        message = (result.error_message or self._pgconn.error_message).decode(errors="replace")
        if self._pgconn.status == psycopg.pq.ConnStatus.BAD:
            raise DatabaseUnavailable(f"OperationalError: {message.strip()}")
        raise psycopg.DatabaseError(f"{command}: {message.strip()}")


class HandlerSavepoints:
    """The savepoints of one batch's transaction (see Dispatcher._run_handlers):
    `batch` for many handlers at once, `handler` around one handler run.

    They are set on the connection of a sync Connection: psycopg's own on
    the sync engine; on the async engine (inside run_sync) that of the
    dispatcher's event loop, which is idle while a handler's batch runs."""

    def __init__(self, driver_connection: Any) -> None:
        self._pgconn = driver_connection.pgconn
        self.batch = Savepoint(self._pgconn, "relay_batch")
        self.handler = Savepoint(self._pgconn, "relay_handler")

    def release(self) -> None:
        """End the savepoints before the batch's marks, so that the marks run
        in the transaction itself. A row this transaction locked (the claim's
        FOR UPDATE) and then updated from inside a savepoint gets a MultiXact
        as its xmax, and an index scan never takes a MultiXact's row version
        for surely dead: its entries in the pending and per-key indexes stay
        live for every claim to visit in the heap until a vacuum, and the
        claim's walk to the lowest pending row grows through a backlog
        (docs/backlog.md). One round trip a batch."""
        if self.batch._open:
            self.batch.release()  # ends relay_handler too, if set after it
            self.handler._open = False
        self.handler.release()

    def aborted(self) -> bool:
        """Did a statement fail in the transaction (no round trip)?"""
        return self._pgconn.transaction_status == psycopg.pq.TransactionStatus.INERROR


class OutboxSession:
    """One outbox worker's own connection, on which a batch costs two round
    trips (one before the publish, one after) of the simple protocol:

        BEGIN; EXECUTE relay_claim(limit, worker, workers)
        EXECUTE relay_mark('{ids}'); COMMIT

    The statements are prepared once per connection. Through a pooled
    SQLAlchemy connection the same batch took six (the pool's ping, psycopg's
    BEGIN, the planner settings, claim, mark, COMMIT), and a round trip that
    wakes an idle core is most of a quiet relay's latency from a commit to
    its publish (docs/outbox.md). Opened on first use and after a
    break; errors meaning the server went away become DatabaseUnavailable.
    """

    def __init__(self, conninfo: str, options: Sequence[str], on_dead: str) -> None:
        self.conninfo = conninfo
        self.options = " ".join([*options, *OUTBOX_SESSION_OPTIONS])
        self.on_dead = on_dead
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Behind a pooler (see relay.pg): no PREPARE and no session
        # settings; each batch says its statements and SET LOCALs in full,
        # in the same two round trips.
        self.pooled = False
        self._claim_sql = _CLAIM_OUTBOX.format(dead=_DEAD_BLOCKS[on_dead])

    async def claim(
        self, limit: int, worker: int = 0, workers: int = 1
    ) -> tuple[list[OutboxRow], int]:
        """Begin a batch's transaction and lock due rows of this worker's
        share of the keys; returns the publishable ones and how many wait on
        another relay's rows of their key. finish() or abort() must follow."""
        async with self._errors():
            conn = await self._connect()
            cursor = conn.cursor()
            args = [str(int(limit)), str(int(worker)), str(int(workers))]
            if self.pooled:
                claim = _POOLED_SESSION + "; " + re.sub(
                    r"\$(\d+)", lambda m: args[int(m[1]) - 1], self._claim_sql)
            else:
                claim = f"EXECUTE relay_claim({', '.join(args)})"
            await cursor.execute(f"BEGIN; {claim}")
            while cursor.nextset():  # to the claim's rows, after the SETs
                pass
            rows, blocked = [], 0
            for *fields, is_blocked in await cursor.fetchall():
                if is_blocked:
                    blocked += 1
                else:
                    rows.append(OutboxRow(*fields))
            return rows, blocked

    async def finish(
        self,
        published: Sequence[str],
        failures: Sequence[tuple[OutboxRow, Failure, float]] = (),
        max_attempts: int = 1,
    ) -> dict[str, str]:
        """Mark the batch's rows and commit; returns each failed row's new status."""
        async with self._errors():
            conn = await self._connect()
            statuses: dict[str, str] = {}
            if failures:
                cursor = await conn.execute(MARK_OUTBOX_FAILED, {
                    "ids": [row.id for row, _, _ in failures],
                    "errors": [clean_error(f.error) for _, f, _ in failures],
                    "delays": [delay for _, _, delay in failures],
                    "permanent": [f.permanent for _, f, _ in failures],
                    "max_attempts": max_attempts,
                })
                statuses = dict(await cursor.fetchall())
            # The ids the claim returned: UUIDs, which need no quoting.
            ids = ",".join(published)
            if not _UUID_LIST(ids):
                raise ValueError(f"not a list of UUIDs: {ids[:80]!r}")
            if not ids:
                await conn.execute("COMMIT")
            elif self.pooled:
                await conn.execute(MARK_PUBLISHED.replace("$1", f"'{{{ids}}}'::uuid[]")
                                   + "; COMMIT")
            else:
                await conn.execute(f"EXECUTE relay_mark('{{{ids}}}'); COMMIT")
            return statuses

    async def abort(self) -> None:
        """Roll back the batch (its rows stay pending); never raises."""
        conn = self._conn
        if conn is None or conn.closed:
            return
        try:
            await conn.rollback()
        except Exception:
            await self.close()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            # prepare_threshold=None: psycopg answers a ROLLBACK with
            # DEALLOCATE ALL once it has prepared statements of its own,
            # which would take ours along.
            conn, self.pooled = await pg.connect_detecting(
                self.conninfo, options=self.options, prepare_threshold=None)
            if self.pooled:
                self._conn = conn
                return conn
            try:
                await conn.execute(
                    "PREPARE relay_claim(int, int, int) AS " + self._claim_sql
                    + "; PREPARE relay_mark(uuid[]) AS " + MARK_PUBLISHED)
            except BaseException:
                await conn.close()
                raise
            self._conn = conn
        return self._conn

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[None]:
        try:
            yield
        except BaseException as exc:
            # Cancelled or broken mid-statement, the connection is in no
            # known state: start again on a new one.
            lost = _is_disconnect(exc) or isinstance(exc, psycopg.errors.InvalidSqlStatementName)
            if lost or not isinstance(exc, psycopg.Error):
                await self.close()
            if lost:
                # A statement gone from the session (a pooler between us and
                # the server, say) is mended the same way: a new connection.
                raise DatabaseUnavailable(_describe(exc)) from exc
            raise


@contextlib.contextmanager
def translate_errors() -> Any:
    """Turn "the server went away" driver errors into DatabaseUnavailable."""
    try:
        yield
    except DatabaseUnavailable:
        raise
    except Exception as exc:
        if _is_disconnect(exc):
            raise DatabaseUnavailable(_describe(exc)) from exc
        raise


def _as_list(value: str | tuple[str, ...] | None) -> list[str]:
    """A URL query parameter's values (it may be absent or repeated)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _describe(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}"


def _keep_no_session_state_behind_a_pooler(engine: sa.Engine) -> None:
    """On each new connection of `engine`, find out whether a pooler is
    between (relay.pg); if so, psycopg prepares no statement on it, and
    backend_pid() knows no pid for it. A pooler that refuses the `options`
    startup parameter is asked again without them."""

    @sa.event.listens_for(engine, "do_connect")
    def connect(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]) -> Any:
        try:
            return dialect.connect(*cargs, **cparams)
        except psycopg.OperationalError as exc:
            if "options" not in cparams or not pg.refused_options(exc):
                raise
            return dialect.connect(*cargs, **{k: v for k, v in cparams.items()
                                              if k != "options"})

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


class Store:
    """The relay's view of PostgreSQL: an async engine and named queries."""

    def __init__(self, database_url: str, *, pool_size: int = 5, sync: bool = False) -> None:
        self.url = sa.make_url(database_url)
        # JIT compiles the claim for far longer than the claim runs without
        # it, because its cost estimate is large (docs/outbox.md). Options given in the URL
        # (`?options=-csearch_path%3Dapp`) are kept.
        self.session_options = [*_as_list(self.url.query.get("options")), "-c jit=off"]
        options: dict[str, Any] = {
            "pool_size": pool_size,
            "max_overflow": pool_size,
            "pool_pre_ping": True,
            "pool_recycle": 3600,
            "connect_args": {
                "connect_timeout": pg.CONNECT_TIMEOUT, "application_name": pg.APPLICATION_NAME,
                "options": " ".join(self.session_options),
            },
        }
        self.engine: AsyncEngine = create_async_engine(self.url, **options)
        # The same database through psycopg's blocking connection, for a
        # dispatcher whose handlers are all sync (see relay.inbox.Dispatcher).
        self.sync_engine: sa.Engine | None = (
            sa.create_engine(self.url, **options) if sync else None
        )
        for engine in (self.engine.sync_engine, self.sync_engine):
            if engine is not None:
                _keep_no_session_state_behind_a_pooler(engine)
        self._claim_inbox = {
            policy: sa.text(_CLAIM_INBOX.format(dead=cond))
            for policy, cond in _INBOX_DEAD_BLOCKS.items()
        }

    def __repr__(self) -> str:
        return f"Store({redact_url(str(self.url))!r})"

    @property
    def conninfo(self) -> str:
        """A libpq URL for plain psycopg connections (LISTEN)."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)

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

    @contextlib.contextmanager
    def sync_transaction(self) -> Iterator[sa.Connection]:
        """transaction() on the sync engine (a Store made with sync=True)."""
        assert self.sync_engine is not None, "a Store(sync=True) has a sync engine"
        with translate_errors(), self.sync_engine.begin() as conn:
            yield conn

    async def notify(self, channel: str, payload: str) -> None:
        """A notification on `channel`, sent through the database URL."""
        with translate_errors():
            async with self.engine.begin() as conn:
                await conn.execute(NOTIFY_PAYLOAD, {"channel": channel, "payload": payload})

    async def ping(self) -> None:
        with translate_errors():
            async with self.engine.connect() as conn:
                await conn.execute(sa.text("SELECT 1"))

    async def check_schema(self) -> None:
        """SchemaError unless the tables exist at the version this relay knows."""
        with translate_errors():
            async with self.engine.connect() as conn:
                version = None
                if await conn.scalar(SCHEMA_TABLE_EXISTS):
                    version = await conn.scalar(schema.CHECK_VERSION_SQL)
        schema.check_version(version)

    # -- outbox --------------------------------------------------------------

    def outbox_session(self, on_dead: str) -> OutboxSession:
        """A connection of its own for one outbox worker (see OutboxSession)."""
        return OutboxSession(self.conninfo, self.session_options, on_dead)

    # -- inbox -----------------------------------------------------------------

    # The dispatcher's batch is sync code, run on a sync Connection of either
    # engine (inside AsyncConnection.run_sync on the async one): these take one.

    def claim_inbox(
        self, conn: sa.Connection, consumer: str, limit: int, on_dead: str,
        worker: int = 0, workers: int = 1,
    ) -> tuple[list[InboxRow], int]:
        """Lock due rows of a consumer, of this worker's share of the keys;
        returns the dispatchable ones and how many wait on rows of their key
        held by another dispatcher."""
        params = {"consumer": consumer, "limit": limit, "worker": worker, "workers": workers}
        with translate_errors():
            conn.exec_driver_sql(PLAN_CLAIM)
            result = conn.execute(self._claim_inbox[on_dead], params)
            # Handlers share this transaction: give them the default planner.
            conn.exec_driver_sql(UNPLAN_CLAIM)
            rows, blocked = [], 0
            for *fields, is_blocked in result:
                if is_blocked:
                    blocked += 1
                else:
                    rows.append(InboxRow(*fields))
            return rows, blocked

    def mark_processed(self, conn: sa.Connection, consumer: str, ids: Sequence[str]) -> None:
        if ids:
            with translate_errors():
                conn.execute(MARK_PROCESSED, {"consumer": consumer,
                                              "ids": orjson.dumps(list(ids)).decode()})

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
            result = conn.execute(MARK_INBOX_FAILED, params)
            # Not dict(result): a Result has keys() (its column names), so
            # dict() would take it for a mapping.
            return {row_id: status for row_id, status in result}  # noqa: C416

    async def fail_hung_handler(
        self, pid: int | None, consumer: str, row: InboxRow, error: str, delay: float,
        max_attempts: int,
    ) -> str | None:
        """End the transaction of a hung handler (backend `pid`: the
        dispatcher's own connection), then record its failed attempt; the
        UPDATE waits for the row lock the ended transaction held, and does
        nothing if the row was finished meanwhile. Returns the new status."""
        params = {"consumer": consumer, "id": row.message_id, "attempts": row.attempts,
                  "error": error, "delay": delay, "max_attempts": max_attempts}
        async with self.transaction() as conn:
            await conn.execute(LOCK_TIMEOUT, {"timeout": "10s"})
            if pid is not None:
                await conn.execute(TERMINATE_BACKEND, {"pid": pid})
            return await conn.scalar(MARK_HUNG, params)

    async def retry(
        self, table: str, *, ids: Sequence[str], all_dead: bool, consumer: str | None
    ) -> int:
        """Dead (or the given) rows back to pending with attempts reset; wakes the daemons."""
        params: dict[str, Any] = {"ids": list(ids), "all_dead": all_dead}
        if table == "inbox":
            params["consumer"] = consumer
        async with self.transaction() as conn:
            result = await conn.execute(RETRY[table], params)
            await conn.execute(NOTIFY, {"channel": f"relay_{table}"})
        return result.rowcount

    # -- status --------------------------------------------------------------

    async def status(self) -> dict[str, dict[str, Any]]:
        """Counts per status and the oldest pending age, for both tables."""
        report: dict[str, dict[str, Any]] = {}
        with translate_errors():
            async with self.engine.connect() as conn:
                for table, statuses in STATUSES.items():
                    counts = dict.fromkeys(statuses, 0)
                    for status, count in await conn.execute(STATUS_COUNTS[table]):
                        counts[status] = count
                    age = await conn.scalar(OLDEST_PENDING[table])
                    report[table] = {**counts, "oldest_pending_seconds": age}
        return report

    async def dead_keys(
        self, limit: int = 20
    ) -> dict[str, list[tuple[str | None, list[str], int]]]:
        """Per table: (consumer or None, the first `limit` keys with a dead
        row, how many such keys there are), for `relay status`."""
        report: dict[str, list[tuple[str | None, list[str], int]]] = {}
        with translate_errors():
            async with self.engine.connect() as conn:
                for table, query in DEAD_KEYS.items():
                    scopes: dict[str | None, tuple[list[str], int]] = {}
                    for consumer, key, total in await conn.execute(query, {"limit": limit}):
                        keys, _ = scopes.setdefault(consumer, ([], total))
                        keys.append(key)
                    report[table] = [(c, keys, total) for c, (keys, total) in scopes.items()]
        return report

    def inbox_body(self, conn: sa.Connection, consumer: str, message_id: str) -> bytes | None:
        """The raw body kept for an inbox row whose body was not JSON."""
        with translate_errors():
            body = conn.execute(INBOX_BODY, {"consumer": consumer, "id": message_id}).scalar()
        return bytes(body) if body is not None else None

    def handler_savepoints(self, conn: sa.Connection) -> HandlerSavepoints:
        """Savepoints for the handlers of the batch in `conn`'s transaction."""
        return HandlerSavepoints(conn.connection.driver_connection)

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


# How long the listener's self-check waits for its own notification.
SELF_CHECK_SECONDS = 5.0


class Listener:
    """LISTEN on its own autocommit connection; calls `wake` on each notification.

    Reconnects in a loop with backoff; while it is down the daemons still
    poll, so a lost notification costs at most one --poll-interval.

    `notify(payload)` sends a notification on the channel the way producers'
    commits do (through the --database-url, which may be a pooler's): on
    each connect the listener sends one to itself and waits for it. When it
    does not arrive (a PgBouncer in transaction mode between: the LISTEN
    was lost with the server connection it ran on), the listener logs one
    warning, lets go and leaves the daemon to poll.
    """

    def __init__(
        self, conninfo: str, channel: str, wake: Callable[[], None],
        notify: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.wake = wake
        self.notify = notify
        self.connected = asyncio.Event()

    @classmethod
    def for_store(cls, store: Store, channel: str, wake: Callable[[], None],
                  listen_url: str | None = None) -> Listener:
        """A Listener on `listen_url` (else the store's database URL) that
        checks itself with a notification sent through the store."""
        conninfo = pg.libpq_url(listen_url) if listen_url else store.conninfo
        return cls(conninfo, channel, wake,
                   notify=lambda payload: store.notify(channel, payload))

    async def run(self) -> None:
        delay = 0.5
        said = False  # one line per outage: the daemon's loop logs each of its waits
        while True:
            try:
                async with await pg.connect(self.conninfo) as conn:
                    await conn.execute(f"LISTEN {self.channel}")  # a constant, never input
                    if not await self._self_check(conn):
                        log.warning(
                            "LISTEN/NOTIFY does not work on this connection (%s): a "
                            "notification sent to %s did not come back within %gs, as "
                            "behind PgBouncer in transaction mode; polling every "
                            "--poll-interval instead. Give --listen-url a direct "
                            "PostgreSQL URL for LISTEN to get wake-ups.",
                            redact_url(self.conninfo), self.channel, SELF_CHECK_SECONDS)
                        with contextlib.suppress(psycopg.Error, OSError):
                            await conn.execute("UNLISTEN *")
                        break
                    self.connected.set()
                    delay, said = 0.5, False
                    # Rows committed while we were away: look once now.
                    self.wake()
                    async for _ in conn.notifies():
                        self.wake()
            except (psycopg.OperationalError, OSError, DatabaseUnavailable) as exc:
                log.log(
                    logging.DEBUG if said else logging.WARNING,
                    "LISTEN %s connection lost (%s); polling until it is back",
                    self.channel,
                    _describe(exc),
                )
                said = True
            finally:
                self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        # A background task of the daemon's, which must not end: poll only.
        await asyncio.Event().wait()

    async def _self_check(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Send a notification through `notify` and wait for it here."""
        if self.notify is None:
            return True
        token = f"relay-self-check-{uuid.uuid4().hex}"
        await self.notify(token)
        async for notification in conn.notifies(timeout=SELF_CHECK_SECONDS):
            if notification.payload == token:
                return True
            self.wake()  # a producer's: a wake-up like any other
        return False


# --------------------------------------------------------------------------
# Retention and gauges (scheduled jobs of both daemons)
# --------------------------------------------------------------------------

RETENTION_LOCK = {"outbox": 0x72657430, "inbox": 0x72657431}

# Small batches keep each delete's locks and WAL short.
_DELETE_OLD = {
    "outbox": "DELETE FROM outbox WHERE id IN (SELECT id FROM outbox "
    "WHERE status = 'published' AND published_at < now() - make_interval(secs => :age) "
    "LIMIT :limit)",
    "inbox": "DELETE FROM inbox WHERE (consumer, message_id) IN (SELECT consumer, message_id "
    "FROM inbox WHERE status = 'processed' AND processed_at < now() - make_interval(secs => :age) "
    "LIMIT :limit)",
}

PENDING_GAUGES = {
    "outbox": sa.text(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8 "
        "FROM outbox WHERE status = 'pending'"
    ),
    "inbox": sa.text(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(received_at)), 0)::float8 "
        "FROM inbox WHERE status = 'pending'"
    ),
}

# The table's dead row versions and its last vacuum (manual or auto), from
# PostgreSQL's cumulative statistics: no scan of the table. Operators watch
# these to see a backlog's churn outrun autovacuum (docs/backlog.md).
TABLE_HEALTH = sa.text(
    "SELECT n_dead_tup, "
    "coalesce(extract(epoch FROM greatest(last_vacuum, last_autovacuum)), 0)::float8 "
    "FROM pg_stat_user_tables WHERE relid = to_regclass(:table)"
)


async def delete_expired(store: Store, table: str, age: float, batch: int = 1000) -> int | None:
    """Delete finished rows older than `age` seconds, batch by batch.

    Only one replica does it at a time (an advisory lock per table); returns
    None when another replica holds it."""
    statement = sa.text(_DELETE_OLD[table])
    lock = sa.text("SELECT pg_try_advisory_xact_lock(:id)")
    total = 0
    while True:
        async with store.transaction() as conn:
            if not await conn.scalar(lock, {"id": RETENTION_LOCK[table]}):
                return None if total == 0 else total
            result = await conn.execute(statement, {"age": age, "limit": batch})
        total += result.rowcount
        if result.rowcount < batch:
            return total


async def pending_gauge(store: Store, table: str) -> tuple[int, float]:
    """How many rows are pending and the age of the oldest, in seconds."""
    with translate_errors():
        async with store.engine.connect() as conn:
            count, age = (await conn.execute(PENDING_GAUGES[table])).one()
    return int(count), float(age)


async def table_health(store: Store, table: str) -> tuple[int, float]:
    """The table's dead row versions and the Unix time of its last vacuum
    (0: never), as the cumulative statistics last counted them."""
    with translate_errors():
        async with store.engine.connect() as conn:
            row = (await conn.execute(TABLE_HEALTH, {"table": table})).one_or_none()
    if row is None:
        return 0, 0.0
    return int(row[0]), float(row[1])
