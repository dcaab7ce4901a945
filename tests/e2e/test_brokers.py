"""One broker suite, written once, run against RabbitMQ and against SQS.

The `broker` fixture gives each test the same small interface over either
server: where a topic's messages land, how to read them back (normalized),
how to send raw messages to an inbox queue, and the broker-specific wire
checks. SQS is moto's standalone server, spoken to over HTTP.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import botocore.exceptions
import orjson
import pytest

import relay
from relay.brokers import make_publisher
from relay.brokers.sqs import (
    BATCH_BYTES,
    SqsConsumer,
    build_entry,
    call_failure,
    chunks,
    entry_failure,
    lanes,
    to_incoming,
)
from relay.config import BrokerURL, OutboxSettings
from relay.outbox import WORKERS, OutboxRelay
from relay.store import OutboxRow, Store
from tests.apps.handlers import EFFECTS_DDL
from tests.conftest import AMQP_URL, Rabbit, insert_outbox, rows, wait_until
from tests.sqs_server import Sqs, sqs, sqs_server  # noqa: F401 - fixtures

HANDLERS = "tests.apps.handlers:registry"


@dataclass
class Received:
    """A message read back from the broker, the same shape for every broker."""

    body: bytes
    message_id: str | None
    type: str | None
    key: str | None
    headers: dict[str, Any]
    raw: Any = field(repr=False)


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
    arrive keeps it shallow. One thread for a FIFO queue keeps the order
    in which messages were received."""

    def __init__(self, sqs: Sqs, dest: str, threads: int) -> None:
        self.sqs, self.dest = sqs, dest
        self.messages: list[dict[str, Any]] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                batch = self.sqs.receive(self.dest, wait=1)
            except Exception:  # the queue is being deleted at teardown
                return
            self.messages += batch  # list.extend is atomic under the GIL

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(10)

    async def wait(self, count: int, timeout: float = 60) -> list[Received]:
        deadline = time.monotonic() + timeout
        while len(self.messages) < count:
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"got {len(self.messages)} of {count} messages "
                                     f"in {timeout}s")
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
        # No queue bound for a topic: a failure only when asked (pub/sub by default).
        self.missing_args = ["--on-unroutable", "fail"]
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

    async def send(self, queue: str, body: bytes, *, message_id: str | None = None,
                   type: str | None = None, key: str | None = None,
                   headers: dict[str, str] | None = None) -> None:
        properties: dict[str, Any] = {"headers": dict(headers or {})}
        if key is not None:
            properties["headers"]["x-relay-key"] = key
        if message_id is None:
            await self.rabbit.publish_without_message_id(
                queue, body, message_type=type, headers=properties["headers"])
        else:
            await self.rabbit.publish(queue, body, message_id=message_id, type=type,
                                      **properties)

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        for body, message_id in messages:
            await self.send(queue, body, message_id=message_id, type=type)

    async def queued(self, queue: str) -> int:
        channel = await self.rabbit.connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        await channel.close()
        return declared.declaration_result.message_count

    def check_wire(self, full: Received, plain: Received, row: dict[str, Any]) -> None:
        message = full.raw
        assert message.routing_key == row["topic"] and message.exchange == self.exchange
        assert message.content_type == "application/json"
        assert message.delivery_mode == 2
        assert message.timestamp == row["created_at"].replace(microsecond=0)
        assert message.headers["x-relay-key"] == row["key"]
        assert plain.raw.headers == {} and plain.raw.type is None

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        pass  # RabbitMQ keeps one queue's order; nothing more on the wire

    async def fail_one_entry(self, publisher: Any, topic: str, marker: str) -> str:
        """The topic for a row that fails while its batch mates go through."""
        publisher.on_unroutable = "fail"  # by default an unroutable message is published
        return topic + ".nowhere"  # unroutable: returned by the broker (mandatory)

    def check_failed_entry(self, status: str, error: str) -> None:
        assert status == "pending" and "unroutable" in error

    def check_missing(self, error: str, topic: str) -> None:
        assert "unroutable" in error and repr(topic) in error


