"""The inbox's receiver: broker → inbox table, acknowledging only what is committed.

The receiver takes batches from the broker, inserts them in one statement
with ON CONFLICT DO NOTHING (the producer's id is the dedup key), and only
after that commit acknowledges them.

`relay inbox` runs it in a child process of its own, `relay demo` on its
own event loop: that plumbing is relay.receiver_process. Either way this
module loads neither SQLAlchemy nor handler code, so the child stays small.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import orjson
import psycopg

from relay import pg
from relay.backoff import reconnect_backoff, sleep_unless, until_available
from relay.brokers import Consumer, Incoming
from relay.config import InboxSettings
from relay.errors import DatabaseUnavailable, Refused, Unavailable
from relay.pacing import Gate
from relay.rows import NewInboxRow
from relay.storable import last_resort, to_row, without_payload

log = logging.getLogger("relay.inbox")

# How long the receiver waits to fill a batch once a message has arrived.
BATCH_WAIT = 0.005

# (messages received, rows new to the table, new rows stored as dead)
Report = Callable[[int, int, int], None]


# --------------------------------------------------------------------------
# Messages to rows
# --------------------------------------------------------------------------


# relay.storable turns each received message into one row, whatever it holds.


# --------------------------------------------------------------------------
# The inbox table
# --------------------------------------------------------------------------

# One statement per received batch, which travels as one JSON array of
# objects (a text array per column cost the receiver much of its CPU in
# psycopg's array quoting; docs/performance.md). Duplicates (same consumer and producer id, in
# the table or earlier in the batch) are skipped; RETURNING tells which rows
# are new. A raw body (not JSON) comes base64-encoded. The rest of relay's
# SQL is in relay.store, which this process does without.
INSERT_INBOX = """
INSERT INTO inbox (consumer, message_id, topic, key, type, payload, body, headers,
                   status, last_error, raw_properties)
SELECT %(consumer)s, m.message_id, m.topic, m.key, m.type, m.payload,
       decode(m.body, 'base64'), m.headers, m.status, m.last_error,
       CAST(m.raw_properties AS json)
FROM json_to_recordset(%(rows)s::json)
     AS m(message_id text, topic text, key text, type text, payload jsonb, body text,
          headers jsonb, status text, last_error text, raw_properties text)
