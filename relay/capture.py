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
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from relay.backoff import reconnect_backoff, sleep_unless, wait_to_reconnect
from relay.db import SlotLost, SlotReader, SlotUnreadable, Transaction
from relay.errors import BrokerUnavailable, ShareBusy, Unavailable
from relay.metrics import OutboxMetrics
from relay.outbox import WORKERS, ClaimedBatch, OutboxRelay
from relay.workers import BLOCKED_RETRY

log = logging.getLogger("relay.outbox")

# The outbox loop's sessions the slot's rows are published on: the two past
# its workers' (relay.outbox.WORKERS). One batch is claimed on the one while
# the batch before it goes out on the other.
WAL_WORKERS = (WORKERS, WORKERS + 1)
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
# How long a round takes the stream's new rows behind the ones it sends
# before it ends, confirms the slot and reads the lag: under a steady load
# the slot is confirmed at least this often.
ROUND_SECONDS = 1.0


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
        """Take what the stream brought: publish it, and what it brings
        meanwhile (for up to ROUND_SECONDS), then confirm the slot as far
        as every row before is published or dead."""
        fresh = not self._inflight
        read: list[str] = []  # the ids this round took, in commit order
        upto = 0

        async def take() -> list[str]:
            """What the stream brought since the last take, visible."""
            nonlocal upto
            self._wakeup.clear()
            peek = await self.reader.peek()
            upto = peek.upto
            self._inflight.extend(peek.transactions)
            ids = [row_id for t in peek.transactions for row_id, _ in t.rows]
            if ids:
                await self._until_visible([t.xid for t in peek.transactions if t.rows])
                read.extend(ids)
            return ids

        ids = await take()
        left: set[str] = set()
        if ids:
            deadline = time.monotonic() + ROUND_SECONDS

            async def more() -> list[str]:
                return await take() if time.monotonic() < deadline else []

            if not await self._publish_all(ids, more):
                left = await self.reader.still_pending(read)
        await self._confirm(upto, left if fresh else None)

    async def _until_visible(self, xids: list[int]) -> None:
        """Wait (briefly) until the read's transactions are visible: a
        commit is in the WAL a moment before other sessions see its rows,
        and a claim then would leave them to the claim, out of commit order."""
        for tries in range(VISIBLE_TRIES):
            if await self.reader.visible(xids):
                return
            await asyncio.sleep(VISIBLE_WAIT * (tries + 1))

    async def _publish_all(
        self, ids: list[str], more: Callable[[], Awaitable[list[str]]] | None = None
    ) -> bool:
        """Publish the read's rows in commit order, a batch at a time, each
        batch claimed (on the other of WAL_WORKERS' sessions) while the one
        before it goes out, and sent once that one went out whole (every
        row published: none failed, held back or left by the byte budget).
        Otherwise the batch claimed ahead is rolled back and claimed again
        once the one before is marked, as the claim would see it: the
        claim's per-key rules then hold exactly as for one batch at a time.
        A batch's mark runs while the next batch goes out.

        `more`: asked, while the last batch known goes out, for the rows
        committed since (in commit order, visible), which then follow it as
        a batch claimed ahead would: the stream's rows go out back to back,
        not a read at a time with the claim, the mark and the confirm
        between (at 1,400 msgs/s of one-row transactions a read was 15 rows
        and 9 ms, and a row waited for the read before its own).

        Whether every row (of `ids` and of what `more` gave) is now
        published, each batch having gone out whole and been marked: then
        no one need ask the table which are still pending (a round trip a
        read, the latency's share)."""
        size = self.batch_size * WORKERS
        chunks = [ids[at : at + size] for at in range(0, len(ids), size)]
        relay = self.relay
        loop = asyncio.get_running_loop()
        at = 0
        turn = 0  # which of WAL_WORKERS claims the batch at `at`
        ahead: ClaimedBatch | None = None  # the next batch, claimed already
        marking: asyncio.Task[tuple[int, int]] | None = None  # the batch before's
        sending: asyncio.Task[tuple[int, int]] | None = None
        whole = True  # every batch so far claimed entire and sent whole
        try:
            while at < len(chunks) and not relay.stopping.is_set():
                batch, ahead = ahead, None
                if batch is None:
                    if marking is not None:
                        await marking
                        marking = None
                    batch = await self._claim(WAL_WORKERS[turn], chunks[at])
                    if batch is None:  # left to the claim (its shares stayed busy)
                        whole = False
                        at += 1
                        continue
                settled: asyncio.Future[bool] = loop.create_future()
                sending = asyncio.create_task(relay.send_batch(batch, settled.set_result))
                if marking is not None:  # on the session the next claim takes
                    await marking
                    marking = None
                if at + 1 == len(chunks) and more is not None:
                    new = await more()
                    chunks += [new[n : n + size] for n in range(0, len(new), size)]
                if at + 1 < len(chunks):
                    ahead = await self._claim(
                        WAL_WORKERS[1 - turn], chunks[at + 1], before=chunks[at]
                    )
                await asyncio.wait((settled, sending), return_when=asyncio.FIRST_COMPLETED)
                relay.last_progress = time.monotonic()
                if settled.done() and settled.result():
                    # Whole: all it claimed went out; entire: it claimed
                    # every row asked (none published already, none due later).
                    whole = whole and len(batch.rows) == len(chunks[at])
                    marking, sending = sending, None
                    at += 1
                    turn = 1 - turn
                    continue
                whole = False
                if ahead is not None:
                    await relay.abandon(ahead)
                    ahead = None
                current, sending = sending, None
                await current
                if not relay.stopped_short(batch.worker):
                    at += 1  # else the same rows again: those the budget left
            for task in (sending, marking):
                if task is not None:
                    await task
            sending = marking = None
            return whole and at >= len(chunks)
        finally:
            # Stopped or broken: nothing claimed stays held, and what was
            # sent is marked where it still can be.
            if ahead is not None:
                await relay.abandon(ahead)
            for task in (sending, marking):
                if task is not None:
                    with contextlib.suppress(BaseException):
                        await task

    async def _claim(
        self, worker: int, ids: list[str], before: list[str] | None = None
    ) -> ClaimedBatch | None:
        """Claim the rows of `ids` on `worker`'s session. A worker of the
        claim may hold a share of the keys: its batch ends in milliseconds,
        so the first claim of a batch asks again, and after long leaves the
        rows to the claim (None); one claimed ahead (`before` given) does
        not wait: None, and it is claimed again in its turn."""
        tries = 0
        while not self.relay.stopping.is_set():
            try:
                return await self.relay.claim_batch(
                    worker, 1, every_key=True, ids=ids, before=before
                )
            except ShareBusy:
                tries += 1
                if before is not None:
                    return None
                if tries >= SHARE_TRIES:
                    self._owe()
                    return None
                await asyncio.sleep(BLOCKED_RETRY)
        return None

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
