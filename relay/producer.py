"""The producer API: write an outbox row in the caller's own transaction."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from relay.schema import outbox


_builtin_type = type


def _insert(
    topic: str,
    payload: Any,
    key: str | None,
    type: str | None,
    headers: Mapping[str, str] | None,
    id: uuid.UUID | str | None,
    available_at: datetime | None,
) -> tuple[uuid.UUID, sa.Insert]:
    if not isinstance(topic, str) or not topic:
        raise ValueError("topic must be a non-empty string")
    if payload is None:
        raise ValueError("payload must not be None (use {} for an empty message)")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a string, not {_builtin_type(key).__name__}")
    if type is not None and not isinstance(type, str):
        raise TypeError(f"type must be a string, not {_builtin_type(type).__name__}")
    headers = dict(headers or {})
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"header {name!r}: names and values must be strings")
    message_id = id if isinstance(id, uuid.UUID) else uuid.UUID(id) if id else uuid.uuid4()
    values: dict[str, Any] = {
        "id": message_id, "topic": topic, "key": key, "type": type,
        "payload": payload, "headers": headers,
    }
    if available_at is not None:
        values["available_at"] = available_at
    return message_id, sa.insert(outbox).values(values)


def enqueue(
    conn: sa.Connection | Session,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    type: str | None = None,
    headers: Mapping[str, str] | None = None,
    id: uuid.UUID | str | None = None,
    available_at: datetime | None = None,
) -> uuid.UUID:
    """Add a message to the outbox in the transaction of `conn`; returns its id.

    The row commits or rolls back with the caller's business writes; the
    outbox relay publishes it after the commit.
    """
    message_id, statement = _insert(topic, payload, key, type, headers, id, available_at)
    conn.execute(statement)
    return message_id


async def enqueue_async(
    conn: AsyncConnection | AsyncSession,
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    type: str | None = None,
    headers: Mapping[str, str] | None = None,
    id: uuid.UUID | str | None = None,
    available_at: datetime | None = None,
) -> uuid.UUID:
    """enqueue() for an AsyncConnection or AsyncSession."""
    message_id, statement = _insert(topic, payload, key, type, headers, id, available_at)
    await conn.execute(statement)
    return message_id
