"""The claim check both ways on Redis Streams (`--claim-check`, moto's S3):
the pointer in `payload` and an `ExtendedPayloadSize` field holding the
decimal text (the contract's Large messages paragraph), as
tests/e2e/test_claim_check.py does for SQS and RabbitMQ."""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from relay.claimcheck import pointer_body
from tests.conftest import HANDLERS, RelayProcess, effects, wait_until  # noqa: F401
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
from tests.redis_server import Redis
from tests.sqs_server import Sqs, sqs, sqs_server  # noqa: F401 - fixtures


@pytest.mark.timeout(300)
def test_both_daemons_wire_format_and_order(
    effects: sa.Engine,  # noqa: F811
    redis_streams: Redis,
    s3: S3,  # noqa: F811
    sqs: Sqs,  # noqa: F811 - for its environment
    start_relay: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    stream = redis_streams.name("big")
    env = {**env_for(sqs), "RELAY_BROKER_URL": redis_streams.url()}
    inbox = start_relay(
        "inbox",
        "--queue",
        stream,
        "--handlers",
        HANDLERS,
        "--poll-interval",
        "0.5",
        "--claim-check",
        s3.url("rds"),
        env=env,
    )
    inbox.wait_for_log("inbox started", timeout=30)
    ids = insert(effects, stream, SIZES)
    done = run_relay("outbox", "--once", "--claim-check", s3.url("rds"), env=env)
    assert done.returncode == 0, done.stderr
    got = [fields for _, fields in redis_streams.read(stream)]
    assert [f[b"id"].decode() for f in got] == ids
    for n, fields in enumerate(got):
        if n in LARGE:
            assert fields[b"payload"] == pointer_body(s3.bucket, f"rds/{ids[n]}").encode()
            assert fields[b"ExtendedPayloadSize"] == str(len(body_of(n, SIZES[n]))).encode()
        else:
            assert fields[b"payload"] == body_of(n, SIZES[n])
            assert b"ExtendedPayloadSize" not in fields
        assert (fields[b"key"], fields[b"type"]) == (b"k", b"Effect")
    assert s3.objects() == {f"rds/{ids[n]}": body_of(n, SIZES[n]) for n in LARGE}
    wait_until(lambda: len(effect_ns(effects)) == len(SIZES), timeout=60, message="all handled")
    assert effect_ns(effects) == list(range(len(SIZES)))
    assert whole_in_inbox(effects) == len(SIZES)
    inbox.stop()
    assert inbox.proc.returncode == 0, inbox.log
