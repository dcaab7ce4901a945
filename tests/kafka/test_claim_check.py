"""The claim check both ways on Kafka (`--claim-check`, moto's S3): the
pointer value and the `ExtendedPayloadSize` header holding the decimal text
(the contract's Large messages paragraph), as tests/e2e/test_claim_check.py
does for SQS and RabbitMQ."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import orjson
import pytest
import sqlalchemy as sa

from relay.claimcheck import pointer_body
from tests.conftest import HANDLERS, RelayProcess, effects, rows, wait_until  # noqa: F401
from tests.e2e.test_claim_check import (
    LARGE,
    S3,
    SIZES,
    body_of,
    effect_ns,
    env_for,
    insert,
    s3,  # noqa: F401 - fixture
    whole_in_inbox,
)
from tests.kafka_server import Kafka
from tests.sqs_server import Sqs, sqs, sqs_server  # noqa: F401 - fixtures


def start_inbox(
    start_relay: Callable[..., RelayProcess], kafka: Kafka, topic: str, *extra: str, env=None
) -> RelayProcess:
    proc = start_relay(
        "inbox",
        "--queue",
        topic,
        "--handlers",
        HANDLERS,
        "--poll-interval",
        "0.5",
        *extra,
        env={"RELAY_BROKER_URL": kafka.url(), **(env or {})},
    )
    proc.wait_for_log("inbox started", timeout=30)
    return proc


@pytest.mark.timeout(300)
def test_both_daemons_wire_format_and_order(
    effects: sa.Engine,  # noqa: F811
    kafka: Kafka,
    s3: S3,  # noqa: F811
    sqs: Sqs,  # noqa: F811 - for its environment
    start_relay: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    topic = kafka.topic("big", 3)
    env = env_for(sqs)
    start_inbox(start_relay, kafka, topic, "--claim-check", s3.url("kfk"), env=env)
    ids = insert(effects, topic, SIZES)
    done = run_relay(
        "outbox",
        "--once",
        "--broker-url",
        kafka.url(),
        "--claim-check",
        s3.url("kfk"),
        "--claim-check-over",
        "256KiB",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    got = kafka.read(topic, len(SIZES))
    assert [dict(r.headers())["id"].decode() for r in got] == ids  # one key: one partition
    for n, record in enumerate(got):
        headers = dict(record.headers())
        if n in LARGE:
            assert record.value() == pointer_body(s3.bucket, f"kfk/{ids[n]}").encode()
            assert headers["ExtendedPayloadSize"] == str(len(body_of(n, SIZES[n]))).encode()
        else:
            assert record.value() == body_of(n, SIZES[n])
            assert "ExtendedPayloadSize" not in headers
        assert record.key() == b"k" and headers["type"] == b"Effect"
        assert headers["content-type"] == b"application/json"
    assert s3.objects() == {f"kfk/{ids[n]}": body_of(n, SIZES[n]) for n in LARGE}
    wait_until(lambda: len(effect_ns(effects)) == len(SIZES), timeout=60, message="all handled")
    assert effect_ns(effects) == list(range(len(SIZES)))
    assert whole_in_inbox(effects) == len(SIZES)


def test_a_pointer_without_claim_check_is_dead_with_the_reason(
    effects: sa.Engine,  # noqa: F811
    kafka: Kafka,
    start_relay: Callable[..., RelayProcess],
) -> None:
    topic = kafka.topic("big")
    pointer = pointer_body("some-bucket", "some/key")
    kafka.produce(
        topic,
        pointer.encode(),
        key=b"k",
        headers=[("id", b"m-1"), ("type", b"Effect"), ("ExtendedPayloadSize", b"400000")],
    )
    kafka.produce(topic, b'{"n": 1}', headers=[("id", b"m-2"), ("type", b"Effect")])
    start_inbox(start_relay, kafka, topic)  # no --claim-check
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == 2, message="both stored")
    [(status, last_error, payload, headers)] = rows(
        effects, "SELECT status, last_error, payload, headers FROM inbox WHERE message_id = 'm-1'"
    )
    assert status == "dead"
    assert "no --claim-check is configured" in last_error
    assert "s3://some-bucket/some/key" in last_error
    assert payload == orjson.loads(pointer) and headers["ExtendedPayloadSize"] == "400000"
    wait_until(lambda: effect_ns(effects, None) == [1], message="the other one handled")
