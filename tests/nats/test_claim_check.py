"""The claim check both ways on NATS (`--claim-check`, moto's S3): bodies
past 256 KiB (and past the server's 1 MB max_payload, which would refuse
them) go to S3, the pointer and the `ExtendedPayloadSize` header (decimal
text) to the stream, as tests/kafka/test_claim_check.py does for Kafka."""

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
from tests.nats_server import Nats
from tests.sqs_server import Sqs, sqs, sqs_server  # noqa: F401 - fixtures


def start_inbox(
    start_relay: Callable[..., RelayProcess], nats: Nats, stream: str, *extra: str, env=None
) -> RelayProcess:
    proc = start_relay(
        "inbox",
        "--queue",
        stream,
        "--handlers",
        HANDLERS,
        "--poll-interval",
        "0.5",
        *extra,
        env={"RELAY_BROKER_URL": nats.url, **(env or {})},
    )
    proc.wait_for_log("inbox started", timeout=30)
    return proc


@pytest.mark.timeout(300)
def test_both_daemons_wire_format_and_order(
    effects: sa.Engine,  # noqa: F811
    nats_helper: Nats,
    s3: S3,  # noqa: F811
    sqs: Sqs,  # noqa: F811 - for its environment
    start_relay: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    stream, subject = nats_helper.run(nats_helper.stream("big"))
    env = env_for(sqs)
    start_inbox(start_relay, nats_helper, stream, "--claim-check", s3.url("nts"), env=env)
    ids = insert(effects, subject, SIZES)
    done = run_relay(
        "outbox", "--once", "--broker-url", nats_helper.url, "--claim-check", s3.url("nts"), env=env
    )
    assert done.returncode == 0, done.stderr
    got = nats_helper.run(nats_helper.messages(stream))
    assert [m.headers["Nats-Msg-Id"] for m in got] == ids  # one key: in seq order
    for n, message in enumerate(got):
        if n in LARGE:
            assert message.data == pointer_body(s3.bucket, f"nts/{ids[n]}").encode()
            assert message.headers["ExtendedPayloadSize"] == str(len(body_of(n, SIZES[n])))
        else:
            assert message.data == body_of(n, SIZES[n])
            assert "ExtendedPayloadSize" not in message.headers
        assert message.headers["key"] == "k" and message.headers["type"] == "Effect"
    assert s3.objects() == {f"nts/{ids[n]}": body_of(n, SIZES[n]) for n in LARGE}
    wait_until(lambda: len(effect_ns(effects)) == len(SIZES), timeout=60, message="all handled")
    assert effect_ns(effects) == list(range(len(SIZES)))
    assert whole_in_inbox(effects) == len(SIZES)


def test_a_pointer_without_claim_check_is_dead_with_the_reason(
    effects: sa.Engine,  # noqa: F811
    nats_helper: Nats,
    start_relay: Callable[..., RelayProcess],
) -> None:
    stream, subject = nats_helper.run(nats_helper.stream("big"))
    pointer = pointer_body("some-bucket", "some/key")
    headers = {"Nats-Msg-Id": "m-1", "type": "Effect", "ExtendedPayloadSize": "400000"}
    nats_helper.run(nats_helper.publish(f"{subject}.x", pointer.encode(), headers))
    nats_helper.run(
        nats_helper.publish(f"{subject}.x", b'{"n": 1}', {"Nats-Msg-Id": "m-2", "type": "Effect"})
    )
    start_inbox(start_relay, nats_helper, stream)  # no --claim-check
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == 2, message="both stored")
    [(status, last_error, payload, stored)] = rows(
        effects, "SELECT status, last_error, payload, headers FROM inbox WHERE message_id = 'm-1'"
    )
    assert status == "dead"
    assert "no --claim-check is configured" in last_error
    assert "s3://some-bucket/some/key" in last_error
    assert payload == orjson.loads(pointer) and stored["ExtendedPayloadSize"] == "400000"
    wait_until(lambda: effect_ns(effects, None) == [1], message="the other one handled")
