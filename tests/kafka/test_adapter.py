"""The Kafka adapter against Tansu, with confluent-kafka as the other side:
what the contract's Kafka paragraphs say of the wire."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import orjson

from relay.brokers import make_publisher
from relay.config import BrokerURL
from relay.rows import OutboxRow
from tests.kafka_server import Kafka

CREATED = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)


def row(
    topic: str, payload: object = None, *, key: str | None = None, n: int = 0, **kw
) -> OutboxRow:
    text = orjson.dumps({"n": n} if payload is None else payload).decode()
    return OutboxRow(
        str(uuid.uuid4()),
        n,
        topic,
        key,
        kw.get("type"),
        text,
        kw.get("headers", "{}"),
        CREATED,
        0,
        kw.get("attributes", ()),
    )


def publisher(kafka: Kafka, extra: str = ""):
    return make_publisher(BrokerURL.parse(kafka.url(extra)), exchange="relay", workers=4)


async def test_a_record_carries_the_contracts_key_value_timestamp_and_headers(kafka: Kafka):
    topic = kafka.topic("wire")
    full = row(
        topic,
        {"order_id": 7, "note": "é", "big": 12345678901234567890},
        key="order-7",
        type="OrderPlaced",
        headers='{"traceparent": "00-abc-def-01"}',
        attributes=(("ExtendedPayloadSize", 300000),),
    )
    plain = row(topic, [1, 2, 3])
    pub = publisher(kafka)
    try:
        assert await pub.publish([full, plain]) == [None, None]
        assert pub.connected
    finally:
        await pub.close()
    got = {m.headers()[0][1].decode(): m for m in kafka.read(topic, 2)}
    first, second = got[full.id], got[plain.id]
    assert first.key() == b"order-7"
    assert first.value() == '{"order_id":7,"note":"é","big":12345678901234567890}'.encode()
    assert first.timestamp()[1] == int(CREATED.timestamp() * 1000)
    assert first.headers() == [
        ("id", full.id.encode()),
        ("type", b"OrderPlaced"),
        ("content-type", b"application/json"),
        ("traceparent", b"00-abc-def-01"),
        ("ExtendedPayloadSize", b"300000"),
    ]
    assert second.key() is None and second.value() == b"[1,2,3]"
    assert second.headers() == [("id", plain.id.encode()), ("content-type", b"application/json")]
