"""The replication protocol's stream of a logical slot, read by a thread.

psycopg 3 has no replication client (its `cursor.copy()` refuses
COPY_BOTH), so this drives libpq through `psycopg.pq` on a
`replication=database` connection: `START_REPLICATION SLOT … LOGICAL`,
then CopyData messages both ways (PostgreSQL's "Streaming Replication
Protocol"):

- from the server, XLogData `w` (start LSN, end of WAL, send time: three
  int64, then one pgoutput message, decoded by relay.db.pgoutput) and
  the primary keepalive `k` (end of WAL, send time, reply requested);
- to the server, the standby status update `r` (written, flushed and
  applied LSN, send time, reply requested): the slot's confirmed position.

The walsender decodes each WAL record once and keeps its decoding session;
the SQL functions (pg_logical_slot_peek_binary_changes) decoded from the
slot's restart_lsn at every call (docs/wal-capture.md has both measured).

The thread hands each committed transaction to the event loop's side
through a deque and calls `on_commit` there (call_soon_threadsafe); the
loop's side confirms positions with `confirm()`, which the thread sends.
A status goes out at least every STATUS_SECONDS (the walsender drops a
client silent for wal_sender_timeout) and at once when the server asks.
"""

from __future__ import annotations

import asyncio
import collections
import select
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import pq

from relay.db import connect as pg
from relay.db.pgoutput import Inserts, PgoutputError, Transaction

# Between two standby status updates at most (PostgreSQL's own
# wal_receiver_status_interval), far inside wal_sender_timeout's 60 s.
STATUS_SECONDS = 10.0
# How long the thread waits for the socket before it looks at what the loop
# asked (a position to confirm, a stop).
TICK = 0.05
_XLOG_HEADER = 25  # `w`, dataStart, walEnd, sendTime
_KEEPALIVE = struct.Struct(">QqB")
_STATUS = struct.Struct(">QQQqB")


class StreamError(Exception):
    """The stream ended: `sqlstate` (None: the connection broke) and why."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class SlotStream:
    """One START_REPLICATION of `slot` (publication of the same name) for
    the outbox table in `schema`, from the slot's confirmed position."""

    def __init__(
        self,
        conninfo: str,
        slot: str,
        schema: str,
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.slot = slot
        self.schema = schema
        self.on_commit = on_commit
        self._loop = asyncio.get_running_loop()
        self._received: collections.deque[Transaction] = collections.deque()
        # Every commit up to here was handed over (a Commit's end, or a
        # keepalive's end of WAL with no transaction open).
        self.upto = 0
        self._confirm = 0
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"relay-slot-{slot}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def take(self) -> list[Transaction]:
        """The transactions received since the last take(), in commit order."""
        taken = []
        while self._received:
            taken.append(self._received.popleft())
        return taken

    def confirm(self, position: int) -> None:
        """Report the slot confirmed to `position` (sent by the thread)."""
        self._confirm = max(self._confirm, position)

    async def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 5.0)

    # -- the thread -------------------------------------------------------------

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            settings: dict[str, Any] = {
                "replication": "database",
                "application_name": pg.APPLICATION_NAME,
                "connect_timeout": pg.CONNECT_TIMEOUT,
            }
            password = pg.current_password()
            if password is not None:
                settings["password"] = password
            conn = psycopg.connect(self.conninfo, autocommit=True, **settings)
            self._stream(conn.pgconn)
        except BaseException as exc:  # handed to the loop's side (SlotReader.peek)
            self.error = exc
        finally:
            if conn is not None:
                try:
                    conn.close()
                except Exception:  # noqa: S110 - closing a connection that broke
                    pass
            if self.on_commit is not None and not self._stop.is_set():
                self._loop.call_soon_threadsafe(self.on_commit)  # the loop notices the end

    def _stream(self, pgconn: Any) -> None:
        options = f"proto_version '1', publication_names '{self.slot}'"
        pgconn.send_query(f"START_REPLICATION SLOT {self.slot} LOGICAL 0/0 ({options})".encode())
        result = pgconn.get_result()
        if result is None or result.status != pq.ExecStatus.COPY_BOTH:
            raise _failed(pgconn, result)
        inserts = Inserts(self.schema, "outbox")
        sent = self._confirm
        sent_at = time.monotonic()
        while not self._stop.is_set():
            nbytes, data = pgconn.get_copy_data(1)
            if nbytes > 0:
                reply = self._message(bytes(data), inserts)
                if reply or self._confirm > sent:
                    sent, sent_at = self._status(pgconn), time.monotonic()
                continue
            if nbytes == -1:  # the server ended the COPY
                raise _failed(pgconn, pgconn.get_result())
            if nbytes < -1:
                raise _failed(pgconn, None)
            if self._confirm > sent or time.monotonic() - sent_at >= STATUS_SECONDS:
                sent, sent_at = self._status(pgconn), time.monotonic()
            ready, _, _ = select.select([pgconn.socket], [], [], TICK)
            if ready:
                pgconn.consume_input()

    def _message(self, data: bytes, inserts: Inserts) -> bool:
        """Take one CopyData message; whether the server asks for a status."""
        kind = data[:1]
        if kind == b"w":
            done = inserts.feed_bytes(data[_XLOG_HEADER:])
            if done is not None:
                self._received.append(done)
                self.upto = max(self.upto, done.end_lsn)
                if done.rows and self.on_commit is not None:
                    self._loop.call_soon_threadsafe(self.on_commit)
            return False
        if kind == b"k":
            wal_end, _, reply = _KEEPALIVE.unpack_from(data, 1)
            if not inserts.open:
                self.upto = max(self.upto, wal_end)
            return bool(reply)
        raise PgoutputError(f"unknown replication message {kind!r}")

    def _status(self, pgconn: Any) -> int:
        position = self._confirm
        pgconn.put_copy_data(b"r" + _STATUS.pack(position, position, position, 0, 0))
        pgconn.flush()
        return position


def _failed(pgconn: Any, result: Any) -> StreamError:
    if result is not None and result.status == pq.ExecStatus.COMMAND_OK:
        return StreamError("the server ended the replication stream")
    sqlstate = None
    message = pgconn.error_message.decode(errors="replace").strip()
    if result is not None:
        code = result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = code.decode() if code else None
        text = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        message = text.decode(errors="replace") if text else message
    return StreamError(message or "the replication connection broke", sqlstate)