class SqsBroker:
    kind = "sqs"
    bulk = 1000  # moto is slower than RabbitMQ; enough to kill mid-stream

    def __init__(self, sqs: Sqs) -> None:
        self.sqs = sqs
        self.url = "sqs://"
        self.exchange = "relay"
        self.env = {"RELAY_BROKER_URL": "sqs://", **sqs.env}
        self.outbox_args: list[str] = []
        self.missing_args: list[str] = []
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
        return Received(message["Body"].encode(), text("message_id"), text("type"), text("key"),
                        headers, message)

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

    async def send(self, queue: str, body: bytes, *, message_id: str | None = None,
                   type: str | None = None, key: str | None = None,
                   headers: dict[str, str] | None = None) -> None:
        attributes = {}
        for name, value in (("message_id", message_id), ("type", type), ("key", key),
                            ("headers", orjson.dumps(headers).decode() if headers else None)):
            if value is not None:
                attributes[name] = {"DataType": "String", "StringValue": value}
        await asyncio.to_thread(
            self.sqs.client.send_message, QueueUrl=self.sqs.urls[queue],
            MessageBody=body.decode(), MessageAttributes=attributes)

    async def send_many(self, queue: str, messages: list[tuple[bytes, str]], type: str) -> None:
        for start in range(0, len(messages), 10):
            await asyncio.to_thread(
                self.sqs.client.send_message_batch, QueueUrl=self.sqs.urls[queue],
                Entries=[{"Id": str(i), "MessageBody": body.decode(), "MessageAttributes": {
                    "message_id": {"DataType": "String", "StringValue": message_id},
                    "type": {"DataType": "String", "StringValue": type}}}
                    for i, (body, message_id) in enumerate(messages[start:start + 10])])

    async def queued(self, queue: str) -> int:
        return await asyncio.to_thread(self.sqs.count, queue)

    def check_wire(self, full: Received, plain: Received, row: dict[str, Any]) -> None:
        attrs = full.raw["MessageAttributes"]
        assert set(attrs) == {"message_id", "type", "key", "headers"}
        assert all(a["DataType"] == "String" for a in attrs.values())
        # headers: one String attribute holding a compact JSON object
        assert attrs["headers"]["StringValue"] == '{"traceparent":"00-abc-def-01"}'
        assert set(plain.raw["MessageAttributes"]) == {"message_id"}
        assert "MessageGroupId" not in full.raw.get("Attributes", {})  # standard queue

    def check_ordered_wire(self, message: Received, topic: str) -> None:
        system = message.raw["Attributes"]
        assert system["MessageGroupId"] == (message.key or topic)
        assert system["MessageDeduplicationId"] == message.message_id

    async def fail_one_entry(self, publisher: Any, topic: str, marker: str) -> str:
        # moto fails an entry of SendMessageBatch (and only it) whose
        # DelaySeconds is out of range; relay never sends one, so a botocore
        # hook adds it to the marked entry on its way out.
        def spoil(params: dict[str, Any], **_: Any) -> None:
            for entry in params["Entries"]:
                if marker in entry["MessageBody"]:
                    entry["DelaySeconds"] = 901

        await publisher.connect()
        publisher._client.meta.events.register(
            "before-parameter-build.sqs.SendMessageBatch", spoil)
        return topic

    def check_failed_entry(self, status: str, error: str) -> None:
        # SenderFault: sending it again cannot help.
        assert status == "dead"
        assert error.startswith("SQS rejected the message: InvalidParameterValue")

    def check_missing(self, error: str, topic: str) -> None:
        assert error == f"SQS queue {topic!r} does not exist"


@pytest.fixture(params=["amqp", "sqs"])
def broker(request: pytest.FixtureRequest) -> Iterator[AmqpBroker | SqsBroker]:
    if request.param == "amqp":
        yield AmqpBroker(request.getfixturevalue("rabbit"))
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
def in_process(broker, monkeypatch):
    """The broker's environment in this process, for adapters run in the test."""
    for name, value in broker.env.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def effects(engine):
    rows(engine, EFFECTS_DDL)
    return engine


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
        proc = start_relay("inbox", *state["args"], "--handlers", HANDLERS,
                           "--poll-interval", "0.5", "--backoff-min", "0.2",
                           "--backoff-max", "0.5", *extra)
        proc.wait_for_log("inbox started")
        return proc

    start.queue = queue
    return start


