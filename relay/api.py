"""Library entry points behind the one-shot commands (schema, status, retry)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relay.audit import Actor, record
from relay.claimcheck.retry import Restore, fetch_from
from relay.config import ClaimCheckURL, Source
from relay.db import Store, retry_in
from relay.db.store import STATUSES
from relay.errors import RelayError, SchemaError, Unavailable


async def apply_schema(database_url: str, schema: str | None = None) -> list[str]:
    """Create or upgrade the tables (in `schema`, made if missing; None: on
    the search_path); returns the names of the files applied."""
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        return await store.apply_schema()
    finally:
        await store.close()


async def table_status(database_url: str, schema: str | None = None) -> dict[str, dict[str, Any]]:
    """What `relay status --json` prints."""
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        await store.check_schema()  # no tables: one line that says so, no traceback
        return await store.status()
    finally:
        await store.close()


_AGE = "oldest_pending_seconds"


async def sources_status(
    sources: Mapping[str, Source], describe: Callable[[str, RelayError], str] | None = None
) -> dict[str, Any]:
    """`relay status --json` of several sources: each one's report under
    `sources` (by label), and the tables' counts of them all (the oldest
    pending age: the greatest). A source that cannot be read (its database
    away, its tables missing) is `{"error": "..."}` there, left out of the
    counts; `describe(label, error)` words it (default: the error's text)."""
    reports = await asyncio.gather(
        *(_status_or_error(label, s, describe) for label, s in sources.items())
    )
    total: dict[str, Any] = {
        table: {**dict.fromkeys(statuses, 0), _AGE: None} for table, statuses in STATUSES.items()
    }
    for report in reports:
        for table, row in report.items():
            if table == "error":
                continue
            into = total[table]
            for name, value in row.items():
                if name == _AGE:
                    ages = [a for a in (into[name], value) if a is not None]
                    into[name] = max(ages) if ages else None
                else:
                    into[name] += value
    return {**total, "sources": dict(zip(sources, reports, strict=True))}


async def _status_or_error(
    label: str, source: Source, describe: Callable[[str, RelayError], str] | None
) -> dict[str, Any]:
    try:
        return await table_status(source.database_url, schema=source.schema)
    except (Unavailable, SchemaError) as exc:
        return {"error": describe(label, exc) if describe else str(exc)}


async def dead_keys(
    database_url: str, limit: int = 20, schema: str | None = None
) -> dict[str, list[tuple[Any, ...]]]:
    """Keys held by dead rows (under --on-dead block), for `relay status`'s text."""
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        return await store.dead_keys(limit)
    finally:
        await store.close()


async def retry(
    database_url: str,
    table: str,
    *,
    ids: Sequence[str] = (),
    all_dead: bool = False,
    consumer: str | None = None,
    claim_check: ClaimCheckURL | None = None,
    by: Actor | None = None,
    schema: str | None = None,
) -> int:
    """Put dead (or the given) rows back to pending with attempts reset; returns how many.
    Inbox rows kept as claim check pointers get their S3 object first
    (`claim_check` gives S3's region and endpoint; without it they stay dead).
    With `by`, the audit trail records it in the same transaction."""
    store = Store(database_url, pool_size=1, schema=schema)
    objects = None
    if claim_check is not None:
        from relay.claimcheck.s3 import ObjectStore

        objects = ObjectStore(claim_check)
    try:
        await store.check_schema()
        async with store.transaction() as conn:
            count = await retry_in(
                conn,
                table,
                ids=ids,
                all_dead=all_dead,
                consumer=consumer,
                restore=Restore(fetch_from(objects)),
            )
            if by is not None:
                chosen: dict[str, Any] = {"all_dead": True} if all_dead else {}
                if consumer is not None:
                    chosen["consumer"] = consumer
                await record(conn, by, "retry", table=table, filter=chosen, ids=ids, count=count)
            return count
    finally:
        await store.close()
        if objects is not None:
            await objects.close()


__all__ = ["apply_schema", "dead_keys", "retry", "sources_status", "table_status"]
