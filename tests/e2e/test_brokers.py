"""`relay outbox` and `relay inbox` end to end, as subprocesses, on RabbitMQ
and on SQS: what only whole daemons against a real broker show (per-key
order across three relays, a kill -9 mid-stream, a broker that is not there).

What each adapter promises is the contract suite's
(tests/brokers/test_contract.py); the loops' own behaviour is tested on the
memory broker (tests/outbox/test_loop.py). The `broker` fixture gives each
test the same small interface over either server: where a topic's messages
land, how to read them back (normalized), how to send raw messages to an
inbox queue. SQS is moto's standalone server, spoken to over HTTP.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

import relay
from relay.outbox import WORKERS
from tests.conftest import (
    AMQP_URL,
    FAST,
    HANDLERS,
    Rabbit,
    Received,
    effect_ids,
    insert_outbox,
    rows,
    wait_until,
)
from tests.kafka_server import Kafka, kafka, kafka_server  # noqa: F401 - fixtures
from tests.nats_server import Nats, nats_helper, nats_server  # noqa: F401 - fixtures
from tests.redis_server import Redis, redis_server, redis_streams  # noqa: F401 - fixtures
from tests.sqs_server import Sqs, sqs, sqs_server  # noqa: F401 - fixtures
from tests.waits import wait_while_progressing


class AmqpCollector:
    """RabbitMQ queues hold a backlog well: read it all at the end."""

    def __init__(self, broker: AmqpBroker, dest: Any) -> None:
        self.broker, self.dest = broker, dest

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        got = await self.broker.read(self.dest, count, timeout)
        return got + await self.broker.read_rest(self.dest)


class SqsCollector:
    """Reads and deletes an SQS queue in threads while the test runs.

    moto recomputes a queue's attributes over every stored message on each
    send, so a deep queue makes publishing quadratic; draining as messages
    arrive keeps it shallow (moto's delete and send race without
    tests/sqs_server.py's lock). One thread for a FIFO queue keeps the
    order in which messages were received."""

    def __init__(self, sqs: Sqs, dest: str, threads: int) -> None:
        self.sqs, self.dest = sqs, dest
        self.messages: list[dict[str, Any]] = []
        self.errors: list[str] = []  # what moto answered besides messages
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                batch = self.sqs.receive(self.dest, wait=1)
            except Exception as exc:
                # moto busy beside a loaded machine (a timeout, a reset
                # connection): ask again until stop() (the broker fixture
                # calls it before the queue is deleted). A received batch
                # whose delete failed comes back after its visibility timeout.
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.stopping.wait(0.2)
                continue
            self.messages += batch  # list.extend is atomic under the GIL

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(10)

    def distinct(self) -> int:
        """How many different messages (by relay's message id) arrived so far."""
        return len({SqsBroker.received(m).message_id for m in list(self.messages)})

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        """Every message arrived at least once (counted by id: after a kill,
        duplicates alone could make up the number), and what followed it."""
        deadline = time.monotonic() + timeout
        while self.distinct() < count:
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(
                    f"got {self.distinct()} of {count} messages in {timeout}s "
                    f"({len(self.errors)} failed receives, the last: {self.errors[-1:]}; "
                    f"the queue still holds {self.sqs.count(self.dest)}, visible or in flight)"
                )
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # duplicates still on their way
        self.stop()
        return [SqsBroker.received(m) for m in self.messages]


class AmqpBroker:
    kind = "amqp"
    bulk = 3000  # messages for the mid-stream kill tests

    def __init__(self, rabbit: Rabbit) -> None:
        self.rabbit = rabbit
        self.url = AMQP_URL
        self.exchange = rabbit.exchange
        self.env: dict[str, str] = {}
        self.outbox_args = ["--exchange", rabbit.exchange]
        self.unreachable_url = "amqp://guest:s3cret@127.0.0.1:1/"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return base  # the exchange is the test's own

    async def destination(self, topic: str) -> Any:
        return await self.rabbit.queue(topic)

    def _received(self, message: Any) -> Received:
        headers = dict(message.headers or {})
        key = headers.pop("x-relay-key", None)
        return Received(message.body, message.message_id, message.type, key, headers, message)

    async def read(self, dest: Any, count: int, timeout: float = 30) -> list[Received]:
        return [self._received(m) for m in await self.rabbit.drain(dest, count, timeout)]

    async def read_rest(self, dest: Any) -> list[Received]:
        got = []
        while (message := await dest.get(no_ack=True, fail=False)) is not None:
            got.append(self._received(message))
        return got

    async def collect(self, dest: Any, *, ordered: bool = False) -> AmqpCollector:
        return AmqpCollector(self, dest)

    async def inbox_queue(self) -> tuple[str, list[str]]:
        name = f"{self.exchange}.in"
        await self.rabbit.queue("#", name=name)  # bound now: nothing sent early is lost
        return name, ["--queue", name, "--exchange", self.exchange, "--bind", "#"]

    async def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        properties: dict[str, Any] = {"headers": dict(headers or {})}
        if key is not None:
            properties["headers"]["x-relay-key"] = key
        if message_id is None:
            await self.rabbit.publish_without_message_id(
                queue, body, message_type=type, headers=properties["headers"]
            )
        else:
            await self.rabbit.publish(queue, body, message_id=message_id, type=type, **properties)

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        for body, message_id in messages:
            await self.send(queue, body, message_id=message_id, type=type)

    async def queued(self, queue: str) -> int:
        channel = await self.rabbit.connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        await channel.close()
        return declared.declaration_result.message_count

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        pass  # RabbitMQ keeps one queue's order; nothing more on the wire


class SqsBroker:
    kind = "sqs"
    bulk = 1000  # moto is slower than RabbitMQ; enough to kill mid-stream

    def __init__(self, sqs: Sqs) -> None:
        self.sqs = sqs
        self.url = "sqs://"
        self.exchange = "relay"
        self.env = {"RELAY_BROKER_URL": "sqs://", **sqs.env}
        self.outbox_args: list[str] = []
        self.unreachable_url = "sqs://?endpoint_url=http://127.0.0.1:1"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.sqs.name(base, fifo=ordered)

    async def destination(self, topic: str, **attributes: Any) -> str:
        self.sqs.create(topic, **attributes)
        return topic

    @staticmethod
    def received(message: dict[str, Any]) -> Received:
        attrs = message.get("MessageAttributes", {})

        def text(name: str) -> str | None:
            return attrs[name]["StringValue"] if name in attrs else None

        headers = orjson.loads(text("headers")) if "headers" in attrs else {}
        return Received(
            message["Body"].encode(),
            text("message_id"),
            text("type"),
            text("key"),
            headers,
            message,
        )

    async def read(self, dest: str, count: int, timeout: float = 30) -> list[Received]:
        got: list[Received] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"got {len(got)} of {count} messages in {timeout}s")
            got += [self.received(m) for m in await asyncio.to_thread(self.sqs.receive, dest)]
        return got

    async def read_rest(self, dest: str) -> list[Received]:
        got = []
        while batch := await asyncio.to_thread(self.sqs.receive, dest):
            got += [self.received(m) for m in batch]
        return got

    async def collect(self, dest: str, *, ordered: bool = False) -> SqsCollector:
        self.collector = SqsCollector(self.sqs, dest, 1 if ordered else 2)
        return self.collector

    async def inbox_queue(self) -> tuple[str, list[str]]:
        name = self.sqs.name("in")
        # A short visibility timeout: what a killed inbox held comes back soon.
        self.sqs.create(name, VisibilityTimeout=5)
        return name, ["--queue", name]

    async def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        await asyncio.to_thread(
            self.sqs.send,
            queue,
            body,
            message_id=message_id,
            type=type,
            key=key,
            headers=headers,
        )

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        for start in range(0, len(messages), 10):
            await asyncio.to_thread(
                self.sqs.client.send_message_batch,
                QueueUrl=self.sqs.urls[queue],
                Entries=[
                    {
                        "Id": str(i),
                        "MessageBody": body.decode(),
                        "MessageAttributes": {
                            "message_id": {"DataType": "String", "StringValue": message_id},
                            "type": {"DataType": "String", "StringValue": type},
                        },
                    }
                    for i, (body, message_id) in enumerate(messages[start : start + 10])
                ],
            )

    async def queued(self, queue: str) -> int:
        return await asyncio.to_thread(self.sqs.count, queue)

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        system = message.raw["Attributes"]
        assert system["MessageGroupId"] == (message.key or topic)
        assert system["MessageDeduplicationId"] == message.message_id


def murmur2(data: bytes) -> int:
    """Kafka's Utils.murmur2 (what Java's default partitioner hashes a key with)."""
    m, r = 0x5BD1E995, 24
    length = len(data)
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    tail = length % 4
    base = length - tail
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h >= 1 << 31 else h


def java_partition(key: bytes, partitions: int) -> int:
    """The partition Java's clients (and Debezium) pick for a key."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


class KafkaCollector:
    """A Kafka topic keeps its records: read them all at the end."""

    def __init__(self, kafka: Kafka, dest: str) -> None:
        self.kafka, self.dest = kafka, dest

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        deadline = time.monotonic() + timeout
        while True:
            records = await asyncio.to_thread(self.kafka.read, self.dest, 0, 2)
            got = [KafkaBroker.received(r) for r in records]
            if len({m.message_id for m in got}) >= count or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.5)


class KafkaBroker:
    kind = "kafka"
    bulk = 3000
    partitions = 3

    def __init__(self, kafka: Kafka) -> None:
        self.kafka = kafka
        self.url = kafka.url()
        self.exchange = "relay"
        self.env = {"RELAY_BROKER_URL": self.url}
        self.outbox_args: list[str] = []
        self.unreachable_url = "kafka://app:s3cret@127.0.0.1:1"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.kafka.name(base)

    async def destination(self, topic: str) -> str:
        return self.kafka.create(topic, self.partitions)

    @staticmethod
    def received(record: Any) -> Received:
        headers = {n: v.decode() for n, v in record.headers() or []}
        key = record.key()
        return Received(
            record.value(),
            headers.pop("id", None),
            headers.pop("type", None),
            key.decode() if key is not None else None,
            headers,
            record,
        )

    async def read(self, dest: str, count: int, timeout: float = 30) -> list[Received]:
        records = await asyncio.to_thread(self.kafka.read, dest, count, timeout)
        return [self.received(r) for r in records]

    async def collect(self, dest: str, *, ordered: bool = False) -> KafkaCollector:
        return KafkaCollector(self.kafka, dest)

    async def inbox_queue(self) -> tuple[str, list[str]]:
        name = self.kafka.topic("in", self.partitions)
        return name, ["--queue", name]

    async def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        await asyncio.to_thread(
            self.kafka.send,
            queue,
            body,
            message_id=message_id,
            type=type,
            key=key,
            headers=headers,
        )

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        for body, message_id in messages:
            self.kafka.produce(
                queue,
                body,
                headers=[("id", message_id.encode()), ("type", type.encode())],
                flush=False,
            )
        await asyncio.to_thread(self.kafka.flush)

    async def queued(self, queue: str) -> int:
        """Records past the group's committed offsets (the group is the topic)."""
        records = await asyncio.to_thread(self.kafka.read, queue, 0, 2)
        ends: dict[int, int] = {}
        for record in records:
            ends[record.partition()] = max(ends.get(record.partition(), 0), record.offset() + 1)
        committed = await asyncio.to_thread(self.kafka.committed, queue, queue)
        return sum(end - max(committed.get(p, 0), 0) for p, end in ends.items())

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        if message.key is not None:  # murmur2: the partition Java's clients pick
            assert message.raw.partition() == java_partition(message.key.encode(), 3)


class RedisCollector:
    """A stream keeps its entries: read them all at the end."""

    def __init__(self, redis: Redis, dest: str) -> None:
        self.redis, self.dest = redis, dest

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        deadline = time.monotonic() + timeout
        while True:
            got = [RedisBroker.received(f) for _, f in self.redis.read(self.dest)]
            if len({m.message_id for m in got}) >= count or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.3)


