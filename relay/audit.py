"""The audit trail: who did what, through the console or the CLI.

Every write action (retry, edit, discard, replay) records one row of
`relay_audit` in the action's own transaction, so an action and its record
commit or roll back together; the console also records the actions it
refused. The CLI's actor is the OS user or `--as NAME`; the console's is
the operator's name from --console-tokens (relay.console.guard).
"""

from __future__ import annotations

import getpass
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay.db import AsyncConnection, Store, named

VIA = ("cli", "console")


@dataclass(frozen=True)
class Actor:
    """Who acts, and through what (cli or console)."""

    name: str
    via: str = "cli"


def cli_actor(name: str | None = None) -> Actor:
    """The CLI's actor: `--as NAME`, else the OS user (its uid when it has no name)."""
    if name:
        return Actor(name, "cli")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid with no passwd entry (containers)
        user = f"uid {os.getuid()}"
    return Actor(user, "cli")


@dataclass(frozen=True)
class Entry:
    """One row of the audit trail."""

    id: int
    at: datetime
    actor: str
    via: str
    action: str
    table: str | None
    filter: dict[str, Any] | None
    ids: list[str] | None
    count: int | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    detail: str | None

    def to_json(self) -> dict[str, Any]:
        """The entry as `relay audit --json` prints it."""
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "actor": self.actor,
            "via": self.via,
            "action": self.action,
            "table": self.table,
            "filter": self.filter,
            "ids": self.ids,
            "count": self.count,
            "before": self.before,
            "after": self.after,
            "detail": self.detail,
        }


def edit_state(payload_text: str | None, headers_text: str, body_text: str | None = None) -> str:
    """A row's payload and headers as one JSON object's text, for an edit's
    before and after. The texts are JSON as PostgreSQL keeps them (not
    parsed again: numbers and keys stay as they were); a body that is not
    JSON goes in as text."""
    if payload_text is None:
        return f'{{"body": {json.dumps(body_text)}, "headers": {headers_text}}}'
    return f'{{"payload": {payload_text}, "headers": {headers_text}}}'


async def record(
    conn: AsyncConnection,
    actor: Actor,
    action: str,
    *,
    table: str | None = None,
    filter: Mapping[str, Any] | None = None,
    ids: Sequence[str] | None = None,
    count: int | None = None,
    before: str | None = None,
    after: str | None = None,
    detail: str | None = None,
) -> None:
    """One row of the trail, in the caller's transaction (before and after:
    JSON texts, see edit_state)."""
    await conn.execute(
        named("audit_insert"),
        {
            "actor": actor.name,
            "via": actor.via,
            "action": action,
            "target": table,
            "filter": json.dumps(dict(filter)) if filter else None,
            "ids": json.dumps(list(ids)) if ids else None,
            "count": count,
            "before": before,
            "after": after,
            "detail": detail,
        },
    )


async def refused(store: Store, actor: Actor, action: str, why: str) -> None:
    """Record an action the console refused (nothing else was done)."""
    async with store.transaction() as conn:
        await record(conn, actor, "refused", detail=f"{action}: {why}")


async def entries(store: Store, *, limit: int = 100, before_id: int | None = None) -> list[Entry]:
    """A page of the trail, newest first (below `before_id` when given)."""
    async with store.connection() as conn:
        result = await conn.execute(named("audit_list"), {"limit": limit, "before_id": before_id})
        return [
            Entry(
                id=r[0],
                at=r[1],
                actor=r[2],
                via=r[3],
                action=r[4],
                table=r[5],
                filter=json.loads(r[6]) if r[6] else None,
                ids=json.loads(r[7]) if r[7] else None,
                count=r[8],
                before=json.loads(r[9]) if r[9] else None,
                after=json.loads(r[10]) if r[10] else None,
                detail=r[11],
            )
            for r in result
        ]


async def run_list(
    database_url: str, *, limit: int, before_id: int | None, schema: str | None = None
) -> list[Entry]:
    """`relay audit`: a page of the trail on a store of its own (on `schema`'s tables)."""
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        await store.check_schema()
        return await entries(store, limit=limit, before_id=before_id)
    finally:
        await store.close()


__all__ = ["Actor", "Entry", "cli_actor", "edit_state", "entries", "record", "refused", "run_list"]
