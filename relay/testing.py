"""Test a handler without a broker: run it for one message, as the daemon would.

    from relay.testing import handle

    def test_order_placed(engine):
        with engine.begin() as conn:
            handle(registry, conn, "OrderPlaced", {"order_id": 7})
            assert conn.execute(...)  # the handler's writes, in this transaction

The handler runs in a savepoint of the caller's transaction with a
`relay.Message` built from the arguments. If it raises, its writes are
rolled back to the savepoint and the exception propagates, exactly what
makes the daemon count a failed attempt.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from relay.handlers import Handler, HandlerRegistry, Message, invoke, is_async


def message(
    type: str,
    payload: Any,
    *,
    id: str | None = None,
    topic: str | None = None,
    key: str | None = None,
    headers: Mapping[str, Any] | None = None,
    attempts: int = 0,
    consumer: str = "test",
) -> Message:
    """A Message as the dispatcher builds it from an inbox row."""
    return Message(
        id=id or str(uuid.uuid4()),
        type=type,
        topic=topic,
        key=key,
        payload=payload,
        headers=dict(headers or {}),
        attempts=attempts,
        consumer=consumer,
    )


def _lookup(registry: HandlerRegistry, type: str) -> Handler:
    handler = registry.get(type)
    if handler is None:
        # The daemon marks such a row dead with this error.
        raise LookupError(f"no handler registered for message type {type!r}")
    return handler


def handle(
    registry: HandlerRegistry, conn: sa.Connection, type: str, payload: Any, **fields: Any
) -> Message:
    """Run the sync handler for `type` in a savepoint of `conn`; returns the Message."""
    handler = _lookup(registry, type)
    if is_async(handler):
        raise TypeError(
            f"the handler for {type!r} is async: use handle_async with an AsyncConnection"
        )
    msg = message(type, payload, **fields)
    with conn.begin_nested():
        handler(msg, conn)
    return msg


async def handle_async(
    registry: HandlerRegistry,
    conn: AsyncConnection,
    type: str,
    payload: Any,
    *,
    timeout: float | None = None,
    **fields: Any,
) -> Message:
    """Run the handler for `type` (sync or async) in a savepoint of an
    AsyncConnection, through the daemon's own code path; returns the Message."""
    msg = message(type, payload, **fields)
    await invoke(_lookup(registry, type), msg, conn, timeout)
    return msg