class RedisBroker:
    kind = "redis"
    bulk = 3000

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.url = redis.url()
        self.exchange = "relay"
        self.env = {"RELAY_BROKER_URL": self.url}
        self.outbox_args: list[str] = []
        self.unreachable_url = "redis://app:s3cret@127.0.0.1:1/0"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.redis.name(base)

    async def destination(self, topic: str) -> str:
        return topic

    @staticmethod
    def received(fields: dict[bytes, bytes]) -> Received:
        text = {n.decode(): v.decode() for n, v in fields.items() if n != b"payload"}
        return Received(
            fields[b"payload"],
            text.get("id"),
            text.get("type"),
            text.get("key"),
            orjson.loads(text["headers"]) if "headers" in text else {},
            fields,
        )

    async def read(self, dest: str, count: int, timeout: float = 30) -> list[Received]:
        return await (await self.collect(dest)).wait(count, timeout)

    async def collect(self, dest: str, *, ordered: bool = False) -> RedisCollector:
        return RedisCollector(self.redis, dest)

    async def inbox_queue(self) -> tuple[str, list[str]]:
        name = self.redis.name("in")
        # A short --claim-idle: what a killed inbox held is claimed soon.
        return name, ["--queue", name, "--claim-idle", "2"]

    async def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.redis.send(queue, body, message_id=message_id, type=type, key=key, headers=headers)

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        pipe = self.redis.client.pipeline(transaction=False)
        for body, message_id in messages:
            pipe.xadd(queue, {"id": message_id, "type": type, "payload": body})
        await asyncio.to_thread(pipe.execute)

    async def queued(self, queue: str) -> int:
        """Entries the group (named after the stream) has not acknowledged."""
        return await asyncio.to_thread(self.redis.lag, queue, queue)

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        pass  # one stream keeps its order; nothing more on the wire


