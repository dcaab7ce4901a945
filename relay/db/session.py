"""The outbox workers' own connections (OutboxSession), through plain psycopg."""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import AsyncIterator, Collection, Sequence
from typing import Any, NamedTuple

import psycopg

from relay.db import connect as pg
from relay.db import namespace
from relay.db.errors import (
    is_disconnect,
    is_driver_error,
    lock_not_available,
    statement_gone,
    unavailable,
)
from relay.db.sql import claim, numbered, pyformat, query
from relay.errors import ShareBusy
from relay.limits import clean_error
from relay.rows import Failure, OutboxRow

# On the outbox workers' connections (OutboxSession), where the planner
# settings of PLAN_CLAIM hold for the session. Commits there need no flush
# to disk (synchronous_commit off): all they record is that rows went out,
# and a mark that a server crash loses only publishes those rows again
# (at least once, same message id).
OUTBOX_SESSION_OPTIONS = [
    "-c enable_sort=off",
    "-c enable_bitmapscan=off",
    "-c enable_seqscan=off",
    "-c synchronous_commit=off",
]
# The same settings for one transaction, where a pooler is between: jit
# off too (see Store.session_options).
_POOLED_SESSION = "; ".join(
    "SET LOCAL " + option.removeprefix("-c ").replace("=", " = ")
    for option in ["-c jit=off", *OUTBOX_SESSION_OPTIONS]
)
_UUID_LIST = re.compile(r"[0-9a-fA-F,-]*").fullmatch
# The prepared statements' parameters, in order: relay_claim(int, int, int,
# bigint, int) and relay_mark(uuid[]).
_CLAIM_PARAMETERS = ("limit", "worker", "workers", "budget", "alone")
# outbox_claim_ids's, the ids (and the rows before them) written in as
# literal arrays (checked UUIDs).
_CLAIM_IDS_PARAMETERS = ("ids", "limit", "budget", "alone", "before")
_IDS_PARAMETER = re.compile(r"\$1(?!\d)")
_BEFORE_PARAMETER = re.compile(r"\$5(?!\d)")
_SORT_IDS = "SET LOCAL enable_sort = on"
# No byte budget: a claim's default (the tests', `relay retry`'s).
UNBOUNDED = 1 << 62
MARK_PUBLISHED = numbered(query("outbox_mark_published"), ["ids"])
MARK_OUTBOX_FAILED = pyformat(query("outbox_mark_failed"))

# The share locks (docs/outbox.md, "Per-key order"): one transaction-level
# advisory lock per share of the keys, across every relay on the database,
# in the two-integer key space: (SHARE_LOCK_CLASS, share_key(share, shares)).
# The class spells "rels"; the producer trigger's per-key locks use class
# 0x72656C79 ("rely") of the same space, and the schema's, retention's and
# the demo's locks the one-bigint space, which never meets this one.
# Relays on another schema's outbox take another class
# (relay.db.namespace.share_lock_class).
SHARE_LOCK_CLASS = namespace.SHARE_LOCK_CLASS
# How long a worker waits in PostgreSQL for its share before it asks again
# (ShareBusy): far longer than a batch holds it, short enough that a
# stopping relay's waiting workers notice within a second.
SHARE_WAIT_MS = 1000
_SHARE_WAIT = numbered(query("outbox_share_wait"), ["timeout", "class", "share"])
_SHARES_TRY = numbered(query("outbox_shares_try"), ["class", "shares"])
_SHARES_TRY_SHARED = numbered(query("outbox_shares_try_shared"), ["class", "shares"])


class Claimed(NamedTuple):
    """A claim's outcome: the rows to publish, how many wait on another
    relay's rows of their key, the bytes of the rows it returned (the
    payloads as PostgreSQL measured them, blocked rows' too), and, when
    it stopped at a row its byte budget could not take, that row's size."""

    rows: list[OutboxRow]
    blocked: int
    used: int
    need: int | None


def sort_claimed(
    found: Sequence[Sequence[Any]],
) -> tuple[list[Sequence[Any]], int, int, int | None]:
    """A claim's result rows (a row's fields, then size, fits, blocked; see
    queries/outbox.sql and inbox.sql) as the fields of the rows to hand
    on, how many are blocked, the bytes of the rows returned, and the size
    of the row the budget stopped at (None: it did not stop)."""
    rows: list[Sequence[Any]] = []
    blocked = used = 0
    need = None
    for row in found:
        *fields, size, fits, is_blocked = row
        if not fits:
            need = size
            continue
        used += size
        if is_blocked:
            blocked += 1
        else:
            rows.append(fields)
    return rows, blocked, used, need


def share_key(share: int, shares: int) -> int:
    """The lock of share `share` of `shares`: relays split in different
    numbers of shares (other versions) never take each other's for their own."""
    return shares << 16 | share


