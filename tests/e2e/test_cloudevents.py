"""CloudEvents end to end (issue 42), with the CloudEvents Python SDK as the
other side, against the real RabbitMQ, SQS (moto) and Kafka (Tansu), each
test run once per broker: relay's outbox messages read by the SDK as the
events they should be (binary mode on RabbitMQ and Kafka, structured on
SQS); the SDK's events, binary and structured, stored and handled once by
`relay inbox`, and once still after they are delivered again; two sources
with one id kept apart; Knative-style ids and sources; generated events
that break the specification kept as dead rows between canaries.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika
import orjson
import pytest
from cloudevents.core.bindings import amqp as sdk_amqp
from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkEvent
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

import relay
from tests.conftest import rows, wait_until
from tests.e2e.test_brokers import (
    AmqpBroker,
    KafkaBroker,
    NatsBroker,
    Received,
    RedisBroker,
    SqsBroker,
    wait_drained,
)
from tests.kafka_server import kafka, kafka_server  # noqa: F401 - fixtures
from tests.nats_server import nats_helper, nats_server  # noqa: F401 - fixtures
from tests.redis_server import redis_server, redis_streams  # noqa: F401 - fixtures
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures

HANDLERS = "tests.apps.cloudevent_handlers:registry"
URI = "https://shop.example.com/orders"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# Knative's sources name themselves by their API path; a ping source's
# events carry UUIDs as ids. A `#` in a source is allowed (a fragment).
KNATIVE_SOURCE = "/apis/v1/namespaces/default/pingsources/nightly#cron"
TYPE = "com.example.order.placed"
DATA_TYPE = "application/json"
LONG = int(os.environ.get("RELAY_GENERATED_EXAMPLES", "0"))


@pytest.fixture
def events(effects):
    from tests.apps.cloudevent_handlers import EVENTS_DDL

    rows(effects, EVENTS_DDL)
    return effects


def _sdk_event(source: str, id: str, type: str = TYPE, **attributes: Any) -> SdkEvent:
    data = attributes.pop("data", {"n": 1})
    return SdkEvent(
        {"source": source, "id": id, "type": type, "datacontenttype": "application/json"}
        | attributes,
        data=data,
    )


def _inbox_rows(engine) -> dict[str, tuple[Any, ...]]:
    return {
        r[0]: tuple(r[1:])
        for r in rows(engine, "SELECT message_id, status, type, key, last_error FROM inbox")
    }


def _events(engine) -> dict[str, tuple[Any, ...]]:
    found = rows(
        engine,
        "SELECT message_id, source, event_id, type, key, subject, data, traceparent FROM events",
    )
    ids = [r[0] for r in found]
    assert len(ids) == len(set(ids)), f"an event handled twice: {ids}"
    return {r[0]: tuple(r[1:]) for r in found}


def _check_sdk_attributes(attributes: dict[str, Any], row: Any) -> None:
    """The SDK's reading of one of relay's events against its outbox row
    (id, topic, key, type, created_at, headers)."""
    id_, topic, key, type_, created_at, headers = row
    assert attributes["specversion"] == "1.0"
    assert attributes["id"] == id_
    assert attributes["source"] == URI
    assert attributes["type"] == (type_ or topic)
    assert attributes.get("subject") == key
    assert attributes["time"] == created_at  # to the microsecond
    assert attributes["datacontenttype"] == "application/json"
    assert attributes.get("traceparent") == headers.get("traceparent")


def _enqueue_two(engine, topic: str) -> None:
    with engine.begin() as conn:
        relay.enqueue(
            conn,
            topic,
            {"order_id": 7, "big": 12345678901234567890123},
            key="order-7",
            type="OrderPlaced",
            headers={"traceparent": TRACEPARENT},
        )
        relay.enqueue(conn, topic, {"n": 2})  # no key, no type: type is the topic


def _outbox_rows(engine) -> dict[str, Any]:
    return {
        r[0]: r
        for r in rows(engine, "SELECT id::text, topic, key, type, created_at, headers FROM outbox")
    }


# --------------------------------------------------------------------------
# Each broker as the SDK's other side
# --------------------------------------------------------------------------
# test_brokers' broker helpers (env, outbox flags, inbox queue, reading
# back), each with what its CloudEvents binding adds: how the SDK reads a
# received message, how an SDK event or a hand-made one is sent.


@dataclass
class Raw:
    """A message made by hand: an event in either mode, or a canary."""

    body: bytes
    message_id: str | None
    type: str | None = None
    content_type: str | None = None
    attributes: dict[str, Any] | None = None  # binary mode: each as a header


class AmqpSide(AmqpBroker):
    modes = ("binary", "structured")
    ordered = True  # one queue: the inbox's rows in the order sent
    examples = 40
    retries: Any = 2  # AMQP headers keep an integer

    async def send_event(self, queue: str, mode: str, event: SdkEvent) -> None:
        if mode == "binary":
            message = sdk_amqp.to_binary(event, JSONFormat())
            await self.rabbit.publish(
                queue,
                message.application_data,
                headers=dict(message.application_properties),
                content_type=message.properties.get("content-type"),
            )
        else:
            await self.rabbit.publish(
                queue, JSONFormat().write(event), content_type=JSONFormat.CONTENT_TYPE
            )

    async def send_raw(self, queue: str, raw: Raw) -> None:
        headers = {f"cloudEvents_{k}": v for k, v in (raw.attributes or {}).items()}
        await self.rabbit.publish(
            queue,
            raw.body,
            headers=headers,
            content_type=raw.content_type,
            message_id=raw.message_id,
            type=raw.type,
        )

    def sdk_read(self, message: Received, row: Any) -> SdkEvent:
        raw = message.raw
        event = sdk_amqp.from_binary(
            sdk_amqp.AMQPMessage(
                properties={"content-type": raw.content_type},
                application_properties=dict(raw.headers),
                application_data=raw.body,
            ),
            JSONFormat(),
            SdkEvent,
        )
        # Everything else as the wire format sets it.
        assert message.type == row[3] and message.key == row[2]
        assert raw.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert raw.timestamp is not None
        return event


class SqsSide(SqsBroker):
    modes = ("structured",)  # SQS has no binding of its own
    ordered = False  # a standard queue: each example found by its id
    examples = 12
    retries: Any = 2

    async def send_event(self, queue: str, mode: str, event: SdkEvent) -> None:
        await self.send_raw(
            queue, Raw(JSONFormat().write(event), None, content_type=JSONFormat.CONTENT_TYPE)
        )

    async def send_raw(self, queue: str, raw: Raw) -> None:
        assert raw.attributes is None, "SQS events are structured"
        given = {"message_id": raw.message_id, "type": raw.type, "content-type": raw.content_type}
        await asyncio.to_thread(
            self.sqs.client.send_message,
            QueueUrl=self.sqs.urls[queue],
            MessageBody=raw.body.decode(),
            MessageAttributes={
                k: {"DataType": "String", "StringValue": v} for k, v in given.items() if v
            },
        )

    def sdk_read(self, message: Received, row: Any) -> SdkEvent:
        attributes = message.raw["MessageAttributes"]
        assert attributes["content-type"]["StringValue"] == "application/cloudevents+json"
        # relay's own attributes as before.
        assert message.key == row[2] and message.type == row[3]
        return JSONFormat().read(SdkEvent, message.body)


class KafkaSide(KafkaBroker):
    modes = ("binary", "structured")
    ordered = True
    partitions = 1  # one partition: the inbox's rows in the order sent
    examples = 25
    retries: Any = "2"  # Kafka headers carry text

    async def send_event(self, queue: str, mode: str, event: SdkEvent) -> None:
        write = sdk_kafka.to_binary if mode == "binary" else sdk_kafka.to_structured
        message = write(event, JSONFormat())
        key = message.key.encode() if isinstance(message.key, str) else message.key
        await asyncio.to_thread(
            self.kafka.produce, queue, message.value, key=key, headers=list(message.headers.items())
        )

    async def send_raw(self, queue: str, raw: Raw) -> None:
        given = [("id", raw.message_id), ("type", raw.type), ("content-type", raw.content_type)]
        given += [(f"ce_{k}", str(v)) for k, v in (raw.attributes or {}).items()]
        await asyncio.to_thread(
            self.kafka.produce,
            queue,
            raw.body,
            headers=[(n, v.encode()) for n, v in given if v is not None],
        )

    def sdk_read(self, message: Received, row: Any) -> SdkEvent:
        record = message.raw
        headers = dict(record.headers())
        event = sdk_kafka.from_binary(
            sdk_kafka.KafkaMessage(headers=headers, key=record.key(), value=record.value()),
            JSONFormat(),
            SdkEvent,
        )
        # The record as the Kafka wire format sets it: key, `id`, `type`,
        # `content-type`, the row's headers, created_at as its timestamp.
        assert message.key == row[2] and message.type == row[3]
        assert headers["content-type"] == b"application/json"
        assert message.headers.get("traceparent") == row[5].get("traceparent")
        assert record.timestamp()[1] == int(row[4].timestamp() * 1000)
        assert event.get_attributes().get("partitionkey") == row[2]  # the SDK's name for the key
        return event


class RedisSide(RedisBroker):
    modes = ("structured",)  # the contract's binding: the event as JSON in `payload`
    ordered = True  # one stream, one consumer: the inbox's rows in the order sent
    examples = 12
    retries: Any = 2  # the event's JSON keeps an integer

    async def send_event(self, queue: str, mode: str, event: SdkEvent) -> None:
        await self.send_raw(
            queue, Raw(JSONFormat().write(event), None, content_type=JSONFormat.CONTENT_TYPE)
        )

    async def send_raw(self, queue: str, raw: Raw) -> None:
        assert raw.attributes is None, "Redis events are structured"
        given = {"id": raw.message_id, "type": raw.type, "content-type": raw.content_type}
        fields = [("payload", raw.body), *((n, v) for n, v in given.items() if v is not None)]
        await asyncio.to_thread(self.redis.add, queue, fields)

    def sdk_read(self, message: Received, row: Any) -> SdkEvent:
        assert message.raw[b"content-type"] == b"application/cloudevents+json"
        # relay's own fields as before.
        assert message.key == row[2] and message.type == row[3]
        return JSONFormat().read(SdkEvent, message.body)


class NatsSide(NatsBroker):
    modes = ("binary", "structured")
    ordered = True  # one stream, one consumer: the inbox's rows in the order sent
    examples = 15
    retries: Any = "2"  # NATS headers carry text

    async def send_event(self, queue: str, mode: str, event: SdkEvent) -> None:
        # The SDK has no NATS binding: its Kafka one writes the contract's
        # NATS binary mode (`ce_` headers, `content-type`) and structured mode.
        write = sdk_kafka.to_binary if mode == "binary" else sdk_kafka.to_structured
        message = write(event, JSONFormat())
        headers = {
            n: v.decode() if isinstance(v, bytes) else str(v) for n, v in message.headers.items()
        }
        await self.nats.publish(f"{queue}.x", message.value, headers=headers)

    async def send_raw(self, queue: str, raw: Raw) -> None:
        given = {"Nats-Msg-Id": raw.message_id, "type": raw.type, "content-type": raw.content_type}
        given |= {f"ce_{k}": str(v) for k, v in (raw.attributes or {}).items()}
        headers = {n: v for n, v in given.items() if v is not None}
        await self.nats.publish(f"{queue}.x", raw.body, headers=headers)

    def sdk_read(self, message: Received, row: Any) -> SdkEvent:
        raw = message.raw
        headers = {n: v.encode() for n, v in (raw.headers or {}).items()}
        event = sdk_kafka.from_binary(
            sdk_kafka.KafkaMessage(headers=headers, key=None, value=raw.data),
            JSONFormat(),
            SdkEvent,
        )
        # The message as the NATS wire format sets it: Nats-Msg-Id, `type`,
        # `key`, Content-Type, the row's headers; `content-type` for the event.
        assert message.key == row[2] and message.type == row[3]
        assert raw.headers["Content-Type"] == raw.headers["content-type"] == "application/json"
        assert message.headers.get("traceparent") == row[5].get("traceparent")
        return event


Side = AmqpSide | SqsSide | KafkaSide | NatsSide | RedisSide


@pytest.fixture(params=["amqp", "sqs", "kafka", "nats", "redis"])
def side(request: pytest.FixtureRequest) -> Side:
    if request.param == "amqp":
        return AmqpSide(request.getfixturevalue("rabbit"))
    if request.param == "redis":
        return RedisSide(request.getfixturevalue("redis_streams"))
    if request.param == "sqs":
        return SqsSide(request.getfixturevalue("sqs"))
    if request.param == "nats":
        return NatsSide(request.getfixturevalue("nats_helper"))
    return KafkaSide(request.getfixturevalue("kafka"))


async def _start_inbox(side: Side, start_relay) -> tuple[str, Any]:
    """`relay inbox` on the side's inbox queue, with the events' handlers."""
    queue, args = await side.inbox_queue()
    # The queue's name is a type too: relay's rows with no type have the topic's.
    env = {**side.env, "TEST_EVENT_TYPES": queue}
    daemon = start_relay("inbox", *args, "--handlers", HANDLERS, env=env)
    daemon.wait_for_log("inbox started", timeout=30)
    return queue, daemon


async def _canary(side: Side, queue: str, message_id: str) -> None:
    await side.send_raw(queue, Raw(b"{}", message_id, type="Effect"))


# --------------------------------------------------------------------------
# relay's outbox, read by the SDK
# --------------------------------------------------------------------------


async def test_outbox_messages_are_events_the_sdk_reads(engine, side, run_relay):
    """Binary mode on RabbitMQ and Kafka, structured mode on SQS."""
    topic = side.topic("orders")
    dest = await side.destination(topic)
    _enqueue_two(engine, topic)
    # The variable (as every flag has one) on SQS, the flag elsewhere.
    source = {"RELAY_CLOUDEVENTS_SOURCE": URI} if side.kind == "sqs" else {}
    flag = [] if source else ["--cloudevents-source", URI]
    result = await asyncio.to_thread(
        run_relay, "outbox", "--once", *side.outbox_args, *flag, env={**side.env, **source}
    )
    assert result.returncode == 0, result.stderr
    outbox = _outbox_rows(engine)
    got = await side.read(dest, 2)
    assert sorted(m.message_id for m in got) == sorted(outbox)
    for message in got:
        row = outbox[message.message_id]
        event = side.sdk_read(message, row)
        _check_sdk_attributes(event.get_attributes(), row)
        payload = {"order_id": 7, "big": 12345678901234567890123} if row[2] else {"n": 2}
        assert event.get_data() == payload
        if "binary" in side.modes:  # binary mode: the body is the payload itself
            assert json.loads(message.body) == payload


# --------------------------------------------------------------------------
# The SDK's events, into relay's inbox
# --------------------------------------------------------------------------


def _sent_events() -> list[tuple[str, SdkEvent]]:
    """(mode, event): binary and structured; one id from two sources;
    Knative-style source and id."""
    knative_id = str(uuid.uuid4())
    return [
        (
            "binary",
            _sdk_event(
                URI, "1", subject="order-1", traceparent=TRACEPARENT, data={"n": 1}, retries=2
            ),
        ),
        ("structured", _sdk_event(URI, "2", subject="order-2", data={"n": 2})),
        ("binary", _sdk_event("https://other.example.com/orders", "1", data={"n": 3})),
        (
            "structured",
            _sdk_event(KNATIVE_SOURCE, knative_id, type="dev.knative.sources.ping", data={"n": 4}),
        ),
        (
            "binary",
            _sdk_event(KNATIVE_SOURCE, str(uuid.uuid4()), type="dev.knative.sources.ping"),
        ),
    ]


def _expected(sent: list[tuple[str, SdkEvent]]) -> dict[str, SdkEvent]:
    return {f"{e.get_attributes()['source']} {e.get_attributes()['id']}": e for _, e in sent}


def _check_handled(engine, sent: list[tuple[str, SdkEvent]], retries: Any) -> None:
    expected = _expected(sent)
    handled = _events(engine)
    assert set(handled) == set(expected)
    for message_id, event in expected.items():
        attributes = event.get_attributes()
        source, event_id, type_, key, subject, data, traceparent = handled[message_id]
        assert (source, event_id, type_) == (
            attributes["source"],
            attributes["id"],
            attributes["type"],
        )
        assert subject == attributes.get("subject") and key == attributes.get("subject")
        assert data == event.get_data()
        assert traceparent == attributes.get("traceparent")
    stored = _inbox_rows(engine)
    for message_id in expected:
        assert stored[message_id][0] == "processed", stored[message_id]
    headers = dict(rows(engine, "SELECT message_id, headers FROM inbox"))
    first = headers[f"{URI} 1"]
    assert first["ce_retries"] == retries and first["ce_specversion"] == "1.0"
    assert first["ce_time"].endswith("Z") and "ce_data" not in first


async def test_sdk_events_are_handled_once_each(events, side, start_relay):
    queue, daemon = await _start_inbox(side, start_relay)
    # Binary and structured where the broker has a binding, else structured.
    sent = [(m if m in side.modes else "structured", e) for m, e in _sent_events()]
    # Each event twice: the second delivery is a duplicate, by source and id
    # (the broker's own id differs, or there is none).
    for _ in range(2):
        for mode, event in sent:
            await side.send_event(queue, mode, event)
    await _canary(side, queue, "canary")
    wait_until(lambda: rows(events, "SELECT 1 FROM effects WHERE message_id = 'canary'"))
    wait_until(lambda: len(_events(events)) >= len(sent), timeout=30, message="events handled")
    await wait_drained(side, queue, timeout=30)  # every copy taken, none handled twice
    _check_handled(events, sent, side.retries)
    assert len(_inbox_rows(events)) == len(sent) + 1
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


# --------------------------------------------------------------------------
# relay to relay: the outbox's events, handled by the inbox
# --------------------------------------------------------------------------


async def test_relay_events_reach_handlers_with_their_attributes(
    events, side, start_relay, run_relay
):
    queue, daemon = await _start_inbox(side, start_relay)
    _enqueue_two(events, queue)  # RabbitMQ: a routing key the inbox's queue binds
    result = await asyncio.to_thread(
        run_relay,
        "outbox",
        "--once",
        *side.outbox_args,
        "--cloudevents-source",
        URI,
        env=side.env,
    )
    assert result.returncode == 0, result.stderr
    outbox = _outbox_rows(events)
    wait_until(lambda: len(_events(events)) == 2, timeout=30, message="both handled")
    for message_id, (source, event_id, type_, key, subject, _, tp) in _events(events).items():
        row = outbox[event_id]
        assert message_id == f"{URI} {event_id}" and source == URI
        assert type_ == (row[3] or row[1]) and key == subject == row[2]
        assert tp == row[5].get("traceparent")
    daemon.stop()


# --------------------------------------------------------------------------
# Generated events that break the specification: dead, between canaries
# --------------------------------------------------------------------------

# Text an event can carry as it is (a NUL character makes any message dead).
text = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=12)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), text),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.dictionaries(text, children, max_size=3)
    ),
    max_leaves=8,
)
SPEC_NAMES = ("id", "source", "type", "specversion", "data", "time", "subject", "dataschema")
# What breaks an event, each in a way the specification names; None: nothing.
BREAKS = (
    None,
    "drop id",
    "drop source",
    "drop type",
    "drop specversion",
    "specversion 0.3",
    "specversion 2.0",
    "empty id",
    "int type",
    "bad time",
    "bad extension name",
    "float extension",
    "reserved data",  # binary: a `data` attribute; structured: data and data_base64
)


# Half the examples valid: they are handled, extensions and all.
breaks = st.one_of(st.none(), st.sampled_from(BREAKS[1:]))


def profile(short: int) -> settings:
    return settings(
        max_examples=LONG or short,
        deadline=None,
        derandomize=not LONG,
        suppress_health_check=list(HealthCheck),
        database=None,
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )


def _attributes(n: int, broken: str | None, draw: dict[str, Any]) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "specversion": "1.0",
        "id": f"gen-{n}-{draw['id']}",
        "source": draw["source"],
        "type": TYPE,
        **draw["extensions"],
    }
    if draw["subject"]:
        attributes["subject"] = draw["subject"]
    if draw["time"]:
        attributes["time"] = "2026-11-27T19:00:01.5+01:00"
    if broken and broken.startswith("drop "):
        del attributes[broken[5:]]
    elif broken and broken.startswith("specversion "):
        attributes["specversion"] = broken[12:]
    elif broken == "empty id":
        attributes["id"] = ""
    elif broken == "int type":
        attributes["type"] = 7
    elif broken == "bad time":
        attributes["time"] = "27/11/2026 19:00"
    elif broken == "bad extension name":
        attributes["Bad_Name"] = "x"
    elif broken == "float extension":
        attributes["ratio"] = 1.5
    return attributes


drawn = st.fixed_dictionaries(
    {
        "id": text,
        "source": st.sampled_from([URI, KNATIVE_SOURCE, "urn:shop:orders", "orders"]),
        "extensions": st.dictionaries(
            st.from_regex(r"\A[a-z][a-z0-9]{0,8}\Z").filter(
                lambda name: name not in SPEC_NAMES and not name.startswith("datacontent")
            ),
            st.one_of(text, st.integers(-(2**31), 2**31 - 1), st.booleans()),
            max_size=3,
        ),
        "subject": st.one_of(st.none(), text.filter(bool)),
        "time": st.booleans(),
        "data": json_values,
    }
)


def _structured_body(attributes: dict[str, Any], data: Any, broken: str | None) -> bytes:
    event = {**attributes, "data": data}
    if broken == "reserved data":
        event["data_base64"] = base64.b64encode(b"{}").decode()
    return orjson.dumps(event)


def _dead_or_handled(found: Any, broken: str | None) -> None:
    status, type_, last_error = found
    if broken is None:
        assert status == "processed" and type_ == TYPE, found
    else:
        assert status == "dead" and "not a valid CloudEvent" in last_error, (broken, found)


def _settled_between(engine, before: str, after: str) -> tuple[list[Any]] | None:
    """The inbox rows between two canaries once there is one and none is
    pending (wrapped). Under --dispatch received a batch's parts commit side
    by side: the canary after a row can be in the table before it."""
    found = rows(
        engine,
        "SELECT message_id, status, type, last_error FROM inbox WHERE "
        "seq > (SELECT seq FROM inbox WHERE message_id = :a) AND "
        "seq < (SELECT seq FROM inbox WHERE message_id = :b)",
        a=before,
        b=after,
    )
    return None if not found or any(r[1] == "pending" for r in found) else (found,)


# Kafka headers carry text: a number where a string must be is a string there.
PLAIN = {
    "id": "plain",
    "source": KNATIVE_SOURCE,
    "extensions": {"retries": 2},
    "subject": "order-1",
    "time": True,
    "data": {"n": 1},
}
TEXT_ONLY = ("int type", "float extension")


@pytest.mark.timeout(600)
async def test_generated_broken_events_are_dead_between_canaries(events, side, start_relay):
    queue, daemon = await _start_inbox(side, start_relay)
    loop = asyncio.get_running_loop()
    counts: dict[str, int] = {}

    @profile(short=side.examples)
    @given(draw=drawn, broken=breaks, binary=st.booleans())
    # Each mode's commonest faults, whatever the generated ones are.
    @example(draw=PLAIN, broken=None, binary=True)
    @example(draw=PLAIN, broken="specversion 2.0", binary=True)
    @example(draw=PLAIN, broken="drop id", binary=True)
    @example(draw=PLAIN, broken="drop source", binary=True)
    @example(draw=PLAIN, broken="specversion 2.0", binary=False)
    @example(draw=PLAIN, broken="drop type", binary=False)
    def one(draw, broken, binary):
        binary = binary and "binary" in side.modes
        assume(not (binary and side.kind in ("kafka", "nats") and broken in TEXT_ONLY))
        # A NATS header value holds no line break and no white space at its ends.
        assume(
            not (binary and side.kind == "nats")
            or all(
                not isinstance(v, str) or (v == v.strip() and "\r" not in v and "\n" not in v)
                for v in _attributes(0, broken, draw).values()
            )
        )
        n = counts["examples"] = counts.get("examples", 0) + 1
        attributes = _attributes(n, broken, draw)
        message_id = f"example-{n}"  # the broker's: a broken event's dedup key
        canaries = [f"canary-{n}-a", f"canary-{n}-b"]

        async def send() -> None:
            await _canary(side, queue, canaries[0])
            if binary:
                if broken == "reserved data":
                    attributes["data"] = "x"
                raw = Raw(orjson.dumps(draw["data"]), message_id, None, DATA_TYPE, attributes)
                await side.send_raw(queue, raw)
            else:
                body = _structured_body(attributes, draw["data"], broken)
                await side.send_raw(queue, Raw(body, message_id, None, JSONFormat.CONTENT_TYPE))
            await _canary(side, queue, canaries[1])

        asyncio.run_coroutine_threadsafe(send(), loop).result(30)
        wait_until(
            lambda: (
                len(
                    rows(events, "SELECT 1 FROM effects WHERE message_id = ANY(:ids)", ids=canaries)
                )
                == 2
            ),
            timeout=30,
            message=f"canaries of example {n}",
        )
        expected_id = message_id if broken else f"{attributes['source']} {attributes['id']}"
        if side.ordered:  # exactly one row between the canaries
            between = wait_until(
                lambda: _settled_between(events, *canaries),
                timeout=30,
                message=f"example {n} settled",
            )[0]
            assert len(between) == 1, between
            [(stored_id, *found)] = between
            assert stored_id == expected_id
        else:  # SQS's standard queue keeps no order: found by its id
            [found] = wait_until(
                lambda: rows(
                    events,
                    "SELECT status, type, last_error FROM inbox WHERE message_id = :m "
                    "AND status <> 'pending'",
                    m=expected_id,
                ),
                timeout=30,
                message=f"example {n} settled",
            )
        _dead_or_handled(tuple(found), broken)
        key = f"{'binary' if binary else 'structured'} {broken or 'valid'}"
        counts[key] = counts.get(key, 0) + 1

    await asyncio.to_thread(one)
    assert daemon.proc.poll() is None, daemon.log
    print(f"\n{side.kind} events: {counts}")
    await wait_drained(side, queue, timeout=30)
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


def test_a_source_that_is_no_uri_reference_exits_2(run_relay):
    for args, env in (
        (["--cloudevents-source", "not a uri"], {}),
        ([], {"RELAY_CLOUDEVENTS_SOURCE": "x#y#z"}),
    ):
        result = run_relay("outbox", "--once", *args, env=env)
        assert result.returncode == 2, result.stderr
        assert "--cloudevents-source" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
