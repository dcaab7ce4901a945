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
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from relay.backoff import reconnect_backoff, sleep_unless, until_available
from relay.brokers import Consumer, Incoming
from relay.errors import Refused, Unavailable
from relay.pacing import Gate
from relay.rows import NewInboxRow
from relay.storable import last_resort, to_row, without_payload

log = logging.getLogger("relay.inbox")

# How long the receiver waits to fill a batch once a message has arrived.
BATCH_WAIT = 0.005

# (messages received, rows new to the table, new rows stored as dead,
# messages whose body was fetched from S3 by claim check, bytes fetched)
Report = Callable[[int, int, int, int, int], None]


# What wiring puts after the stage, for every broker: the messages as their
# rows should hold them (relay.cloudevents.received: an event's id, source,
# type and attributes), each other message as it is.
Envelope = Callable[[Sequence[Incoming]], list[Incoming]]


class Writer(Protocol):
    """Where the receiver's batches go: relay.db.writer.InboxWriter's one
    INSERT (--dispatch stored), or relay.inbox.Handing's receiving
    transactions, which handle the rows as they store them."""

    async def insert(self, consumer: str, batch: Sequence[NewInboxRow]) -> set[str]:
        """Store the batch; the ids that were new. Raises Refused for a value
        PostgreSQL will not take, Unavailable while the database is away."""

    async def close(self) -> None: ...


class Stage(Protocol):
    """What wiring puts between the consumer's batches and their rows: the
    claim check's (relay.claimcheck.inbound.Inbound), whichever the broker."""

    def parts(self, batch: Sequence[Incoming]) -> list[Sequence[Incoming]]:
        """The batch in the parts to store one after the other."""

    async def resolve(self, part: Sequence[Incoming]) -> tuple[list[Incoming], int, int]:
        """The part's messages as their rows are built from them; how many
        bodies were fetched, and how many bytes. Raises Unavailable while
        what it fetches from cannot be reached."""

    async def close(self) -> None: ...


# --------------------------------------------------------------------------
# Messages to rows
# --------------------------------------------------------------------------


# relay.storable turns each received message into one row, whatever it holds.


# --------------------------------------------------------------------------
# The inbox table
# --------------------------------------------------------------------------

# The receiver's INSERT and its connection are relay.db.writer's (no
# SQLAlchemy there either).


# --------------------------------------------------------------------------
# The receiver
# --------------------------------------------------------------------------


class Receiver:
    """Broker → inbox table, acknowledging only what is committed."""

    def __init__(
        self,
        writer: Writer,
        consumer: Consumer,
        pace: Gate,
        report: Report,
        *,
        consumer_name: str,
        batch_size: int,
        stage: Stage | None = None,
        envelope: Envelope | None = None,
    ) -> None:
        self.writer = writer
        self.consumer = consumer
        self.pace = pace
        self.report = report
        self.consumer_name = consumer_name  # the inbox rows' consumer
        self.batch_size = batch_size
        self.stage = stage
        self.envelope = envelope
        self.stopping = asyncio.Event()
        self.reconnect = reconnect_backoff()

    async def close(self) -> None:
        if self.stage is not None:
            await self.stage.close()

    def stop(self) -> None:
        self.stopping.set()
        self.pace.release()

    async def run(self) -> None:
        await until_available(self._consume, self.stopping, self.reconnect, log)

    async def _consume(self) -> None:
        batches = self.consumer.batches(self.batch_size, BATCH_WAIT)
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
        """Resolve the batch through the stage (the claim check's: the bodies
        of pointers fetched), insert and commit, then acknowledge. Holds on
        to the batch (unacked) while S3 or the database is away, unless
        stopping.

        The stage may split the batch in parts (the claim check's hold at
        most relay.claimcheck.inbound.FETCHED_AT_ONCE pointers, and at most
        a quarter of --batch-bytes of declared sizes, relay.budget, so that
        no more large bodies than that are in memory at once); the batch
        is acknowledged once every part is committed."""
        stored: list[NewInboxRow] = []
        new: set[str] = set()
        fetched = fetched_bytes = 0
        parts = self.stage.parts(batch) if self.stage is not None else [batch]
        for part in parts:
            resolved, count, size = await self._resolve(part)
            if self.envelope is not None:
                resolved = self.envelope(resolved)
            fetched, fetched_bytes = fetched + count, fetched_bytes + size
            rows = [to_row(m) for m in resolved]
            new |= await self._store(resolved, rows)
            if len(parts) == 1:  # the usual case: nothing to let go of early
                stored = rows
                break
            # What the report needs, not the large bodies.
            stored += [dataclasses.replace(row, payload=None, body=None) for row in rows]
            del resolved, rows
        await self.consumer.ack(batch)
        dead = 0
        for row in stored:
            if row.status == "dead" and row.message_id in new:
                dead += 1
                log.warning(
                    "stored as dead: %s",
                    row.last_error,
                    extra={
                        "action": "received_dead",
                        "message_id": row.message_id,
                        "topic": row.topic,
                    },
                )
        self.report(len(stored), len(new), dead, fetched, fetched_bytes)

    async def _store(self, batch: Sequence[Incoming], rows: list[NewInboxRow]) -> set[str]:
        """_insert, waiting out a database that is away (unless stopping)."""
        failures = 0
        while True:
            try:
                return await self._insert(batch, rows)
            except Unavailable as exc:
                if self.stopping.is_set():
                    raise
                failures += 1
                delay = self.reconnect.delay(failures)
                log.warning(
                    "cannot store %d received messages: %s; retrying in %.1fs",
                    len(rows),
                    exc,
                    delay,
                    extra={"action": "store_wait"},
                )
                await sleep_unless(self.stopping, delay)

    async def _resolve(self, batch: Sequence[Incoming]) -> tuple[list[Incoming], int, int]:
        """The stage's resolve, waiting out an S3 that cannot be reached (as
        a database that is away: nothing is stored dead for it)."""
        if self.stage is None:
            return list(batch), 0, 0
        failures = 0
        while True:
            try:
                return await self.stage.resolve(batch)
            except Unavailable as exc:
                if self.stopping.is_set():
                    raise
                failures += 1
                delay = self.reconnect.delay(failures)
                log.warning(
                    "cannot fetch claim checked bodies: %s; retrying in %.1fs",
                    exc,
                    delay,
                    extra={"action": "claim_check_wait"},
                )
                await sleep_unless(self.stopping, delay)

    async def _insert(self, batch: Sequence[Incoming], rows: list[NewInboxRow]) -> set[str]:
        """Store the rows; a row PostgreSQL refuses (one statement fails for
        all) is stored again by itself, and if refused again, as a dead row
        of what cannot be refused (relay.storable.last_resort). Replaces the
        refused rows in `rows`, so that the report counts what was stored."""
        consumer = self.consumer_name
        try:
            return await self.writer.insert(consumer, rows)
        except Refused as exc:
            new = set(exc.stored)  # by other parts of the batch (Handing)
        for index, (message, row) in enumerate(zip(batch, rows, strict=True)):
            try:
                new |= await self.writer.insert(consumer, [row])
            except Refused as exc:
                refused = str(exc)
            else:
                continue
            for kept in (
                without_payload(row, message, refused),
                last_resort(row, message, refused),
            ):
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
