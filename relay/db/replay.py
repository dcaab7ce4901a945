"""The SQL of replay (relay.replay): count, hold, move finished rows back to pending.

The statements are templates of queries/replay.sql whose {where} is built
by `condition` from fixed fragments; every value is a bound parameter.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from relay.db.errors import lock_not_available
from relay.db.sql import query
from relay.db.store import named, statement
from relay.errors import ReplayBusy

# The column a time range looks at: when the row was written.
WRITTEN = {"outbox": "r.created_at", "inbox": "r.received_at"}


def condition(table: str, where: Any) -> tuple[str, dict[str, Any]]:
    """The SQL condition (on alias `r`) of a relay.replay.ReplayFilter, and its parameters."""
    parts = ["true"]
    params: dict[str, Any] = {}
    if where.since is not None:
        parts.append(f"{WRITTEN[table]} >= :since")
        params["since"] = where.since
    if where.until is not None:
        parts.append(f"{WRITTEN[table]} < :until")
        params["until"] = where.until
    if where.topic is not None:
        # A topic pattern as a regular expression over '.' + topic
        # (relay.replay.topic_regex).
        parts.append("('.' || coalesce(r.topic, '')) ~ :topic_regex")
        params["topic_regex"] = where.topic_regex()
    for name in ("type", "key", "consumer"):
        value = getattr(where, name)
        if value is not None:
            parts.append(f"r.{name} = :{name}")
            params[name] = value
    return " AND ".join(parts), params


async def count(conn: AsyncConnection, table: str, where: Any) -> int:
    """How many finished rows of `table` match."""
    cond, params = condition(table, where)
    sql = query(f"replay_count_{table}").format(where=cond)
    return int(await conn.scalar(statement(sql), params) or 0)


async def hold(conn: AsyncConnection, table: str, where: Any, timeout: float) -> int:
    """Lock the pending rows of the keys that have matching finished rows, in
    the caller's transaction (see queries/replay.sql), waiting `timeout`
    seconds at most for the transactions that hold them (batches in flight),
    else ReplayBusy; returns how many."""
    cond, params = condition(table, where)
    sql = query(f"replay_hold_{table}").format(where=cond)
    await conn.execute(named("lock_timeout"), {"timeout": f"{round(timeout * 1000)}ms"})
    try:
        return len((await conn.execute(statement(sql), params)).all())
    except sa.exc.DBAPIError as exc:
        if exc.orig is not None and lock_not_available(exc.orig):
            raise ReplayBusy(
                f"the pending rows of the keys to replay stayed locked for {timeout:.0f} s "
                "by other transactions: nothing was replayed; try again"
            ) from None
        raise


async def move(conn: AsyncConnection, table: str, where: Any) -> int:
    """The matching finished rows back to pending, in the caller's
    transaction, then a wake-up for the daemons; returns how many."""
    cond, params = condition(table, where)
    sql = query(f"replay_{table}").format(where=cond)
    result = await conn.execute(statement(sql), params)
    await conn.execute(named("notify_wake"), {"channel": f"relay_{table}", "table": table})
    return int(result.rowcount)


async def wait_out_older_statements(conn: AsyncConnection, timeout: float) -> bool:
    """Wait (up to `timeout` seconds) until no statement that began before
    now still runs on this database; False when some still did at the end."""
    since = await conn.scalar(named("replay_clock"))
    deadline = time.monotonic() + timeout
    while True:
        await conn.execute(named("replay_activity_fresh"))
        if not await conn.scalar(named("replay_older_statements"), {"since": since}):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
