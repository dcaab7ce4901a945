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

A batch handler runs through the daemon's own code for it
(relay.batches.run_in_parts): in calls of up to its max_size messages, each
in a savepoint; a call that raises runs again in halves, down to single
messages, and later messages of a failed message's key are held:

    result = handle_batch(registry, conn, "ReadingTaken", [{"v": 1}, {"v": -1}])
    assert [m.payload for m, exc in result.failed] == [{"v": -1}]
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

from relay import batches
from relay.cloudevents import headers_for
from relay.handlers import (
    BatchHandler,
    Handler,
    HandlerRegistry,
    Message,
    call_from_sync,
    invoke,
    is_async,
)


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
    cloudevent: Mapping[str, Any] | None = None,
) -> Message:
    """A Message as the dispatcher builds it from an inbox row. With
    `cloudevent` (attributes, at least `source`), as the inbox stores an
    event: its attributes as `ce_` headers (specversion 1.0, `type` and a
    new id unless given), its id `source id` unless `id` is given, its key
    the event's `subject` unless `key` is."""
    all_headers = dict(headers or {})
    if cloudevent is not None:
        if "source" not in cloudevent:
            raise ValueError("a cloudevent needs at least a source")
        attributes = {"specversion": "1.0", "id": str(uuid.uuid4()), "type": type, **cloudevent}
        all_headers.update(headers_for(attributes))
        id = id or f"{attributes['source']} {attributes['id']}"
        if key is None and isinstance(attributes.get("subject"), str):
            key = attributes["subject"]
    return Message(
        id=id or str(uuid.uuid4()),
        type=type,
        topic=topic,
        key=key,
        payload=payload,
        headers=all_headers,
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


@dataclass
class BatchResult:
    """What the daemon would make of a batch: the messages handled (their
    writes kept), those that failed on their own (rolled back; the daemon
    counts an attempt) with their exception, and those held behind a
    failed message of their key (not run; the daemon leaves them pending)."""

    processed: list[Message] = field(default_factory=list)
    failed: list[tuple[Message, Exception]] = field(default_factory=list)
    held: list[Message] = field(default_factory=list)
    calls: int = 0  # how many times the batch handler was called


def _lookup_batch(registry: HandlerRegistry, type: str) -> tuple[BatchHandler, int]:
    batch = registry.get_batch(type)
    if batch is None:
        raise LookupError(f"no batch handler registered for message type {type!r}")
    return batch


def _messages(type: str, items: Sequence[Any], fields: dict[str, Any]) -> list[Message]:
    """Messages as given, or built with message() from payloads."""
    return [item if isinstance(item, Message) else message(type, item, **fields) for item in items]


def _run_batch(
    fn: BatchHandler,
    max_size: int,
    messages: list[Message],
    conn: sa.Connection,
    async_conn: AsyncConnection | None,
    timeout: float | None,
) -> BatchResult:
    result = BatchResult()
    failed_keys: set[str] = set()

    def attempt(part: list[Message]) -> Exception | None:
        result.calls += 1
        try:
            with conn.begin_nested():
                call_from_sync(fn, part, conn, async_conn, timeout)
        except Exception as exc:
            return exc
        return None

    # In calls of up to max_size, as a claimed batch is given to the handler.
    for start in range(0, len(messages), max_size):
        outcome = batches.run_in_parts(
            messages[start : start + max_size],
            attempt,
            key=lambda m: m.key,
            failed_keys=failed_keys,
            alone=lambda m: m.attempts > 0,
        )
        result.processed += outcome.done
        result.failed += outcome.failed
        result.held += outcome.held
    return result


def handle_batch(
    registry: HandlerRegistry,
    conn: sa.Connection,
    type: str,
    items: Sequence[Any],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> BatchResult:
    """Run the sync batch handler for `type` as the daemon would, in
    savepoints of `conn`. `items`: payloads (made into Messages with
    `fields`, as message() does) or Messages."""
    fn, max_size = _lookup_batch(registry, type)
    if is_async(fn):
        raise TypeError(
            f"the batch handler for {type!r} is async: "
            "use handle_batch_async with an AsyncConnection"
        )
    return _run_batch(fn, max_size, _messages(type, items, fields), conn, None, timeout)


async def handle_batch_async(
    registry: HandlerRegistry,
    conn: AsyncConnection,
    type: str,
    items: Sequence[Any],
    *,
    timeout: float | None = None,
    **fields: Any,
) -> BatchResult:
    """handle_batch for a batch handler (sync or async) on an
    AsyncConnection, through the daemon's own code path."""
    fn, max_size = _lookup_batch(registry, type)
    messages = _messages(type, items, fields)
    result: BatchResult = await conn.run_sync(
        lambda sync_conn: _run_batch(fn, max_size, messages, sync_conn, conn, timeout)
    )
    return result
