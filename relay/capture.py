"""Capture from the WAL (`relay outbox --capture wal`): the outbox learns of
committed rows from a logical replication slot instead of polling.

WalCapture looks at the slot's stream (relay.db.slot.SlotReader) whenever
it brings a commit (or a commit's notification wakes it), and hands the
rows of each committed transaction,
in commit order, to the outbox loop's batch (OutboxRelay.publish_batch
with their ids: fetched by id, published, marked). The table stays the
truth: the slot is confirmed past a transaction only once every row of it
and of every transaction before it is `published` or `dead`, and what the
slot does not bring (rows that failed and wait for their next attempt,
rows delayed by `available_at`, rows committed while no slot was read, a
retried row) the loop's own claim publishes: its idle workers claim at
--poll-interval while the table may hold such rows (claims_due), and not
otherwise. A slot dropped or invalidated under
the reader loses nothing: it is logged, made again, the table drained by
the claim, and reading goes on. One process reads a slot (the reader's
lock, relay.db.slot); the others stand by and take over when it goes.

Idle, the reader asks the database for nothing but the slot's lag every
STATUS_INTERVAL; the stream's status updates confirm the slot to the
server's position, so that a quiet outbox does not hold back the WAL that
other databases of the server write. docs/wal-capture.md has the reasons
and the measurements.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from relay.backoff import reconnect_backoff, sleep_unless, wait_to_reconnect
from relay.db import SlotLost, SlotReader, SlotUnreadable, Transaction
from relay.errors import BrokerUnavailable, ShareBusy, Unavailable
from relay.metrics import OutboxMetrics
from relay.outbox import WORKERS, OutboxRelay
from relay.workers import BLOCKED_RETRY

log = logging.getLogger("relay.outbox")

# The outbox loop's session the slot's rows are published on: one past its
# workers' (relay.outbox.WORKERS).
WAL_WORKER = WORKERS
# How often an idle reader confirms its slot to the server's position (and
# reads the lag): PostgreSQL's own wal_receiver_status_interval.
STATUS_INTERVAL = 10.0
# How many times a batch of the slot's rows asks for the keys' shares held
# by the claim's workers before it leaves the rows to the claim.
SHARE_TRIES = 20
# How many times a read's transactions are asked after until they are
# visible (a commit is in the WAL before its rows are), and the wait
# before the next time (times the tries so far).
VISIBLE_TRIES = 20
VISIBLE_WAIT = 0.001
# A pending row older than this (or twice --poll-interval) is one the slot
# will not bring: the claim runs (WalCapture.claims_due); three runs of the
# gauges' job (relay.maintenance.GAUGE_INTERVAL).
STALE_AFTER = 15.0


class WalCapture:
    """The slot's reader beside an OutboxRelay (`relay`), which publishes
    the rows and whose idle workers' claim this governs (poll_due)."""

    def __init__(
        self,
        relay: OutboxRelay,
        reader: SlotReader,
        metrics: OutboxMetrics,
        *,
        poll_interval: float,
        batch_size: int,
    ) -> None:
        self.relay = relay
        self.reader = reader
        self.metrics = metrics
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.reading = False
        # Delivered transactions not yet all published or dead, in commit order.
        self._inflight: deque[Transaction] = deque()
        # Whether some were left so by the last round (not: are in its hands).
        self._left = False
        # Until when the claim runs whatever the table holds (the drain).
        self._owed_until = -float("inf")
        # The age past which a pending row is one the slot will not bring.
        self.stale_after = max(2 * poll_interval, STALE_AFTER)
        self._wakeup = asyncio.Event()
        self._lag_at = -float("inf")
        # Whether this process has read the slot: one it then has to make
        # again was lost (and is logged so, once).
        self._had_slot = False
        relay.poll_due = self.claims_due
        reader.on_commit = self.wake  # the stream brought a commit (or ended)

    def wake(self) -> None:
        """A commit's notification (the listener's wake-up)."""
        self._wakeup.set()

    def claims_due(self) -> bool:
        """Whether the outbox loop's idle workers claim at their interval:
        while the table may hold pending rows the slot will not bring. That
        is, for one interval after the reading began (the drain of what was
        committed before), while rows the slot brought wait (failed,
        delayed, held behind their key), and while the table's oldest
        pending row is older than the slot would have left it (a row failed
        or delayed before, retried, or committed while no one read the
        slot): the `/metrics` gauge of the scheduled job, read here, not asked."""
        if not self.reading:
            return False
        if self._left or time.monotonic() < self._owed_until:
            return True
        oldest = self.metrics.registry.get_sample_value("relay_outbox_oldest_pending_seconds")
        return oldest is not None and oldest > self.stale_after

    async def run(self) -> None:
        """Stand by for the slot, read it until stopped; ConfigError (exit 2)
        for a server or role that cannot have one."""
        stopping = self.relay.stopping
        backoff = reconnect_backoff()
        failures = 0
        checked = False
        self.metrics.slot_active.set(0)
        while not stopping.is_set():
            try:
                if not checked:
                    await self.reader.check()
                    checked = True
                if not await self.reader.stand_by():
                    self._stand_by()
                    self.relay.last_progress = time.monotonic()  # standing by is its work
                    continue
                if not self.reading:
                    await self._start()
                await self._round()
                # Idle, the claim makes no progress to show: the reads do.
                self.relay.last_progress = time.monotonic()
                failures = 0
                await self._wait()
            except SlotLost as exc:
                log.warning(
                    "replication slot %s lost (%s): draining the table, making it again",
                    self.reader.slot,
                    exc,
                    extra={"action": "slot_lost"},
                )
                if isinstance(exc, SlotUnreadable):
                    await self.reader.drop()
                self._had_slot = False  # said: not again when it is made
                self._stand_by()
            except BrokerUnavailable as exc:
                # The rows read stay pending, the slot before them; the
                # claim publishes them once the broker is back.
                self._left = True
                failures += 1
                await wait_to_reconnect(exc, failures, backoff, stopping, log)
            except Unavailable as exc:
                self._stand_by()
                failures += 1
                await wait_to_reconnect(exc, failures, backoff, stopping, log)
        self._stand_by()
        await self.reader.close()

    def _stand_by(self) -> None:
        self.reading = False
        self._inflight.clear()
        self._left = False
        self.metrics.slot_active.set(0)

    async def _start(self) -> None:
        """The reader's lock is ours: make the slot where missing, then let
        the claim drain what the table holds (rows committed before the
        slot's position, or while no one read it)."""
        made = await self.reader.prepare()
        if made and self._had_slot:
            # Gone between two reads (dropped while the stream was down, or
            # with it): no read failed on its absence, so it is said here.
            log.warning(
                "replication slot %s lost (gone when reading resumed): "
                "draining the table, making it again",
                self.reader.slot,
                extra={"action": "slot_lost"},
            )
        self._had_slot = True
        self.reading = True
        self._owe()
        self._inflight.clear()
        self.metrics.slot_active.set(1)
        log.info(
            "reading replication slot %s%s",
            self.reader.slot,
            " (new)" if made else "",
            extra={"action": "slot_reading"},
        )
        self.relay.wake()

    def _owe(self) -> None:
        """The claim takes what the table holds, for one interval."""
        self._owed_until = time.monotonic() + self.poll_interval

    async def _wait(self) -> None:
        """Until a notification, or the next status (sooner while rows the
        slot brought wait)."""
        interval = self.poll_interval if self._left else STATUS_INTERVAL
        await sleep_unless(self._wakeup, interval)

    async def _round(self) -> None:
        """Take what the stream brought: publish it, then confirm the slot
        as far as every row before is published or dead."""
        self._wakeup.clear()
        peek = await self.reader.peek()
        ids = [row_id for t in peek.transactions for row_id, _ in t.rows]
        fresh = not self._inflight
        self._inflight.extend(peek.transactions)
        left: set[str] = set()
        if ids:
            await self._until_visible([t.xid for t in peek.transactions if t.rows])
            for at in range(0, len(ids), self.batch_size):
                await self._publish(ids[at : at + self.batch_size])
            left = await self.reader.still_pending(ids)
        await self._confirm(peek.upto, left if fresh else None)

    async def _until_visible(self, xids: list[int]) -> None:
        """Wait (briefly) until the read's transactions are visible: a
        commit is in the WAL a moment before other sessions see its rows,
        and a claim then would leave them to the claim, out of commit order."""
        for tries in range(VISIBLE_TRIES):
            if await self.reader.visible(xids):
                return
            await asyncio.sleep(VISIBLE_WAIT * (tries + 1))

    async def _publish(self, ids: list[str]) -> None:
        tries = 0
        while not self.relay.stopping.is_set():
            try:
                await self.relay.publish_batch(WAL_WORKER, 1, every_key=True, ids=ids)
            except ShareBusy:
                # A worker of the claim holds a share of the keys: its batch
                # ends in milliseconds; after long, the claim gets these too.
                tries += 1
                if tries >= SHARE_TRIES:
                    self._owe()
                    return
                await asyncio.sleep(BLOCKED_RETRY)
                continue
            self.relay.last_progress = time.monotonic()
            if not self.relay.stopped_short(WAL_WORKER):
                return  # (rows left out stay pending: _confirm sees them)

    def _compact(self, pending: set[str]) -> None:
        """Keep of the transactions behind a held one only what the slot's
        move needs: each one's rows still pending, and of a run of finished
        ones the last's position. What relay holds then grows with the rows
        left to the claim, not with what committed after them (a row
        delayed by a day holds the slot that long, not a day of ids)."""
        kept: deque[Transaction] = deque()
        for transaction in self._inflight:
            rows = [row for row in transaction.rows if row[0] in pending]
            if not rows and kept and not kept[-1].rows:
                kept[-1] = Transaction(transaction.end_lsn, [], transaction.xid)
            else:
                kept.append(Transaction(transaction.end_lsn, rows, transaction.xid))
        self._inflight = kept

    async def _confirm(self, upto: int, pending: set[str] | None) -> None:
        """Move the slot past the delivered transactions whose rows (and
        every earlier one's) are all published or dead; to `upto` (what the
        read covered) when none is left. `pending`: of the delivered rows,
        those still pending, if known."""
        position = None
        if self._inflight:
            if pending is None:
                pending = await self.reader.still_pending(
                    [row_id for t in self._inflight for row_id, _ in t.rows]
                )
            while self._inflight and not any(r in pending for r, _ in self._inflight[0].rows):
                position = self._inflight.popleft().end_lsn
            self._compact(pending)
        if not self._inflight:
            position = upto
        self._left = bool(self._inflight)
        if position is not None:
            await self.reader.advance(position)
        now = time.monotonic()
        if now - self._lag_at >= 1.0:
            self._lag_at = now
            lag = await self.reader.lag()
            if lag is not None:
                self.metrics.slot_lag_bytes.set(lag)
