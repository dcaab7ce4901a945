"""Scheduled jobs of both daemons (APScheduler): retention, backlog gauges
(pending rows, and the table's dead row versions and last vacuum) and the
vacuum of a churning table (Vacuums).

Retention deletes published outbox rows (processed inbox rows) older than
--retention, 1000 rows per transaction so that no delete holds its locks
for long; a transaction-level advisory lock per table lets only one replica
delete at a time (the others skip that run).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from relay.db import Store, delete_expired, pending_gauge, table_health, vacuum
from relay.errors import Unavailable

log = logging.getLogger(__name__)

GAUGE_INTERVAL = 5.0
# The first retention run, after start-up: soon, but not in the connection storm of a restart.
RETENTION_FIRST_RUN = 5.0


def _job(fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
    """A job that ends quietly when the scheduler shuts down under it.

    APScheduler cancels the jobs in flight at shutdown and logs each
    cancellation as a crash; a cancelled delete only rolls its batch back."""

    @functools.wraps(fn)
    async def run() -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            log.debug("job %s cancelled by the shutdown", fn.__name__)

    return run


# The churn vacuum (Vacuums): after this many dead row versions, at most
# once per VACUUM_INTERVAL seconds since the end of the table's last vacuum,
# relay's or autovacuum's, looked at every VACUUM_CHECK seconds (a read of
# the table's statistics, no scan): about every 10 s from start to start
# under a backlog, as measured (docs/backlog.md, "Fifth round", "Sixth
# round": looked at with the 5 s gauges, it came every 15 s).
VACUUM_AFTER_DEAD = 50_000
VACUUM_INTERVAL = 8.0
VACUUM_CHECK = 1.0
_LOCK_NOT_AVAILABLE = "55P03"


class Vacuums:
    """relay's own VACUUM of its table while a backlog churns through it.

    Every message leaves a dead row version and a dead entry in the pending
    index, and each claim finds the lowest pending row by stepping over the
    dead entries left of it, a walk that lengthens by every message until a
    vacuum: over a million-message backlog, from 500 index pages to 3,500
    per claim. autovacuum would clear them, but it looks at a database once
    a minute (autovacuum_naptime, server-wide), while a queue table passes
    any threshold in seconds. So a job reads the table's dead versions
    every VACUUM_CHECK seconds (the statistics, exported as gauges too) and
    vacuums the table itself once they pass VACUUM_AFTER_DEAD, at most
    every VACUUM_INTERVAL seconds after its last vacuum ended.
    SKIP_LOCKED: a table autovacuum or another replica is vacuuming is left
    to them. A user that may not vacuum the table (not its owner) is told
    once, and relay stops trying; autovacuum still does the work."""

    def __init__(self, store: Store, table: str, metrics: Any) -> None:
        self.store = store
        self.table = table
        self.metrics = metrics
        self.last = 0.0  # Unix time of relay's last vacuum of the table
        self.allowed = True
        self.running: asyncio.Task[None] | None = None

    def due(self, dead: int, vacuumed: float, now: float) -> bool:
        """Whether to vacuum, given the table's dead row versions and its last
        vacuum (Unix time, 0: never) as the statistics count them."""
        return (
            self.allowed
            and dead >= VACUUM_AFTER_DEAD
            and now - max(vacuumed, self.last) >= VACUUM_INTERVAL
        )

    def start(self, look: Callable[[], Awaitable[None]]) -> None:
        """`look` (read the table's statistics, then check()) in a task of
        its own, unless the last one still runs: the job that starts it every
        VACUUM_CHECK seconds neither waits for a vacuum (seconds on a large
        table) nor piles up behind a database that is away (a connection
        attempt may take seconds, and APScheduler would warn of each
        overlapping run)."""
        if self.running is None or self.running.done():
            self.running = asyncio.ensure_future(look())
            self.running.add_done_callback(self._failed)

    def _failed(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("vacuum of %s failed", self.table, exc_info=exc)

    async def stop(self) -> None:
        if self.running is not None and not self.running.done():
            self.running.cancel()
            await asyncio.gather(self.running, return_exceptions=True)

    async def check(self, dead: int, vacuumed: float) -> None:
        now = time.time()
        if not self.due(dead, vacuumed, now):
            return
        self.last = now
        try:
            warnings = await vacuum(self.store, self.table)
        except Unavailable as exc:
            log.warning("vacuum skipped: %s", exc, extra={"action": "vacuum_skipped"})
            return
        refused = [message for state, message in warnings if state != _LOCK_NOT_AVAILABLE]
        if refused:
            self.allowed = False
            log.warning(
                "relay may not vacuum %s (%s); autovacuum alone clears its dead rows "
                "(docs/backlog.md)",
                self.table,
                "; ".join(m or "" for m in refused),
                extra={"action": "vacuum_refused", "table": self.table},
            )
        elif warnings:
            log.debug("vacuum of %s skipped: another vacuum holds it", self.table)
        else:
            self.metrics.vacuums.labels(table=self.table).inc()
            log.debug(
                "vacuumed %s (%d dead row versions, %.1fs)",
                self.table,
                dead,
                time.time() - now,
            )


def retention_interval(retention: float) -> float:
    """How often to look for expired rows: often enough to stay near the
    retention, never more than once a minute or less than once an hour."""
    return min(max(retention / 10, 60.0), 3600.0)


def _retention_job(
    store: Store, table: str, retention: float, metrics: Any
) -> Callable[[], Awaitable[None]]:
    """Delete the finished rows past the retention (one replica at a time)."""

    @_job
    async def expire() -> None:
        try:
            deleted = await delete_expired(store, table, retention)
        except Unavailable as exc:
            log.warning("retention skipped: %s", exc, extra={"action": "retention_skipped"})
            return
        if deleted is None:
            log.debug("retention: another replica is deleting %s rows", table)
            return
        metrics.deleted.inc(deleted)
        if deleted:
            log.info(
                "retention deleted %d %s rows older than %.0fs",
                deleted,
                table,
                retention,
                extra={"action": "retention", "table": table, "deleted": deleted},
            )

    return expire


async def run_scheduler(
    store: Store,
    table: str,
    retention: float | None,
    metrics: Any,
    stop: asyncio.Event,
    *,
    stagger: bool = False,
) -> None:
    """Run the jobs until `stop` is set (or the task is cancelled); without
    retention (None: `relay outbox --once`), the gauges and vacuums only.

    With `stagger` (each source of an outbox of several, relay.sources) the
    periodic jobs start at a random point of their interval: a hundred
    sources started together would otherwise look at their tables in the
    same instant every second, a burst on the one event loop that every
    source's next row would wait behind."""

    vacuums = Vacuums(store, table, metrics)

    @_job
    async def gauges() -> None:
        try:
            count, age = await pending_gauge(store, table)
        except Unavailable:
            return
        metrics.pending.set(count)
        metrics.oldest_pending.set(age)

    # (looked at, dead versions seen): with `stagger`, a quiet table (few
    # dead versions) is looked at every GAUGE_INTERVAL only, not every
    # VACUUM_CHECK: a hundred idle sources' looks were most of their cost.
    last = [0.0, 0]

    async def look() -> None:
        try:
            dead, vacuumed = await table_health(store, table)
        except Unavailable:
            return
        last[:] = [time.monotonic(), dead]
        metrics.dead_tuples.labels(table=table).set(dead)
        metrics.last_vacuum.labels(table=table).set(vacuumed)
        await vacuums.check(dead, vacuumed)

    @_job
    async def health() -> None:
        quiet = last[1] < VACUUM_AFTER_DEAD // 10
        if stagger and quiet and time.monotonic() - last[0] < GAUGE_INTERVAL:
            return
        vacuums.start(look)

    scheduler = AsyncIOScheduler(job_defaults={"coalesce": True, "max_instances": 1})
    now = datetime.now().astimezone()
    if retention is not None:
        scheduler.add_job(
            _retention_job(store, table, retention, metrics),
            "interval",
            seconds=retention_interval(retention),
            id="retention",
            next_run_time=now + timedelta(seconds=RETENTION_FIRST_RUN),
        )

    def first(interval: float) -> datetime:
        return now + timedelta(seconds=random.uniform(0, interval) if stagger else 0)

    scheduler.add_job(
        gauges, "interval", seconds=GAUGE_INTERVAL, id="gauges", next_run_time=first(GAUGE_INTERVAL)
    )
    scheduler.add_job(
        health, "interval", seconds=VACUUM_CHECK, id="health", next_run_time=first(VACUUM_CHECK)
    )
    scheduler.start()
    try:
        await stop.wait()
    finally:
        scheduler.shutdown(wait=False)
        await vacuums.stop()
