"""relay.cloudevents, the envelope alone (no server), with the CloudEvents
Python SDK as the other side: what relay writes the SDK reads as the
event it should be, in each broker's binding; what the SDK writes relay
stores as the row it should be; and relay's verdict on an event's
validity agrees with the SDK's on generated attributes.

End to end against the real brokers: tests/e2e/test_cloudevents.py."""

from __future__ import annotations

import base64
import dataclasses
from datetime import UTC, datetime
from typing import Any

import orjson
import pytest
from cloudevents.core.bindings import amqp as sdk_amqp
from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from relay import cloudevents
from relay.brokers import KINDS, Incoming, row_body
from relay.cloudevents import BINDINGS, CloudEvent, CloudEventsPublisher, binding, receive
from relay.config import OutboxSettings
from relay.errors import ConfigError
from relay.handlers import Message
from relay.rows import OutboxRow
from relay.storable import to_row
from relay.testing import message as make_message

SOURCE = "https://shop.example.com/orders"
CREATED = datetime(2026, 11, 27, 19, 0, 1, 234567, tzinfo=UTC)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _row(**changes: Any) -> OutboxRow:
    values: dict[str, Any] = {
        "id": "0193a2b4-0000-7000-8000-000000000001",
        "seq": 1,
        "topic": "orders.placed",
        "key": "order-7",
        "type": "OrderPlaced",
        "payload": '{"order_id": 7, "big": 123456789012345678901234567890}',
        "headers": orjson.dumps({"traceparent": TRACEPARENT, "x": "y"}).decode(),
        "created_at": CREATED,
        "attempts": 0,
    }
    values.update(changes)
    return OutboxRow(**values)


def _event(kind: str, row: OutboxRow) -> OutboxRow:
    return CloudEventsPublisher(None, SOURCE, binding(kind)).event(row)  # type: ignore[arg-type]


def _check_sdk_event(event: Any, row: OutboxRow) -> None:
    attributes = event.get_attributes()
    assert attributes["specversion"] == "1.0"
    assert attributes["id"] == row.id
    assert attributes["source"] == SOURCE
    assert attributes["type"] == (row.type or row.topic)
    assert attributes.get("subject") == row.key
    assert attributes["time"] == row.created_at
    assert attributes["datacontenttype"] == "application/json"
    assert attributes["traceparent"] == TRACEPARENT


# --------------------------------------------------------------------------
# Outbox: relay's events as the SDK reads them
# --------------------------------------------------------------------------


@pytest.mark.parametrize("row", [_row(), _row(key=None, type=None)], ids=["full", "bare"])
def test_binary_amqp_events_read_by_the_sdk(row):
    event_row = _event("amqp", row)
    # What the AMQP adapter sends: the row's headers, the attributes, the body.
    headers = {**orjson.loads(row.headers), **dict(event_row.attributes)}
    message = sdk_amqp.AMQPMessage(
        properties={"content-type": "application/json"},
        application_properties=headers,
        application_data=row_body(event_row),
    )
    event = sdk_amqp.from_binary(message, JSONFormat(), SdkEvent)
    _check_sdk_event(event, row)
    assert event.get_data() == {"order_id": 7, "big": 123456789012345678901234567890}
    # Binary mode: the row as it was, but for the attributes added.
    assert dataclasses.replace(event_row, attributes=row.attributes) == row


def test_binary_kafka_events_read_by_the_sdk():
    row = _row()
    event_row = _event("kafka", row)
    # What the Kafka adapter sends: content-type, the row's headers, the attributes.
    headers = {
        "content-type": b"application/json",
        **{k: v.encode() for k, v in orjson.loads(row.headers).items()},
        **{k: str(v).encode() for k, v in event_row.attributes},
    }
    message = sdk_kafka.KafkaMessage(headers=headers, key=row.key, value=row_body(event_row))
    event = sdk_kafka.from_binary(message, JSONFormat(), SdkEvent)
    _check_sdk_event(event, row)
    assert all(name.startswith("ce_") for name, _ in event_row.attributes)


def test_structured_sqs_events_read_by_the_sdk():
    row = _row()
    event_row = _event("sqs", row)
    assert dict(event_row.attributes)["content-type"] == "application/cloudevents+json"
    body = row_body(event_row)
    event = JSONFormat().read(SdkEvent, body)
    _check_sdk_event(event, row)
    # data is the payload, every number exact.
    assert b'"big":123456789012345678901234567890' in body
    assert orjson.loads(body)["data"]["order_id"] == 7


