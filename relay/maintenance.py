"""Scheduled jobs of both daemons (APScheduler): retention and backlog gauges
(pending rows, and the table's dead row versions and last vacuum).

Retention deletes published outbox rows (processed inbox rows) older than
--retention, 1000 rows per transaction so that no delete holds its locks
for long; a transaction-level advisory lock per table lets only one replica
delete at a time (the others skip that run).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from relay.db import Store, delete_expired, pending_gauge, table_health
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


def retention_interval(retention: float) -> float:
    """How often to look for expired rows: often enough to stay near the
    retention, never more than once a minute or less than once an hour."""
    return min(max(retention / 10, 60.0), 3600.0)


async def run_scheduler(
    store: Store, table: str, retention: float, metrics: Any, stop: asyncio.Event
) -> None:
    """Run the jobs until `stop` is set (or the task is cancelled)."""

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

    @_job
    async def gauges() -> None:
        try:
            count, age = await pending_gauge(store, table)
        except Unavailable:
            return
        metrics.pending.set(count)
        metrics.oldest_pending.set(age)
        try:
            dead, vacuumed = await table_health(store, table)
        except Unavailable:
            return
        metrics.dead_tuples.labels(table=table).set(dead)
        metrics.last_vacuum.labels(table=table).set(vacuumed)

    scheduler = AsyncIOScheduler(job_defaults={"coalesce": True, "max_instances": 1})
    now = datetime.now().astimezone()
    scheduler.add_job(
        expire,
        "interval",
        seconds=retention_interval(retention),
        id="retention",
        next_run_time=now + timedelta(seconds=RETENTION_FIRST_RUN),
    )
    scheduler.add_job(gauges, "interval", seconds=GAUGE_INTERVAL, id="gauges", next_run_time=now)
    scheduler.start()
    try:
        await stop.wait()
    finally:
        scheduler.shutdown(wait=False)
