"""Handlers of the CloudEvents tests (tests/e2e/test_cloudevents.py):
`registry` holds tests.apps.handlers' (the canaries' `Effect`) and one
handler for the event types the tests send, which records what
`relay.Message.cloudevent` gave it in the `events` table."""

from __future__ import annotations

import os

import sqlalchemy as sa

import relay
from tests.apps.handlers import registry as plain

EVENTS_DDL = (
    "CREATE TABLE events (id bigserial PRIMARY KEY, message_id text NOT NULL, type text, "
    "key text, source text, event_id text, time timestamptz, subject text, data jsonb, "
    "traceparent text)"
)
TYPES = ("com.example.order.placed", "dev.knative.sources.ping", "OrderPlaced", "orders.shipped")

_INSERT = sa.text(
    "INSERT INTO events (message_id, type, key, source, event_id, time, subject, data, "
    "traceparent) VALUES (:m, :t, :k, :s, :i, :time, :subject, CAST(:data AS jsonb), :tp)"
)

registry = relay.HandlerRegistry()
registry.include(plain)


def event(message: relay.Message, conn: sa.Connection) -> None:
    import json

    cloudevent = message.cloudevent
    assert cloudevent is not None, "an event's message has its attributes"
    conn.execute(
        _INSERT,
        {
            "m": message.id,
            "t": cloudevent.type,
            "k": message.key,
            "s": cloudevent.source,
            "i": cloudevent.id,
            "time": cloudevent.time,
            "subject": cloudevent.subject,
            "data": json.dumps(message.payload),
            "tp": message.headers.get("traceparent"),
        },
    )


# A test's own topic, when its rows have no type (TEST_EVENT_TYPES, comma-separated).
for _type in (*TYPES, *filter(None, os.environ.get("TEST_EVENT_TYPES", "").split(","))):
    registry.add(_type, event)