def test_structured_event_keeps_the_claim_check_attribute_and_other_attributes():
    row = _row(attributes=(("ExtendedPayloadSize", 10),))
    assert _event("sqs", row).attributes[0] == ("ExtendedPayloadSize", 10)
    assert _event("amqp", row).attributes[0] == ("ExtendedPayloadSize", 10)


def test_a_row_whose_headers_are_not_an_object_has_no_traceparent_extension():
    for headers in ('["traceparent"]', '{"traceparent": 5}', "not json traceparent"):
        names = [name for name, _ in _event("amqp", _row(headers=headers)).attributes]
        assert "cloudEvents_traceparent" not in names


def test_time_is_rfc3339_utc_to_the_microsecond():
    from datetime import timedelta, timezone

    local = CREATED.astimezone(timezone(timedelta(hours=5, minutes=30)))
    assert cloudevents.rfc3339(local) == "2026-11-27T19:00:01.234567Z"
    assert cloudevents.rfc3339(CREATED.replace(microsecond=0)) == "2026-11-27T19:00:01.000000Z"


@pytest.mark.parametrize(
    "source", ["https://example.com/a", "/orders", "urn:shop:orders", "orders", "//h/p#frag"]
)
def test_the_source_is_a_uri_reference(source):
    assert OutboxSettings("postgresql://x/db", cloudevents_source=source).cloudevents_source


@pytest.mark.parametrize(
    "source", ["", "a b", "caf\u00e9", "x#y#z", "1a:b", "%zz", "http://h:99999"]
)
def test_a_source_that_is_no_uri_reference_is_a_config_error(source):
    with pytest.raises(ConfigError, match="--cloudevents-source"):
        OutboxSettings("postgresql://x/db", cloudevents_source=source)


def test_the_binding_table_names_every_broker():
    assert set(BINDINGS) == set(KINDS)
    assert binding("amqp").prefixes[0] == "cloudEvents_"
    assert binding("kafka").prefixes == ("ce_",)
    assert binding("nats").prefixes == ("ce_", "ce-")
    assert binding("nats").content_type == "content-type"
    assert not binding("sqs").binary


# --------------------------------------------------------------------------
# Inbox: the SDK's events as relay stores them
# --------------------------------------------------------------------------


def _sdk_event(**attributes: Any) -> SdkEvent:
    base = {
        "id": "evt-1",
        "source": "/apis/v1/namespaces/default/pingsources/ping#cron",
        "type": "dev.knative.sources.ping",
        "subject": "sub-1",
        "datacontenttype": "application/json",
        "time": datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
        "traceparent": TRACEPARENT,
        "retries": 3,
    }
    base.update(attributes)
    return SdkEvent({k: v for k, v in base.items() if v is not None}, data={"n": 1})


def _incoming(body: bytes, headers: dict[str, Any], content_type: str | None) -> Incoming:
    return Incoming(
        message_id="broker-id",
        topic="t",
        key=None,
        type="t",
        body=body,
        headers=headers,
        content_type=content_type,
    )


def _check_row(received: Incoming, *, time: str) -> dict[str, Any]:
    row = to_row(received)
    assert row.status == "pending", row.last_error
    assert row.message_id == "/apis/v1/namespaces/default/pingsources/ping#cron evt-1"
    assert row.type == "dev.knative.sources.ping"
    assert row.key == "sub-1"
    assert orjson.loads(row.payload or "null") == {"n": 1}
    headers = orjson.loads(row.headers)
    assert headers["ce_id"] == "evt-1"
    assert headers["ce_source"] == "/apis/v1/namespaces/default/pingsources/ping#cron"
    assert headers["ce_specversion"] == "1.0"
    assert headers["ce_time"] == time
    assert headers["ce_traceparent"] == TRACEPARENT
    assert headers["traceparent"] == TRACEPARENT  # for relay's tracing and logs
    assert "data" not in headers and "ce_data" not in headers
    return headers


def test_sdk_amqp_binary_events_become_rows():
    message = sdk_amqp.to_binary(_sdk_event(), JSONFormat())
    received = receive(
        _incoming(
            message.application_data,
            dict(message.application_properties),
            message.properties["content-type"],
        ),
        binding("amqp"),
    )
    # The SDK writes the AMQP time as integer milliseconds.
    headers = _check_row(received, time="2026-01-02T03:04:05.678000Z")
    assert headers["ce_retries"] == 3
    assert headers["ce_datacontenttype"] == "application/json"
    assert not any(name.startswith("cloudEvents") for name in headers)


