"""Large messages through a claim check in S3 (`--claim-check`), end to end.

Both daemons run as subprocesses against real peers: moto's server (S3 and
SQS on one endpoint, tests/sqs_server.py) and RabbitMQ. What is checked is
the contract's wire format (the pointer body, ExtendedPayloadSize, exactly
one object PREFIX/<id> holding exactly the body), that Amazon's own Python
library (amazon-sqs-extended-client) reads relay's large messages and relay
reads its, per-key order with small messages interleaved, and the faults:
S3 away for a while, a missing bucket, a pointer to a missing object.
"""

from __future__ import annotations

import contextlib
import hashlib
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import boto3
import orjson
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.claimcheck import pointer_body, read_pointer
from relay.claimcheck.inbound import declared_size, parts, resolve
from relay.config import ClaimCheckURL, parse_size
from relay.errors import ConfigError
from tests.conftest import (
    AMQP_URL,
    HANDLERS,
    Rabbit,
    RelayProcess,
    effects,  # noqa: F401 - fixture
    free_port,
    rows,
    wait_until,
)
from tests.proxy import Proxy
from tests.sqs_server import REGION, Sqs, sqs, sqs_env, sqs_server  # noqa: F401 - fixtures

KiB = 1024
MiB = 1024 * 1024
POINTER = "software.amazon.payloadoffloading.PayloadS3Pointer"


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


class S3:
    """A test's own bucket on the moto server."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        self.bucket = f"relay-cc-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=self.bucket)

    def url(self, prefix: str = "", endpoint: str | None = None) -> str:
        path = f"/{prefix}" if prefix else ""
        return f"s3://{self.bucket}{path}?endpoint_url={endpoint or self.endpoint}"

    def objects(self) -> dict[str, bytes]:
        listed = self.client.list_objects_v2(Bucket=self.bucket).get("Contents", [])
        return {
            o["Key"]: self.client.get_object(Bucket=self.bucket, Key=o["Key"])["Body"].read()
            for o in listed
        }


@pytest.fixture
def s3(sqs_server: str) -> Iterator[S3]:  # noqa: F811 - the fixture
    helper = S3(sqs_server)
    yield helper
    # The session's moto server keeps objects in memory: let the next tests have it.
    with contextlib.suppress(Exception):
        for key in helper.objects():
            helper.client.delete_object(Bucket=helper.bucket, Key=key)
        helper.client.delete_bucket(Bucket=helper.bucket)
    helper.client.close()


def env_for(sqs: Sqs) -> dict[str, str]:  # noqa: F811 - the fixture's type
    return {**sqs_env(sqs.endpoint), "AWS_ENDPOINT_URL_S3": sqs.endpoint}


def insert(engine: sa.Engine, topic: str, sizes: list[int], key: str | None = "k") -> list[str]:
    """One row per size (payload {"n": i, "blob": "x" * size}), in one transaction; their ids."""
    ids = []
    with engine.begin() as conn:
        for n, size in enumerate(sizes):
            ids.append(
                str(
                    conn.execute(
                        sa.text(
                            "INSERT INTO outbox (topic, key, type, payload) VALUES (:topic, :key, "
                            "'Effect', jsonb_build_object('n', CAST(:n AS int), "
                            "'blob', repeat('x', :size))) RETURNING id"
                        ),
                        {"topic": topic, "key": key, "n": n, "size": size},
                    ).scalar()
                )
            )
    return ids


def body_of(n: int, size: int) -> bytes:
    """The compact JSON body relay publishes for insert()'s row n."""
    return orjson.dumps({"n": n, "blob": "x" * size})


def outbox_status(engine: sa.Engine) -> list[tuple[str, str, int, str | None]]:
    return [
        (r[0], r[1], r[2], r[3])
        for r in rows(
            engine, "SELECT id::text, status, attempts, last_error FROM outbox ORDER BY seq"
        )
    ]


def whole_in_inbox(engine: sa.Engine) -> int:
    """Inbox rows whose payload is exactly the outbox row's payload."""
    return int(
        rows(
            engine,
            "SELECT count(*) FROM inbox i JOIN outbox o ON i.message_id = o.id::text "
            "WHERE i.payload = o.payload",
        )[0][0]
    )


