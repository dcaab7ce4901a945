"""Library entry points behind the one-shot commands (schema, status, retry)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from relay.db import Store


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
    schema: str | None = None,
) -> int:
    """Put dead (or the given) rows back to pending with attempts reset; returns how many."""
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        await store.check_schema()
        return await store.retry(table, ids=ids, all_dead=all_dead, consumer=consumer)
    finally:
        await store.close()


__all__ = ["apply_schema", "dead_keys", "retry", "table_status"]