def test_amqp_colon_prefix_and_timestamp_are_read():
    message = sdk_amqp.to_binary(_sdk_event(), JSONFormat())
    headers = {
        k.replace("cloudEvents_", "cloudEvents:"): v
        for k, v in message.application_properties.items()
    }
    headers["cloudEvents:time"] = datetime(2026, 1, 2, 3, 4, 5)  # an AMQP timestamp (seconds)
    received = receive(_incoming(message.application_data, headers, None), binding("amqp"))
    _check_row(received, time="2026-01-02T03:04:05.000000Z")


def test_sdk_kafka_binary_events_become_rows():
    message = sdk_kafka.to_binary(_sdk_event(), JSONFormat())
    headers = dict(message.headers)
    content_type = headers.pop("content-type").decode()
    received = receive(_incoming(message.value, headers, content_type), binding("kafka"))
    headers = _check_row(received, time="2026-01-02T03:04:05.678000Z")
    assert headers["ce_retries"] == "3"  # Kafka headers carry text


@pytest.mark.parametrize("kind", ["amqp", "kafka", "sqs"])
def test_sdk_structured_events_become_rows_on_every_broker(kind):
    body = JSONFormat().write(_sdk_event())
    received = receive(
        _incoming(
            body,
            {"content-type": "application/cloudevents+json"},
            "Application/CloudEvents+JSON; charset=utf-8",
        ),
        binding(kind),
    )
    headers = _check_row(received, time="2026-01-02T03:04:05.678000Z")
    assert headers["ce_datacontenttype"] == "application/json"
    assert "content-type" not in headers  # the envelope's, not the data's


def test_structured_data_base64_and_no_data():
    event = SdkEvent({"id": "1", "source": "s", "type": "T"}, data=b'{"n": 2}')
    received = receive(
        _incoming(JSONFormat().write(event), {}, "application/cloudevents+json"), binding("sqs")
    )
    assert received.body == b'{"n": 2}'
    empty = SdkEvent({"id": "2", "source": "s", "type": "T"})
    received = receive(
        _incoming(JSONFormat().write(empty), {}, "application/cloudevents+json"), binding("sqs")
    )
    assert to_row(received).payload == "null"


def test_the_broker_key_wins_over_the_subject():
    message = sdk_amqp.to_binary(_sdk_event(), JSONFormat())
    incoming = _incoming(message.application_data, dict(message.application_properties), None)
    incoming.key = "relay-key"
    assert receive(incoming, binding("amqp")).key == "relay-key"


def test_messages_that_are_no_events_are_left_as_they_are():
    plain = _incoming(b"{}", {"x-relay-key": "k", "ce_id": "1"}, "application/json")
    assert receive(plain, binding("amqp")) is plain
    assert receive(plain, binding("sqs")) is plain  # SQS: structured mode only
    kafka_like = _incoming(b"{}", {"cloudEvents_id": "1"}, None)
    assert receive(kafka_like, binding("kafka")) is kafka_like


@pytest.mark.parametrize(
    ("kind", "body", "headers", "content_type", "reason"),
    [
        ("amqp", b"{}", {"cloudEvents_id": "1", "cloudEvents_source": "s"}, None, "'specversion'"),
        (
            "amqp",
            b"{}",
            {
                "cloudEvents_specversion": "0.3",
                "cloudEvents_id": "1",
                "cloudEvents_source": "s",
                "cloudEvents_type": "T",
            },
            None,
            "specversion is '0.3'",
        ),
        ("sqs", b'{"specversion": "1.0", "id": 5, "source": "s", "type": "T"}', {}, None, "id"),
        ("sqs", b"[1]", {}, None, "not an object"),
        ("sqs", b"not json", {}, None, "not valid JSON"),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","time":"yesterday"}',
            {},
            None,
            "RFC 3339",
        ),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","time":1700000000000}',
            {},
            None,
            "'time' is a integer",
        ),
        ("sqs", b'{"specversion":"1.0","id":"1","source":"","type":"T"}', {}, None, "empty"),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","Bad_Name":"x"}',
            {},
            None,
            "lower-case",
        ),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","ext":1.5}',
            {},
            None,
            "number",
        ),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","ext":4294967296}',
            {},
            None,
            "32-bit",
        ),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","data":1,"data_base64":"AA=="}',
            {},
            None,
            "both data",
        ),
        (
            "sqs",
            b'{"specversion":"1.0","id":"1","source":"s","type":"T","data_base64":"!"}',
            {},
            None,
            "base64",
        ),
        (
            "kafka",
            b"{}",
            {"ce_specversion": b"1.0", "ce_id": b"\xff", "ce_source": b"s", "ce_type": b"T"},
            None,
            "UTF-8",
        ),
    ],
)
def test_events_that_break_the_specification_are_dead_as_received(
    kind, body, headers, content_type, reason
):
    if kind == "sqs":
        content_type = "application/cloudevents+json"
    incoming = _incoming(body, headers, content_type)
    received = receive(incoming, binding(kind))
    assert received.rejected is not None and reason in received.rejected, received.rejected
    row = to_row(received)
    assert row.status == "dead" and "not a valid CloudEvent" in (row.last_error or "")
    # Kept as received: the broker's id, the body as it came.
    assert row.message_id == "broker-id"
    assert (row.payload or "").encode() == body or row.body == body