def effect_ns(engine: sa.Engine, key: str | None = "k") -> list[int]:
    return [
        r[0]
        for r in rows(
            engine, "SELECT n FROM effects WHERE key IS NOT DISTINCT FROM :k ORDER BY id", k=key
        )
    ]


# 300 KiB, 1 MiB and 10 MiB bodies, small ones between them, one key.
SIZES = [10, 300 * KiB, 20, 1 * MiB, 30, 10 * MiB, 40, 300 * KiB, 50]
LARGE = [i for i, size in enumerate(SIZES) if size > 256 * KiB]


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------


def test_claim_check_url_and_size_parse() -> None:
    url = ClaimCheckURL.parse("s3://my-bucket/a/b/?region=eu-west-1&endpoint_url=http://h:9000")
    assert (url.bucket, url.prefix, url.region, url.endpoint_url) == (
        "my-bucket",
        "a/b",
        "eu-west-1",
        "http://h:9000",
    )
    assert url.key("id-1") == "a/b/id-1"
    assert ClaimCheckURL.parse("s3://my-bucket").key("id-1") == "id-1"
    for bad in ("http://b/x", "s3://", "s3://UPPER", "s3://b?color=red", "s3://bb?endpoint_url=x"):
        with pytest.raises(ConfigError):
            ClaimCheckURL.parse(bad)
    assert [parse_size(s) for s in ("256KiB", "1MiB", "1000", 5)] == [262144, 1048576, 1000, 5]
    for bad in ("1 MB", "-1", "0", "lots"):
        with pytest.raises(ConfigError):
            parse_size(bad)


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--claim-check", "http://bucket/x"), ("--claim-check-over", "1MB")],
)
def test_bad_claim_check_exits_2_with_one_line(
    run_relay: Callable[..., subprocess.CompletedProcess[str]], flag: str, value: str
) -> None:
    for command in (["outbox", "--once"], ["inbox", "--queue", "q"]):
        done = run_relay(*command, "--claim-check", "s3://bucket", flag, value)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert "claim-check" in done.stderr


async def test_pointer_format_and_recognition() -> None:
    text = pointer_body("b", "p/1")
    assert text == f'["{POINTER}",{{"s3BucketName":"b","s3Key":"p/1"}}]'
    assert read_pointer(text) == ("b", "p/1")
    # Amazon's Python client writes it with json.dumps' spaces; the old Java class name too.
    assert read_pointer(f'["{POINTER}", {{"s3BucketName": "b", "s3Key": "k"}}]') == ("b", "k")
    legacy = '["com.amazon.sqs.javamessaging.MessageS3Pointer",{"s3BucketName":"b","s3Key":"k"}]'
    assert read_pointer(legacy) == ("b", "k")
    for other in ('["x",{"s3BucketName":"b","s3Key":"k"}]', f'["{POINTER}"]', "{}", "[1,2]"):
        assert read_pointer(other) is None
    # Without the size attribute a pointer-shaped body is an ordinary message.
    from relay.brokers import Incoming

    plain = Incoming("m", "t", None, "T", text.encode())
    assert (await resolve([plain], None))[0] == [plain]


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=300), st.text(min_size=1, max_size=300))
def test_any_pointer_reads_back(bucket: str, key: str) -> None:
    assert read_pointer(pointer_body(bucket, key)) == (bucket, key)
    assert read_pointer(pointer_body(bucket, key).encode()) == (bucket, key)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | st.text(max_size=400).map(lambda t: f'["{POINTER}",{t}]'))
def test_any_other_body_is_not_a_pointer_and_never_raises(body: bytes | str) -> None:
    found = read_pointer(body)
    if found is not None:  # then it is one: the exact form, whatever else the object holds
        value = orjson.loads(body)
        assert len(value) == 2 and value[0] == POINTER
        assert (value[1]["s3BucketName"], value[1]["s3Key"]) == found


