"""The SQL of the dead-message workflow (relay.dead): reading, changing and
discarding dead rows of both tables.

The statements are templates of queries/dead.sql, filled with table and
column names from COLUMNS and with conditions built by `condition`, whose
values are all bound parameters. Errors pass through the Store's
connections (relay.db.errors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection

from relay.db.sql import query
from relay.db.store import named, statement

# Per table: the id, the consumer (NULL for the outbox) and the time the row
# was written, under common names.
COLUMNS = {
    "outbox": ("d.id::text", "NULL::text", "d.created_at"),
    "inbox": ("d.message_id", "d.consumer", "d.received_at"),
}


def error_line(alias: str = "d") -> str:
    """The error group of a row of `alias` as an SQL expression (see queries/dead.sql)."""
    return query("dead_error_line").format(t=alias)


def condition(table: str, where: Any) -> tuple[str, dict[str, Any]]:
    """The SQL condition (on alias `d`) of a relay.dead.DeadFilter, and its parameters."""
    written = COLUMNS[table][2]
    parts = ["d.status = 'dead'"]
    params: dict[str, Any] = {}
    if where.consumer is not None:
        parts.append("d.consumer = :consumer")
        params["consumer"] = where.consumer
    for name in ("topic", "type", "key"):
        value = getattr(where, name)
        if value is not None:
            parts.append(f"d.{name} = :{name}")
            params[name] = value
    if where.error:
        parts.append("d.last_error ILIKE :error ESCAPE '\\'")
        params["error"] = "%" + _like_escape(where.error) + "%"
    if where.group is not None:
        parts.append(f"{error_line()} = :group")
        params["group"] = where.group
    if where.older_than is not None:
        parts.append(f"{written} <= now() - make_interval(secs => :older_than)")
        params["older_than"] = where.older_than
    if where.newer_than is not None:
        parts.append(f"{written} > now() - make_interval(secs => :newer_than)")
        params["newer_than"] = where.newer_than
    return " AND ".join(parts), params


def _like_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


async def page(
    conn: AsyncConnection, table: str, where: Any, *, limit: int, after_seq: int | None = None
) -> Sequence[Any]:
    """Up to `limit` dead rows of `table` matching `where`, newest first, below
    `after_seq` when given: (id, consumer, seq, topic, key, type, attempts,
    error group, written at, available_at)."""
    cond, params = condition(table, where)
    after_sql = ""
    if after_seq is not None:
        after_sql = "AND d.seq < :after_seq"
        params["after_seq"] = after_seq
    ident, consumer, written = COLUMNS[table]
    sql = query("dead_list").format(
        ident=ident,
        consumer=consumer,
        written=written,
        error_line=error_line(),
        table=table,
        where=cond,
        after=after_sql,
    )
    params["limit"] = limit
    return (await conn.execute(statement(sql), params)).all()


async def count(conn: AsyncConnection, table: str, where: Any, cap: int | None) -> int:
    """How many dead rows of `table` match; counting stops at `cap` when given."""
    cond, params = condition(table, where)
    limit = ""
    if cap is not None:
        limit = " LIMIT :cap"
        params["cap"] = cap
    sql = query("dead_count").format(table=table, where=cond, cap=limit)
    return await conn.scalar(statement(sql), params) or 0


async def groups(
    conn: AsyncConnection, table: str, where: Any, *, limit: int, newest: int | None
) -> Sequence[Any]:
    """(error group, count, newest written at) of the matching dead rows of
    `table`, largest first; of only its `newest` rows when given."""
    cond, params = condition(table, where)
    written = COLUMNS[table][2]
    source = f"{table} d WHERE {cond}"
    if newest is not None:
        source = query("dead_groups_newest").format(written=written, source=source)
        params["newest"] = newest
    sql = query("dead_groups").format(error_line=error_line(), written=written, source=source)
    params["limit"] = limit
    return (await conn.execute(statement(sql), params)).all()


async def get(
    conn: AsyncConnection, table: str, row_id: str, consumer: str | None
) -> Sequence[Any]:
    """The dead rows of `table` with this id (an outbox id must be a UUID),
    in full: the columns of page(), then payload and headers as JSON text,
    last_error, the raw body and raw_properties (inbox)."""
    ident, consumer_col, written = COLUMNS[table]
    params: dict[str, Any] = {"id": row_id}
    if table == "outbox":
        match = "d.id = CAST(:id AS uuid)"
        extra = "NULL::bytea, NULL::text"
    else:
        match = "d.message_id = :id"
        if consumer is not None:
            match += " AND d.consumer = :consumer"
            params["consumer"] = consumer
        extra = "d.body, d.raw_properties::text"
    order = " ORDER BY d.consumer" if table == "inbox" else ""
    sql = query("dead_get").format(
        ident=ident,
        consumer=consumer_col,
        error_line=error_line(),
        written=written,
        extra=extra,
        table=table,
        match=match,
        order=order,
    )
    return (await conn.execute(statement(sql), params)).all()


async def edit(
    conn: AsyncConnection,
    table: str,
    row_id: str,
    consumer: str | None,
    *,
    payload: str | None,
    headers: str | None,
) -> int:
    """Replace a dead row's payload and/or headers (JSON texts); returns how
    many rows changed (0: no longer dead)."""
    sets, params = [], {"id": row_id, "consumer": consumer}
    if payload is not None:
        sets.append("payload = CAST(:payload AS jsonb)")
        params["payload"] = payload
        if table == "inbox":
            sets.append("body = NULL")  # the body is JSON now
    if headers is not None:
        sets.append("headers = CAST(:headers AS jsonb)")
        params["headers"] = headers
    match = (
        "id = CAST(:id AS uuid)"
        if table == "outbox"
        else "consumer = :consumer AND message_id = :id"
    )
    sql = query("dead_update").format(table=table, sets=", ".join(sets), match=match)
    result = await conn.execute(statement(sql), params)
    return int(result.rowcount)


async def lock(
    conn: AsyncConnection, table: str, where: Any, ids: Sequence[str]
) -> dict[str | None, list[str]]:
    """Ids of the matching dead rows (and, when given, with these ids;
    outbox ids UUIDs), locked, by consumer (None for the outbox)."""
    cond, params = condition(table, where)
    ident, consumer, _ = COLUMNS[table]
    if ids:
        if table == "outbox":
            cond += " AND d.id = ANY(CAST(:ids AS uuid[]))"
        else:
            cond += " AND d.message_id = ANY(CAST(:ids AS text[]))"
        params["ids"] = list(ids)
    sql = query("dead_lock").format(consumer=consumer, ident=ident, table=table, where=cond)
    chosen: dict[str | None, list[str]] = {}
    for owner, row_id in await conn.execute(statement(sql), params):
        chosen.setdefault(owner, []).append(row_id)
    return chosen


async def discard(
    conn: AsyncConnection, table: str, ids: Sequence[str], consumer: str | None, reason: str | None
) -> int:
    """Move these dead rows whole into relay_discarded; returns how many."""
    params: dict[str, Any] = {"ids": list(ids), "reason": reason}
    if table == "inbox":
        params["consumer"] = consumer
    result = await conn.execute(named(f"discard_{table}"), params)
    return int(result.rowcount)