# --------------------------------------------------------------------------
# relay's verdict against the SDK's, on generated attributes
# --------------------------------------------------------------------------

_names = st.sampled_from(["id", "source", "type", "specversion", "subject", "dataschema"])
_values = st.one_of(
    st.text(max_size=8),
    st.integers(-(2**31), 2**31 - 1),
    st.booleans(),
    st.just("1.0"),
)
_extensions = st.dictionaries(
    st.one_of(st.from_regex(r"\A[a-z0-9]{1,10}\Z"), st.from_regex(r"\A[A-Za-z_]{1,10}\Z")),
    st.one_of(st.text(max_size=8), st.integers(-(2**31), 2**31 - 1), st.booleans()),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(
    base=st.fixed_dictionaries(
        {},
        optional={
            "id": st.one_of(st.text(max_size=8), _values),
            "source": st.one_of(st.text(max_size=8), _values),
            "type": st.one_of(st.text(max_size=8), _values),
            "specversion": st.one_of(st.just("1.0"), _values),
            "subject": _values,
            "dataschema": _values,
            "datacontenttype": st.just("application/json"),
        },
    ),
    extensions=_extensions,
)
def test_relay_and_the_sdk_agree_on_which_events_are_valid(base, extensions):
    attributes = {**extensions, **base}
    attributes.pop("data", None)
    try:
        SdkEvent(dict(attributes), data={"n": 1})
        sdk_valid = True
    except BaseCloudEventException:
        sdk_valid = False
    # The SDK fills in a missing specversion and id itself; a producer's
    # message without them is no valid event.
    sdk_valid = sdk_valid and "specversion" in attributes and "id" in attributes
    body = orjson.dumps({**attributes, "data": {"n": 1}})
    received = receive(_incoming(body, {}, "application/cloudevents+json"), binding("sqs"))
    assert (received.rejected is None) == sdk_valid, (attributes, received.rejected)


# --------------------------------------------------------------------------
# Handlers: relay.Message.cloudevent and relay.testing
# --------------------------------------------------------------------------


def test_message_cloudevent_reads_the_ce_headers():
    message = Message(
        id="s 1",
        type="T",
        topic=None,
        key=None,
        payload={},
        headers={
            "ce_specversion": "1.0",
            "ce_id": "1",
            "ce_source": "s",
            "ce_type": "T",
            "ce_time": "2026-01-02T03:04:05.678Z",
            "ce_retries": 3,
            "other": "x",
        },
    )
    event = message.cloudevent
    assert isinstance(event, CloudEvent)
    assert (event.id, event.source, event.type, event.specversion) == ("1", "s", "T", "1.0")
    assert event.time == datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
    assert event["retries"] == 3 and event.extensions == {"retries": 3}
    assert "other" not in event and event.subject is None
    with pytest.raises(TypeError):
        event["id"] = "2"  # type: ignore[index]
    assert Message(id="x", type=None, topic=None, key=None, payload=None).cloudevent is None


def test_relay_testing_builds_messages_of_events():
    message = make_message(
        "OrderPlaced",
        {"order_id": 7},
        cloudevent={"source": SOURCE, "id": "e-1", "subject": "order-7", "time": CREATED},
    )
    assert message.id == f"{SOURCE} e-1"
    assert message.key == "order-7"
    event = message.cloudevent
    assert event is not None and event.type == "OrderPlaced" and event.time == CREATED
    assert message.headers["ce_time"] == "2026-11-27T19:00:01.234567Z"
    with pytest.raises(ValueError, match="source"):
        make_message("T", {}, cloudevent={"id": "1"})


def test_a_binary_extension_is_kept_as_base64():
    message = sdk_amqp.to_binary(_sdk_event(), JSONFormat())
    headers = dict(message.application_properties)
    headers["cloudEvents_blob"] = bytearray(b"\x00\x01")
    received = receive(_incoming(message.application_data, headers, None), binding("amqp"))
    assert received.headers["ce_blob"] == base64.b64encode(b"\x00\x01").decode()