def test_a_batch_of_pointers_is_stored_in_parts() -> None:
    from relay.brokers import Incoming

    def message(n: int, large: bool) -> Incoming:
        body = pointer_body("b", str(n)).encode() if large else b"{}"
        return Incoming(str(n), "t", None, "T", body, {"ExtendedPayloadSize": 9})

    small = [message(n, False) for n in range(5)]
    assert parts(small, 2) == [small]
    mixed = [message(n, n % 2 == 1) for n in range(10)]  # pointers at 1, 3, 5, 7, 9
    assert [[m.message_id for m in part] for part in parts(mixed, 2)] == [
        ["0", "1", "2", "3", "4"],
        ["5", "6", "7", "8"],
        ["9"],
    ]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.none() | st.integers(0, 50) | st.just("bad"), max_size=30),
    st.integers(1, 5),
    st.none() | st.integers(1, 60),
)
def test_a_batch_in_parts_holds_at_most_max_bytes_of_declared_sizes(
    sizes: list[int | str | None], pointers: int, max_bytes: int | None
) -> None:
    """parts(max_bytes): the batch, in order, in parts of at most `pointers`
    pointers whose declared sizes (an unreadable one counts 0) add up to at
    most max_bytes, but for one larger pointer alone (issue 43)."""
    from relay.brokers import Incoming

    def message(n: int, size: int | str | None) -> Incoming:
        if size is None:  # not a pointer
            return Incoming(str(n), "t", None, "T", b"{}", {})
        body = pointer_body("b", str(n)).encode()
        return Incoming(str(n), "t", None, "T", body, {"ExtendedPayloadSize": size})

    batch = [message(n, size) for n, size in enumerate(sizes)]
    split = parts(batch, pointers, max_bytes)
    assert [m for part in split for m in part] == batch
    for part in split:
        declared = [declared_size(m.headers) for m in part if m.headers]
        assert len(declared) <= pointers
        if max_bytes is not None and len(declared) > 1:
            assert sum(declared) <= max_bytes


def test_the_receivers_parts_carry_its_shares_of_batch_bytes() -> None:
    """wiring.receiver_parts: half of --batch-bytes to RabbitMQ's consumer,
    a quarter to the claim check's parts, through the pickled factories."""
    import pickle

    from relay.config import BrokerURL, InboxSettings
    from relay.wiring import receiver_parts

    settings_ = InboxSettings(
        database_url="postgresql://127.0.0.1/x",
        broker=BrokerURL.parse("amqp://guest:guest@127.0.0.1/"),
        queue="q",
        batch_bytes="8MiB",
    )
    made = pickle.loads(pickle.dumps(receiver_parts(settings_)))
    assert made.consumer().max_bytes == 4 * 1024 * 1024
    assert made.stage is not None and made.stage().max_bytes == 2 * 1024 * 1024


# --------------------------------------------------------------------------
# SQS
# --------------------------------------------------------------------------