class NatsCollector:
    """A stream keeps its messages: read them all at the end."""

    def __init__(self, nats: Nats, dest: str) -> None:
        self.nats, self.dest = nats, dest

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        deadline = time.monotonic() + timeout
        while True:
            got = [NatsBroker.received(m) for m in await self.nats.messages(self.dest)]
            if len({m.message_id for m in got}) >= count or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.5)


class NatsBroker:
    kind = "nats"
    bulk = 3000
    # The inbox's consumer, made by the test with a short AckWait (relay
    # uses a consumer it finds as it is): what a killed inbox held comes
    # back in seconds, not the default 30.
    ack_wait = 3.0

    def __init__(self, nats: Nats) -> None:
        self.nats = nats
        self.url = nats.url
        self.exchange = "relay"
        self.env = {"RELAY_BROKER_URL": self.url}
        self.outbox_args: list[str] = []
        self.unreachable_url = "nats://app:s3cret@127.0.0.1:1"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.nats.name(base)

    async def destination(self, topic: str) -> str:
        return await self.nats.create(f"S-{topic}", [topic])

    @staticmethod
    def received(message: Any) -> Received:
        headers = dict(message.headers or {})
        headers.pop("Content-Type", None)
        return Received(
            message.data,
            headers.pop("Nats-Msg-Id", None),
            headers.pop("type", None),
            headers.pop("key", None),
            headers,
            message,
        )

    async def read(self, dest: str, count: int, timeout: float = 30) -> list[Received]:
        return await (await self.collect(dest)).wait(count, timeout)

    async def collect(self, dest: str, *, ordered: bool = False) -> NatsCollector:
        return NatsCollector(self.nats, dest)

    async def inbox_queue(self) -> tuple[str, list[str]]:
        name, _ = await self.nats.stream("in")
        await self.nats.add_consumer(name, name, ack_wait=self.ack_wait)
        return name, ["--queue", name]

    async def send(
        self,
        queue: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        await self.nats.send(
            queue, body, message_id=message_id, type=type, key=key, headers=headers
        )

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        await self.nats.publish_many(
            [
                (f"{queue}.x", body, {"Nats-Msg-Id": message_id, "type": type})
                for body, message_id in messages
            ]
        )

    async def queued(self, queue: str) -> int:
        """Messages the consumer (named as the stream) has not had acknowledged."""
        info = await self.nats.consumer_info(queue, queue)
        return int(info.num_pending) + int(info.num_ack_pending)

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        assert message.raw.subject == topic


@pytest.fixture(params=["amqp", "sqs", "kafka", "nats", "redis"])
def broker(
    request: pytest.FixtureRequest,
) -> Iterator[AmqpBroker | SqsBroker | KafkaBroker | NatsBroker | RedisBroker]:
    if request.param == "amqp":
        yield AmqpBroker(request.getfixturevalue("rabbit"))
        return
    if request.param == "nats":
        yield NatsBroker(request.getfixturevalue("nats_helper"))
        return
    if request.param == "redis":
        yield RedisBroker(request.getfixturevalue("redis_streams"))
        return
    if request.param == "kafka":
        yield KafkaBroker(request.getfixturevalue("kafka"))
        return
    helper = SqsBroker(request.getfixturevalue("sqs"))
    yield helper
    if getattr(helper, "collector", None) is not None:
        helper.collector.stop()


@pytest.fixture
def relay_env(relay_env: dict[str, str], request: pytest.FixtureRequest) -> dict[str, str]:
    """conftest's environment for `relay` subprocesses, pointed at the broker under
    test (only tests that use `broker` are run once per broker)."""
    if "broker" in request.fixturenames:
        return {**relay_env, **request.getfixturevalue("broker").env}
    return relay_env


@pytest.fixture
def inbox(broker, start_relay):
    """`relay inbox` on the test's inbox queue; start(...) returns the process."""
    state: dict[str, Any] = {}

    async def queue() -> str:
        if "queue" not in state:
            state["queue"], state["args"] = await broker.inbox_queue()
        return state["queue"]

    async def start(*extra: str):
        await queue()
        proc = start_relay(
            "inbox",
            *state["args"],
            "--handlers",
            HANDLERS,
            *FAST,
            *extra,
        )
        proc.wait_for_log("inbox started")
        return proc

    start.queue = queue
    return start


def published_count(engine) -> int:
    return rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0]


