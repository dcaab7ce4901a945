"""Scheduled jobs of both daemons (APScheduler): retention and backlog gauges."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta
from typing import Any

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from relay.errors import Unavailable
from relay.store import Store, delete_expired, pending_gauge

log = logging.getLogger(__name__)

GAUGE_INTERVAL = 5.0


def retention_interval(retention: float) -> float:
    """How often to look for expired rows: often enough to stay near the
    retention, never more than once a minute or less than once an hour."""
    return min(max(retention / 10, 60.0), 3600.0)


async def run_scheduler(
    store: Store, table: str, retention: float, metrics: Any, stop: asyncio.Event
) -> None:
    """Run the jobs until `stop` is set."""

    async def expire() -> None:
        try:
            deleted = await delete_expired(store, table, retention)
        except Unavailable as exc:
            log.warning("retention skipped: %s", exc)
            return
        if deleted:
            log.info(
                "retention deleted %d %s rows older than %.0fs", deleted, table, retention,
                extra={"action": "retention"},
            )

    async def gauges() -> None:
        try:
            count, age = await pending_gauge(store, table)
        except Unavailable:
            return
        metrics.pending.set(count)
        metrics.oldest_pending.set(age)

    scheduler = AsyncIOScheduler(job_defaults={"coalesce": True, "max_instances": 1})
    now = datetime.now().astimezone()
    scheduler.add_job(
        expire, "interval", seconds=retention_interval(retention), id="retention",
        next_run_time=now + timedelta(seconds=5),
    )
    scheduler.add_job(gauges, "interval", seconds=GAUGE_INTERVAL, id="gauges", next_run_time=now)
    scheduler.start()
    try:
        await stop.wait()
    finally:
        scheduler.shutdown(wait=False)
