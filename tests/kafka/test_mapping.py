"""Kafka records as the inbox sees them (relay.brokers.kafka.to_incoming,
then relay.storable.to_row): the contract's mapping, and any record at all
becoming one row, dead with the reason when its columns cannot hold it.
Pure unit tests: records built with confluent-kafka's own Message."""

from __future__ import annotations

import orjson
from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkEvent
from confluent_kafka import KafkaError, Message
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.brokers.kafka import KafkaConsumer, KafkaPublisher, Record, Token, to_incoming
from relay.cloudevents import binding, receive
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable
from relay.rows import Failure
from relay.storable import to_row


def incoming(value: bytes | None, key: bytes | None = None, headers=None, offset: int = 7):
    message = Message(
        topic="orders", partition=2, offset=offset, key=key, value=value, headers=headers or []
    )
    return to_incoming(message, Token("orders", 2, offset, 1))


def test_the_dedup_key_is_id_then_message_id_then_the_records_place():
    assert incoming(b"{}", headers=[("id", b"a"), ("message_id", b"b")]).message_id == "a"
    assert incoming(b"{}", headers=[("message_id", b"b")]).message_id == "b"
    assert incoming(b"{}").message_id == "kafka:orders:2:7"
    assert incoming(b"{}", headers=[("id", b"")]).message_id == "kafka:orders:2:7"


def test_type_key_headers_and_content_type():
    got = incoming(
        b'{"n": 1}',
        key=b"order-1",
        headers=[
            ("type", b"Placed"),
            ("content-type", b"application/json"),
            ("traceparent", b"00-a-b-01"),
            ("traceparent", b"second"),  # a repeated name: the last, as Java's lastHeader()
        ],
    )
    assert (got.type, got.key, got.topic, got.content_type) == (
        "Placed",
        "order-1",
        "orders",
        "application/json",
    )
    assert got.headers["traceparent"] == "second"
    assert incoming(b"{}").type == "orders"  # no type header: the topic
    assert incoming(None).body == b""  # a tombstone's null value


def test_the_sdks_events_as_the_adapter_delivers_them_are_events_to_relay_cloudevents():
    """librdkafka's headers are bytes: decoded as every header, `ce_` ones
    are attributes to relay.cloudevents and `content-type` its content type,
    in binary and structured mode; an attribute that is not UTF-8 is a dead
    row's reason."""
    event = SdkEvent(
        {
            "source": "/apis/v1/pings#a",
            "id": "1",
            "type": "t",
            "datacontenttype": "application/json",
        },
        data={"n": 1},
    )
    for write in (sdk_kafka.to_binary, sdk_kafka.to_structured):
        sdk = write(event, JSONFormat())
        got = receive(incoming(sdk.value, headers=list(sdk.headers.items())), binding("kafka"))
        assert (got.message_id, got.type, got.body, got.rejected) == (
            "/apis/v1/pings#a 1",
            "t",
            b'{"n":1}' if write is sdk_kafka.to_structured else sdk.value,
            None,
        )
        assert got.headers["ce_id"] == "1" and "ce_data" not in got.headers
    bad = incoming(
        b"{}",
        headers=[
            ("ce_specversion", b"1.0"),
            ("ce_id", b"\xff"),
            ("ce_source", b"s"),
            ("ce_type", b"t"),
        ],
    )
    row = to_row(receive(bad, binding("kafka")))
    assert row.status == "dead" and "UTF-8" in (row.last_error or ""), row


names = st.text(min_size=1, max_size=20)
values = st.one_of(st.none(), st.binary(max_size=40))


@settings(max_examples=300, deadline=None)
@given(
    value=st.one_of(st.none(), st.binary(max_size=200)),
    key=st.one_of(st.none(), st.binary(max_size=40)),
    headers=st.lists(st.tuples(names, values), max_size=6),
)
def test_any_record_becomes_one_row_dead_with_a_reason_when_not_storable(value, key, headers):
    message = incoming(value, key=key, headers=headers)
    row = to_row(message)  # never raises
    assert row.message_id
    if row.status == "dead":
        assert row.last_error
        assert row.raw_properties is None or orjson.loads(row.raw_properties) is not None
    bad_key = key is not None and (b"\x00" in key or not _utf8(key))
    last = dict(headers)
    bad_header = any(v is not None and (b"\x00" in v or not _utf8(v)) for v in last.values())
    bad_name = any("\x00" in name for name in last)
    if bad_key or bad_header or bad_name:
        assert row.status == "dead", (key, headers, row.last_error)


def _utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_anything_that_ends_the_consume_thread_reaches_the_loop_as_a_failure(monkeypatch):
    """No broker: the thread's own wrapper, given a consume loop that raises
    what nobody expected. Before it, the thread died and the inbox waited."""
    consumer = KafkaConsumer(
        BrokerURL.parse("kafka://b:9092"), topics=["t"], group="g", prefetch=10
    )

    def broken() -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(consumer, "_consume", broken)
    consumer._consume_or_fail()
    assert isinstance(consumer._failure, BrokerUnavailable)
    assert str(consumer._failure) == "Kafka consumer of t: ZeroDivisionError('a bug')"
    assert consumer._failed()


def test_a_record_the_cluster_refuses_as_too_large_is_dead_with_its_size_and_whose_limit():
    """The cluster's own limit (a topic's max.message.bytes below the
    client's): Tansu takes records of any size, so the delivery report's
    error is built here, as librdkafka hands it over."""
    publisher = KafkaPublisher(BrokerURL.parse("kafka://b:9092?message.max.bytes=50000"))
    record = Record("t", b"k", b"x" * 40_000, [("id", b"1")], 0)
    refused = publisher._result(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), record)
    assert isinstance(refused, Failure) and refused.permanent
    assert refused.error.startswith("record is 40004 bytes (value, key and headers), refused by")
    assert "max.message.bytes" in refused.error and "50000-byte" in refused.error
