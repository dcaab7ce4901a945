"""CloudEvents on Kafka (issue 42), end to end against the broker (Tansu),
with the CloudEvents Python SDK's Kafka binding as the other side: relay's
outbox records read by `cloudevents.core.bindings.kafka` as the events they
should be (binary mode, `ce_` headers); the SDK's events, binary and
structured, stored and handled once by `relay inbox`, and once still after
they are delivered again; two sources with one id kept apart. The other
brokers' tests: tests/e2e/test_cloudevents.py."""

from __future__ import annotations

import json
import uuid
from typing import Any

import sqlalchemy as sa
from cloudevents.core.bindings import kafka as sdk_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent as SdkEvent

from tests.conftest import rows, wait_until
from tests.e2e.test_cloudevents import (
    HANDLERS,
    KNATIVE_SOURCE,
    TRACEPARENT,
    URI,
    _check_sdk_attributes,
    _enqueue_two,
    _outbox_rows,
    _sdk_event,
    events,  # noqa: F401 - fixture
)
from tests.kafka.test_daemons import inbox_args
from tests.kafka_server import Kafka


def test_kafka_outbox_records_are_binary_events_the_sdk_reads(
    engine: sa.Engine, kafka: Kafka, run_relay
):
    topic = kafka.topic("ce")
    _enqueue_two(engine, topic)
    done = run_relay(
        "outbox",
        "--once",
        "--cloudevents-source",
        URI,
        env={"RELAY_BROKER_URL": kafka.url()},
    )
    assert done.returncode == 0, done.stderr
    outbox = _outbox_rows(engine)
    for record in kafka.read(topic, 2):
        headers = dict(record.headers())
        row = outbox[headers["id"].decode()]
        event = sdk_kafka.from_binary(
            sdk_kafka.KafkaMessage(headers=headers, key=record.key(), value=record.value()),
            JSONFormat(),
            SdkEvent,
        )
        _check_sdk_attributes(event.get_attributes(), row)
        assert event.get_data() == json.loads(record.value())  # every number exact
        # Everything else as the wire format sets it.
        assert headers["content-type"] == b"application/json"
        assert headers.get("type") == (row[3].encode() if row[3] else None)
        assert record.key() == (row[2].encode() if row[2] else None)


def _kafka_record(mode: str, event: SdkEvent) -> tuple[bytes, list[tuple[str, bytes]]]:
    if mode == "binary":
        message = sdk_kafka.to_binary(event, JSONFormat())
    else:
        message = sdk_kafka.to_structured(event, JSONFormat())
    return message.value, list(message.headers.items())


def test_sdk_events_on_kafka_are_handled_once_each(events, kafka: Kafka, start_relay):  # noqa: F811
    topic = kafka.topic("ce-in")
    sent: list[tuple[str, SdkEvent]] = [
        (
            "binary",
            _sdk_event(URI, "1", subject="order-1", traceparent=TRACEPARENT, retries=2),
        ),
        ("structured", _sdk_event(URI, "2", subject="order-2", data={"n": 2})),
        ("binary", _sdk_event("https://other.example.com/orders", "1", data={"n": 3})),
        (
            "structured",
            _sdk_event(KNATIVE_SOURCE, str(uuid.uuid4()), type="dev.knative.sources.ping"),
        ),
    ]
    # Each twice: the second is a duplicate by source and id.
    for _ in range(2):
        for mode, event in sent:
            value, headers = _kafka_record(mode, event)
            kafka.produce(topic, value, headers=headers, flush=False)
    kafka.produce(topic, b"{}", headers=[("id", b"canary"), ("type", b"Effect")], flush=False)
    kafka.flush()
    # tests.apps.handlers' registry and the events' (which includes it).
    daemon = start_relay(
        *inbox_args(kafka, topic, "--handlers", HANDLERS), env={"RELAY_BROKER_URL": kafka.url()}
    )
    wait_until(lambda: rows(events, "SELECT 1 FROM effects WHERE message_id = 'canary'"), 60)
    wait_until(lambda: kafka.committed(topic, topic) == {0: 2 * len(sent) + 1}, timeout=30)
    handled = rows(events, "SELECT message_id, source, event_id, type, key, data FROM events")
    expected = {f"{e.get_attributes()['source']} {e.get_attributes()['id']}": e for _, e in sent}
    assert sorted(r[0] for r in handled) == sorted(expected)  # each once
    for message_id, source, event_id, type_, key, data in handled:
        attributes: dict[str, Any] = expected[message_id].get_attributes()
        assert (source, event_id, type_) == (
            attributes["source"],
            attributes["id"],
            attributes["type"],
        )
        # The SDK's default key mapper sends no record key here: the subject is the key.
        assert key == attributes.get("subject")
        assert data == expected[message_id].get_data()
    stored = dict(rows(events, "SELECT message_id, headers FROM inbox"))
    assert len(stored) == len(sent) + 1
    first = stored[f"{URI} 1"]
    assert first["ce_retries"] == "2"  # Kafka headers carry text
    assert first["ce_traceparent"] == first["traceparent"] == TRACEPARENT
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log
