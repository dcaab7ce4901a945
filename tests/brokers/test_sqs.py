"""The SQS adapter's own behaviour, beyond the contract suite: settings, a
missing queue, the queue's size limit, visibility while a batch is held,
and its pieces (batching into calls and lanes, error classification, the
attribute mapping) as unit tests. SQS is moto's standalone server."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import botocore.exceptions
import orjson
import pytest

import relay
from relay.brokers import make_publisher
from relay.brokers.aws import BATCH_BYTES, chunks, lanes
from relay.brokers.sqs import (
    SqsConsumer,
    build_entry,
    call_failure,
    entry_failure,
    to_incoming,
)
from relay.config import BrokerURL
from relay.outbox import WORKERS
from relay.rows import OutboxRow
from tests.conftest import HANDLERS, effect_ids, rows, wait_until


async def test_oversized_message_is_dead_with_a_clear_error(engine, sqs, run_relay):
    # RabbitMQ's 128 MiB limit is covered by tests/inbox/test_hostile.py with
    # a real over-limit payload.
    topic = sqs.name("big")
    sqs.create(topic, MaximumMessageSize=262144)
    with engine.begin() as conn:
        big = relay.enqueue(conn, topic, {"blob": "x" * 300_000})
        small = relay.enqueue(conn, topic, {"n": 1})
    result = run_relay("outbox", "--once", env={"RELAY_BROKER_URL": "sqs://", **sqs.env})
    assert result.returncode == 0, result.stderr
    [message] = sqs.receive(topic)
    assert message["MessageAttributes"]["message_id"]["StringValue"] == str(small)
    [(status, attempts, error)] = rows(
        engine, "SELECT status, attempts, last_error FROM outbox WHERE id = :id", id=big
    )
    assert (status, attempts) == ("dead", 1)
    assert "bytes" in error and "over the 262144-byte limit" in error and topic in error


def test_sqs_bind_and_a_bad_queue_name_are_configuration_errors(run_relay):
    cases = {
        ("--queue", "q", "--bind", "#"): "--bind applies to RabbitMQ only",
        ("--queue", "orders.in"): "invalid --queue 'orders.in' for SQS",
    }
    for args, expected in cases.items():
        result = run_relay(
            "inbox", "--broker-url", "sqs://", *args, env={"AWS_DEFAULT_REGION": "us-east-1"}
        )
        assert result.returncode == 2, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_sqs_without_a_region_is_a_configuration_error(run_relay):
    if os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION"):
        pytest.skip("this environment sets an AWS region")
    result = run_relay(
        "outbox", "--once", "--broker-url", "sqs://", env={"AWS_CONFIG_FILE": "/nonexistent"}
    )
    assert result.returncode == 2, result.stderr
    assert "no AWS region for SQS" in result.stderr and "Traceback" not in result.stderr


async def test_sqs_region_and_endpoint_from_the_url(engine, sqs, run_relay):
    topic = sqs.name("url")
    sqs.create(topic)
    with engine.begin() as conn:
        relay.enqueue(conn, topic, {"n": 1})
    url = f"sqs://?region=us-east-1&endpoint_url={sqs.endpoint}"
    env = {
        "RELAY_BROKER_URL": url,
        "AWS_ENDPOINT_URL_SQS": "http://127.0.0.1:1",
        "AWS_DEFAULT_REGION": "eu-west-3",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
    }
    result = run_relay("outbox", "--once", env=env)
    assert result.returncode == 0, result.stderr
    assert rows(engine, "SELECT status FROM outbox") == [("published",)]
    [message] = sqs.receive(topic)
    assert orjson.loads(message["Body"]) == {"n": 1}


async def test_sqs_inbox_waits_for_a_missing_queue(effects, sqs, start_relay):
    queue = sqs.name("later")
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--handlers",
        HANDLERS,
        env={"RELAY_BROKER_URL": "sqs://", **sqs.env},
    )
    daemon.wait_for_log("retrying in", timeout=20)
    assert f"SQS queue {queue!r} does not exist" in daemon.log
    assert daemon.proc.poll() is None
    sqs.create(queue)
    sqs.client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody='{"n": 1}',
        MessageAttributes={
            "message_id": {"DataType": "String", "StringValue": "late-1"},
            "type": {"DataType": "String", "StringValue": "Effect"},
        },
    )
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
    assert all(a.isdisjoint(b) for i, a in enumerate(keys) for b in keys[i + 1 :])
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
            {
                "Error": {"Code": code, "Message": "m"},
                "ResponseMetadata": {"HTTPStatusCode": status},
            },
            "SendMessageBatch",
        )

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

    message = {
        "Body": '{"a":1}',
        "ReceiptHandle": "rh",
        "MessageId": "sqs-id",
        "MessageAttributes": attrs(
            message_id="m", type="T", key="k", headers='{"traceparent":"tp"}', extra="e"
        ),
    }
    incoming = to_incoming(message, "q")
    assert (incoming.message_id, incoming.type, incoming.key, incoming.topic) == (
        "m",
        "T",
        "k",
        "q",
    )
    assert incoming.headers == {"traceparent": "tp", "extra": "e"}
    assert incoming.body == b'{"a":1}' and incoming.ack_token == "rh"
    bare = to_incoming(
        {
            "Body": "x",
            "ReceiptHandle": "rh",
            "MessageId": "sqs-id",
            "MessageAttributes": attrs(headers="not json"),
        },
        "q",
    )
    # Never the SQS MessageId: the inbox falls back to the body's sha256.
    assert (bare.message_id, bare.type, bare.headers) == (None, "q", {"headers": "not json"})


def test_sqs_publisher_is_not_connected_before_it_connects():
    assert not make_publisher(
        BrokerURL.parse("sqs://"), exchange="relay", workers=WORKERS
    ).connected
