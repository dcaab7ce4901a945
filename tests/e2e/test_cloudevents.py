"""CloudEvents end to end (issue 42), with the CloudEvents Python SDK as the
other side, against the real RabbitMQ and SQS (moto): relay's outbox
messages read by the SDK as the events they should be; the SDK's events,
binary and structured, stored and handled once by `relay inbox`, and once
still after they are delivered again; two sources with one id kept apart;
Knative-style ids and sources; generated events that break the
specification kept as dead rows between canaries that are handled.

Kafka's, with the SDK's Kafka binding: tests/kafka/test_cloudevents.py
(which uses this module's helpers).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from typing import Any

import aio_pika
import orjson
import pytest
from cloudevents.core.bindings import amqp as sdk_amqp
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkEvent
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import relay
from tests.conftest import rows, wait_until
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures

HANDLERS = "tests.apps.cloudevent_handlers:registry"
URI = "https://shop.example.com/orders"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
# Knative's sources name themselves by their API path; a ping source's
# events carry UUIDs as ids. A `#` in a source is allowed (a fragment).
KNATIVE_SOURCE = "/apis/v1/namespaces/default/pingsources/nightly#cron"
TYPE = "com.example.order.placed"
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
# relay's outbox, read by the SDK
# --------------------------------------------------------------------------


async def test_rabbitmq_outbox_messages_are_binary_events_the_sdk_reads(engine, rabbit, run_relay):
    queue = await rabbit.queue("orders.#")
    _enqueue_two(engine, "orders.placed")
    result = await asyncio.to_thread(
        run_relay, "outbox", "--once", "--exchange", rabbit.exchange, "--cloudevents-source", URI
    )
    assert result.returncode == 0, result.stderr
    outbox = _outbox_rows(engine)
    got = await rabbit.drain(queue, 2)
    for message in got:
        row = outbox[message.message_id]
        event = sdk_amqp.from_binary(
            sdk_amqp.AMQPMessage(
                properties={"content-type": message.content_type},
                application_properties=dict(message.headers),
                application_data=message.body,
            ),
            JSONFormat(),
            SdkEvent,
        )
        _check_sdk_attributes(event.get_attributes(), row)
        # Everything else as the wire format sets it.
        assert message.type == row[3]
        assert (message.headers or {}).get("x-relay-key") == row[2]
        assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
        assert message.timestamp is not None
        assert json.loads(message.body) == (
            {"order_id": 7, "big": 12345678901234567890123} if row[2] else {"n": 2}
        )
        assert event.get_data() == json.loads(message.body)


async def test_sqs_outbox_messages_are_structured_events_the_sdk_reads(engine, sqs, run_relay):
    topic = sqs.name("orders")
    sqs.create(topic)
    _enqueue_two(engine, topic)
    # The variable, as every flag has one.
    env = {"RELAY_BROKER_URL": "sqs://", **sqs.env, "RELAY_CLOUDEVENTS_SOURCE": URI}
    result = await asyncio.to_thread(run_relay, "outbox", "--once", env=env)
    assert result.returncode == 0, result.stderr
    outbox = _outbox_rows(engine)
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(got) < 2 and time.monotonic() < deadline:
        got += await asyncio.to_thread(sqs.receive, topic)
    assert len(got) == 2
    for message in got:
        attributes = message["MessageAttributes"]
        assert attributes["content-type"]["StringValue"] == "application/cloudevents+json"
        row = outbox[attributes["message_id"]["StringValue"]]
        event = JSONFormat().read(SdkEvent, message["Body"])
        _check_sdk_attributes(event.get_attributes(), row)
        assert event.get_data() == (
            {"order_id": 7, "big": 12345678901234567890123} if row[2] else {"n": 2}
        )
        # relay's own attributes as before.
        assert attributes.get("key", {}).get("StringValue") == row[2]
        assert attributes.get("type", {}).get("StringValue") == row[3]


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


def _check_handled(engine, sent: list[tuple[str, SdkEvent]]) -> None:
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
    assert first["ce_retries"] == 2 and first["ce_specversion"] == "1.0"
    assert first["ce_time"].endswith("Z") and "ce_data" not in first


async def _publish_amqp(rabbit, mode: str, event: SdkEvent) -> None:
    if mode == "binary":
        message = sdk_amqp.to_binary(event, JSONFormat())
        await rabbit.publish(
            "events.in",
            message.application_data,
            headers=dict(message.application_properties),
            content_type=message.properties.get("content-type"),
        )
    else:
        await rabbit.publish(
            "events.in", JSONFormat().write(event), content_type=JSONFormat().get_content_type()
        )


async def test_sdk_events_on_rabbitmq_are_handled_once_each(events, rabbit, inbox):
    daemon = inbox(handlers=HANDLERS)
    sent = _sent_events()
    # Each event twice: the second delivery is a duplicate, by source and id
    # (aio-pika gives every publish a message_id of its own).
    for _ in range(2):
        for mode, event in sent:
            await _publish_amqp(rabbit, mode, event)
    await rabbit.publish("canary", b"{}", message_id="canary", type="Effect")
    wait_until(lambda: rows(events, "SELECT 1 FROM effects WHERE message_id = 'canary'"))
    wait_until(lambda: len(_events(events)) >= len(sent), message="events handled")
    time.sleep(0.5)  # a second effect would land by now
    _check_handled(events, sent)
    assert len(_inbox_rows(events)) == len(sent) + 1
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


def _send_sqs(sqs, queue: str, body: bytes, attributes: dict[str, str], **extra: Any) -> None:
    sqs.client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody=body.decode(),
        MessageAttributes={
            k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()
        },
        **extra,
    )


async def test_sdk_structured_events_on_sqs_are_handled_once_each(events, sqs, start_relay):
    queue = sqs.name("events")
    sqs.create(queue)
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--handlers",
        HANDLERS,
        env={"RELAY_BROKER_URL": "sqs://", **sqs.env},
    )
    daemon.wait_for_log("inbox started", timeout=30)
    # SQS has no binding of its own: every event in structured mode.
    sent = [("structured", event) for _, event in _sent_events()]
    for _ in range(2):
        for _, event in sent:
            _send_sqs(
                sqs, queue, JSONFormat().write(event), {"content-type": JSONFormat.CONTENT_TYPE}
            )
    _send_sqs(sqs, queue, b"{}", {"message_id": "canary", "type": "Effect"})
    wait_until(lambda: rows(events, "SELECT 1 FROM effects WHERE message_id = 'canary'"))
    wait_until(lambda: len(_events(events)) >= len(sent), timeout=30, message="events handled")
    wait_until(lambda: sqs.count(queue) == 0, timeout=30)
    _check_handled(events, sent)
    assert len(_inbox_rows(events)) == len(sent) + 1
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


# --------------------------------------------------------------------------
# relay to relay: the outbox's events, handled by the inbox
# --------------------------------------------------------------------------


async def test_relay_events_through_rabbitmq_reach_handlers_with_their_attributes(
    events, rabbit, inbox, run_relay
):
    daemon = inbox(handlers=HANDLERS, bind="orders.#")
    _enqueue_two(events, "orders.shipped")
    result = await asyncio.to_thread(
        run_relay, "outbox", "--once", "--exchange", rabbit.exchange, "--cloudevents-source", URI
    )
    assert result.returncode == 0, result.stderr
    outbox = _outbox_rows(events)
    wait_until(lambda: len(_events(events)) == 2, message="both handled")
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
    elif broken == "specversion 0.3":
        attributes["specversion"] = "0.3"
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
    """The inbox rows between two canaries once none is pending (wrapped, so
    that an empty list is an answer too)."""
    found = rows(
        engine,
        "SELECT message_id, status, type, last_error FROM inbox WHERE "
        "seq > (SELECT seq FROM inbox WHERE message_id = :a) AND "
        "seq < (SELECT seq FROM inbox WHERE message_id = :b)",
        a=before,
        b=after,
    )
    return None if any(r[1] == "pending" for r in found) else (found,)


async def test_generated_broken_events_on_rabbitmq_are_dead_between_canaries(events, rabbit, inbox):
    daemon = inbox(handlers=HANDLERS)
    loop = asyncio.get_running_loop()
    counts: dict[str, int] = {}

    @profile(short=40)
    @given(draw=drawn, broken=breaks, binary=st.booleans())
    def example(draw, broken, binary):
        n = counts["examples"] = counts.get("examples", 0) + 1
        attributes = _attributes(n, broken, draw)
        message_id = f"example-{n}"  # the broker's: a broken event's dedup key

        async def send() -> None:
            await rabbit.publish("canary", b"{}", message_id=f"canary-{n}-a", type="Effect")
            if binary:
                headers: dict[str, Any] = {f"cloudEvents_{k}": v for k, v in attributes.items()}
                if broken == "reserved data":
                    headers["cloudEvents_data"] = "x"
                body = orjson.dumps(draw["data"])
                await rabbit.publish(
                    "events.in",
                    body,
                    headers=headers,
                    content_type="application/json",
                    message_id=message_id,
                )
            else:
                await rabbit.publish(
                    "events.in",
                    _structured_body(attributes, draw["data"], broken),
                    content_type="application/cloudevents+json",
                    message_id=message_id,
                )
            await rabbit.publish("canary", b"{}", message_id=f"canary-{n}-b", type="Effect")

        asyncio.run_coroutine_threadsafe(send(), loop).result(30)
        wait_until(
            lambda: (
                len(
                    rows(
                        events,
                        "SELECT 1 FROM effects WHERE message_id = ANY(:ids)",
                        ids=[f"canary-{n}-a", f"canary-{n}-b"],
                    )
                )
                == 2
            ),
            timeout=30,
            message=f"canaries of example {n}",
        )
        between = wait_until(
            lambda: _settled_between(events, f"canary-{n}-a", f"canary-{n}-b"),
            timeout=30,
            message=f"example {n} settled",
        )[0]
        assert len(between) == 1, between
        [(stored_id, *found)] = between
        expected_id = message_id if broken else f"{attributes['source']} {attributes['id']}"
        assert stored_id == expected_id
        _dead_or_handled(tuple(found), broken)
        key = f"{'binary' if binary else 'structured'} {broken or 'valid'}"
        counts[key] = counts.get(key, 0) + 1

    await asyncio.to_thread(example)
    assert daemon.proc.poll() is None, daemon.log
    print(f"\nrabbitmq events: {counts}")
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


@pytest.mark.timeout(600)
async def test_generated_broken_events_on_sqs_are_dead_and_canaries_handled(
    events, sqs, start_relay
):
    queue = sqs.name("gen")
    sqs.create(queue)
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--handlers",
        HANDLERS,
        env={"RELAY_BROKER_URL": "sqs://", **sqs.env},
    )
    daemon.wait_for_log("inbox started", timeout=30)
    counts: dict[str, int] = {}

    @profile(short=12)
    @given(draw=drawn, broken=breaks)
    def example(draw, broken):
        n = counts["examples"] = counts.get("examples", 0) + 1
        attributes = _attributes(n, broken, draw)
        message_id = f"example-{n}"
        canaries = [f"canary-{n}-a", f"canary-{n}-b"]
        _send_sqs(sqs, queue, b"{}", {"message_id": canaries[0], "type": "Effect"})
        _send_sqs(
            sqs,
            queue,
            _structured_body(attributes, draw["data"], broken),
            {"content-type": JSONFormat.CONTENT_TYPE, "message_id": message_id},
        )
        _send_sqs(sqs, queue, b"{}", {"message_id": canaries[1], "type": "Effect"})
        # A standard queue keeps no order: the example is found by its id.
        expected_id = message_id if broken else f"{attributes['source']} {attributes['id']}"
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
        counts[broken or "valid"] = counts.get(broken or "valid", 0) + 1

    await asyncio.to_thread(example)
    assert daemon.proc.poll() is None, daemon.log
    print(f"\nsqs events: {counts}")
    wait_until(lambda: sqs.count(queue) == 0, timeout=30)
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