def published_count(engine) -> int:
    return rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0]


def effect_ids(engine) -> list[str]:
    return [r[0] for r in rows(engine, "SELECT message_id FROM effects ORDER BY id")]


async def wait_drained(broker, queue: str, timeout: float = 15) -> None:
    """Until the queue holds nothing: every copy was acknowledged."""
    deadline = time.monotonic() + timeout
    while (left := await broker.queued(queue)) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert left == 0, f"{left} messages left in {queue}"


# --------------------------------------------------------------------------
# Outbox → broker
# --------------------------------------------------------------------------


async def test_publish_with_the_contract_wire_format(engine, broker, run_relay):
    topic = broker.topic("orders")
    dest = await broker.destination(topic)
    with engine.begin() as conn:
        full_id = relay.enqueue(conn, topic, {"order_id": 7, "note": "é"}, key="order-7",
                                type="OrderPlaced", headers={"traceparent": "00-abc-def-01"})
        plain_id = relay.enqueue(conn, topic, [1, 2, 3])
    created_at = rows(engine, "SELECT created_at FROM outbox WHERE id = :id", id=full_id)[0][0]

    result = run_relay("outbox", "--once", *broker.outbox_args)
    assert result.returncode == 0, result.stderr

    got = {m.message_id: m for m in await broker.read(dest, 2)}
    full, plain = got[str(full_id)], got[str(plain_id)]
    # jsonb keeps its own key order; the body is compact UTF-8 JSON of it.
    assert full.body == '{"note":"é","order_id":7}'.encode()
    assert (full.type, full.key, full.headers) == (
        "OrderPlaced", "order-7", {"traceparent": "00-abc-def-01"})
    assert (plain.body, plain.type, plain.key, plain.headers) == (b"[1,2,3]", None, None, {})
    broker.check_wire(full, plain, {"topic": topic, "key": "order-7", "created_at": created_at})
    assert rows(engine, "SELECT status, attempts, last_error FROM outbox") == [
        ("published", 0, None)] * 2


async def test_per_key_order_holds_with_three_relays(engine, broker, start_relay):
    # SQS: a FIFO queue (order per MessageGroupId = key); RabbitMQ: one queue.
    topic = broker.topic("ordered", ordered=True)
    dest = await broker.destination(topic)
    collector = await broker.collect(dest, ordered=True)
    relays = [start_relay("outbox", *broker.outbox_args, "--batch-size", "40",
                          "--poll-interval", "0.2") for _ in range(3)]
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


async def test_partial_batch_failure_marks_only_the_failed_row(
    engine, database, broker, in_process
):
    topic = broker.topic("partial")
    dest = await broker.destination(topic)
    settings = OutboxSettings(database_url=database, broker=BrokerURL.parse(broker.url),
                              exchange=broker.exchange, backoff_min=30, backoff_max=60)
    publisher = make_publisher(settings.broker, exchange=settings.exchange)
    bad_topic = await broker.fail_one_entry(publisher, topic, '"spoil":true')
    with engine.begin() as conn:
        ok_1 = relay.enqueue(conn, topic, {"n": 1})
        bad = relay.enqueue(conn, bad_topic, {"n": 2, "spoil": True})
        ok_3 = relay.enqueue(conn, topic, {"n": 3})
    store = Store(database)
    try:
        outbox = OutboxRelay(settings, store, publisher)
        assert await outbox.publish_batch() == (3, 0)  # one batch, one call for SQS
        await outbox.close()
    finally:
        await publisher.close()
        await store.close()
    assert {m.message_id for m in await broker.read(dest, 2)} == {str(ok_1), str(ok_3)}
    outcome = {r[0]: r[1:] for r in rows(
        engine, "SELECT id, status, attempts, last_error FROM outbox")}
    assert outcome[ok_1] == outcome[ok_3] == ("published", 0, None)
    status, attempts, error = outcome[bad]
    assert attempts == 1
    broker.check_failed_entry(status, error)


