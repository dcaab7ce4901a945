"""The producer API: write an outbox row in the caller's own transaction."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa
from psycopg.types.json import Jsonb
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.orm import Session

from relay import tracing
from relay.db.schema import outbox
from relay.errors import InvalidMessage
from relay.limits import (
    MAX_JSON_DEPTH,
    MAX_KEY_BYTES,
    MAX_SHORTSTR_BYTES,
    problem,
    utf8_length,
    value_depth,
)

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
        raise InvalidMessage("topic must be a non-empty string")
    if payload is None:
        raise InvalidMessage("payload must not be None (use {} for an empty message)")
    if key is not None and not isinstance(key, str):
        raise TypeError(f"key must be a string, not {_builtin_type(key).__name__}")
    if type is not None and not isinstance(type, str):
        raise TypeError(f"type must be a string, not {_builtin_type(type).__name__}")
    headers = dict(headers or {})
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"header {name!r}: names and values must be strings")
    tracing.add_current_context(headers)
    _check_carried(topic, payload, key, type, headers)
    message_id = id if isinstance(id, uuid.UUID) else uuid.UUID(id) if id else uuid.uuid4()
    values: dict[str, Any] = {
        "id": message_id,
        "topic": topic,
        "key": key,
        "type": type,
        "payload": payload,
        "headers": headers,
    }
    if available_at is not None:
        values["available_at"] = available_at
    return message_id, sa.insert(outbox).values(values)


# The same INSERT for connections outside SQLAlchemy (psycopg 3, Django):
# compiled once per call for psycopg's placeholders, JSON as psycopg's Jsonb.
_DIALECT = postgresql_psycopg.dialect()  # type: ignore[no-untyped-call]


def _dbapi(statement: sa.Insert) -> tuple[str, dict[str, Any]]:
    compiled = statement.compile(dialect=_DIALECT)
    params = dict(compiled.params)
    for name in ("payload", "headers"):
        params[name] = Jsonb(params[name])
    return str(compiled), params


def _is_django(conn: Any) -> bool:
    """django.db.connection (a proxy) or a connection from django.db.connections."""
    return type(conn).__module__.startswith("django.") and hasattr(conn, "cursor")


def _check_carried(
    topic: str, payload: Any, key: str | None, type: str | None, headers: Mapping[str, str]
) -> None:
    """InvalidMessage for what relay could store but not carry (relay.limits)."""
    texts = [("topic", topic), ("key", key), ("type", type)]
    texts += [(f"header name {n!r}", n) for n in headers]
    texts += [(f"header {n!r}", v) for n, v in headers.items()]
    for what, text in texts:
        if text is not None and (why := problem(text)):
            raise InvalidMessage(f"{what} {why}: PostgreSQL's text cannot hold it")
    for what, text in [("topic", topic), ("type", type), *texts[3 : 3 + len(headers)]]:
        if text is not None and utf8_length(text) > MAX_SHORTSTR_BYTES:
            raise InvalidMessage(
                f"{what} is longer than {MAX_SHORTSTR_BYTES} bytes, the AMQP "
                "limit for a routing key, a type or a header name"
            )
    if key is not None and utf8_length(key) > MAX_KEY_BYTES:
        raise InvalidMessage(
            f"key is longer than {MAX_KEY_BYTES} bytes, relay's limit for an "
            "ordering key (it is indexed)"
        )
    depth = value_depth(payload)
    if depth > MAX_JSON_DEPTH:
        raise InvalidMessage(
            f"payload is nested more than {MAX_JSON_DEPTH} levels deep, relay's limit for JSON"
        )
    _check_json_values(payload)


def _check_json_values(payload: Any) -> None:
    """Strings jsonb cannot hold, and numbers JSON cannot write, anywhere in
    the payload (iteratively: the depth is checked first)."""
    stack = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if why := problem(item):
                raise InvalidMessage(f"a string in the payload {why}: jsonb cannot hold it")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidMessage(f"the payload holds {item!r}, which JSON cannot carry")
        elif isinstance(item, dict):
            for name, value in item.items():
                if isinstance(name, str) and (why := problem(name)):
                    raise InvalidMessage(f"a key in the payload {why}: jsonb cannot hold it")
                stack.append(value)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)


def enqueue(
    conn: sa.Connection | Session | psycopg.Connection[Any] | Any,
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
    outbox relay publishes it after the commit. `conn` is a SQLAlchemy
    Connection or Session, a psycopg 3 Connection, or Django's connection
    (PostgreSQL backend on psycopg 3, inside transaction.atomic()).
    """
    message_id, statement = _insert(topic, payload, key, type, headers, id, available_at)
    if isinstance(conn, psycopg.Connection):
        conn.execute(*_dbapi(statement))
    elif _is_django(conn):
        django: Any = conn  # Django is not a dependency: typed by duck
        if getattr(django, "vendor", "postgresql") != "postgresql":
            raise TypeError(f"relay.enqueue needs a PostgreSQL database, not {django.vendor}")
        with django.cursor() as cursor:
            cursor.execute(*_dbapi(statement))
    else:  # SQLAlchemy's Connection, Session, scoped_session...
        conn.execute(statement)
    return message_id


async def enqueue_async(
    conn: AsyncConnection | AsyncSession | psycopg.AsyncConnection[Any],
    topic: str,
    payload: Any,
    *,
    key: str | None = None,
    type: str | None = None,
    headers: Mapping[str, str] | None = None,
    id: uuid.UUID | str | None = None,
    available_at: datetime | None = None,
) -> uuid.UUID:
    """enqueue() for a SQLAlchemy AsyncConnection or AsyncSession, or a
    psycopg 3 AsyncConnection."""
    message_id, statement = _insert(topic, payload, key, type, headers, id, available_at)
    if isinstance(conn, psycopg.AsyncConnection):
        await conn.execute(*_dbapi(statement))
    else:  # SQLAlchemy's AsyncConnection, AsyncSession, async_scoped_session...
        await conn.execute(statement)
    return message_id
