"""The Kafka adapter against Tansu, with confluent-kafka as the other side:
what the contract's Kafka paragraphs say of the wire."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from relay.brokers import Outcome, make_consumer, make_publisher
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable
from relay.rows import Failure, OutboxRow
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


def group_consumer(kafka: Kafka, topic: str):
    """relay's consumer of `topic` as the group g-TOPIC."""
    return make_consumer(
        BrokerURL.parse(kafka.url()),
        queue=topic,
        exchange="relay",
        binds=(),
        prefetch=100,
        consumer_name="g-" + topic,
    )


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
    # Row headers named like relay's own: relay's stay the only ones.
    clash = row(
        topic,
        type="Real",
        headers='{"id": "forged", "type": "Other", "content-type": "text/plain", '
        '"ExtendedPayloadSize": "1", "kept": "yes"}',
        attributes=(("ExtendedPayloadSize", 300000),),
    )
    pub = publisher(kafka)
    try:
        assert await pub.publish([full, plain, clash]) == [None, None, None]
        assert pub.connected
    finally:
        await pub.close()
    got = {m.headers()[0][1].decode(): m for m in kafka.read(topic, 3)}
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
    assert got[clash.id].headers() == [
        ("id", clash.id.encode()),
        ("type", b"Real"),
        ("content-type", b"application/json"),
        ("kept", b"yes"),
        ("ExtendedPayloadSize", b"300000"),
    ]


async def test_a_keys_later_rows_wait_behind_its_failed_row(kafka: Kafka):
    topic = kafka.topic("held")
    missing = kafka.name("missing")
    batch = [
        row(topic, key="a", n=0),
        row(topic, key="a", n=1, headers="[1]"),  # cannot be encoded: dead
        row(topic, key="a", n=2),  # waits (released, no attempt)
        row(missing, key="b", n=3),  # a missing topic: an attempt
        row(topic, key="b", n=4),  # waits behind it
        row(topic, {"blob": "x" * 3000}, key="c", n=5),  # over message.max.bytes: dead
        row(topic, key="c", n=6),  # waits
        row(topic, key="d", n=7),
    ]
    pub = publisher(kafka, "message.max.bytes=2000")
    try:
        results = await pub.publish(batch)
    finally:
        await pub.close()
    assert results[0] is None and results[7] is None
    assert isinstance(results[1], Failure) and results[1].permanent
    assert isinstance(results[3], Failure) and not results[3].permanent
    assert isinstance(results[5], Failure) and results[5].permanent
    assert "over the 2000-byte limit" in results[5].error
    assert [results[i] for i in (2, 4, 6)] == [Outcome.RELEASE] * 3
    sent = [orjson.loads(r.value())["n"] for r in kafka.read(topic, 2)]
    assert sent == [0, 7]


async def test_an_unreachable_cluster_is_unavailable_with_librdkafkas_reason(kafka: Kafka):
    pub = make_publisher(BrokerURL.parse("kafka://127.0.0.1:1"), exchange="relay", workers=4)
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            await pub.publish([row("t")])
        assert "Kafka at kafka://127.0.0.1:1" in str(raised.value)
        assert not pub.connected
    finally:
        await pub.close()


async def test_the_consumer_commits_only_behind_acknowledged_records(kafka: Kafka):
    topic = kafka.topic("commit")
    for n in range(5):
        kafka.produce(topic, b'{"n": %d}' % n, flush=False)
    kafka.flush()
    consumer = group_consumer(kafka, topic)
    batches = consumer.batches(10, 0.3)
    try:
        got = []
        async with asyncio.timeout(30):
            while len(got) < 5:
                got += await anext(batches)
        await consumer.ack([got[0], got[1], got[3]])  # 2 is not stored yet: stop at 2
        await asyncio.sleep(1)
    finally:
        await batches.aclose()
        await consumer.close()
    assert kafka.committed("g-" + topic, topic) == {0: 2}
    assert [m.message_id for m in got] == [f"kafka:{topic}:0:{n}" for n in range(5)]