async def test_missing_destination_names_it_then_dies_at_max_attempts(
    engine, broker, run_relay
):
    topic = broker.topic("nowhere")
    with engine.begin() as conn:
        relay.enqueue(conn, topic, {"x": 1})
    args = ["outbox", "--once", *broker.outbox_args, *broker.missing_args, "--backoff-min", "30",
            "--backoff-max", "60", "--max-attempts", "2"]
    result = run_relay(*args)
    assert result.returncode == 0, result.stderr
    [(status, attempts, error, delay)] = rows(
        engine, "SELECT status, attempts, last_error, "
                "extract(epoch FROM available_at - now()) FROM outbox")
    assert (status, attempts) == ("pending", 1)
    broker.check_missing(error, topic)
    assert 25 <= delay <= 60
    rows(engine, "UPDATE outbox SET available_at = now()")
    assert run_relay(*args).returncode == 0
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("dead", 2)]


# SQS only: RabbitMQ's 128 MiB limit is covered by
# tests/test_hostile.py with a real over-limit payload.
@pytest.mark.parametrize("broker", ["sqs"], indirect=True)
async def test_oversized_message_is_dead_with_a_clear_error(engine, broker, run_relay):
    topic = broker.topic("big")
    dest = await broker.destination(topic, MaximumMessageSize=262144)
    with engine.begin() as conn:
        big = relay.enqueue(conn, topic, {"blob": "x" * 300_000})
        small = relay.enqueue(conn, topic, {"n": 1})
    assert run_relay("outbox", "--once", *broker.outbox_args).returncode == 0
    [message] = await broker.read(dest, 1)
    assert message.message_id == str(small)
    [(status, attempts, error)] = rows(
        engine, "SELECT status, attempts, last_error FROM outbox WHERE id = :id", id=big)
    assert (status, attempts) == ("dead", 1)
    assert "bytes" in error and "over the 262144-byte limit" in error and topic in error


async def test_kill_9_of_the_outbox_mid_stream_loses_nothing(engine, broker, start_relay):
    topic = broker.topic("kill")
    dest = await broker.destination(topic)
    collector = await broker.collect(dest)
    total = broker.bulk
    insert_outbox(engine, total, topic=topic, keys=50)
    first = start_relay("outbox", *broker.outbox_args, "--batch-size", "100")
    wait_until(lambda: published_count(engine) > total // 10, timeout=30,
               message="first relay publishing")
    first.signal(signal.SIGKILL)
    first.wait()
    assert published_count(engine) < total, "the kill came too late to prove anything"
    second = start_relay("outbox", *broker.outbox_args, "--poll-interval", "0.5")
    wait_until(lambda: published_count(engine) == total, timeout=90,
               message="all published after restart")
    ids = [m.message_id for m in await collector.wait(total, timeout=60)]
    assert set(ids) == {str(r[0]) for r in rows(engine, "SELECT id FROM outbox")}
    # Duplicates are bounded by what was in flight when killed: a batch per worker.
    assert len(ids) - len(set(ids)) <= WORKERS * 100
    second.stop()
    assert second.proc.returncode == 0


async def test_unreachable_broker_is_retried_and_counts_no_attempt(engine, broker, start_relay):
    with engine.begin() as conn:
        relay.enqueue(conn, broker.topic("x"), {})
    daemon = start_relay("outbox", *broker.outbox_args,
                         env={"RELAY_BROKER_URL": broker.unreachable_url})
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


