"""Library entry points behind the one-shot commands (schema, status, retry)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relay.audit import Actor, record
from relay.claimcheck import fetch_from
from relay.config import ClaimCheckURL
from relay.db import Store, retry_in


async def apply_schema(database_url: str) -> list[str]:
    """Create or upgrade the tables; returns the names of the files applied."""
    store = Store(database_url, pool_size=1)
    try:
        return await store.apply_schema()
    finally:
        await store.close()


async def table_status(database_url: str) -> dict[str, dict[str, Any]]:
    """What `relay status --json` prints."""
    store = Store(database_url, pool_size=1)
    try:
        await store.check_schema()  # no tables: one line that says so, no traceback
        return await store.status()
    finally:
        await store.close()


async def dead_keys(database_url: str, limit: int = 20) -> dict[str, list[tuple[Any, ...]]]:
    """Keys held by dead rows (under --on-dead block), for `relay status`'s text."""
    store = Store(database_url, pool_size=1)
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
) -> int:
    """Put dead (or the given) rows back to pending with attempts reset; returns how many.
    Inbox rows kept as claim check pointers get their S3 object first
    (`claim_check` gives S3's region and endpoint; without it they stay dead).
    With `by`, the audit trail records it in the same transaction."""
    store = Store(database_url, pool_size=1)
    objects = None
    if claim_check is not None:
        from relay.s3 import ObjectStore

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
                fetch=fetch_from(objects),
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


__all__ = ["apply_schema", "dead_keys", "retry", "table_status"]
