"""relay's AMQP wire format: the batch encoder produces exactly the bytes
pamqp (aiormq's encoder) produces, and the receiver's decoding of
deliveries gives what pamqp's gives."""

from __future__ import annotations

import struct
import uuid
from datetime import UTC, datetime

import pytest
from aiormq.abc import DeliveredMessage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands as spec
from pamqp import frame
from pamqp.body import ContentBody
from pamqp.decode import field_table
from pamqp.header import ContentHeader

from relay.brokers import Incoming
from relay.brokers.amqp import aiormq_internals, consuming, publishing
from relay.brokers.amqp import lenient as amqp_lenient
from relay.brokers.amqp import wire as amqp_wire
from relay.brokers.amqp.wire import publish_frames, shortstr
from tests import amqp_raw


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


# --- deliveries: relay's decoding against pamqp's ------------------------------

_text = st.one_of(st.text(max_size=20), st.binary(max_size=20))  # bytes: maybe not UTF-8
_values = st.recursive(
    st.one_of(
        st.tuples(st.just("S"), _text),
        st.tuples(st.just("l"), st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("t"), st.booleans()),
        st.tuples(st.just("T"), st.integers(0, 2**64 - 1)),  # past year 9999 too
        st.tuples(st.just("V"), st.none()),
        st.tuples(st.just("Z"), st.none()),  # a type no decoder knows
    ),
    lambda inner: st.tuples(st.just("F"), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=6,
)
_properties = st.fixed_dictionaries(
    {},
    optional={
        "content_type": _text,
        "content_encoding": _text,
        "headers": st.dictionaries(st.one_of(_text, st.just("x-relay-key")), _values, max_size=4),
        "delivery_mode": st.integers(0, 255),
        "priority": st.integers(0, 255),
        "correlation_id": _text,
        "reply_to": _text,
        "expiration": _text,
        "message_id": _text,
        "timestamp": st.integers(0, 2**64 - 1),
        "type": _text,
        "user_id": _text,
        "app_id": _text,
    },
)


class _Channel:
    number = 7


def _field(value):
    kind, inner = value
    if kind == "Z":
        return amqp_raw.Encoded(b"Z")
    if kind == "F":
        return ("F", {name: _field(v) for name, v in inner.items()})
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    properties=_properties,
    routing_key=_text,
    exchange=st.text(max_size=10),
    tag=st.integers(1, 2**63 - 1),
    body=st.binary(max_size=300),
    chunk=st.integers(1, 200),
)
def test_deliveries_decode_as_pamqp_decodes_them(
    properties, routing_key, exchange, tag, body, chunk
):
    """Whatever a producer put in a delivery's properties (invalid UTF-8,
    timestamps past year 9999, tables of unknown types), the receiver's own
    decoding gives the inbox exactly what pamqp's (with relay's lenient
    fallbacks) gives it."""
    amqp_lenient.install()
    if "headers" in properties:
        properties["headers"] = {k: _field(v) for k, v in properties["headers"].items()}
    header = amqp_raw.content_header(len(body), **properties)
    method = (
        struct.pack(">HH", 60, 60)
        + amqp_raw.shortstr("ctag")
        + struct.pack(">QB", tag, 0)
        + amqp_raw.shortstr(exchange)
        + amqp_raw.shortstr(routing_key)
    )
    got: list[Incoming] = []
    deliveries = consuming._Deliveries(_Channel(), got.append)
    assert not deliveries(1, 8, method)  # another channel's frames go on to aiormq
    assert deliveries(1, 7, method)
    assert deliveries(2, 7, header)
    for start in range(0, len(body), chunk):
        assert deliveries(3, 7, body[start : start + chunk])
    expected = consuming._from_pamqp(
        DeliveredMessage(
            delivery=aiormq_internals.decode_method(method),
            header=aiormq_internals.decode_header(header),
            body=body,
            channel=_Channel(),
        )
    )
    [incoming] = got
    for name in (
        "message_id",
        "topic",
        "key",
        "type",
        "body",
        "headers",
        "undecodable",
        "content_type",
    ):
        assert getattr(incoming, name) == getattr(expected, name), name
    assert incoming.ack_token[1] == expected.ack_token[1] == tag
    assert incoming.original() == expected.original()