ON CONFLICT (consumer, message_id) DO NOTHING
RETURNING message_id
"""


def rows_json(batch: Sequence[NewInboxRow]) -> str:
    """A received batch as the JSON array INSERT_INBOX reads. Payloads and
    headers are JSON texts already (checked when received): they go in as
    they are."""
    return orjson.dumps([
        {
            "message_id": m.message_id, "topic": m.topic, "key": m.key, "type": m.type,
            "payload": None if m.payload is None else orjson.Fragment(m.payload),
            "body": None if m.body is None else base64.b64encode(m.body).decode(),
            "headers": orjson.Fragment(m.headers), "status": m.status,
            "last_error": m.last_error,
            # As a string: json_to_recordset would unescape a nested \u0000.
            "raw_properties": m.raw_properties,
        }
        for m in batch
    ]).decode()


def _refused_by_content(exc: BaseException) -> bool:
    if isinstance(exc, (psycopg.DataError, psycopg.errors.ProgramLimitExceeded)):
        return True
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate.startswith(("22", "54"))


class InboxWriter:
    """Inserts received batches on one autocommit connection of psycopg's
    (one statement, one round trip), opened on first use and after a break."""

    def __init__(self, database_url: str) -> None:
        self.conninfo = pg.libpq_url(database_url)
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def insert(self, consumer: str, batch: Sequence[NewInboxRow]) -> set[str]:
        """Insert a batch; returns the ids that were new. Raises Refused for a
        value PostgreSQL will not take, DatabaseUnavailable when it is away."""
        if not batch:
            return set()
        try:
            params = {"consumer": consumer, "rows": rows_json(batch)}
        except (orjson.JSONEncodeError, TypeError, ValueError) as exc:  # cannot happen
            raise Refused(f"the row could not be encoded: {exc}") from exc
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await pg.connect(self.conninfo)
            cursor = await self._conn.execute(INSERT_INBOX, params)
            return {row[0] for row in await cursor.fetchall()}
        except psycopg.Error as exc:
            if _refused_by_content(exc):
                first = str(exc).strip().splitlines()
                raise Refused(first[0] if first else type(exc).__name__) from exc
            await self._lost(exc)
        except OSError as exc:
            await self._lost(exc)

    async def _lost(self, exc: BaseException) -> NoReturn:
        """Any other failure is the server's or the connection's (gone, read
        only, out of disk): close the connection, raise DatabaseUnavailable,
        and the batch waits, unacknowledged."""
        await self.close()
        first = str(exc).strip().splitlines()
        raise DatabaseUnavailable(f"{type(exc).__name__}: {first[0] if first else ''}") from exc

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()


# --------------------------------------------------------------------------
# The receiver
# --------------------------------------------------------------------------


class Receiver:
    """Broker → inbox table, acknowledging only what is committed."""

    def __init__(
        self,
        settings: InboxSettings,
        writer: InboxWriter,
        consumer: Consumer,
        pace: Gate,
        report: Report,
    ) -> None:
        self.settings = settings
        self.writer = writer
        self.consumer = consumer
        self.pace = pace
        self.report = report
        self.stopping = asyncio.Event()
        self.reconnect = reconnect_backoff()

    def stop(self) -> None:
        self.stopping.set()
        self.pace.release()

    async def run(self) -> None:
        await until_available(self._consume, self.stopping, self.reconnect, log)

    async def _consume(self) -> None:
        batches = self.consumer.batches(self.settings.batch_size, BATCH_WAIT)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                await self.pace.wait(self.stopping)
                next_batch = asyncio.ensure_future(anext(batches))
                await asyncio.wait({next_batch, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not next_batch.done():
                    # Stopping: what was received and not stored is not
                    # acknowledged, so the broker delivers it again.
                    next_batch.cancel()
                    await asyncio.gather(next_batch, return_exceptions=True)
                    return
                batch = next_batch.result()
                await self.store_batch(batch)
        finally:
            stop.cancel()
            await batches.aclose()

    async def store_batch(self, batch: Sequence[Incoming]) -> None:
        """Insert and commit, then acknowledge. Holds on to the batch (unacked)
        while the database is away, unless stopping."""
        rows = [to_row(m) for m in batch]
        failures = 0
        while True:
            try:
                new = await self._insert(batch, rows)
                break
            except Unavailable as exc:
                if self.stopping.is_set():
                    raise
                failures += 1
                delay = self.reconnect.delay(failures)
                log.warning(
                    "cannot store %d received messages: %s; retrying in %.1fs",
                    len(rows), exc, delay, extra={"action": "store_wait"},
                )
                await sleep_unless(self.stopping, delay)
        await self.consumer.ack(batch)
        dead = 0
        for row in rows:
            if row.status == "dead" and row.message_id in new:
                dead += 1
                log.warning(
                    "stored as dead: %s", row.last_error,
                    extra={"action": "received_dead", "message_id": row.message_id,
                           "topic": row.topic},
                )
        self.report(len(rows), len(new), dead)

    async def _insert(self, batch: Sequence[Incoming], rows: list[NewInboxRow]) -> set[str]:
        """Store the rows; a row PostgreSQL refuses (one statement fails for
        all) is stored again by itself, and if refused again, as a dead row
        of what cannot be refused (relay.storable.last_resort). Replaces the
        refused rows in `rows`, so that the report counts what was stored."""
        consumer = self.settings.consumer_name
        try:
            return await self.writer.insert(consumer, rows)
        except Refused:
            pass
        new: set[str] = set()
        for index, (message, row) in enumerate(zip(batch, rows, strict=True)):
            try:
                new |= await self.writer.insert(consumer, [row])
            except Refused as exc:
                refused = str(exc)
            else:
                continue
            for kept in (without_payload(row, message, refused),
                         last_resort(row, message, refused)):
                try:
                    new |= await self.writer.insert(consumer, [kept])
                except Refused as exc:
                    refused = str(exc)
                    continue
                rows[index] = kept
                break
            else:  # relay.storable's last resort holds nothing PostgreSQL refuses
                raise RuntimeError(f"PostgreSQL refused even the last-resort row: {refused}")
        return new
