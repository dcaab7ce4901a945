"""The SQL of the daemons' scheduled jobs (relay.maintenance): retention,
gauges and the vacuum of a churning table."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from relay.db import namespace
from relay.db.sql import query
from relay.db.store import Store, named, statement

RETENTION_LOCK = {"outbox": 0x72657430, "inbox": 0x72657431}


async def delete_expired(store: Store, table: str, age: float, batch: int = 1000) -> int | None:
    """Delete finished rows older than `age` seconds, batch by batch.

    Only one replica does it at a time (an advisory lock per table, and per
    schema: relay.db.namespace.table_lock); returns None when another
    replica holds it."""
    total = 0
    lock = namespace.table_lock(RETENTION_LOCK[table], await store.locate())
    while True:
        async with store.transaction() as conn:
            if not await conn.scalar(named("retention_lock"), {"id": lock}):
                return None if total == 0 else total
            result = await conn.execute(
                named(f"delete_expired_{table}"), {"age": age, "limit": batch}
            )
        total += result.rowcount
        if result.rowcount < batch:
            return total


async def pending_gauge(store: Store, table: str) -> tuple[int, float]:
    """How many rows are pending and the age of the oldest, in seconds."""
    async with store.connection() as conn:
        count, age = (await conn.execute(named(f"pending_gauge_{table}"))).one()
    return int(count), float(age)


async def table_health(store: Store, table: str) -> tuple[int, float]:
    """The table's dead row versions and the Unix time of its last vacuum
    (0: never), as the cumulative statistics last counted them."""
    async with store.connection() as conn:
        row = (
            await conn.execute(named("table_health"), {"table": store.table(table)})
        ).one_or_none()
    if row is None:
        return 0, 0.0
    return int(row[0]), float(row[1])


def _vacuum(store: Store, table: str) -> sa.TextClause:
    """The table's VACUUM: AUTOCOMMIT, so under --schema (which a pooler
    would set per transaction only) with the table named in full."""
    if store.schema is None:
        return named(f"vacuum_{table}")
    return statement(query(f"vacuum_{table}").replace(table, store.table(table)))


async def vacuum(store: Store, table: str) -> list[tuple[str | None, str | None]]:
    """VACUUM (SKIP_LOCKED) the table, outside a transaction; returns the
    WARNINGs PostgreSQL answered with, as (SQLSTATE, message): 55P03 when
    another vacuum held the table (skipped), others when this user may not
    vacuum it. An empty list: it ran."""
    warnings: list[tuple[str | None, str | None]] = []

    def notice(diag: Any) -> None:
        if diag.severity_nonlocalized == "WARNING":
            warnings.append((diag.sqlstate, diag.message_primary))

    async with store.connection() as pooled:
        conn = await pooled.execution_options(isolation_level="AUTOCOMMIT")
        driver = (await conn.get_raw_connection()).driver_connection
        assert driver is not None, "a checked-out connection has its driver's"
        driver.add_notice_handler(notice)
        try:
            await conn.execute(_vacuum(store, table))
        finally:
            driver.remove_notice_handler(notice)
    return warnings