@pytest.mark.parametrize(
    "properties",
    [
        {},
        {"message_id": "m-1", "message_type": "OrderPlaced"},
        {  # what pika, amqplib and kombu send: every common property
            "content_type": "application/json",
            "content_encoding": "utf-8",
            "headers": {"x-relay-key": "k", "n": 5, "nested": {"a": [1, "b"]}},
            "delivery_mode": 2,
            "priority": 0,
            "correlation_id": "c",
            "reply_to": "r",
            "expiration": "60000",
            "message_id": "m-2",
            "timestamp": datetime(2026, 11, 27, tzinfo=UTC),
            "message_type": "T",
            "user_id": "guest",
            "app_id": "shop",
            "cluster_id": "",
        },
    ],
)
def test_common_deliveries_are_decoded_without_pamqp(properties):
    """The fast way is the way taken: headers as clients send them decode
    without falling back to pamqp (which gives the same values, slower)."""
    header = ContentHeader(properties=spec.Basic.Properties(**properties), body_size=3)
    payload = frame.marshal(header, 1)[7:-1]
    size, message_id, type_, headers, content_type = amqp_wire.decode_header(payload, field_table)
    assert (size, message_id, type_, content_type) == (
        3,
        properties.get("message_id"),
        properties.get("message_type"),
        properties.get("content_type"),
    )
    assert headers == (properties.get("headers") or {})
    deliver = spec.Basic.Deliver("ctag", 42, False, "relay", "orders.placed")
    assert amqp_wire.decode_deliver(frame.marshal(deliver, 1)[7:-1]) == (
        42,
        "relay",
        "orders.placed",
    )


class _PublisherChannel:
    """What _Returns reads of aiormq's channel: its number, its message id ->
    delivery tag map and its confirmation table."""

    number = 7

    def __init__(self, tags: dict[str, int], confirmations: dict[int, object]) -> None:
        self.message_id_delivery_tag = tags
        self.confirmations = confirmations


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    properties=_properties,
    body=st.binary(max_size=300),
    chunk=st.integers(1, 200),
    published=st.booleans(),
)
def test_returns_are_matched_to_their_publish_as_pamqp_decodes_them(
    properties, body, chunk, published
):
    """Whatever a returned message's properties hold (relay's own publishes
    carry the app's headers), the publisher's reader of basic.return finds
    the message id pamqp (with relay's lenient fallbacks) finds, takes the
    return's every frame and notes the tag of its publish, and only that."""
    amqp_lenient.install()
    if "headers" in properties:
        properties["headers"] = {k: _field(v) for k, v in properties["headers"].items()}
    header = amqp_raw.content_header(len(body), **properties)
    expected = aiormq_internals.decode_header(header).properties.message_id
    batch = publishing._Confirms(None, 41, {}, {})  # type: ignore[arg-type]
    tags = {expected: 42} if published and expected is not None else {}
    channel = _PublisherChannel(tags, {41: batch, 42: batch})
    returned: dict[int, object] = {}
    returns = publishing._Returns(channel, returned)  # type: ignore[arg-type]
    method = (
        amqp_wire.BASIC_RETURN
        + struct.pack(">H", 312)
        + amqp_raw.shortstr("NO_ROUTE")
        + amqp_raw.shortstr("relay")
        + amqp_raw.shortstr("nobody.listens")
    )
    assert not returns(1, 8, method)  # another channel's frames go on to aiormq
    assert not returns(2, 7, header)  # a header not after a return: a delivery's
    assert returns(1, 7, method)
    assert returns(2, 7, header)
    for start in range(0, len(body), chunk):
        assert returns(3, 7, body[start : start + chunk])
    assert not returns(3, 7, b"x")  # the return's body is over
    assert returned == ({42: batch} if tags else {})


def test_a_common_return_is_read_without_pamqp():
    """Relay's own publishes come back as relay encoded them: the fast way."""
    message_id = "0f7f6c3c-2d0e-4d7e-9a39-7d1c1c1c1c1c"
    frames = publish_frames(
        1,
        shortstr("relay"),
        "nobody.listens",
        b'{"a":1}',
        message_id=message_id,
        type="T",
        timestamp=datetime(2026, 11, 28, tzinfo=UTC),
        headers={"traceparent": "00-abc-01", "x-relay-key": "k", "n": 5},
        max_content_size=100,
    )
    # The frames: the publish method, the content header, the body.
    (method_size,) = struct.unpack_from(">I", frames, 3)
    at = 7 + method_size + 1
    (header_size,) = struct.unpack_from(">I", frames, at + 3)
    header = frames[at + 7 : at + 7 + header_size]
    assert amqp_wire.decode_returned(header) == (7, message_id)
