"""The outbox's logical replication slot (`relay outbox --capture wal`).

One autocommit psycopg connection of its own holds the reader's lock (a
session advisory lock on the slot's name: one reader per slot, the others
stand by); on it the slot (`pgoutput`) and a publication of the outbox
table (its inserts, and where the server can, only the `id` and `seq`
columns) are made where missing, and the table and the slot's lag are
asked after. The slot itself is read through the replication protocol
(relay.db.stream, a thread on a `replication=database` connection) and
confirmed by its status updates once the rows read are published or dead.
Why the protocol and not the SQL functions: docs/wal-capture.md.

The messages are decoded by relay.db.pgoutput; the queries are in
queries/wal.sql. Errors meaning the server went away become
DatabaseUnavailable; a slot dropped or invalidated under the reader,
SlotLost; a server or role that cannot have a slot, ConfigError.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors as pgerrors
from psycopg import sql

from relay.db import connect as pg
from relay.db import namespace
from relay.db.errors import describe, is_disconnect
from relay.db.pgoutput import PgoutputError, Transaction, lsn, lsn_text
from relay.db.sql import pyformat, query
from relay.db.stream import SlotStream, StreamError
from relay.errors import ConfigError, DatabaseUnavailable, RelayError

log = logging.getLogger(__name__)

DEFAULT_SLOT = "relay_outbox"
# A slot's name: lower-case letters, digits and underscores, 63 at most.
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
# How long a stand-by waits for the reader's lock before it asks again
# (and notices that it is stopping).
STANDBY_WAIT = "5s"
# PostgreSQL 15 publishes a column list: only id and seq travel.
COLUMN_LISTS = 150000


class SlotLost(RelayError):
    """The slot is gone (dropped, or invalidated past max_slot_wal_keep_size,
    or lost in a failover): relay drains the table and makes it again."""


def slot_name(given: str | None, schema: str | None) -> str:
    """--slot, else relay_outbox (with _SCHEMA for a --schema); ConfigError
    for a name PostgreSQL would not take for a slot."""
    name = given or (DEFAULT_SLOT if schema is None else f"{DEFAULT_SLOT}_{schema}")
    if not _SLOT_NAME.fullmatch(name):
        raise ConfigError(
            f"invalid slot name {name!r}: a replication slot's name is 1 to 63 lower-case "
            "letters, digits and underscores (give one with --slot)"
        )
    return name


@dataclass
class Peek:
    """One look at the stream: the transactions committed since the
    reader's last look, in commit order; `upto`, the position up to which
    the stream brought every commit."""

    transactions: list[Transaction]
    upto: int


class SlotReader:
    """The slot `slot` (and publication of that name) of the outbox table in
    schema `located` (None: public), on the connection `conninfo` with the
    store's session `options` (its search_path)."""

    def __init__(
        self,
        conninfo: str,
        options: Sequence[str],
        slot: str,
        located: str | None,
    ) -> None:
        self.conninfo = conninfo
        self.options = " ".join(options)
        self.slot = slot
        self.schema = located or namespace.DEFAULT
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.confirmed = 0  # the slot's confirmed position, as last known
        self.read_upto = 0  # the end of the last transaction handed on
        self.holding = False  # the reader's lock
        # The replication stream (relay.db.stream), from prepare() on; and
        # what to call when it brings a commit (WalCapture.wake).
        self._stream: SlotStream | None = None
        self.on_commit: Callable[[], None] | None = None

    # -- connection ------------------------------------------------------------

    async def _connect(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self.holding = False
            self._conn = await pg.connect(self.conninfo, options=self.options)
        return self._conn

    async def close(self) -> None:
        await self._stop_stream()
        conn, self._conn = self._conn, None
        self.holding = False
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()

    @contextlib.asynccontextmanager
    async def _errors(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        try:
            yield await self._connect()
        except (pgerrors.UndefinedObject, pgerrors.ObjectNotInPrerequisiteState) as exc:
            # The slot or its publication does not exist (dropped), or the
            # slot can no longer be read (invalidated).
            raise SlotLost(describe(exc)) from exc
        except pgerrors.ObjectInUse as exc:
            # Another session reads the slot now (a tool, an operator's
            # peek): waited out like a server that is away.
            raise DatabaseUnavailable(describe(exc)) from exc
        except BaseException as exc:
            if isinstance(exc, Exception) and is_disconnect(exc):
                await self.close()
                raise DatabaseUnavailable(describe(exc)) from exc
            if not isinstance(exc, psycopg.Error):
                await self.close()  # cancelled mid-statement: no known state
            raise

    async def _one(self, name: str, **params: Any) -> Any:
        async with self._errors() as conn:
            cursor = await conn.execute(pyformat(query(name)), params)
            row = await cursor.fetchone()
            return None if row is None else row[0]

    # -- the checks and the reader's lock --------------------------------------

    async def check(self) -> None:
        """ConfigError, in one line saying what to change, for a server
        without wal_level = logical or a role that may not replicate."""
        async with self._errors() as conn:
            cursor = await conn.execute(query("wal_settings"))
            row = await cursor.fetchone()
        assert row is not None
        wal_level, role, may_replicate, on_rds = row
        if wal_level != "logical":
            where = (
                "set rds.logical_replication = 1 in the DB parameter group and reboot"
                if on_rds
                else "set wal_level = logical in postgresql.conf and restart PostgreSQL "
                "(on RDS and Aurora: rds.logical_replication = 1 in the parameter group)"
            )
            raise ConfigError(f"--capture wal needs wal_level = logical, not {wal_level}: {where}")
        if not may_replicate:
            raise ConfigError(
                f"--capture wal needs a role that may replicate, and {role} may not: "
                f"ALTER ROLE {role} REPLICATION "
                f"(on RDS and Aurora: GRANT rds_replication TO {role})"
            )

    async def stand_by(self) -> bool:
        """Wait up to STANDBY_WAIT for the reader's lock; whether it is held."""
        if self.holding and self._conn is not None and not self._conn.closed:
            return True
        async with self._errors() as conn:
            await conn.execute("SELECT set_config('lock_timeout', %s, false)", (STANDBY_WAIT,))
            try:
                await conn.execute(pyformat(query("wal_reader_lock")), {"slot": self.slot})
            except pgerrors.LockNotAvailable:
                return False
            finally:
                await conn.execute("RESET lock_timeout")
        self.holding = True
        return True

    # -- the publication and the slot -------------------------------------------

    async def prepare(self) -> bool:
        """Make the publication and the slot where missing (a slot that was
        invalidated is dropped and made again); whether the slot is new. Its
        confirmed position becomes the reader's start."""
        await self._stop_stream()
        async with self._errors() as conn:
            published = bool(await self._scalar(conn, "wal_publication_exists"))
            if not published:
                table = sql.Identifier(self.schema, "outbox")
                columns = (
                    sql.SQL(" (id, seq)")
                    if conn.info.server_version >= COLUMN_LISTS
                    else sql.SQL("")
                )
                create = sql.SQL(
                    "CREATE PUBLICATION {} FOR TABLE {}{} WITH (publish = 'insert')"
                ).format(sql.Identifier(self.slot), table, columns)
                try:
                    await conn.execute(create)
                except pgerrors.DuplicateObject:
                    pass  # another relay made it first
                except pgerrors.InsufficientPrivilege as exc:
                    raise ConfigError(
                        f"--capture wal cannot make publication {self.slot} "
                        f"({describe(exc)}): run {create.as_string(conn)} as the outbox "
                        "table's owner with CREATE on the database, or give relay's role both"
                    ) from exc
                log.info("made publication %s of %s.outbox", self.slot, self.schema)
            cursor = await conn.execute(pyformat(query("wal_slot")), {"slot": self.slot})
            found = await cursor.fetchone()
            if found is not None:
                plugin, database, wal_status, confirmed = found
                if database != conn.info.dbname or plugin != "pgoutput":
                    raise ConfigError(
                        f"replication slot {self.slot} belongs to database {database} "
                        f"(plugin {plugin}): give this relay another --slot"
                    )
                if published and wal_status != "lost" and confirmed is not None:
                    self._start(lsn(confirmed))
                    return False
                # Invalidated (past max_slot_wal_keep_size), or older than
                # its publication (which its decoding would never find).
                log.warning(
                    "replication slot %s cannot be read (%s): dropping it, draining the "
                    "table and making it again",
                    self.slot,
                    "invalidated" if wal_status == "lost" else "its publication was missing",
                    extra={"action": "slot_lost"},
                )
                await self._drop(conn)
            try:
                made = await self._scalar(conn, "wal_create_slot")
            except pgerrors.DuplicateObject:
                return await self.prepare()  # another made it first
            self._start(lsn(made))
            log.info(
                "made replication slot %s at %s", self.slot, made, extra={"action": "slot_made"}
            )
            return True

    async def drop(self) -> None:
        """Drop the slot (one whose changes cannot be decoded)."""
        await self._stop_stream()
        async with self._errors() as conn:
            await self._drop(conn)

    async def _drop(self, conn: psycopg.AsyncConnection[Any]) -> None:
        with contextlib.suppress(pgerrors.UndefinedObject):
            await conn.execute(pyformat(query("wal_drop_slot")), {"slot": self.slot})

    async def _scalar(self, conn: psycopg.AsyncConnection[Any], name: str) -> Any:
        cursor = await conn.execute(pyformat(query(name)), {"slot": self.slot})
        row = await cursor.fetchone()
        return None if row is None else row[0]

    def _start(self, position: int) -> None:
        self.confirmed = self.read_upto = position

    async def _stop_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.stop()

    # -- reading and moving ---------------------------------------------------

    async def peek(self) -> Peek:
        """The transactions committed into the outbox that the stream
        brought since the last peek (those handed on before are left out),
        and the position up to which it brought every commit. Starts the
        stream (from the slot's confirmed position) when there is none."""
        stream = self._stream
        if stream is not None and stream.error is not None:
            self._stream = None
            await stream.stop()
            raise _stream_error(stream.error, self.slot)
        if stream is None or not stream.alive:
            await self._stop_stream()
            stream = self._stream = SlotStream(
                self.conninfo, self.slot, self.schema, self.on_commit
            )
            stream.confirm(self.confirmed)
            stream.start()
        transactions = [t for t in stream.take() if t.end_lsn > self.read_upto]
        if transactions:
            self.read_upto = transactions[-1].end_lsn
        return Peek(transactions, max(stream.upto, self.confirmed))

    async def advance(self, position: int) -> None:
        """Confirm the slot to `position` (never back): a status update on
        the stream, or with none running, pg_replication_slot_advance."""
        if position <= self.confirmed:
            return
        if self._stream is not None and self._stream.alive:
            self._stream.confirm(position)
        else:
            async with self._errors() as conn:
                await conn.execute(
                    pyformat(query("wal_advance")),
                    {"slot": self.slot, "lsn": lsn_text(position)},
                )
        self.confirmed = position
        self.read_upto = max(self.read_upto, position)

    async def lag(self) -> int | None:
        """The bytes of WAL the slot holds back (None: no slot)."""
        value = await self._one("wal_lag", slot=self.slot)
        return None if value is None else int(value)

    async def visible(self, xids: Sequence[int]) -> bool:
        """Whether the transactions `xids` are visible to a snapshot now."""
        return bool(await self._one("wal_visible", xids=list(xids)))

    async def still_pending(self, ids: Sequence[str]) -> set[str]:
        """Of `ids`, those whose rows are neither published nor dead."""
        if not ids:
            return set()
        async with self._errors() as conn:
            cursor = await conn.execute(pyformat(query("wal_still_pending")), {"ids": list(ids)})
            return {row[0] for row in await cursor.fetchall()}


class SlotUnreadable(SlotLost):
    """The slot gave bytes relay cannot decode: treated as a lost slot (the
    table drained, the slot made again), and logged as an error."""


# SQLSTATEs of a stream that cannot go on with this slot: it does not exist
# (dropped), it cannot be read any more (invalidated), its publication is gone.
_LOST = {"42704", "55000"}


def _stream_error(error: BaseException, slot: str) -> Exception:
    """relay's error for why the stream ended."""
    if isinstance(error, PgoutputError):
        return SlotUnreadable(f"replication slot {slot}: {error}")
    if isinstance(error, StreamError) and error.sqlstate in _LOST:
        return SlotLost(f"{error} ({error.sqlstate})")
    return DatabaseUnavailable(f"replication stream of slot {slot}: {describe(error)}")
