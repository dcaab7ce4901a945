"""The batch encoder produces exactly the bytes pamqp (aiormq's encoder) produces."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
from pamqp import commands as spec
from pamqp import frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from relay.brokers.amqp_wire import publish_frames, shortstr


def pamqp_bytes(channel, exchange, routing_key, body, properties, max_content):
    frames = [
        spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=True),
        ContentHeader(properties=properties, body_size=len(body)),
    ]
    frames += [ContentBody(body[i : i + max_content]) for i in range(0, len(body), max_content)]
    return b"".join(frame.marshal(f, channel) for f in frames)


@pytest.mark.parametrize("type_", ["OrderPlaced", None])
@pytest.mark.parametrize("headers", [{}, {"traceparent": "00-abc-01", "x-relay-key": "kæy"}])
@pytest.mark.parametrize("body", [b'{"a":1}', b"x" * 10_000, b""])
def test_same_bytes_as_pamqp(type_, headers, body):
    message_id = str(uuid.uuid4())
    stamp = datetime(2026, 11, 22, 3, 4, 5, 678000, tzinfo=UTC)
    properties = spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=message_id,
        message_type=type_,
        timestamp=stamp,
        headers=headers or None,
    )
    expected = pamqp_bytes(3, "relay", "orders.placed", body, properties, 4096)
    got = publish_frames(
        3,
        shortstr("relay"),
        "orders.placed",
        body,
        message_id=message_id,
        type=type_,
        timestamp=stamp,
        headers=headers,
        max_content_size=4096,
    )
    assert got == expected


def test_overlong_short_string_is_refused():
    with pytest.raises(ValueError, match="255 bytes"):
        shortstr("k" * 256)