async def wait_drained(broker, queue: str, timeout: float = 15) -> None:
    """Until the queue holds nothing: every copy was acknowledged."""
    deadline = time.monotonic() + timeout
    while (left := await broker.queued(queue)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert left == 0, f"{left} messages left in {queue}"


# --------------------------------------------------------------------------
# Outbox → broker
# --------------------------------------------------------------------------


async def test_per_key_order_holds_with_three_relays(engine, broker, start_relay):
    # SQS: a FIFO queue (order per MessageGroupId = key); RabbitMQ: one queue.
    topic = broker.topic("ordered", ordered=True)
    dest = await broker.destination(topic)
    collector = await broker.collect(dest, ordered=True)
    relays = [
        start_relay("outbox", *broker.outbox_args, "--batch-size", "40", "--poll-interval", "0.2")
        for _ in range(3)
    ]
    for proc in relays:
        proc.wait_for_log("outbox relay started")
    # Committed in many small transactions while the relays run.
    for chunk in range(12):
        with engine.begin() as conn:
            for i in range(50):
                n = chunk * 50 + i
                relay.enqueue(conn, topic, {"n": n}, key=f"key-{n % 20}", type="Ordered")
            relay.enqueue(conn, topic, {"n": -1})  # no key: FIFO group = topic
        await asyncio.sleep(0.05)
    messages = await collector.wait(612, timeout=90)
    last: dict[str, int] = {}
    for message in messages:
        broker.check_ordered_wire(message, topic)
        if message.key is None:
            continue
        n = orjson.loads(message.body)["n"]
        assert n > last.get(message.key, -1), f"{message.key}: {n} after {last[message.key]}"
        last[message.key] = n
    assert len({m.message_id for m in messages}) == 612
    wait_until(lambda: published_count(engine) == 612)


async def test_kill_9_of_the_outbox_mid_stream_loses_nothing(engine, broker, start_relay):
    topic = broker.topic("kill")
    dest = await broker.destination(topic)
    collector = await broker.collect(dest)
    total = broker.bulk
    insert_outbox(engine, total, topic=topic, keys=50)
    first = start_relay("outbox", *broker.outbox_args, "--batch-size", "100")
    # The daemon's start and first batches: as long as it makes progress.
    wait_while_progressing(
        lambda: published_count(engine) > total // 10,
        first.proc,
        quiet=30,
        what="first relay publishing",
        log=lambda: first.log,
    )
    first.signal(signal.SIGKILL)
    first.wait()
    assert published_count(engine) < total, "the kill came too late to prove anything"
    second = start_relay("outbox", *broker.outbox_args, "--poll-interval", "0.5")
    wait_until(
        lambda: published_count(engine) == total, timeout=90, message="all published after restart"
    )
    ids = [m.message_id for m in await collector.wait(total, timeout=60)]
    assert set(ids) == {str(r[0]) for r in rows(engine, "SELECT id FROM outbox")}
    # Duplicates are bounded by what was in flight when killed: a batch per worker.
    assert len(ids) - len(set(ids)) <= WORKERS * 100
    second.stop()
    assert second.proc.returncode == 0


async def test_unreachable_broker_is_retried_and_counts_no_attempt(engine, broker, start_relay):
    with engine.begin() as conn:
        relay.enqueue(conn, broker.topic("x"), {})
    daemon = start_relay(
        "outbox", *broker.outbox_args, env={"RELAY_BROKER_URL": broker.unreachable_url}
    )
    daemon.wait_for_log("retrying in", timeout=30)
    time.sleep(1)
    assert daemon.proc.poll() is None
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("pending", 0)]
    daemon.stop()
    assert daemon.proc.returncode == 0
    assert "s3cret" not in daemon.log