async def test_received_message_becomes_an_inbox_row_and_one_effect(effects, broker, inbox):
    queue = await inbox.queue()
    await inbox()
    await broker.send(queue, b'{"n": 5}', message_id="m-1", type="Effect", key="order-5",
                      headers={"traceparent": "00-aa-bb-01"})
    await broker.send(queue, b'{"n": 6}', message_id="m-2")  # no type: the fallback
    wait_until(lambda: effect_ids(effects) == ["m-1"])
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox WHERE status <> 'pending'")) == 2)
    got = {r[0]: r[1:] for r in rows(
        effects, "SELECT message_id, status, type, key, topic, payload, headers FROM inbox")}
    assert got["m-1"][:5] == ("processed", "Effect", "order-5", queue, {"n": 5})
    assert got["m-1"][5]["traceparent"] == "00-aa-bb-01"
    # The type falls back to the routing key (RabbitMQ) or the queue name (SQS),
    # here both the queue's name, which no handler takes.
    assert got["m-2"][:3] == ("dead", queue, None)
    assert rows(effects, "SELECT n, key, traceparent FROM effects") == [
        (5, "order-5", "00-aa-bb-01")]
    await wait_drained(broker, queue)


async def test_redelivered_message_is_stored_and_handled_once(effects, broker, inbox):
    queue = await inbox.queue()
    for _ in range(3):  # three copies of each, like redeliveries
        for i in range(10):
            await broker.send(queue, b'{"n": %d}' % i, message_id=f"dup-{i}", type="Effect")
    await inbox()
    await inbox()
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox WHERE status = 'processed'"))
               == 10)
    await wait_drained(broker, queue)
    assert sorted(effect_ids(effects)) == sorted(f"dup-{i}" for i in range(10))
    assert len(rows(effects, "SELECT 1 FROM inbox")) == 10


async def test_missing_message_id_dedups_by_body_hash(effects, broker, inbox):
    queue = await inbox.queue()
    await inbox()
    for _ in range(3):
        await broker.send(queue, b'{"n": 9}', type="Effect")
    expected = "sha256:" + hashlib.sha256(b'{"n": 9}').hexdigest()
    wait_until(lambda: effect_ids(effects) == [expected])
    time.sleep(0.5)
    assert [r[0] for r in rows(effects, "SELECT message_id FROM inbox")] == [expected]
    assert effect_ids(effects) == [expected]


async def test_kill_9_of_the_inbox_mid_stream_loses_and_duplicates_nothing(
    effects, broker, inbox
):
    queue = await inbox.queue()
    total = broker.bulk // 2
    await broker.send_many(
        queue, [(orjson.dumps({"n": n}), f"k-{n}") for n in range(total)], type="Effect")
    first = await inbox("--batch-size", "20")
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) > total // 10, timeout=30)
    first.signal(signal.SIGKILL)
    first.wait()
    assert len(rows(effects, "SELECT 1 FROM inbox")) < total, "killed too late to prove anything"
    await inbox()
    wait_until(lambda: len(effect_ids(effects)) >= total, timeout=90)
    time.sleep(1)
    ids = effect_ids(effects)
    assert len(ids) == total and len(set(ids)) == total
    assert rows(effects, "SELECT status, count(*) FROM inbox GROUP BY status") == [
        ("processed", total)]
    await wait_drained(broker, queue, timeout=30)


# --------------------------------------------------------------------------
# SQS only: settings, queue handling, visibility, and the adapter's pieces
# --------------------------------------------------------------------------


def test_sqs_bind_and_a_bad_queue_name_are_configuration_errors(run_relay):
    cases = {
        ("--queue", "q", "--bind", "#"): "--bind applies to RabbitMQ only",
        ("--queue", "orders.in"): "invalid --queue 'orders.in' for SQS",
    }
    for args, expected in cases.items():
        result = run_relay("inbox", "--broker-url", "sqs://", *args,
                           env={"AWS_DEFAULT_REGION": "us-east-1"})
        assert result.returncode == 2, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_sqs_without_a_region_is_a_configuration_error(run_relay):
    if os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
        pytest.skip("this environment sets an AWS region")
    result = run_relay("outbox", "--once", "--broker-url", "sqs://",
                       env={"AWS_CONFIG_FILE": "/nonexistent"})
    assert result.returncode == 2, result.stderr
    assert "no AWS region for SQS" in result.stderr and "Traceback" not in result.stderr


