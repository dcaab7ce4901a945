"""The outbox relay: claim due rows, publish them, mark them, repeat.

Each worker runs claim → publish → mark inside one transaction, so the
row locks taken by `FOR UPDATE SKIP LOCKED` are the claim: a relay that
dies mid-batch releases them with its connection, and another relay
publishes those rows again (at least once, same message id).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from relay import tracing
from relay.backoff import (
    Backoff,
    reconnect_backoff,
    sleep_unless,
    until_available,
    wait_to_reconnect,
)
from relay.brokers import Outcome, Publisher
from relay.budget import Budget
from relay.config import DEFAULT_BATCH_BYTES
from relay.db import OutboxSession, Store
from relay.errors import BrokerUnavailable, ShareBusy, Unavailable
from relay.metrics import OutboxMetrics
from relay.rows import Failure, OutboxRow
from relay.workers import BLOCKED_RETRY, report_failure

log = logging.getLogger(__name__)

# Workers per relay. Most of a batch's time is spent waiting (for the
# claim, the broker's confirms, the commit), so while some wait others claim
# and publish; past four, more workers added little in the benchmark (the
# measurements are in docs/outbox.md). Each adds a connection and one batch
# to what a crash can publish twice.
WORKERS = 4
# Unroutable messages are logged once per topic per this many seconds.
UNROUTABLE_LOG_INTERVAL = 60.0


@dataclasses.dataclass
class ClaimedBatch:
    """A claimed batch (OutboxRelay.claim_batch): the worker whose session
    holds its transaction, the rows to publish, how many were left blocked,
    the bytes of the budget it holds, and whether the budget took every row
    it found (not: stopped short)."""

    worker: int
    session: OutboxSession
    rows: list[OutboxRow]
    blocked: int
    used: int
    whole: bool


class OutboxRelay:
    """The outbox loop, independent of which broker the Publisher speaks to.

    Given what wiring read from the settings: the claim's `batch_size`, the
    idle workers' `poll_interval`, `max_attempts` and `on_dead` for the
    marks, the failed attempts' `backoff`, and for log lines and spans the
    `exchange`, the broker's `messaging_system` (relay.brokers.Kind.system)
    and the spans' `destination` (the exchange, or None: each row's topic);
    the `budget` its workers' claims share (--batch-bytes, relay.budget)."""

    def __init__(
        self,
        store: Store,
        publisher: Publisher,
        metrics: OutboxMetrics | None = None,
        *,
        batch_size: int,
        poll_interval: float,
        max_attempts: int,
        on_dead: str,
        backoff: Backoff,
        exchange: str,
        messaging_system: str = "",
        destination: str | None = None,
        budget: Budget | None = None,
    ) -> None:
        self.store = store
        self.publisher = publisher
        self.metrics = metrics or OutboxMetrics()
        self.batch_size = batch_size
        self.poll_interval = poll_interval
        self.max_attempts = max_attempts
        self.on_dead = on_dead
        self.exchange = exchange
        self.messaging_system = messaging_system
        self.destination = destination
        self.backoff = backoff
        self.reconnect = reconnect_backoff()
        self._wakeups: dict[int, asyncio.Event] = {}  # by worker
        self._idle: set[int] = set()  # workers waiting for a notification
        self._scouts: set[int] = set()  # woken to claim every key's rows
        self._holding: dict[int, frozenset[int]] = {}  # the share locks each batch holds
        self._sessions: dict[int, OutboxSession] = {}
        # The bytes of claimed rows the relay holds, its workers' together
        # (relay.budget: wiring's, of --batch-bytes); what the last claim of
        # each worker stopped short of, a row its grant could not take.
        self.budget = budget or Budget(DEFAULT_BATCH_BYTES, WORKERS, self.metrics.claimed_bytes.set)
        self._need: dict[int, int | None] = {}
        self.stopping = asyncio.Event()
        # Whether idle workers claim at their poll interval (None: always).
        # Under --capture wal only while the table may hold rows the slot
        # will not deliver (relay.capture.WalCapture.claims_due): idle, the
        # relay claims nothing.
        self.poll_due: Callable[[], bool] | None = None
        self.last_progress = time.monotonic()
        # When the last claim of every key's due rows began (a scout's that
        # found no share held elsewhere): a poll sooner after it than the
        # poll interval would find nothing it did not (the shared poll of an
        # outbox of several sources, relay.db.listener.SharedListeners.poll).
        self.swept_at = -float("inf")
        # topic -> (when it was last logged, unroutable rows since)
        self._unroutable: dict[str, tuple[float, int]] = {}

    def wake(self) -> None:
        """Rows were committed (a notification). Each busy worker claims
        again after its batch; of the idle ones, one claims the due rows of
        every key (a scout) and the rest sleep on, so a quiet relay answers
        a notification with one claim rather than one per worker. While a
        scout's batch is in hand, no second scout starts: that one claims
        every key again after its batch (see _worker). A second scout's
        claim found the first's shares locked (ShareBusy) or the keys of
        its rows held (blocked), and woke every idle worker to wait in
        PostgreSQL for the share locks the first held until its commit:
        100 trickling sources kept dozens of sessions waiting on those
        locks and more idle in a transaction (docs/multi-source.md)."""
        busy_scout = any(worker not in self._idle for worker in self._scouts)
        scout = None if busy_scout else min(self._idle, default=None)
        if scout is not None:
            self._scouts.add(scout)
        for worker, event in self._wakeups.items():
            if worker == scout or worker not in self._idle:
                event.set()

    @property
    def settled(self) -> bool:
        """Read-only: every worker waits for a notification (or the poll) and
        none has been woken, so the relay holds no rows and claims nothing
        until something wakes it. For tests that wait for a quiet relay."""
        return len(self._idle) == WORKERS and not any(e.is_set() for e in self._wakeups.values())

    def _wake_idle(self) -> None:
        """A batch came back full: more rows wait, the idle workers help."""
        for worker in self._idle:
            self._wakeups[worker].set()

    def stop(self) -> None:
        self.stopping.set()
        for event in self._wakeups.values():
            event.set()

    async def close(self) -> None:
        """Close the workers' connections (after run() has returned)."""
        sessions, self._sessions = list(self._sessions.values()), {}
        for session in sessions:
            await session.close()

    async def publish_batch(
        self,
        worker: int = 0,
        workers: int = 1,
        *,
        every_key: bool = False,
    ) -> tuple[int, int]:
        """Claim, publish and mark one batch: the rows of `worker`'s share of
        the keys (of `workers` shares), or with every_key those of all keys,
        on the worker's own connection.

        Returns how many rows it published or failed, and how many it left
        for the worker that holds an earlier row of their key; a claim that
        stopped at the byte budget (--batch-bytes) counts as a full batch,
        more rows wait (self.stopped_short). Raises
        ShareBusy (nothing claimed) when the share's lock stayed held by
        another relay's worker, or with every_key when one share was held
        elsewhere: the locks, one per share across every relay, are how no
        two relays claim rows of the same keys at once."""
        batch = await self.claim_batch(worker, workers, every_key=every_key)
        if batch is None:
            return 0, 0  # stopping
        return await self.send_batch(batch)

    async def claim_batch(
        self,
        worker: int = 0,
        workers: int = 1,
        *,
        every_key: bool = False,
        ids: list[str] | None = None,
        before: list[str] | None = None,
    ) -> ClaimedBatch | None:
        """publish_batch's first half: the claim (None: stopping). Its
        transaction stays open until send_batch or abandon ends it.

        With `ids` (and every_key), the batch is those rows, as far as they
        are pending and due and no earlier row of their key holds them
        back, in the order given (a replication slot's commit order:
        relay.capture) rather than by seq; `before` are the rows of the
        batch sent ahead of this one, which hold none of these back
        (relay.db.OutboxSession.claim)."""
        session = self._sessions.get(worker)
        if session is None:
            session = self._sessions[worker] = self.store.outbox_session(self.on_dead, WORKERS)
        # A claim of every key leaves out the shares this relay's own
        # workers hold: their rows it skips, as one relay's workers always
        # did. (Not those of the sessions past the workers', a slot's
        # reader's: its two batches both take every share, shared.)
        held = (
            frozenset[int]().union(
                *(v for w, v in self._holding.items() if w != worker and w < WORKERS)
            )
            if every_key
            else frozenset()
        )
        grant = await self.budget.take(self._need.get(worker), self.stopping)
        if not grant:
            return None
        try:
            share = (0, 1) if every_key else (worker, workers)
            rows, blocked, used, need = await session.claim(
                len(ids) if ids is not None else self.batch_size,
                *share,
                held=held,
                budget=grant,
                alone=self.budget.alone(grant),
                ids=ids,
                before=before or (),
            )
        except BaseException:
            await session.abort()
            self.budget.claimed(grant, 0)
            raise
        self.budget.claimed(grant, used)
        self._need[worker] = need
        self._holding[worker] = (
            frozenset(range(WORKERS)) - held if every_key else frozenset({worker})
        )
        if ids is not None:
            # Commit order; per key it is seq order (the producers'
            # trigger draws a key's seq only once its earlier rows committed).
            place = {row_id: n for n, row_id in enumerate(ids)}
            rows.sort(key=lambda row: place.get(row.id, 0))
        return ClaimedBatch(worker, session, rows, blocked, used, need is None)

    async def abandon(self, batch: ClaimedBatch) -> None:
        """End a claimed batch unsent: its rows stay pending, as they were."""
        try:
            await batch.session.abort()
        finally:
            self._holding.pop(batch.worker, None)
            self._need.pop(batch.worker, None)
            self.budget.release(batch.used)

    async def send_batch(
        self, batch: ClaimedBatch, settled: Callable[[bool], None] | None = None
    ) -> tuple[int, int]:
        """publish_batch's second half: publish the claimed rows, mark them
        and commit. `settled`, if given, is told once the broker answered
        for every row, before the marks, whether the batch went out whole:
        every row published, none failed, held back or left by the budget
        (what lets the reader of a slot send its next batch: relay.capture)."""
        worker, session, rows = batch.worker, batch.session, batch.rows
        used = batch.used
        try:
            if not rows:
                if settled is not None:
                    settled(batch.blocked == 0 and batch.whole)
                await session.finish(())
                return 0, batch.blocked
            started = time.perf_counter()
            spans = self._start_spans(rows) if tracing.enabled else None
            results = await self.publisher.publish(rows)
            self.metrics.publish_seconds.observe(time.perf_counter() - started)
            if spans is not None:
                tracing.end_send(
                    spans,
                    [
                        r.error
                        if isinstance(r, Failure)
                        else "not confirmed (connection lost)"
                        if r is Outcome.RELEASE
                        else None
                        for r in results
                    ],
                )
            published: list[OutboxRow] = []
            failed: list[tuple[OutboxRow, Failure, float]] = []
            for row, result in zip(rows, results, strict=True):
                if result is None:
                    published.append(row)
                elif result is Outcome.UNROUTABLE:
                    published.append(row)
                    self._note_unroutable(row)
                elif isinstance(result, Failure):
                    failed.append((row, result, self.backoff.delay(row.attempts + 1)))
            if settled is not None:
                settled(len(published) == len(rows) and batch.blocked == 0 and batch.whole)
            statuses = await session.finish(
                [row.id for row in published], failed, self.max_attempts
            )
        except BaseException:
            await session.abort()
            raise
        finally:
            self._holding.pop(worker, None)
            self.budget.release(used)
        self.metrics.published.inc(len(published))
        for row, failure, delay in failed:
            report_failure(
                log,
                self.metrics,
                "publish",
                failure.error,
                dead=statuses.get(row.id) == "dead",
                delay=delay,
                extra={
                    "action": "publish_failed",
                    "message_id": row.id,
                    "topic": row.topic,
                    "attempts": row.attempts + 1,
                },
            )
        # RELEASE rows stay pending, no attempt counted: held back behind a
        # failed row of their key, or unconfirmed because the connection broke.
        if Outcome.RELEASE in results and not self.publisher.connected:
            raise BrokerUnavailable("connection lost before every confirm arrived")
        return len(rows), batch.blocked

    def stopped_short(self, worker: int) -> bool:
        """Whether the worker's last claim stopped at a row its share of the
        byte budget could not take: more rows wait, as after a full batch."""
        return self._need.get(worker) is not None

    def _note_unroutable(self, row: OutboxRow) -> None:
        """Count a row published although no queue took it; log it once per
        topic per UNROUTABLE_LOG_INTERVAL, not once per message."""
        self.metrics.unroutable.labels(row.topic).inc()
        now = time.monotonic()
        logged, since = self._unroutable.get(row.topic, (-UNROUTABLE_LOG_INTERVAL, 0))
        if now - logged < UNROUTABLE_LOG_INTERVAL:
            self._unroutable[row.topic] = (logged, since + 1)
            return
        if len(self._unroutable) >= 10_000:  # topics without end: forget the old ones
            self._unroutable.clear()
        self._unroutable[row.topic] = (now, 0)
        log.warning(
            "unroutable: no queue is bound to exchange %r for topic %r; published anyway "
            "(%d more since the last notice; relay_outbox_unroutable_total counts them; "
            "--on-unroutable fail makes them failed attempts)",
            self.exchange,
            row.topic,
            since,
            extra={"action": "unroutable", "message_id": row.id, "topic": row.topic},
        )

    def _start_spans(self, rows: list[OutboxRow]) -> list[Any]:
        """A PRODUCER span per row, each continuing its row's traceparent."""
        headers = []
        for row in rows:
            try:
                parsed = orjson.loads(row.headers)
            except orjson.JSONDecodeError:
                parsed = None
            headers.append(parsed if isinstance(parsed, dict) else {})
        return tracing.start_send(rows, self.messaging_system, self.destination, headers)

    async def run(self, *, once: bool = False) -> None:
        """Run the workers until stop() (or, with once, until nothing is due)."""
        await self.wait_ready()
        workers = [asyncio.create_task(self._worker(i, once)) for i in range(WORKERS)]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def wait_ready(self) -> None:
        """Wait until the schema is there and the broker answers."""
        await until_available(self._connect, self.stopping, self.reconnect, log)

    async def _connect(self) -> None:
        await self.store.check_schema()
        await self.publisher.connect()

    async def _worker(self, worker: int, once: bool) -> None:
        wakeup = self._wakeups[worker] = asyncio.Event()
        failures = 0
        while not self.stopping.is_set():
            # Cleared before the claim, so a NOTIFY that lands during it
            # makes the idle wait below return at once.
            wakeup.clear()
            # A scout claims every key's rows: it stands in for the idle
            # workers, whose shares of the keys it covers, for one claim.
            scout = worker in self._scouts
            if self.publisher.blocked is not None:
                # A resource alarm: wait, holding no rows, counting nothing.
                await self._until_unblocked()
                continue
            try:
                claimed_at = time.monotonic()
                done, blocked = await self.publish_batch(worker, WORKERS, every_key=scout)
                failures = 0
                if scout:
                    self.swept_at = claimed_at
            except ShareBusy:
                # Another relay's worker held the share all the while: ask
                # again, waiting in PostgreSQL's queue (unless stopping). A
                # scout that found a share held elsewhere hands the keys
                # back: the idle workers claim their own shares, it its own.
                log.debug("worker %d: share busy%s", worker, " (scout)" if scout else "")
                if scout:
                    self._scouts.discard(worker)
                    self._wake_idle()
                continue
            except Unavailable as exc:
                failures += 1
                await wait_to_reconnect(exc, failures, self.reconnect, self.stopping, log)
                continue
            self.last_progress = time.monotonic()
            if not (scout and wakeup.is_set() and not blocked and done < self.batch_size):
                # A scout woken during its batch stays one: it claims every
                # key again, in place of a second scout (wake()); after a
                # full batch the workers claim their own shares, as ever.
                self._scouts.discard(worker)
            if blocked:
                # Another worker or relay holds the head of these keys; it
                # commits in milliseconds, and nothing will notify us when it
                # does: claim again (shortly, if this found nothing to
                # publish). A scout hands the keys back to their workers,
                # each to claim its own share, as the owners of those keys.
                if scout:
                    self._wake_idle()
                if not done:
                    await asyncio.sleep(BLOCKED_RETRY)
                continue
            if done >= self.batch_size or self.stopped_short(worker):
                self._wake_idle()
                continue
            if once:
                if done:
                    continue
                return
            # A batch that was not full took every row due then; rows
            # committed since have notified (and set wakeup).
            self._idle.add(worker)
            try:
                # A little less than the interval, at random: workers (and
                # sources) started together do not poll in the same instant.
                await sleep_unless(wakeup, self.poll_interval * random.uniform(0.8, 1.0))
                while not wakeup.is_set() and self.poll_due is not None and not self.poll_due():
                    await sleep_unless(wakeup, self.poll_interval)
            finally:
                self._idle.discard(worker)

    async def _until_unblocked(self) -> None:
        waiter = asyncio.ensure_future(self.publisher.wait_unblocked())
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({waiter, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            stop.cancel()