# --------------------------------------------------------------------------
# Broker → inbox
# --------------------------------------------------------------------------


async def test_kill_9_of_the_inbox_mid_stream_loses_and_duplicates_nothing(effects, broker, inbox):
    queue = await inbox.queue()
    total = broker.bulk // 2
    await broker.send_many(
        queue, [(orjson.dumps({"n": n}), f"k-{n}") for n in range(total)], type="Effect"
    )
    first = await inbox("--batch-size", "20")
    wait_while_progressing(
        lambda: len(rows(effects, "SELECT 1 FROM inbox")) > total // 10,
        first.proc,
        quiet=30,
        what="first inbox storing",
        log=lambda: first.log,
    )
    first.signal(signal.SIGKILL)
    first.wait()
    assert len(rows(effects, "SELECT 1 FROM inbox")) < total, "killed too late to prove anything"
    await inbox()
    wait_until(lambda: len(effect_ids(effects)) >= total, timeout=90)
    time.sleep(1)
    ids = effect_ids(effects)
    assert len(ids) == total and len(set(ids)) == total
    assert rows(effects, "SELECT status, count(*) FROM inbox GROUP BY status") == [
        ("processed", total)
    ]
    await wait_drained(broker, queue, timeout=30)


def test_murmur2_is_kafkas_own():
    # Kafka's UtilsTest.testMurmur2 values: the partition check above rests on them.
    assert murmur2(b"21") == -973932308
    assert murmur2(b"foobar") == -790332482
    assert murmur2(b"a-little-bit-long-string") == -985981536
    assert murmur2(b"a-little-bit-longer-string") == -1486304829
    assert murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8") == -58897971