async def test_sqs_region_and_endpoint_from_the_url(engine, sqs, run_relay):
    topic = sqs.name("url")
    sqs.create(topic)
    with engine.begin() as conn:
        relay.enqueue(conn, topic, {"n": 1})
    url = f"sqs://?region=us-east-1&endpoint_url={sqs.endpoint}"
    env = {"RELAY_BROKER_URL": url, "AWS_ENDPOINT_URL_SQS": "http://127.0.0.1:1",
           "AWS_DEFAULT_REGION": "eu-west-3", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing"}
    result = run_relay("outbox", "--once", env=env)
    assert result.returncode == 0, result.stderr
    assert rows(engine, "SELECT status FROM outbox") == [("published",)]
    [message] = sqs.receive(topic)
    assert orjson.loads(message["Body"]) == {"n": 1}


async def test_sqs_inbox_waits_for_a_missing_queue(effects, sqs, start_relay):
    queue = sqs.name("later")
    daemon = start_relay("inbox", "--queue", queue, "--handlers", HANDLERS,
                         env={"RELAY_BROKER_URL": "sqs://", **sqs.env})
    daemon.wait_for_log("retrying in", timeout=20)
    assert f"SQS queue {queue!r} does not exist" in daemon.log
    assert daemon.proc.poll() is None
    sqs.create(queue)
    sqs.client.send_message(QueueUrl=sqs.urls[queue], MessageBody='{"n": 1}', MessageAttributes={
        "message_id": {"DataType": "String", "StringValue": "late-1"},
        "type": {"DataType": "String", "StringValue": "Effect"}})
    wait_until(lambda: effect_ids(effects) == ["late-1"], timeout=60)
    started = time.monotonic()
    daemon.stop()  # its receivers are in 20-second long polls: not waited for
    assert daemon.proc.returncode == 0
    assert time.monotonic() - started < 5


async def test_sqs_visibility_is_extended_while_a_batch_is_held(sqs, monkeypatch):
    for name, value in sqs.env.items():
        monkeypatch.setenv(name, value)
    queue = sqs.name("held")
    sqs.create(queue, VisibilityTimeout=2)
    for n in range(3):
        sqs.client.send_message(QueueUrl=sqs.urls[queue], MessageBody=str(n))
    consumer = SqsConsumer(BrokerURL.parse("sqs://"), queue=queue)
    batches = consumer.batches(10, 0.2)
    try:
        batch = await anext(batches)
        while len(batch) < 3:
            batch += await anext(batches)
        await asyncio.sleep(5)  # more than twice the visibility timeout, unacked
        assert await asyncio.to_thread(sqs.receive, queue, delete=False) == []
        await consumer.ack(batch)
        assert sqs.count(queue) == 0
    finally:
        await batches.aclose()
        await consumer.close()


async def test_sqs_close_makes_held_messages_visible_at_once(sqs, monkeypatch):
    for name, value in sqs.env.items():
        monkeypatch.setenv(name, value)
    queue = sqs.name("release")
    sqs.create(queue, VisibilityTimeout=300)
    sqs.client.send_message(QueueUrl=sqs.urls[queue], MessageBody="{}")
    consumer = SqsConsumer(BrokerURL.parse("sqs://"), queue=queue)
    batches = consumer.batches(10, 0.01)
    [incoming] = await anext(batches)
    started = time.monotonic()
    await batches.aclose()
    await consumer.close()  # stored nothing: the message goes back now, not in 300 s
    assert time.monotonic() - started < 2  # no waiting for the receivers' long polls
    [again] = sqs.receive(queue)
    assert again["ReceiptHandle"] != incoming.ack_token


def _row(n: int, *, topic: str = "q", key: str | None = None, payload: str = "{}") -> OutboxRow:
    return OutboxRow(str(uuid.uuid4()), n, topic, key, None, payload, "{}", None, 0)  # type: ignore


def test_sqs_calls_hold_10_entries_and_the_byte_limit_and_keep_key_order():
    entries = [build_entry(_row(n, key=f"k{n % 40}"), n) for n in range(95)]
    split = lanes(entries)
    assert len(split) == 8
    for lane in split:
        assert [e.index for e in lane] == sorted(e.index for e in lane)  # seq order
    keys = [{e.order_key for e in lane} for lane in split]
    assert all(a.isdisjoint(b) for i, a in enumerate(keys) for b in keys[i + 1:])
    calls = chunks(split[0])
    assert all(len(c) <= 10 for c in calls) and sum(map(len, calls)) == len(split[0])
    assert len(lanes(entries[:12])) == 2  # few rows: few calls
    big = [build_entry(_row(n, payload=f'"{"x" * 100_000}"'), n) for n in range(5)]
    calls = chunks(big)
    assert [len(c) for c in calls] == [2, 2, 1]
    assert all(sum(e.size for e in c) <= BATCH_BYTES for c in calls)
    huge = build_entry(_row(9, payload=f'"{"x" * 500_000}"'), 9)
    assert [len(c) for c in chunks([huge, *big[:1]])] == [1, 1]  # alone in its call


def test_sqs_fifo_entry_and_bad_content():
    row = _row(1, topic="t.fifo", key="order-1")
    params = build_entry(row, 0).params
    assert (params["MessageGroupId"], params["MessageDeduplicationId"]) == ("order-1", str(row.id))
    assert build_entry(_row(2, topic="t.fifo"), 0).params["MessageGroupId"] == "t.fifo"
    with pytest.raises(ValueError, match="cannot be an SQS MessageGroupId"):
        build_entry(_row(3, topic="t.fifo", key="has space"), 0)
    with pytest.raises(ValueError, match="U\\+FFFF"):
        build_entry(_row(4, payload='"\uffff"'), 0)
    with pytest.raises(ValueError, match="not a valid SQS queue name"):
        build_entry(_row(5, topic="orders.placed"), 0)


def test_sqs_error_classification():
    def client_error(code: str, status: int = 400) -> botocore.exceptions.ClientError:
        return botocore.exceptions.ClientError(
            {"Error": {"Code": code, "Message": "m"},
             "ResponseMetadata": {"HTTPStatusCode": status}}, "SendMessageBatch")

    throttled = call_failure(client_error("ThrottlingException"), "q")
    assert throttled.error.startswith("throttled by SQS") and not throttled.permanent
    missing = call_failure(client_error("AWS.SimpleQueueService.NonExistentQueue"), "q")
    assert missing.error == "SQS queue 'q' does not exist" and not missing.permanent
    assert call_failure(client_error("InvalidMessageContents"), "q").permanent
    assert entry_failure({"Id": "0", "SenderFault": True, "Code": "X", "Message": "m"}).permanent
    assert not entry_failure({"Id": "0", "SenderFault": False, "Code": "InternalError"}).permanent


def test_sqs_received_attributes_map_to_the_inbox_fields():
    def attrs(**values: str) -> dict[str, Any]:
        return {k: {"DataType": "String", "StringValue": v} for k, v in values.items()}

    message = {"Body": '{"a":1}', "ReceiptHandle": "rh", "MessageId": "sqs-id",
               "MessageAttributes": attrs(message_id="m", type="T", key="k",
                                          headers='{"traceparent":"tp"}', extra="e")}
    incoming = to_incoming(message, "q")
    assert (incoming.message_id, incoming.type, incoming.key, incoming.topic) == (
        "m", "T", "k", "q")
    assert incoming.headers == {"traceparent": "tp", "extra": "e"}
    assert incoming.body == b'{"a":1}' and incoming.ack_token == "rh"
    bare = to_incoming({"Body": "x", "ReceiptHandle": "rh", "MessageId": "sqs-id",
                        "MessageAttributes": attrs(headers="not json")}, "q")
    # Never the SQS MessageId: the inbox falls back to the body's sha256.
    assert (bare.message_id, bare.type, bare.headers) == (None, "q", {"headers": "not json"})


def test_sqs_publisher_is_not_connected_before_it_connects():
    assert not make_publisher(BrokerURL.parse("sqs://"), exchange="relay").connected