def _written(sql: str, values: Sequence[int | Sequence[int]]) -> str:
    """A numbered statement with its values written in ($n: the n-th), for
    the simple protocol: integers (int()) and arrays of integers only."""

    def value(match: re.Match[str]) -> str:
        v = values[int(match[1]) - 1]
        if isinstance(v, int):
            return str(int(v))
        return "'{" + ",".join(str(int(n)) for n in v) + "}'"

    return re.sub(r"\$(\d+)", value, sql)


@functools.cache
def _share_wait(key: int, lock_class: int = SHARE_LOCK_CLASS) -> str:
    """The wait for share lock `key`, written out once per share: a
    worker sends the same one with every batch."""
    return _written(_SHARE_WAIT, [SHARE_WAIT_MS, lock_class, key])


def _lost(exc: BaseException) -> bool:
    # A statement gone from the session (a pooler between us and the
    # server, say) is mended the same way as a lost connection: a new one.
    return is_disconnect(exc) or statement_gone(exc)


class OutboxSession:
    """One outbox worker's own connection, on which a batch costs two round
    trips (one before the publish, one after) of the simple protocol:

        BEGIN; <its share's lock>; EXECUTE relay_claim(limit, worker, workers)
        EXECUTE relay_mark('{ids}'); COMMIT

    The statements are prepared once per connection. Through a pooled
    SQLAlchemy connection the same batch took six (the pool's ping, psycopg's
    BEGIN, the planner settings, claim, mark, COMMIT), and a round trip that
    wakes an idle core is most of a quiet relay's latency from a commit to
    its publish (docs/outbox.md). Opened on first use and after a
    break; errors meaning the server went away become DatabaseUnavailable.
    """

    def __init__(
        self,
        conninfo: str,
        options: Sequence[str],
        on_dead: str,
        shares: int = 1,
        *,
        schema: str | None = None,
        located: str | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.options = " ".join([*options, *OUTBOX_SESSION_OPTIONS])
        self.on_dead = on_dead
        # The keys' shares the locks are taken for: the relay's workers.
        self.shares = shares
        # --schema (its search_path is in `options`, and behind a pooler set
        # per batch), and the schema the outbox was found in, whose share
        # locks these are (relay.db.namespace).
        self._pooled_session = _POOLED_SESSION
        if schema is not None:
            self._pooled_session += "; " + namespace.set_local(schema)
        self.lock_class = namespace.share_lock_class(located)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Behind a pooler (see relay.db.connect): no PREPARE and no session
        # settings; each batch says its statements and SET LOCALs in full,
        # in the same two round trips.
        self.pooled = False
        self._claim_sql = ""  # for the server's version, once connected
        self._claim_ids_sql = ""
        self._claim_ids_before_sql = ""

    async def claim(
        self,
        limit: int,
        worker: int = 0,
        workers: int = 1,
        *,
        held: Collection[int] = (),
        budget: int = UNBOUNDED,
        alone: bool = True,
        ids: Sequence[str] | None = None,
        before: Sequence[str] = (),
    ) -> Claimed:
        """Begin a batch's transaction and lock due rows of this worker's
        share of the keys (or, with workers 1, of every key); returns the
        publishable ones and how many wait on another relay's rows of their
        key. finish() or abort() must follow, also after ShareBusy.

        A share's claim first waits for the share's lock (SHARE_WAIT_MS at
        most, then ShareBusy); a claim of every key tries the lock of every
        share but those in `held` (held by the caller's own workers, whose
        rows it skips as SKIP LOCKED always did) and, when one is held
        elsewhere, claims nothing and raises ShareBusy.

        The rows' payloads add up to at most `budget` bytes, but for a first
        row larger than that, which is taken alone when `alone` (see
        relay.budget and the claim in queries/outbox.sql).

        With `ids` (a claim of every key), only those rows are claimed, as
        they are due (outbox_claim_ids: the rows a replication slot
        delivered, relay outbox --capture wal), under every share's lock
        taken shared: the WAL reader's next batch is claimed, on another
        session, while the one `before` it goes out, and those rows hold
        none of this one's back (the reader publishes it only once they
        went out whole: relay.capture)."""
        every_key = workers == 1
        if ids is not None and not every_key:
            raise ValueError("a claim of given rows is a claim of every key")
        if not every_key and workers != self.shares:
            raise ValueError(f"{workers} shares of the keys, but locks for {self.shares}")
        async with self._errors():
            conn = await self._connect()
            cursor = conn.cursor()
            args = [int(limit), int(worker), int(workers), int(budget), int(alone)]
            if every_key:
                tried = [share_key(s, self.shares) for s in range(self.shares) if s not in held]
                tries = _SHARES_TRY if ids is None else _SHARES_TRY_SHARED
                lock = _written(tries, [self.lock_class, tried])
            else:
                lock = _share_wait(share_key(worker, workers), self.lock_class)
            if ids is not None:
                listed = ",".join(ids)
                earlier = ",".join(before)
                for given in (listed, earlier):
                    if not _UUID_LIST(given):
                        raise ValueError(f"not a list of UUIDs: {given[:80]!r}")
                if before:
                    written = _BEFORE_PARAMETER.sub(f"'{{{earlier}}}'", self._claim_ids_before_sql)
                else:
                    written = self._claim_ids_sql
                written = _IDS_PARAMETER.sub(f"'{{{listed}}}'", written)
                claim = _written(written, [0, int(limit), int(budget), int(alone)])
                # Sorting the rows found by id costs less than the walk of
                # the pending index in seq order that enable_sort=off would
                # choose (a backlog long: 21 ms against 6 for 500 of 20,000).
                claim = f"{_SORT_IDS}; {claim}"
                if self.pooled:
                    claim = f"{self._pooled_session}; {lock}; {claim}"
                else:
                    claim = f"{lock}; {claim}"
            elif self.pooled:
                claim = f"{self._pooled_session}; {lock}; {_written(self._claim_sql, args)}"
            else:
                claim = f"{lock}; EXECUTE relay_claim({', '.join(map(str, args))})"
            await cursor.execute(f"BEGIN; {claim}")
            busy = False
            while True:  # to the claim's rows, after the SETs and the locks
                if cursor.description and cursor.description[0].name == "shares_busy":
                    busy = await cursor.fetchone() == ("true",)
                if not cursor.nextset():
                    break
            if busy:
                raise ShareBusy("a share of the keys is held by another worker")
            found = await cursor.fetchall()
            # libpq's copy of the result goes now, before the rows are made:
            # the payloads stay only as the Python text the publish encodes.
            await cursor.close()
            fields, blocked, used, need = sort_claimed(found)
            return Claimed([OutboxRow(*row) for row in fields], blocked, used, need)

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
                cursor = await conn.execute(
                    MARK_OUTBOX_FAILED,
                    {
                        "ids": [row.id for row, _, _ in failures],
                        "errors": [clean_error(f.error) for _, f, _ in failures],
                        "delays": [delay for _, _, delay in failures],
                        "permanent": [f.permanent for _, f, _ in failures],
                        "max_attempts": max_attempts,
                    },
                )
                statuses = dict(await cursor.fetchall())
            # The ids the claim returned: UUIDs, which need no quoting.
            ids = ",".join(published)
            if not _UUID_LIST(ids):
                raise ValueError(f"not a list of UUIDs: {ids[:80]!r}")
            if not ids:
                await conn.execute("COMMIT")
            elif self.pooled:
                await conn.execute(
                    MARK_PUBLISHED.replace("$1", f"'{{{ids}}}'::uuid[]") + "; COMMIT"
                )
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

    @property
    def connection(self) -> psycopg.AsyncConnection[Any] | None:
        """The worker's open connection, None before the first claim and
        after a break: to inspect its settings, not to run batches on."""
        return self._conn

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            # prepare_threshold=None: psycopg answers a ROLLBACK with
            # DEALLOCATE ALL once it has prepared statements of its own,
            # which would take ours along.
            conn, self.pooled = await pg.connect_detecting(
                self.conninfo, options=self.options, prepare_threshold=None
            )
            self._claim_sql = numbered(
                claim("outbox", self.on_dead, conn.info.server_version), _CLAIM_PARAMETERS
            )
            self._claim_ids_sql = numbered(
                claim("outbox", self.on_dead, conn.info.server_version, which="_ids"),
                _CLAIM_IDS_PARAMETERS,
            )
            self._claim_ids_before_sql = numbered(
                claim("outbox", self.on_dead, conn.info.server_version, which="_ids", before=True),
                _CLAIM_IDS_PARAMETERS,
            )
            if self.pooled:
                self._conn = conn
                return conn
            try:
                await conn.execute(
                    "PREPARE relay_claim(int, int, int, bigint, int) AS "
                    + self._claim_sql
                    + "; PREPARE relay_mark(uuid[]) AS "
                    + MARK_PUBLISHED
                )
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
            if isinstance(exc, ShareBusy):
                raise  # the connection is fine: abort() rolls the transaction back
            error = (
                unavailable(exc, _lost, busy=lock_not_available)
                if isinstance(exc, Exception)
                else None
            )
            if isinstance(error, ShareBusy):
                raise error from exc  # the same: only the lock wait timed out
            if error is not None or not is_driver_error(exc):
                await self.close()
            if error is not None:
                raise error from exc
            raise
