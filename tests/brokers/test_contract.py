"""What the broker ports promise, written once and run against every adapter:
RabbitMQ, SQS and SNS (moto's server), Kafka and the memory broker
(relay.brokers.memory), each in this process through `Publisher` and
`Consumer` (SNS's consumer half: relay's SQS consumer of a queue subscribed
to the topic, opening SNS's notification envelopes).

Where the brokers differ by design (an unroutable message, a nack's
permanence, the type's fallback), the `port` helper says what its broker does.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import orjson
import pytest

from relay.brokers import Incoming, Outcome
from relay.errors import BrokerUnavailable
from relay.rows import Failure, OutboxRow
from tests.brokers.conftest import (
    AmqpPort,
    KafkaPort,
    NatsPort,
    Port,
    RedisPort,
    SnsPort,
    SqsPort,
)
from tests.sqs_server import REGION

CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def row(
    topic: str,
    payload: object = None,
    *,
    key: str | None = None,
    type: str | None = None,
    headers: str = "{}",
    n: int = 0,
) -> OutboxRow:
    text = orjson.dumps({"n": n} if payload is None else payload).decode()
    return OutboxRow(str(uuid.uuid4()), n, topic, key, type, text, headers, CREATED, 0)


async def collect(consumer: object, count: int, timeout: float = 20) -> list[Incoming]:
    """Batches from `consumer` until `count` messages (not acknowledged)."""
    batches = consumer.batches(10, 0.2)  # type: ignore[attr-defined]
    got: list[Incoming] = []
    try:
        async with asyncio.timeout(timeout):
            while len(got) < count:
                got += await anext(batches)
    finally:
        await batches.aclose()
    return got


# --------------------------------------------------------------------------
# Publisher
# --------------------------------------------------------------------------


async def test_a_batch_is_confirmed_row_by_row_carrying_id_type_key_and_headers(port: Port):
    topic = port.topic("orders")
    dest = await port.destination(topic)
    full = row(
        topic,
        {"order_id": 7, "note": "é"},
        key="order-7",
        type="OrderPlaced",
        headers='{"traceparent": "00-abc-def-01"}',
    )
    plain = row(topic, [1, 2, 3])
    publisher = port.publisher()
    try:
        assert await publisher.publish([full, plain]) == [None, None]
        assert publisher.connected
    finally:
        await publisher.close()
    got = {m.message_id: m for m in await port.read(dest, 2)}
    assert (got[full.id].body, got[full.id].type, got[full.id].key, got[full.id].headers) == (
        '{"order_id":7,"note":"é"}'.encode(),
        "OrderPlaced",
        "order-7",
        {"traceparent": "00-abc-def-01"},
    )
    assert (got[plain.id].body, got[plain.id].type, got[plain.id].key, got[plain.id].headers) == (
        b"[1,2,3]",
        None,
        None,
        {},
    )
    if isinstance(port, AmqpPort):  # the contract's AMQP properties
        message = got[full.id].raw
        assert (message.routing_key, message.exchange) == (topic, port.rabbit.exchange)
        assert (message.content_type, message.delivery_mode) == ("application/json", 2)
        assert message.timestamp == CREATED
    if isinstance(port, SqsPort):  # four String attributes, headers as compact JSON
        attrs = got[full.id].raw["MessageAttributes"]
        assert set(attrs) == {"message_id", "type", "key", "headers"}
        assert attrs["headers"]["StringValue"] == '{"traceparent":"00-abc-def-01"}'
        assert set(got[plain.id].raw["MessageAttributes"]) == {"message_id"}
    if isinstance(port, KafkaPort):  # the id, type and content-type headers, the timestamp
        record = got[full.id].raw
        assert [n for n, _ in record.headers()] == ["id", "type", "content-type", "traceparent"]
        assert dict(record.headers())["content-type"] == b"application/json"
        assert record.timestamp()[1] == int(CREATED.timestamp() * 1000)
        assert [n for n, _ in got[plain.id].raw.headers()] == ["id", "content-type"]
    if isinstance(port, RedisPort):  # the fields, in this order, and no other
        assert list(got[full.id].raw) == [b"id", b"payload", b"type", b"key", b"headers"]
        assert got[full.id].raw[b"headers"] == b'{"traceparent":"00-abc-def-01"}'
        assert list(got[plain.id].raw) == [b"id", b"payload"]
    if isinstance(port, NatsPort):  # Nats-Msg-Id, type, key, Content-Type, the row's
        assert got[full.id].raw.headers == {
            "traceparent": "00-abc-def-01",
            "Nats-Msg-Id": full.id,
            "type": "OrderPlaced",
            "key": "order-7",
            "Content-Type": "application/json",
        }
        assert got[full.id].raw.subject == topic
        assert got[plain.id].raw.headers == {
            "Nats-Msg-Id": plain.id,
            "Content-Type": "application/json",
        }


async def test_a_keys_messages_arrive_in_the_order_of_the_batch(port: Port):
    # SQS: a FIFO queue (order per MessageGroupId = key); the others: one queue.
    topic = port.topic("ordered", ordered=True)
    dest = await port.destination(topic)
    batch = [row(topic, key=f"k{n % 5}", n=n) for n in range(40)]
    publisher = port.publisher()
    try:
        assert await publisher.publish(batch) == [None] * 40
    finally:
        await publisher.close()
    last: dict[str, int] = {}
    for message in await port.read(dest, 40):
        n = orjson.loads(message.body)["n"]
        assert message.key is not None and n > last.get(message.key, -1)
        last[message.key] = n


async def test_a_refused_message_fails_alone_and_its_batch_mates_are_confirmed(port: Port):
    topic = port.topic("partial")
    dest = await port.destination(topic)
    publisher = port.publisher()
    refused = await port.refuse(publisher, topic)
    batch = [row(topic, n=1), row(refused, n=2), row(topic, n=3)]
    try:
        results = await publisher.publish(batch)
    finally:
        await publisher.close()
    assert results[0] is None and results[2] is None
    assert isinstance(results[1], Failure)
    assert {m.message_id for m in await port.read(dest, 2)} == {batch[0].id, batch[2].id}


async def test_an_unroutable_message_is_reported_not_lost_silently(port: Port):
    topic = port.topic("routed")
    dest = await port.destination(topic)
    nowhere = port.topic("nowhere")
    batch = [row(nowhere, n=1), row(topic, n=2)]
    for on_unroutable in ("publish", "fail"):
        publisher = port.publisher(on_unroutable=on_unroutable)
        try:
            results = await publisher.publish(batch)
        finally:
            await publisher.close()
        assert results[1] is None
        if isinstance(port, SnsPort):  # a missing topic: an attempt, never created
            assert results[0] == Failure(f"SNS topic {nowhere!r} does not exist in {REGION}")
            assert not port.sns.exists(nowhere)
        elif isinstance(port, SqsPort):  # a missing queue: never published
            assert results[0] == Failure(f"SQS queue {nowhere!r} does not exist")
        elif isinstance(port, KafkaPort):  # a missing topic: an attempt, never created
            assert isinstance(results[0], Failure) and not results[0].permanent
            assert "does not exist" in results[0].error and repr(nowhere) in results[0].error
            assert not port.kafka.exists(nowhere)
        elif isinstance(port, RedisPort):  # XADD makes the stream: published
            assert results[0] is None
        elif isinstance(port, NatsPort):  # no stream captures it: an attempt, none made
            assert isinstance(results[0], Failure) and not results[0].permanent
            assert "no responders" in results[0].error and repr(nowhere) in results[0].error
            assert not await port.nats.has_stream(f"S-{nowhere}")
        elif on_unroutable == "publish":  # pub/sub: confirmed, counted as unroutable
            assert results[0] is Outcome.UNROUTABLE
        else:
            assert isinstance(results[0], Failure) and not results[0].permanent
            assert "unroutable" in results[0].error and repr(nowhere) in results[0].error
    # NATS: the second publish of the same row (its Nats-Msg-Id) is a
    # duplicate the stream's window drops.
    assert len(await port.read(dest, 1 if isinstance(port, NatsPort) else 2))
    if isinstance(port, RedisPort):
        assert len(await port.read(nowhere, 2)) == 2


async def test_rows_no_broker_can_carry_fail_for_good_and_alone(port: Port):
    topic = port.topic("carry")
    dest = await port.destination(topic)
    batch = [
        row(topic, headers='{"n": 1}'),
        row(topic, headers="[1]"),
        row(""),
        row(topic, headers='{"a": "b"}', n=4),
    ]
    publisher = port.publisher()
    try:
        results = await publisher.publish(batch)
    finally:
        await publisher.close()
    assert results[3] is None
    errors = []
    for result in results[:3]:
        assert isinstance(result, Failure) and result.permanent
        errors.append(result.error)
    assert "header 'n' has a int value" in errors[0]
    assert "headers must be a JSON object" in errors[1]
    assert errors[2] == "topic is empty"
    [message] = await port.read(dest, 1)
    assert message.message_id == batch[3].id and message.headers == {"a": "b"}


async def test_an_unreachable_broker_is_unavailable_without_the_password(port: Port):
    publisher = port.unreachable()
    try:
        with pytest.raises(BrokerUnavailable) as raised:
            await publisher.publish([row("t")])
        assert "s3cret" not in str(raised.value)
        assert not publisher.connected
    finally:
        await publisher.close()


async def test_a_broker_that_goes_away_is_unavailable_then_publishing_resumes(port: Port):
    topic = port.topic("away")
    dest = await port.destination(topic)
    publisher = port.publisher()
    try:
        assert await publisher.publish([row(topic, n=1)]) == [None]
        port.go_down()
        await asyncio.sleep(0.3)  # the client sees its connection cut
        # Nothing sent: BrokerUnavailable, or each row released (not counted).
        try:
            results = await publisher.publish([row(topic, n=2)])
        except BrokerUnavailable:
            pass
        else:
            assert results == [Outcome.RELEASE]
        assert not publisher.connected
        port.come_back()
        assert await publisher.publish([row(topic, n=3)]) == [None]
    finally:
        port.come_back()
        await publisher.close()
    assert [orjson.loads(m.body)["n"] for m in await port.read(dest, 2)] == [1, 3]


# --------------------------------------------------------------------------
# Consumer
# --------------------------------------------------------------------------


async def test_a_received_message_carries_id_type_key_headers_and_the_type_fallback(port: Port):
    queue = await port.inbox_queue()
    await port.send(
        queue,
        b'{"n": 5}',
        message_id="m-1",
        type="Effect",
        key="order-5",
        headers={"traceparent": "00-aa-bb-01"},
    )
    await port.send(queue, b'{"n": 6}', message_id="m-2")  # no type, no key
    await port.send(queue, b'{"n": 7}', type="Effect")  # no id: the inbox hashes the body
    consumer = port.consumer(queue)
    try:
        got = {m.message_id: m for m in await collect(consumer, 3)}
        await consumer.ack(list(got.values()))
    finally:
        await consumer.close()
    if isinstance(port, KafkaPort):  # no id: the record's own place in the log
        got[None] = got.pop(f"kafka:{queue}:0:2")
    if isinstance(port, RedisPort):  # no id: the entry's own place in the stream
        [place] = [m for m in got if m and m.startswith(f"redis:{queue}:")]
        got[None] = got.pop(place)
    if isinstance(port, NatsPort):  # no id: the message's own place in the stream
        got[None] = got.pop(f"nats:{queue}:3")
    first, second, third = got["m-1"], got["m-2"], got[None]
    assert (first.body, first.type, first.key) == (b'{"n": 5}', "Effect", "order-5")
    assert first.headers.get("traceparent") == "00-aa-bb-01"
    assert (second.type, second.key) == (port.fallback_type(queue), None)
    # Never an id of the broker's own (a delivery's, the SQS MessageId);
    # on Kafka, the record's place (topic, partition, offset) is its identity.
    assert (third.body, third.type) == (b'{"n": 7}', "Effect")


async def test_what_is_not_acknowledged_is_delivered_again_and_what_is_is_not(port: Port):
    queue = await port.inbox_queue()
    for n in range(4):
        await port.send(queue, b'{"n": %d}' % n, message_id=f"r-{n}", type="T")
    consumer = port.consumer(queue)
    try:
        got = await collect(consumer, 4)
        await consumer.ack(got[:2])  # the first two delivered
    finally:
        await consumer.close()  # the other two received, never acknowledged
    again = port.consumer(queue)
    try:
        redelivered = await collect(again, 2)
        await again.ack(redelivered)
        assert {m.message_id for m in redelivered} == {m.message_id for m in got[2:]}
        with pytest.raises(TimeoutError):
            await collect(again, 1, timeout=0.5)
    finally:
        await again.close()


async def test_a_broker_that_goes_away_ends_the_batches_as_unavailable(port: Port):
    queue = await port.inbox_queue()
    await port.send(queue, b"{}", message_id="d-1", type="T")
    consumer = port.consumer(queue)
    batches = consumer.batches(10, 0.1)
    try:
        [incoming] = await anext(batches)
        port.go_down()
        with pytest.raises(BrokerUnavailable):
            async with asyncio.timeout(60):
                await anext(batches)
        assert not consumer.connected
    finally:
        port.come_back()
        await batches.aclose()
        await consumer.close()
    assert incoming.message_id == "d-1"