async def held_then_the_rest(consumer, total: int) -> tuple[list, list[list]]:
    """What the consumer hands out while nothing is acknowledged (until
    nothing more comes for 2 s); then, acknowledging that and each batch as
    it comes, the batches that follow until `total` records have come."""
    batches = consumer.batches(1000, 0.05)
    pending = asyncio.ensure_future(anext(batches))
    try:
        async with asyncio.timeout(60):
            held = await pending  # the group joined
            pending = asyncio.ensure_future(anext(batches))
            while True:  # nothing acknowledged: what arrives stops at the limit
                done, _ = await asyncio.wait({pending}, timeout=2)
                if not done:
                    break
                held += pending.result()
                pending = asyncio.ensure_future(anext(batches))
            await consumer.ack(held)
            rest, count = [], len(held)
            while count < total:
                batch = await pending
                pending = asyncio.ensure_future(anext(batches))
                rest.append(batch)
                count += len(batch)
                await consumer.ack(batch)
    finally:
        pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await batches.aclose()
        await consumer.close()
    return held, rest


async def test_over_its_limit_the_consumer_waits_then_pauses_and_loses_nothing(
    kafka: Kafka, monkeypatch: pytest.MonkeyPatch
):
    """Records held unacknowledged up to the limit stop the consuming; after
    PAUSE_AFTER the partitions are paused (librdkafka drops what it had
    prefetched); once acknowledged, every record arrives, each once, and the
    offset committed is past the last."""
    import relay.brokers.kafka.consuming as adapter

    monkeypatch.setattr(adapter, "PAUSE_AFTER", 0.3)
    topic = kafka.topic("held")
    total = 1500
    for n in range(total):
        kafka.produce(topic, b'{"n": %d}' % n, flush=False)
    kafka.flush()
    consumer = group_consumer(kafka, topic)
    consumer.max_held = 5
    held, rest = await held_then_the_rest(consumer, total)
    assert 5 <= len(held) < total
    got = held + [m for batch in rest for m in batch]
    assert sorted(m.message_id for m in got) == sorted(f"kafka:{topic}:0:{n}" for n in range(total))
    assert kafka.committed("g-" + topic, topic) == {0: total}


async def test_what_is_handed_out_stays_within_the_byte_bound_plus_one_record(
    kafka: Kafka,
):
    """However many records librdkafka has fetched, what is handed out and
    not acknowledged stays within the bytes bound plus one record (Tansu
    answered one consume() with 86 records of 50 MiB, issue 51's memory
    test); a record larger than the bound still comes, the last of what
    is held; once acknowledged, every record arrives, each once, in offset
    order."""
    topic = kafka.topic("bytes")
    sizes = [1000] * 300 + [50_000] + [1000] * 10
    for n, size in enumerate(sizes):
        body = b'{"n": %d, "pad": ""}' % n
        kafka.produce(topic, body[:-2] + b"x" * (size - len(body)) + b'"}', flush=False)
    kafka.flush()
    consumer = group_consumer(kafka, topic)
    consumer.max_held_bytes = 10_000
    held, rest = await held_then_the_rest(consumer, len(sizes))
    assert 10_000 <= sum(len(m.body) for m in held) < 10_000 + 1000
    got = held + [m for batch in rest for m in batch]
    assert [m.message_id for m in got] == [f"kafka:{topic}:0:{n}" for n in range(len(sizes))]
    # Each batch acknowledged before the next: what was held before its
    # last record was under the bound.
    batch_sizes = [[len(m.body) for m in batch] for batch in rest]
    assert all(sum(s[:-1]) < 10_000 for s in batch_sizes)
    assert [50_000] in [s[-1:] for s in batch_sizes]
    assert kafka.committed("g-" + topic, topic) == {0: len(sizes)}
