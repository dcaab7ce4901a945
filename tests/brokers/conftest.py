"""The `port` fixture: each broker (RabbitMQ, SQS on moto's server, SNS
on the same, Kafka on Tansu, the memory broker) behind one small
interface, for the contract suite.

The adapters run in the test's own process, built as relay builds them
(make_publisher, make_consumer, MemoryBroker). Each helper knows where a
topic's messages land and how to read them back, normalized to `Received`;
how to make the broker refuse (nack) a message; and how to take the broker
away and bring it back (a TCP proxy in front of a real server).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Iterator
from typing import Any

import aio_pika
import boto3.session
import orjson
import pytest

from relay.brokers import Consumer, Publisher, make_consumer, make_publisher
from relay.brokers.memory import MemoryBroker, Message
from relay.config import BrokerURL
from relay.outbox import WORKERS
from tests.conftest import AMQP_URL, Rabbit, Received
from tests.kafka_server import Kafka, kafka, kafka_server  # noqa: F401 - fixtures
from tests.nats_server import Nats, nats_helper, nats_server  # noqa: F401 - fixtures
from tests.proxy import Proxy
from tests.redis_server import Redis, redis_server, redis_streams  # noqa: F401 - fixtures
from tests.sns_server import Sns, sns  # noqa: F401 - fixture
from tests.sqs_server import REGION, Sqs, sqs, sqs_server  # noqa: F401 - fixtures


class MemoryPort:
    kind = "memory"

    def __init__(self) -> None:
        self.broker = MemoryBroker()

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return base

    async def destination(self, topic: str) -> str:
        self.broker.bind(f"{topic}.q", topic)
        return f"{topic}.q"

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return self.broker.publisher(on_unroutable=on_unroutable)

    async def read(self, dest: str, count: int) -> list[Received]:
        got = self.broker.take(dest)
        assert len(got) == count, f"{len(got)} messages in {dest}, not {count}"
        return [Received(m.body, m.message_id, m.type, m.key, m.headers, m) for m in got]

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        """A topic whose messages the broker rejects (nacks); it has a destination."""
        self.broker.nack_when(lambda row: row.topic == topic + "-refused")
        await self.destination(topic + "-refused")
        return topic + "-refused"

    async def inbox_queue(self) -> str:
        self.broker.bind("in", "in.#")
        return "in"

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return self.broker.consumer(queue, prefetch=prefetch)

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
        self.broker.send("in.x", body, message_id=message_id, type=type, key=key, headers=headers)

    def fallback_type(self, queue: str) -> str:
        return "in.x"  # the routing key

    def go_down(self) -> None:
        self.broker.go_down()

    def come_back(self) -> None:
        self.broker.come_back()

    def unreachable(self) -> Publisher:
        broker = MemoryBroker()
        broker.go_down()
        return broker.publisher()


class AmqpPort:
    kind = "amqp"

    def __init__(self, rabbit: Rabbit, proxy: Proxy) -> None:
        self.rabbit = rabbit
        self.proxy = proxy
        parts = urllib.parse.urlsplit(AMQP_URL)
        self.url = f"amqp://{parts.username}:{parts.password}@127.0.0.1:{proxy.port}{parts.path}"

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return base  # the exchange is the test's own

    async def destination(self, topic: str) -> aio_pika.abc.AbstractQueue:
        return await self.rabbit.queue(topic)

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return make_publisher(
            BrokerURL.parse(self.url),
            exchange=self.rabbit.exchange,
            workers=WORKERS,
            on_unroutable=on_unroutable,
        )

    async def read(self, dest: aio_pika.abc.AbstractQueue, count: int) -> list[Received]:
        got = []
        for message in await self.rabbit.drain(dest, count):
            headers = dict(message.headers or {})
            key = headers.pop("x-relay-key", None)
            got.append(
                Received(
                    message.body,
                    message.message_id,
                    message.type,
                    key,  # type: ignore[arg-type]
                    headers,
                    message,
                )
            )
        assert await dest.get(no_ack=True, fail=False) is None, "more messages than expected"
        return got

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        # A full queue that rejects publishes makes RabbitMQ nack them.
        channel = await self.rabbit.connection.channel()
        exchange = await channel.declare_exchange(self.rabbit.exchange, "topic", durable=True)
        full = await channel.declare_queue(
            f"{self.rabbit.exchange}.full",
            durable=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        self.rabbit.queues.append(full.name)
        await full.bind(exchange, topic + "-refused")
        await channel.close()
        return topic + "-refused"

    async def inbox_queue(self) -> str:
        name = f"{self.rabbit.exchange}.in"
        self.rabbit.queues.append(name)
        # Declared and bound by a first consumer: nothing sent early is lost.
        consumer = self.consumer(name)
        await consumer.connect()
        await consumer.close()
        return name

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return make_consumer(
            BrokerURL.parse(self.url),
            queue=queue,
            exchange=self.rabbit.exchange,
            binds=["in.#"],
            prefetch=prefetch,
        )

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
        all_headers: dict[str, Any] = dict(headers or {})
        if key is not None:
            all_headers["x-relay-key"] = key
        if message_id is None:  # no property at all (aiormq would make one up)
            await self.rabbit.publish_without_message_id(
                "in.x", body, message_type=type, headers=all_headers
            )
            return
        await self.rabbit.publish(
            "in.x", body, message_id=message_id, type=type, headers=all_headers
        )

    def fallback_type(self, queue: str) -> str:
        return "in.x"  # the routing key

    def go_down(self) -> None:
        self.proxy.stop()

    def come_back(self) -> None:
        self.proxy.start()

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse("amqp://guest:s3cret@127.0.0.1:1/"),
            exchange=self.rabbit.exchange,
            workers=WORKERS,
        )


class SqsPort:
    kind = "sqs"

    def __init__(self, sqs: Sqs, proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sqs = sqs
        self.proxy = proxy
        self.monkeypatch = monkeypatch
        for name, value in sqs.env.items():
            monkeypatch.setenv(name, value)
        endpoint = f"http://127.0.0.1:{proxy.port}"
        self.url = f"sqs://?region={REGION}&endpoint_url={urllib.parse.quote(endpoint)}"
        self.inbox_url = self.url

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.sqs.name(base, fifo=ordered)

    async def destination(self, topic: str) -> str:
        self.sqs.create(topic)
        return topic

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return make_publisher(
            BrokerURL.parse(self.url),
            exchange="relay",
            workers=WORKERS,
            on_unroutable=on_unroutable,
        )

    async def read(self, dest: str, count: int) -> list[Received]:
        got: list[Received] = []
        for _ in range(30):
            for message in await asyncio.to_thread(self.sqs.receive, dest):
                attrs = message.get("MessageAttributes", {})
                text = {n: a["StringValue"] for n, a in attrs.items()}
                headers = orjson.loads(text["headers"]) if "headers" in text else {}
                got.append(
                    Received(
                        message["Body"].encode(),
                        text.get("message_id"),
                        text.get("type"),
                        text.get("key"),
                        headers,
                        message,
                    )
                )
            if len(got) >= count:
                break
        assert len(got) == count, f"{len(got)} messages in {dest}, not {count}"
        return got

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        # moto fails an entry of SendMessageBatch whose DelaySeconds is out
        # of range; relay never sends one, so a botocore hook adds it to the
        # entries of the refused topic's queue on their way out.
        def spoil(params: dict[str, Any], **_: Any) -> None:
            if params["QueueUrl"].endswith("-refused"):
                for entry in params["Entries"]:
                    entry["DelaySeconds"] = 901

        real_client = boto3.session.Session.client

        def client(session: Any, *args: Any, **kwargs: Any) -> Any:
            made = real_client(session, *args, **kwargs)
            made.meta.events.register("before-parameter-build.sqs.SendMessageBatch", spoil)
            return made

        self.monkeypatch.setattr(boto3.session.Session, "client", client)
        refused = self.sqs.name("refused")
        self.sqs.create(refused)
        return refused

    async def inbox_queue(self) -> str:
        name = self.sqs.name("in")
        self.sqs.create(name)
        return name

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return make_consumer(
            BrokerURL.parse(self.inbox_url),
            queue=queue,
            exchange="relay",
            binds=(),
            prefetch=prefetch,
        )

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

    def fallback_type(self, queue: str) -> str:
        return queue  # the queue's name

    def go_down(self) -> None:
        self.proxy.stop()

    def come_back(self) -> None:
        self.proxy.start()

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse(f"sqs://?region={REGION}&endpoint_url=http://127.0.0.1:1"),
            exchange="relay",
            workers=WORKERS,
        )


class SnsPort(SqsPort):
    """SNS publishes only: what the outbox publishes is read back from an
    SQS queue subscribed with raw message delivery; the consumer half is
    relay's SQS consumer of a queue subscribed without it, opening SNS's
    notification envelopes, what SNS delivers to it published to the topic."""

    kind = "sns"

    def __init__(self, sns: Sns, proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__(sns.sqs, proxy, monkeypatch)
        self.sns = sns
        for name, value in sns.env.items():
            monkeypatch.setenv(name, value)
        self.url = self.url.replace("sqs://", "sns://", 1)
        self.topics: dict[str, str] = {}  # inbox queue -> its topic

    async def destination(self, topic: str) -> str:
        self.sns.topic(topic)
        return self.sns.subscribe(topic, topic, raw=True)

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        # moto fails an entry of PublishBatch whose MessageStructure is not
        # `json`; relay never sends one, so a botocore hook adds it to the
        # entries for the refused topic on their way out.
        def spoil(params: dict[str, Any], **_: Any) -> None:
            if params["TopicArn"].endswith("-refused"):
                for entry in params["PublishBatchRequestEntries"]:
                    entry["MessageStructure"] = "spoiled"

        real_client = boto3.session.Session.client

        def client(session: Any, *args: Any, **kwargs: Any) -> Any:
            made = real_client(session, *args, **kwargs)
            made.meta.events.register("before-parameter-build.sns.PublishBatch", spoil)
            return made

        self.monkeypatch.setattr(boto3.session.Session, "client", client)
        refused = self.sns.name("refused")
        await self.destination(refused)
        return refused

    async def inbox_queue(self) -> str:
        topic = self.sns.name("in-topic")
        self.sns.topic(topic)
        queue = self.sns.subscribe(topic, self.sns.name("in"), raw=False)
        self.topics[queue] = topic
        return queue

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
            self.sns.publish,
            self.topics[queue],
            body,
            message_id=message_id,
            type=type,
            key=key,
            headers=orjson.dumps(headers).decode() if headers else None,
        )

    def fallback_type(self, queue: str) -> str:
        return self.topics[queue]  # the topic's name, from the envelope

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse(f"sns://?region={REGION}&endpoint_url=http://127.0.0.1:1"),
            exchange="relay",
            workers=WORKERS,
        )


class KafkaPort:
    kind = "kafka"
    # One partition: the suite reads back keyless rows in order too (the
    # murmur2 partitions are tests/e2e/test_brokers.py's).
    PARTITIONS = 1
    RELAY_HEADERS = ("id", "type", "content-type")

    def __init__(self, kafka: Kafka) -> None:
        self.kafka = kafka
        self.url = kafka.url()

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.kafka.name(base)

    async def destination(self, topic: str) -> str:
        return self.kafka.create(topic, self.PARTITIONS)

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return make_publisher(
            BrokerURL.parse(self.url),
            exchange="relay",
            workers=WORKERS,
            on_unroutable=on_unroutable,
        )

    async def read(self, dest: str, count: int) -> list[Received]:
        got = []
        for record in await asyncio.to_thread(self.kafka.read, dest, count):
            headers = {n: v.decode() for n, v in record.headers() or []}
            key = record.key()
            got.append(
                Received(
                    record.value(),
                    headers.get("id"),
                    headers.get("type"),
                    key.decode() if key is not None else None,
                    {n: v for n, v in headers.items() if n not in self.RELAY_HEADERS},
                    record,
                )
            )
        assert len(got) == count, f"{len(got)} records in {dest}, not {count}"
        return got

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        return self.kafka.name("refused")  # a topic that does not exist

    async def inbox_queue(self) -> str:
        return self.kafka.topic("in", 2)

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return make_consumer(
            BrokerURL.parse(self.url), queue=queue, exchange="relay", binds=(), prefetch=prefetch
        )

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
            partition=0,
        )

    def fallback_type(self, queue: str) -> str:
        return queue  # the topic

    def go_down(self) -> None:
        self.kafka.proxy.stop()

    def come_back(self) -> None:
        self.kafka.proxy.start()

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse("kafka://app:s3cret@127.0.0.1:1"), exchange="relay", workers=WORKERS
        )


class RedisPort:
    kind = "redis"
    RELAY_FIELDS = (b"id", b"payload", b"type", b"key", b"headers")

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.url = redis.url()

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.redis.name(base)

    async def destination(self, topic: str) -> str:
        return topic  # XADD makes the stream

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return make_publisher(
            BrokerURL.parse(self.url),
            exchange="relay",
            workers=WORKERS,
            on_unroutable=on_unroutable,
        )

    async def read(self, dest: str, count: int) -> list[Received]:
        got = []
        for _, fields in await asyncio.to_thread(self.redis.read, dest):
            text = {n.decode(): v.decode() for n, v in fields.items() if n != b"payload"}
            got.append(
                Received(
                    fields[b"payload"],
                    text.get("id"),
                    text.get("type"),
                    text.get("key"),
                    orjson.loads(text["headers"]) if "headers" in text else {},
                    fields,
                )
            )
        assert len(got) == count, f"{len(got)} entries in {dest}, not {count}"
        return got

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        # A key that holds a string: XADD to it is refused (WRONGTYPE).
        refused = self.redis.name("refused")
        await asyncio.to_thread(self.redis.client.set, refused, "not a stream")
        return refused

    async def inbox_queue(self) -> str:
        return self.redis.name("in")  # the group is made at the stream's first entry

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return make_consumer(
            BrokerURL.parse(self.url), queue=queue, exchange="relay", binds=(), prefetch=prefetch
        )

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
            self.redis.send,
            queue,
            body,
            message_id=message_id,
            type=type,
            key=key,
            headers=headers,
        )

    def fallback_type(self, queue: str) -> str:
        return queue  # the stream

    def go_down(self) -> None:
        self.redis.proxy.stop()

    def come_back(self) -> None:
        self.redis.proxy.start()

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse("redis://app:s3cret@127.0.0.1:1/0"), exchange="relay", workers=WORKERS
        )


class NatsPort:
    kind = "nats"
    # relay's own headers: the rest are the row's.
    RELAY_HEADERS = ("Nats-Msg-Id", "type", "key", "Content-Type")

    def __init__(self, helper: Nats) -> None:
        self.nats = helper
        self.url = helper.url

    def topic(self, base: str, *, ordered: bool = False) -> str:
        return self.nats.name(base)  # a subject

    async def destination(self, topic: str) -> str:
        """A stream capturing the subject `topic`."""
        return await self.nats.create(f"S-{topic}", [topic])

    def publisher(self, *, on_unroutable: str = "publish") -> Publisher:
        return make_publisher(
            BrokerURL.parse(self.url),
            exchange="relay",
            workers=WORKERS,
            on_unroutable=on_unroutable,
        )

    async def read(self, dest: str, count: int) -> list[Received]:
        got = []
        for message in await self.nats.messages(dest):
            headers = dict(message.headers or {})
            got.append(
                Received(
                    message.data,
                    headers.get("Nats-Msg-Id"),
                    headers.get("type"),
                    headers.get("key"),
                    {n: v for n, v in headers.items() if n not in self.RELAY_HEADERS},
                    message,
                )
            )
        assert len(got) == count, f"{len(got)} messages in {dest}, not {count}"
        return got

    async def refuse(self, publisher: Publisher, topic: str) -> str:
        """A subject whose stream takes no message over 8 bytes."""
        refused = topic + "-refused"
        await self.nats.create(f"S-{refused}", [refused], max_msg_size=8)
        return refused

    async def inbox_queue(self) -> str:
        stream, _ = await self.nats.stream("in")
        return stream

    def consumer(self, queue: str, *, prefetch: int = 100) -> Consumer:
        return make_consumer(
            BrokerURL.parse(self.url), queue=queue, exchange="relay", binds=(), prefetch=prefetch
        )

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

    def fallback_type(self, queue: str) -> str:
        return f"{queue}.x"  # the subject

    def go_down(self) -> None:
        self.nats.proxy.stop()

    def come_back(self) -> None:
        self.nats.proxy.start()

    def unreachable(self) -> Publisher:
        return make_publisher(
            BrokerURL.parse("nats://app:s3cret@127.0.0.1:1"), exchange="relay", workers=WORKERS
        )


Port = MemoryPort | AmqpPort | SqsPort | SnsPort | KafkaPort | NatsPort | RedisPort


@pytest.fixture(params=["memory", "amqp", "sqs", "sns", "kafka", "nats", "redis"])
def port(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Port]:
    """Each broker in turn, for a test written once."""
    if request.param == "memory":
        yield MemoryPort()
        return
    if request.param == "nats":  # its proxy is the server's own (tests/nats_server.py)
        yield NatsPort(request.getfixturevalue("nats_helper"))
        return
    if request.param == "redis":  # its proxy is the server's own (tests/redis_server.py)
        yield RedisPort(request.getfixturevalue("redis_streams"))
        return
    if request.param == "kafka":  # its proxy is the broker's own (tests/kafka_server.py)
        yield KafkaPort(request.getfixturevalue("kafka"))
        return
    if request.param == "amqp":
        rabbit = request.getfixturevalue("rabbit")
        proxy = Proxy(urllib.parse.urlsplit(AMQP_URL).port or 5672)
        target = AmqpPort(rabbit, proxy)
    else:
        helper = request.getfixturevalue("sqs")
        proxy = Proxy(int(urllib.parse.urlsplit(helper.endpoint).port or 80))
        if request.param == "sns":
            target = SnsPort(request.getfixturevalue("sns"), proxy, monkeypatch)  # type: ignore[assignment]
        else:
            target = SqsPort(helper, proxy, monkeypatch)  # type: ignore[assignment]
    proxy.start()
    try:
        yield target
    finally:
        proxy.close()


@pytest.fixture
def memory_broker() -> Iterator[MemoryBroker]:
    yield MemoryBroker()


__all__ = [
    "Message",
    "Port",
    "Received",
    "kafka",
    "kafka_server",
    "memory_broker",
    "nats_helper",
    "nats_server",
    "port",
    "redis_server",
    "redis_streams",
    "sns",
    "sqs",
    "sqs_server",
]