def test_sqs_outbox_wire_format_and_amazon_client_reads_it(
    engine: sa.Engine,
    sqs: Sqs,  # noqa: F811 - the fixture
    s3: S3,
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    raw_q, amazon_q = sqs.name("raw"), sqs.name("amazon")
    sqs.create(raw_q)
    sqs.create(amazon_q)
    raw_id = insert(engine, raw_q, [300 * KiB])[0]
    rows(engine, 'UPDATE outbox SET headers = \'{"traceparent": "tp"}\'')
    amazon_id = insert(engine, amazon_q, [1 * MiB], key=None)[0]
    small_id = insert(engine, raw_q, [10])[0]
    done = run_relay(
        "outbox",
        "--once",
        "--broker-url",
        "sqs://",
        "--claim-check",
        s3.url("large"),
        env=env_for(sqs),
    )
    assert done.returncode == 0, done.stderr
    assert {status for _, status, _, _ in outbox_status(engine)} == {"published"}

    # Exactly one object per large message, PREFIX/<id>, holding exactly the body.
    assert s3.objects() == {
        f"large/{raw_id}": body_of(0, 300 * KiB),
        f"large/{amazon_id}": body_of(0, 1 * MiB),
    }
    got = sqs.receive(raw_q)
    by_id = {m["MessageAttributes"]["message_id"]["StringValue"]: m for m in got}
    large, small = by_id[raw_id], by_id[small_id]
    assert large["Body"] == (
        f'["{POINTER}",{{"s3BucketName":"{s3.bucket}","s3Key":"large/{raw_id}"}}]'
    )
    attributes = large["MessageAttributes"]
    assert attributes["ExtendedPayloadSize"] == {
        "DataType": "Number",
        "StringValue": str(len(body_of(0, 300 * KiB))),
    }
    assert attributes["type"]["StringValue"] == "Effect"
    assert attributes["key"]["StringValue"] == "k"
    assert orjson.loads(attributes["headers"]["StringValue"]) == {"traceparent": "tp"}
    assert small["Body"] == body_of(0, 10).decode()
    assert "ExtendedPayloadSize" not in small["MessageAttributes"]

    # Amazon's own client reads the other one whole.
    from sqs_extended_client import SQSExtendedClientSession

    client = SQSExtendedClientSession(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    ).client("sqs", endpoint_url=sqs.endpoint)
    client.large_payload_support = s3.bucket
    client.s3_client = boto3.session.Session().client(
        "s3",
        endpoint_url=sqs.endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    messages = client.receive_message(
        QueueUrl=sqs.urls[amazon_q], MessageAttributeNames=["All"], WaitTimeSeconds=1
    )["Messages"]
    assert [m["Body"].encode() for m in messages] == [body_of(0, 1 * MiB)]
    assert messages[0]["MessageAttributes"]["message_id"]["StringValue"] == amazon_id


def _sqs_inbox(
    start_relay: Callable[..., RelayProcess],
    sqs: Sqs,
    queue: str,
    *extra: str,  # noqa: F811
) -> RelayProcess:
    proc = start_relay(
        "inbox",
        "--broker-url",
        "sqs://",
        "--queue",
        queue,
        "--handlers",
        HANDLERS,
        "--poll-interval",
        "0.5",
        "--http-port",
        "0",
        *extra,
        env=env_for(sqs),
    )
    proc.wait_for_log("inbox started", timeout=30)
    return proc


def test_sqs_both_daemons_large_and_small_in_key_order(
    effects: sa.Engine,  # noqa: F811 - the fixture
    sqs: Sqs,  # noqa: F811
    s3: S3,
    start_relay: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    # A FIFO queue: a standard one delivers in no order, to several receivers.
    queue = sqs.name("both") + ".fifo"
    sqs.create(queue)
    ids = insert(effects, queue, SIZES)
    # The threshold by environment, and S3's endpoint from AWS_ENDPOINT_URL_S3.
    env = {
        **env_for(sqs),
        "RELAY_CLAIM_CHECK": f"s3://{s3.bucket}",
        "RELAY_CLAIM_CHECK_OVER": "1000",
    }
    done = run_relay("outbox", "--once", "--broker-url", "sqs://", env=env)
    assert done.returncode == 0, done.stderr
    # Over 1,000 bytes: the large ones, with no prefix the key is the id.
    assert set(s3.objects()) == {ids[i] for i in LARGE}
    port = free_port()
    _sqs_inbox(
        start_relay, sqs, queue, "--claim-check", f"s3://{s3.bucket}", "--http-port", str(port)
    )
    wait_until(lambda: len(effect_ns(effects)) == len(SIZES), timeout=60, message="all handled")
    assert effect_ns(effects) == list(range(len(SIZES)))
    assert whole_in_inbox(effects) == len(SIZES)
    metrics = metrics_of(port)
    assert metrics["relay_inbox_claim_checked_total"] == len(LARGE)
    assert metrics["relay_inbox_claim_check_downloaded_bytes_total"] == sum(
        len(body_of(n, SIZES[n])) for n in LARGE
    )


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def metrics_of(port: int) -> dict[str, float]:
    """The daemon's /metrics samples without labels, by name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def test_amazon_client_message_is_stored_whole_by_the_inbox(
    effects: sa.Engine,  # noqa: F811
    sqs: Sqs,  # noqa: F811
    s3: S3,
    start_relay: Callable[..., RelayProcess],
) -> None:
    from sqs_extended_client import SQSExtendedClientSession

    queue = sqs.name("from-amazon")
    sqs.create(queue)
    client = SQSExtendedClientSession(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    ).client("sqs", endpoint_url=sqs.endpoint)
    client.large_payload_support = s3.bucket
    client.s3_client = s3.client
    body = body_of(7, 400 * KiB).decode()
    client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody=body,
        MessageAttributes={
            "type": {"DataType": "String", "StringValue": "Effect"},
            "key": {"DataType": "String", "StringValue": "k"},
        },
    )
    assert len(s3.objects()) == 1  # the client did store it in S3
    _sqs_inbox(start_relay, sqs, queue, "--claim-check", s3.url())
    wait_until(lambda: effect_ns(effects) == [7], timeout=30, message="handled")
    [(message_id, payload, headers, status)] = rows(
        effects, "SELECT message_id, payload::text, headers, status FROM inbox"
    )
    assert orjson.loads(payload) == orjson.loads(body)
    # No message_id attribute: the dedup key is the hash of the whole body.
    assert message_id == "sha256:" + hashlib.sha256(body.encode()).hexdigest()
    assert "ExtendedPayloadSize" not in headers
    assert status == "processed"


def test_pointer_to_a_missing_object_is_dead_until_retried(
    effects: sa.Engine,  # noqa: F811
    sqs: Sqs,  # noqa: F811
    s3: S3,
    start_relay: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    queue = sqs.name("missing")
    sqs.create(queue)
    key = "later/obj"
    sqs.client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody=pointer_body(s3.bucket, key),
        MessageAttributes={
            "message_id": {"DataType": "String", "StringValue": "m-1"},
            "type": {"DataType": "String", "StringValue": "Effect"},
            "key": {"DataType": "String", "StringValue": "k"},
            "SQSLargePayloadSize": {"DataType": "Number", "StringValue": "300000"},
        },
    )
    sqs.send(queue, b'{"n": 2}', message_id="m-2", type="Effect", key="other")
    _sqs_inbox(start_relay, sqs, queue, "--claim-check", s3.url())
    wait_until(lambda: effect_ns(effects, "other") == [2], timeout=30, message="the rest flows")
    [(status, last_error, payload)] = rows(
        effects, "SELECT status, last_error, payload FROM inbox WHERE message_id = 'm-1'"
    )
    assert status == "dead"
    assert f"s3://{s3.bucket}/{key}" in last_error and "NoSuchKey" in last_error
    assert payload == [POINTER, {"s3BucketName": s3.bucket, "s3Key": key}]  # kept as received

    # Without --claim-check the retry reads the bucket the pointer names, with
    # the standard AWS settings: not the test server's here (no endpoint, no
    # credentials), so it cannot: still dead, and it says why, on the
    # terminal and in last_error.
    done = run_relay("dead", "retry", "--id", "m-1")
    assert done.returncode == 0, done.stderr
    assert "retried 0 inbox rows" in done.stdout
    assert f"not retried: the message is a claim check pointer to s3://{s3.bucket}/" in (
        done.stderr
    )
    [(status, last_error)] = rows(
        effects, "SELECT status, last_error FROM inbox WHERE message_id = 'm-1'"
    )
    assert status == "dead" and "whose object could not be read" in last_error
    assert "no --claim-check" not in last_error

    # With them (the environment's endpoint and credentials), it does.
    s3.client.put_object(Bucket=s3.bucket, Key=key, Body=body_of(5, 300 * KiB))
    done = run_relay("retry", "inbox", "--id", "m-1", env=env_for(sqs))
    assert done.returncode == 0, done.stderr
    assert "retried 1 inbox row" in done.stdout
    wait_until(lambda: effect_ns(effects) == [5], timeout=30, message="handled after retry")
    [(payload, headers)] = rows(
        effects, "SELECT payload, headers FROM inbox WHERE message_id = 'm-1'"
    )
    assert payload == orjson.loads(body_of(5, 300 * KiB))
    assert "SQSLargePayloadSize" not in headers


def test_s3_away_for_a_while_is_retried_and_nothing_dies(
    engine: sa.Engine,
    sqs: Sqs,  # noqa: F811
    s3: S3,
    start_relay: Callable[..., RelayProcess],
) -> None:
    queue = sqs.name("away")
    sqs.create(queue)
    port = int(sqs.endpoint.rsplit(":", 1)[1])
    proxy = Proxy(port)  # S3 only goes through it; SQS stays reachable
    try:
        ids = insert(engine, queue, [300 * KiB, 10, 300 * KiB])
        proc = start_relay(
            "outbox",
            "--broker-url",
            "sqs://",
            "--claim-check",
            s3.url("p", endpoint=f"http://127.0.0.1:{proxy.port}"),
            "--max-attempts",
            "2",
            "--poll-interval",
            "0.2",
            "--http-port",
            str(port := free_port()),
            env=env_for(sqs),
        )
        # Up (its HTTP server serves before it connects), and has met S3 away;
        # then a while for anything it should not do.
        proc.wait_for_log("retrying in")
        time.sleep(4)
        # Nothing was published (the key waits behind its first row), no attempt counted.
        assert [(s, a) for _, s, a, _ in outbox_status(engine)] == [("pending", 0)] * 3
        assert http_status(port, "/readyz") == 503
        proxy.start()
        wait_until(
            lambda: {s for _, s, _, _ in outbox_status(engine)} == {"published"},
            timeout=60,
            message="published once S3 is back",
        )
        assert all(a == 0 for _, _, a, _ in outbox_status(engine))
        assert http_status(port, "/readyz") == 200
        objects = s3.objects()
        assert set(objects) == {f"p/{ids[0]}", f"p/{ids[2]}"}
        metrics = metrics_of(port)
        assert metrics["relay_outbox_claim_checked_total"] == 2
        assert metrics["relay_outbox_claim_check_uploaded_bytes_total"] >= sum(
            len(v) for v in objects.values()
        )

        # Away again while the relay runs: the large row and its key wait,
        # other keys flow, no attempt is counted.
        proxy.stop()
        held = insert(engine, queue, [300 * KiB, 10])
        other = insert(engine, queue, [20], key="other")[0]
        wait_until(lambda: {i: s for i, s, _, _ in outbox_status(engine)}[other] == "published")
        time.sleep(2)
        status = {i: (s, a) for i, s, a, _ in outbox_status(engine)}
        assert [status[i] for i in held] == [("pending", 0)] * 2
        assert "claim check: S3 at" in proc.log
        proxy.start()
        wait_until(
            lambda: {s for _, s, _, _ in outbox_status(engine)} == {"published"},
            timeout=60,
            message="published once S3 is back again",
        )
        assert all(a == 0 for _, _, a, _ in outbox_status(engine))
        assert f"p/{held[0]}" in s3.objects()
    finally:
        proxy.close()


def test_s3_away_at_the_inbox_holds_the_message_and_nothing_dies(
    effects: sa.Engine,  # noqa: F811
    sqs: Sqs,  # noqa: F811
    s3: S3,
    start_relay: Callable[..., RelayProcess],
) -> None:
    queue = sqs.name("inbox-away")
    sqs.create(queue, VisibilityTimeout=5)
    s3.client.put_object(Bucket=s3.bucket, Key="obj", Body=body_of(3, 300 * KiB))
    sqs.client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody=pointer_body(s3.bucket, "obj"),
        MessageAttributes={
            "type": {"DataType": "String", "StringValue": "Effect"},
            "key": {"DataType": "String", "StringValue": "k"},
            "ExtendedPayloadSize": {"DataType": "Number", "StringValue": "307220"},
        },
    )
    proxy = Proxy(int(sqs.endpoint.rsplit(":", 1)[1]))  # S3 only goes through it
    try:
        url = s3.url(endpoint=f"http://127.0.0.1:{proxy.port}")
        proc = _sqs_inbox(start_relay, sqs, queue, "--claim-check", url)
        proc.wait_for_log("cannot fetch claim checked bodies", timeout=30)
        assert rows(effects, "SELECT count(*) FROM inbox")[0][0] == 0  # held, not stored dead
        proxy.start()
        wait_until(lambda: effect_ns(effects) == [3], timeout=60, message="handled once S3 is back")
        assert rows(effects, "SELECT status, attempts FROM inbox") == [("processed", 0)]
    finally:
        proxy.close()


def test_missing_bucket_is_dead_with_the_reason_and_the_rest_flows(
    engine: sa.Engine,
    sqs: Sqs,  # noqa: F811
    s3: S3,
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    queue = sqs.name("nobucket")
    sqs.create(queue)
    large = insert(engine, queue, [300 * KiB], key="a")[0]
    small = insert(engine, queue, [10, 20], key="b")
    args = ["outbox", "--once", "--broker-url", "sqs://", "--max-attempts", "2"]
    args += ["--backoff-min", "0", "--backoff-max", "0"]
    args += [
        "--claim-check",
        f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}?endpoint_url={sqs.endpoint}",
    ]
    done = run_relay(*args, env=env_for(sqs))
    assert done.returncode == 0, done.stderr
    status = {i: (s, a, e) for i, s, a, e in outbox_status(engine)}
    assert status[large][0] == "dead" and status[large][1] == 2
    assert "NoSuchBucket" in (status[large][2] or "")
    assert all(status[i][0] == "published" for i in small)
    assert len(sqs.receive(queue)) == 2


# --------------------------------------------------------------------------
# RabbitMQ
# --------------------------------------------------------------------------


async def test_rabbitmq_both_daemons_wire_format_and_order(
    effects: sa.Engine,  # noqa: F811
    rabbit: Rabbit,
    s3: S3,
    sqs: Sqs,  # noqa: F811 - for its environment
    inbox: Callable[..., RelayProcess],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    tap = await rabbit.queue("big.#")  # sees what relay publishes, beside the inbox's queue
    env = env_for(sqs)
    inbox("--claim-check", s3.url("rmq"), bind="big.#", env=env)
    ids = insert(effects, "big.one", SIZES)
    done = run_relay(
        "outbox",
        "--once",
        "--broker-url",
        AMQP_URL,
        "--exchange",
        rabbit.exchange,
        "--claim-check",
        s3.url("rmq"),
        "--claim-check-over",
        "256KiB",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    got = await rabbit.drain(tap, len(SIZES), timeout=30)
    assert [m.message_id for m in got] == ids
    for n, message in enumerate(got):
        headers = message.headers or {}
        if n in LARGE:
            assert message.body == pointer_body(s3.bucket, f"rmq/{ids[n]}").encode()
            assert headers["ExtendedPayloadSize"] == len(body_of(n, SIZES[n]))
        else:
            assert message.body == body_of(n, SIZES[n])
            assert "ExtendedPayloadSize" not in headers
        assert headers["x-relay-key"] == "k"
        assert message.type == "Effect" and message.content_type == "application/json"
    objects = s3.objects()
    assert objects == {f"rmq/{ids[n]}": body_of(n, SIZES[n]) for n in LARGE}
    wait_until(lambda: len(effect_ns(effects)) == len(SIZES), timeout=60, message="all handled")
    assert effect_ns(effects) == list(range(len(SIZES)))
    assert whole_in_inbox(effects) == len(SIZES)


async def test_rabbitmq_pointer_without_claim_check_is_dead_with_the_reason(
    effects: sa.Engine,  # noqa: F811
    rabbit: Rabbit,
    inbox: Callable[..., RelayProcess],
) -> None:
    inbox()  # no --claim-check
    pointer = pointer_body("some-bucket", "some/key")
    await rabbit.publish(
        "big.one",
        pointer.encode(),
        message_id="m-1",
        type="Effect",
        headers={"ExtendedPayloadSize": 400000, "x-relay-key": "k"},
    )
    await rabbit.publish("big.one", b'{"n": 1}', message_id="m-2", type="Effect")
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == 2, message="both stored")
    [(status, last_error, payload, headers)] = rows(
        effects, "SELECT status, last_error, payload, headers FROM inbox WHERE message_id = 'm-1'"
    )
    assert status == "dead"
    assert "no --claim-check is configured" in last_error
    assert "s3://some-bucket/some/key" in last_error
    assert payload == orjson.loads(pointer) and headers["ExtendedPayloadSize"] == 400000
    wait_until(lambda: effect_ns(effects, None) == [1], message="the other one handled")
