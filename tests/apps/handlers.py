"""Handlers the inbox tests load with --handlers tests.apps.handlers:registry.

Every handler records its effect in the `effects` table of the test's
database (the tests create it), inside the inbox transaction.

`registry` holds sync handlers only, so its dispatcher runs on psycopg's
blocking connection; `mixed_registry` adds the async ones, which puts the
dispatcher on the async engine (relay.inbox.Dispatcher.dispatch_batch).
`batch_registry` has batch handlers for the types the fault suite
(tests/e2e/test_faults.py) sends, with the effects of `registry`'s.
"""

from __future__ import annotations

import asyncio
import json
import time

import sqlalchemy as sa

import relay

registry = relay.HandlerRegistry()
async_registry = relay.HandlerRegistry()

EFFECTS_DDL = (
    "CREATE TABLE effects (id bigserial PRIMARY KEY, message_id text NOT NULL, "
    "type text, key text, n int, traceparent text, at timestamptz DEFAULT clock_timestamp())"
)

_INSERT = sa.text(
    "INSERT INTO effects (message_id, type, key, n, traceparent) VALUES (:m, :t, :k, :n, :tp)"
)


def _effect(message: relay.Message) -> dict[str, object]:
    payload = message.payload if isinstance(message.payload, dict) else {}
    return {
        "m": message.id,
        "t": message.type,
        "k": message.key,
        "n": payload.get("n"),
        "tp": message.headers.get("traceparent"),
    }


@registry.handler("Effect")
def effect(message: relay.Message, conn: sa.Connection) -> None:
    conn.execute(_INSERT, _effect(message))


@async_registry.handler("AsyncEffect")
async def async_effect(message: relay.Message, conn) -> None:  # AsyncConnection
    await conn.execute(_INSERT, _effect(message))


@async_registry.handler("AsyncFlaky")
async def async_flaky(message: relay.Message, conn) -> None:  # AsyncConnection
    """Flaky, async."""
    await conn.execute(_INSERT, _effect(message))
    if message.attempts < message.payload["fail_times"]:
        raise RuntimeError(f"flaky failure on attempt {message.attempts + 1}")


@registry.handler("Flaky")
def flaky(message: relay.Message, conn: sa.Connection) -> None:
    """Writes, then fails while attempts < payload['fail_times']."""
    conn.execute(_INSERT, _effect(message))
    if message.attempts < message.payload["fail_times"]:
        raise RuntimeError(f"flaky failure on attempt {message.attempts + 1}")


@registry.handler("AlwaysFails")
def always_fails(message: relay.Message, conn: sa.Connection) -> None:
    conn.execute(_INSERT, _effect(message))
    raise ValueError("this handler always fails")


@registry.handler("Slow")
def slow(message: relay.Message, conn: sa.Connection) -> None:
    time.sleep(message.payload.get("seconds", 1))
    conn.execute(_INSERT, _effect(message))


@async_registry.handler("AsyncHang")
async def async_hang(message: relay.Message, conn) -> None:
    await conn.execute(_INSERT, _effect(message))
    await asyncio.sleep(3600)


@registry.handler("SyncHang")
def sync_hang(message: relay.Message, conn: sa.Connection) -> None:
    """Writes, then blocks its thread for an hour: cannot be interrupted."""
    conn.execute(_INSERT, _effect(message))
    time.sleep(3600)


@registry.handler("Logs")
def logs(message: relay.Message, conn: sa.Connection) -> None:
    """Logs one line of its own: the inbox adds the message's id and traceparent."""
    import logging

    logging.getLogger("tests.apps").info("handling")
    conn.execute(_INSERT, _effect(message))


# Batch handlers: every message's effect in one statement, then a failure
# when any message of the call has {"fail": true} (so only the messages
# that fail on their own lose their effects).
_INSERT_MANY = sa.text(
    "INSERT INTO effects (message_id, type, key, n, traceparent) "
    "SELECT m, t, k, n, tp FROM ROWS FROM (json_to_recordset(CAST(:rows AS json)) "
    "AS (m text, t text, k text, n int, tp text)) WITH ORDINALITY AS r(m, t, k, n, tp, i) "
    "ORDER BY i"
)


def _effects(messages: list[relay.Message]) -> dict[str, str]:
    return {"rows": json.dumps([_effect(message) for message in messages])}


def _raise_for_failing(messages: list[relay.Message]) -> None:
    failing = [m.id for m in messages if isinstance(m.payload, dict) and m.payload.get("fail")]
    if failing:
        raise ValueError(f"failing messages in the batch: {failing}")


@registry.batch_handler("BatchEffect", max_size=100)
def batch_effect(messages: list[relay.Message], conn: sa.Connection) -> None:
    conn.execute(_INSERT_MANY, _effects(messages))
    _raise_for_failing(messages)


@async_registry.batch_handler("AsyncBatchEffect", max_size=100)
async def async_batch_effect(messages: list[relay.Message], conn) -> None:  # AsyncConnection
    await conn.execute(_INSERT_MANY, _effects(messages))
    _raise_for_failing(messages)


@registry.batch_handler("BatchHang")
def batch_hang(messages: list[relay.Message], conn: sa.Connection) -> None:
    """Writes, then blocks its thread for an hour if any message has {"hang": true}."""
    conn.execute(_INSERT_MANY, _effects(messages))
    if any(m.payload.get("hang") for m in messages):
        time.sleep(3600)


# The fault suite's handlers as batch handlers: the effects of `effect` and
# `slow`, in the messages' order (effects.id), each call's in one statement.
# max_size below the suite's --batch-size, so that a claimed batch takes
# several calls.
batch_registry = relay.HandlerRegistry()


@batch_registry.batch_handler("Effect", max_size=20)
def effect_batch(messages: list[relay.Message], conn: sa.Connection) -> None:
    conn.execute(_INSERT_MANY, _effects(messages))


@batch_registry.batch_handler("Slow", max_size=20)
def slow_batch(messages: list[relay.Message], conn: sa.Connection) -> None:
    """As long as `slow` would take for the messages one by one."""
    time.sleep(sum(message.payload.get("seconds", 1) for message in messages))
    conn.execute(_INSERT_MANY, _effects(messages))


mixed_registry = relay.HandlerRegistry()
mixed_registry.include(registry)
mixed_registry.include(async_registry)


@registry.handler("RaisesPayloadMessage")
def raises_payload_message(message: relay.Message, conn: sa.Connection) -> None:
    """Fails with the payload's own text, "<NUL>" standing for a NUL character."""
    raise ValueError(message.payload["message"].replace("<NUL>", "\x00"))


@registry.handler("TraceEffect")
def trace_effect(message: relay.Message, conn: sa.Connection) -> None:
    """Records the trace and span the handler runs in (OpenTelemetry's current span)."""
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    conn.execute(
        _INSERT, {**_effect(message), "tp": f"{context.trace_id:032x}-{context.span_id:016x}"}
    )


@registry.handler("RawBody")
def raw_body(message: relay.Message, conn: sa.Connection) -> None:
    """Records what it was given: the raw body (hex) or the JSON payload, in `key`."""
    seen = (
        f"body:{message.body.hex()}" if message.body is not None else f"payload:{message.payload!r}"
    )
    conn.execute(_INSERT, {**_effect(message), "k": seen})
