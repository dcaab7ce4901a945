"""The SNS adapter beyond the contract suite, against moto's server: FIFO
topics, a missing topic, ARNs where ListTopics is denied, the claim check's
pointer (and Amazon's SNS Extended Client's), CloudEvents in structured
mode, a topic fanned out to two queues read by two `relay inbox`
processes (raw delivery on one, SNS's envelope on the other), and hostile
envelopes, each exactly one row."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import types
import uuid
from typing import Any

import boto3
import botocore.exceptions
import orjson
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relay
from relay import cloudevents
from relay.brokers import make_publisher
from relay.brokers.sns import build_entry, open_notification
from relay.brokers.sqs import to_incoming
from relay.claimcheck.publisher import ClaimCheckPublisher
from relay.config import BrokerURL, ClaimCheckURL
from relay.errors import ConfigError
from relay.outbox import WORKERS
from relay.rows import Failure
from relay.storable import to_row
from tests.brokers.test_contract import row
from tests.conftest import HANDLERS, rows, wait_until
from tests.sns_server import Sns
from tests.sqs_server import REGION

POINTER = "software.amazon.payloadoffloading.PayloadS3Pointer"


def url_of(sns: Sns) -> BrokerURL:
    return BrokerURL.parse(f"sns://?region={REGION}&endpoint_url={sns.endpoint}")


def bucket(sns: Sns) -> Any:
    """A bucket of the test's own on the moto server (emptied by nobody:
    the objects are small and the names unique)."""
    s3 = boto3.session.Session().client(
        "s3",
        endpoint_url=sns.endpoint,
        region_name=REGION,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    name = f"relay-sns-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return types.SimpleNamespace(name=name, client=s3)


def received(sns: Sns, queue: str, count: int) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    for _ in range(30):
        got += sns.sqs.receive(queue)
        if len(got) >= count:
            break
    assert len(got) == count, f"{len(got)} messages in {queue}, not {count}"
    return got


# --------------------------------------------------------------------------
# The publisher
# --------------------------------------------------------------------------


async def test_sns_fifo_topic_gets_group_and_deduplication_ids(sns, monkeypatch):
    for name, value in sns.env.items():
        monkeypatch.setenv(name, value)
    topic = sns.name("orders", fifo=True)
    sns.topic(topic)
    queue = sns.subscribe(topic, sns.name("orders-q", fifo=True), raw=True)
    keyed, keyless = row(topic, key="order-7", type="T", n=1), row(topic, n=2)
    publisher = make_publisher(url_of(sns), exchange="relay", workers=WORKERS)
    try:
        assert await publisher.publish([keyed, keyless]) == [None, None]
    finally:
        await publisher.close()
    got = {
        m["MessageAttributes"]["message_id"]["StringValue"]: m["Attributes"]
        for m in await asyncio.to_thread(received, sns, queue, 2)
    }
    assert (got[keyed.id]["MessageGroupId"], got[keyed.id]["MessageDeduplicationId"]) == (
        "order-7",
        keyed.id,
    )
    assert got[keyless.id]["MessageGroupId"] == topic  # no key: the topic


def test_sns_rows_it_cannot_carry_fail_for_good():
    for bad, why in (
        (row("orders.placed"), "not a valid SNS topic name"),
        (row("t.fifo", key="has space"), "cannot be an SNS MessageGroupId"),
        (row("t", "\uffff"), r"U\+FFFF, a character SNS does not accept"),
    ):
        with pytest.raises(ValueError, match=why):
            build_entry(bad, 0)
    made = build_entry(row("t", key="k", type="T", headers='{"a": "b"}'), 3)
    assert made.params["Message"] == '{"n":0}' and made.params["Id"] == "3"
    assert set(made.params["MessageAttributes"]) == {"message_id", "type", "key", "headers"}


def test_sns_missing_topic_fails_the_attempt_and_is_never_created(engine, sns, run_relay):
    topic, missing = sns.name("here"), sns.name("missing")
    sns.topic(topic)
    queue = sns.subscribe(topic, topic, raw=True)
    with engine.begin() as conn:
        there = relay.enqueue(conn, topic, {"n": 1}, type="T")
        lost = relay.enqueue(conn, missing, {"n": 2}, key="k")
    done = run_relay("outbox", "--once", "--broker-url", "sns://", env=sns.env)
    assert done.returncode == 0, done.stderr
    status = {
        str(i): (s, a, e)
        for i, s, a, e in rows(engine, "SELECT id, status, attempts, last_error FROM outbox")
    }
    assert status[str(there)][:2] == ("published", 0)
    assert status[str(lost)] == (
        "pending",
        1,
        f"SNS topic {missing!r} does not exist in {REGION}",
    )
    assert not sns.exists(missing)
    [message] = sns.sqs.receive(queue)
    assert message["MessageAttributes"]["message_id"]["StringValue"] == str(there)


async def test_sns_topic_arns_from_the_account_where_listing_topics_is_denied(sns, monkeypatch):
    # Credentials that may publish but not list: ListTopics answers
    # AuthorizationError (a botocore hook in place of the server), and relay
    # builds the ARN from STS GetCallerIdentity, checked by GetTopicAttributes.
    for name, value in sns.env.items():
        monkeypatch.setenv(name, value)
    denied: list[str] = []

    def deny(**_: Any) -> tuple[Any, dict[str, Any]]:
        denied.append("ListTopics")
        error = {"Code": "AuthorizationError", "Message": "not authorized to list"}
        return types.SimpleNamespace(status_code=403, headers={}), {
            "Error": error,
            "ResponseMetadata": {"HTTPStatusCode": 403},
        }

    real_client = boto3.session.Session.client

    def client(session: Any, *args: Any, **kwargs: Any) -> Any:
        made = real_client(session, *args, **kwargs)
        made.meta.events.register("before-call.sns.ListTopics", deny)
        return made

    monkeypatch.setattr(boto3.session.Session, "client", client)
    topic, missing = sns.name("built"), sns.name("absent")
    sns.topic(topic)
    queue = sns.subscribe(topic, topic, raw=True)
    ok, lost = row(topic, n=1), row(missing, n=2)
    publisher = make_publisher(url_of(sns), exchange="relay", workers=WORKERS)
    try:
        assert await publisher.publish([ok, lost]) == [
            None,
            Failure(f"SNS topic {missing!r} does not exist in {REGION}"),
        ]
    finally:
        await publisher.close()
    assert denied  # the probe and the lookup were refused
    [message] = await asyncio.to_thread(received, sns, queue, 1)
    assert message["MessageAttributes"]["message_id"]["StringValue"] == ok.id


async def test_sns_claim_check_pointer_is_amazons_and_its_client_is_read(sns, monkeypatch):
    for name, value in {**sns.env, "AWS_ENDPOINT_URL_S3": sns.endpoint}.items():
        monkeypatch.setenv(name, value)
    store = bucket(sns)
    topic = sns.name("large")
    sns.topic(topic)
    raw_q = sns.subscribe(topic, sns.name("large-raw"), raw=True)
    env_q = sns.subscribe(topic, sns.name("large-env"), raw=False)
    large = row(topic, {"blob": "x" * 3000}, type="Big", key="k")
    publisher = ClaimCheckPublisher(
        make_publisher(url_of(sns), exchange="relay", workers=WORKERS),
        ClaimCheckURL.parse(f"s3://{store.name}/p"),
        over=1000,
    )
    try:
        assert await publisher.publish([large]) == [None]
    finally:
        await publisher.close()
    body = orjson.dumps({"blob": "x" * 3000})
    stored = store.client.get_object(Bucket=store.name, Key=f"p/{large.id}")["Body"].read()
    assert stored == body
    [message] = await asyncio.to_thread(received, sns, raw_q, 1)
    assert message["Body"] == (
        f'["{POINTER}",{{"s3BucketName":"{store.name}","s3Key":"p/{large.id}"}}]'
    )
    assert message["MessageAttributes"]["ExtendedPayloadSize"] == {
        "DataType": "Number",
        "StringValue": str(len(body)),
    }
    # Through the envelope, the same pointer and size reach the inbox.
    [enveloped] = await asyncio.to_thread(received, sns, env_q, 1)
    opened = to_incoming(enveloped, env_q)
    assert (opened.body.decode(), opened.message_id, opened.type, opened.key) == (
        message["Body"],
        large.id,
        "Big",
        "k",
    )
    assert opened.headers["ExtendedPayloadSize"] == str(len(body))

    # Amazon's SNS Extended Client writes the pointer relay reads.
    from sns_extended_client import SNSExtendedClientSession

    amazon = SNSExtendedClientSession(
        aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
    ).client("sns", endpoint_url=sns.endpoint)
    amazon.large_payload_support = store.name
    amazon.message_size_threshold = 1000
    amazon.s3_client = store.client
    amazon.publish(
        TopicArn=sns.arns[topic],
        Message=body.decode(),
        MessageAttributes={"message_id": {"DataType": "String", "StringValue": "amazon-1"}},
    )
    for queue in (raw_q, env_q):
        [theirs] = await asyncio.to_thread(received, sns, queue, 1)
        incoming = to_incoming(theirs, queue)
        assert incoming.message_id == "amazon-1"
        assert incoming.headers["ExtendedPayloadSize"] == str(len(body))
        assert orjson.loads(incoming.body)[0] == POINTER


async def test_sns_cloudevents_structured_mode_reaches_the_inbox_as_the_event(sns, monkeypatch):
    for name, value in sns.env.items():
        monkeypatch.setenv(name, value)
    topic = sns.name("events")
    sns.topic(topic)
    raw_q = sns.subscribe(topic, sns.name("events-raw"), raw=True)
    env_q = sns.subscribe(topic, sns.name("events-env"), raw=False)
    event = row(topic, {"order": 7}, type="OrderPlaced", key="order-7")
    publisher = cloudevents.wrap(
        make_publisher(url_of(sns), exchange="relay", workers=WORKERS), "urn:shop", "sns"
    )
    try:
        assert await publisher.publish([event]) == [None]
    finally:
        await publisher.close()
    [message] = await asyncio.to_thread(received, sns, raw_q, 1)
    assert message["MessageAttributes"]["content-type"]["StringValue"] == (
        "application/cloudevents+json"
    )
    body = orjson.loads(message["Body"])
    assert {k: body[k] for k in ("specversion", "id", "source", "type", "subject", "data")} == {
        "specversion": "1.0",
        "id": event.id,
        "source": "urn:shop",
        "type": "OrderPlaced",
        "subject": "order-7",
        "data": {"order": 7},
    }
    [enveloped] = await asyncio.to_thread(received, sns, env_q, 1)
    for got, queue in ((message, raw_q), (enveloped, env_q)):
        [stored] = cloudevents.received([to_incoming(got, queue)], cloudevents.binding("sqs"))
        assert (stored.message_id, stored.type, stored.key) == (
            f"urn:shop {event.id}",
            "OrderPlaced",
            "order-7",
        )
        assert orjson.loads(stored.body) == {"order": 7}


def test_sns_is_publish_only_and_its_url_takes_the_sqs_parameters(run_relay):
    inbox = run_relay(
        "inbox", "--broker-url", "sns://", "--queue", "q", env={"AWS_DEFAULT_REGION": REGION}
    )
    assert inbox.returncode == 2, inbox.stderr
    assert "sns:// publishes only" in inbox.stderr and "Traceback" not in inbox.stderr
    assert len(inbox.stderr.strip().splitlines()) == 1
    demo = run_relay("demo", "--broker-url", "sns://", env={"AWS_DEFAULT_REGION": REGION})
    assert demo.returncode == 2, demo.stderr
    assert "sns:// publishes only" in demo.stderr and "Traceback" not in demo.stderr
    with pytest.raises(ConfigError, match="sns:// takes region and endpoint_url"):
        BrokerURL.parse("sns://?queue=x")
    parsed = BrokerURL.parse("sns://?region=eu-west-1&endpoint_url=http://localhost:4566")
    assert (parsed.kind, parsed.aws_region, parsed.aws_endpoint_url) == (
        "sns",
        "eu-west-1",
        "http://localhost:4566",
    )


# --------------------------------------------------------------------------
# Fan-out: one topic, two queues, two `relay inbox` processes
# --------------------------------------------------------------------------


def _stored(engine: sa.Engine, consumer: str) -> dict[str, tuple[Any, ...]]:
    return {
        m: (t, k, h, p)
        for m, t, k, h, p in rows(
            engine,
            "SELECT message_id, type, key, headers, payload FROM inbox WHERE consumer = :c",
            c=consumer,
        )
    }


def test_sns_fan_out_raw_and_enveloped_inboxes_store_the_same_rows(effects, sns, start_relay):
    topic = sns.name("fan")
    sns.topic(topic)
    raw_q = sns.subscribe(topic, sns.name("fan-raw"), raw=True)
    env_q = sns.subscribe(topic, sns.name("fan-env"), raw=False)
    store = bucket(sns)
    env = {
        **sns.env,
        "AWS_ENDPOINT_URL_S3": sns.endpoint,
        "RELAY_CLAIM_CHECK": f"s3://{store.name}",
        "RELAY_CLAIM_CHECK_OVER": "2000",
        "RELAY_POLL_INTERVAL": "0.5",
    }
    for queue in (raw_q, env_q):
        start_relay(
            "inbox", "--broker-url", "sqs://", "--queue", queue, "--handlers", HANDLERS, env=env
        ).wait_for_log("inbox started", timeout=30)

    def enqueue(start: int, count: int) -> list[str]:
        ids = []
        with effects.begin() as conn:
            for n in range(start, start + count):
                ids.append(
                    str(
                        relay.enqueue(
                            conn,
                            topic,
                            {"n": n, "note": "é ü \u2028", "blob": "x" * (3000 if n == 3 else 1)},
                            key=None if n % 7 == 0 else f"k{n % 3}",
                            type="Effect",
                            headers={} if n % 5 == 0 else {"traceparent": f"tp-{n}", "x-ü": "ü"},
                        )
                    )
                )
        return ids

    ids = enqueue(0, 12)  # waiting when the outbox starts
    with effects.begin() as conn:
        untyped = str(relay.enqueue(conn, topic, {"n": 99}))
    start_relay("outbox", "--broker-url", "sns://", env=env)
    ids += enqueue(12, 12)  # published as they come
    consumers = (raw_q, env_q)
    wait_until(
        lambda: all(len(_stored(effects, c)) == len(ids) + 1 for c in consumers),
        timeout=90,
        message="both inboxes hold every row",
    )
    raw, enveloped = (_stored(effects, c) for c in consumers)
    # No type: as any SQS message (the queue) raw, the topic's name enveloped.
    assert (raw.pop(untyped)[0], enveloped.pop(untyped)[0]) == (raw_q, topic)
    assert raw == enveloped
    published = {
        str(i): (t, k, h, p)
        for i, t, k, h, p in rows(effects, "SELECT id, type, key, headers, payload FROM outbox")
    }
    for message_id, (type_, key, headers, payload) in raw.items():
        assert (type_, key, payload) == (
            published[message_id][0],
            published[message_id][1],
            published[message_id][3],
        )
        assert headers.items() >= published[message_id][2].items()
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM effects")) == 2 * len(ids), timeout=60)


# --------------------------------------------------------------------------
# Hostile envelopes
# --------------------------------------------------------------------------

ARN = "arn:aws:sns:us-east-1:123456789012:"
texts = st.text(max_size=16)
good_values = st.one_of(
    st.tuples(st.just("String"), texts),
    st.tuples(st.just("Number"), st.integers().map(str)),
    st.tuples(st.just("Binary"), st.binary(max_size=8).map(lambda b: base64.b64encode(b).decode())),
    st.tuples(st.just("String.Array"), st.lists(texts, max_size=3).map(json.dumps)),
).map(lambda tv: {"Type": tv[0], "Value": tv[1]})
names = st.one_of(st.sampled_from(["message_id", "type", "key", "headers", "traceparent"]), texts)
good_attributes = st.dictionaries(names, good_values, max_size=5)
bad_values = st.one_of(
    st.none(),
    st.integers(),
    texts,
    st.lists(st.integers(), max_size=2),
    st.fixed_dictionaries({"Type": st.integers(), "Value": texts}),
    st.fixed_dictionaries({"Type": st.just("String"), "Value": st.integers()}),
    st.fixed_dictionaries({"Value": texts}),
    st.fixed_dictionaries({"Type": st.just("Binary"), "Value": st.just("not base64!")}),
    st.fixed_dictionaries({"Type": st.just("Decimal"), "Value": texts}),
)
messages = st.one_of(texts, st.dictionaries(texts, st.integers(), max_size=3).map(json.dumps))


@st.composite
def envelopes(draw: st.DrawFn, nonce: str = "") -> tuple[str, str, dict[str, Any]]:
    """(kind, SQS body, the envelope): `good` opens, `bad` is an envelope
    that cannot be opened, `cut` and `deep` are no JSON relay reads."""
    kind = draw(st.sampled_from(["good", "bad", "cut", "deep"]))
    envelope: dict[str, Any] = {
        "MessageId": nonce or draw(texts),
        "Type": "Notification",
        "TopicArn": ARN + draw(st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True)),
        "Message": draw(messages),
    }
    attributes = draw(st.one_of(st.none(), good_attributes))
    if attributes is not None:
        envelope["MessageAttributes"] = attributes
    if kind == "bad":
        defect = draw(st.sampled_from(["message", "arn", "attributes", "attribute"]))
        if defect == "message":
            envelope["Message"] = draw(st.one_of(st.none(), st.integers(), st.lists(texts)))
        elif defect == "arn":
            envelope["TopicArn"] = draw(st.one_of(st.none(), st.integers(), st.just(ARN)))
        elif defect == "attributes":
            envelope["MessageAttributes"] = draw(st.one_of(st.integers(), texts, st.lists(texts)))
        else:
            envelope["MessageAttributes"] = {
                **(attributes or {}),
                draw(texts): draw(bad_values),
            }
    if kind == "deep":
        depth = draw(st.integers(1100, 3000))
        envelope["MessageAttributes"] = {"x": json.loads("[" * 10 + "]" * 10)}
        text = json.dumps(envelope).replace("[[[[[[[[[[]]]]]]]]]]", "[" * depth + "]" * depth)
        return kind, text, envelope
    text = json.dumps(envelope)
    if kind == "cut":
        start = len(json.dumps({"MessageId": envelope["MessageId"]})) - 1
        text = text[: draw(st.integers(start, len(text) - 1))]
    return kind, text, envelope


def _value(attributes: dict[str, Any] | None, name: str) -> str | None:
    found = (attributes or {}).get(name)
    if found and found["Type"].startswith(("String", "Number")) and found["Value"]:
        return str(found["Value"])
    return None


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(envelopes())
def test_any_envelope_opens_as_sns_meant_or_is_kept_whole_and_dead(drawn):
    kind, text, envelope = drawn
    incoming = to_incoming({"Body": text, "ReceiptHandle": "rh"}, "q")
    stored = to_row(incoming)  # never raises: one message, one row
    if kind == "good":
        attributes = envelope.get("MessageAttributes")
        assert incoming.undecodable is None
        assert incoming.body == envelope["Message"].encode()
        assert incoming.message_id == _value(attributes, "message_id")
        assert incoming.key == _value(attributes, "key")
        assert incoming.type == (
            _value(attributes, "type") or envelope["TopicArn"].rpartition(":")[2]
        )
        return
    assert incoming.body == text.encode() and incoming.message_id is None
    assert stored.status == "dead" and stored.last_error
    if kind == "bad" or incoming.undecodable is not None:
        # Deep nesting some parser still reads is a malformed attribute.
        assert kind in ("bad", "deep") and "SNS notification" in stored.last_error
    else:
        assert kind in ("cut", "deep") and incoming.type == "q"


def test_an_envelope_is_only_opened_from_a_body_without_attributes():
    text = json.dumps({"Type": "Notification", "TopicArn": ARN + "t", "Message": "{}"})
    attributes = {"message_id": {"DataType": "String", "StringValue": "m"}}
    sent = to_incoming({"Body": text, "ReceiptHandle": "rh", "MessageAttributes": attributes}, "q")
    assert (sent.body, sent.message_id, sent.type) == (text.encode(), "m", "q")
    assert open_notification('{"Type": "Notification", "Message": "x"}') is None  # no TopicArn
    # A lone surrogate escape: JSON, but no UTF-8; opened, then dead for it.
    lone = to_incoming({"Body": text.replace('"{}"', '"\\ud800"'), "ReceiptHandle": "rh"}, "q")
    assert lone.undecodable is None and lone.type == "t"
    stored = to_row(lone)
    assert stored.status == "dead" and "UTF-8" in (stored.last_error or "")


async def test_hostile_envelopes_through_a_queue_each_become_one_row(engine, sns, start_relay):
    queue = sns.name("hostile")
    url = sns.sqs.create(queue)
    daemon = start_relay(
        "inbox",
        "--broker-url",
        "sqs://",
        "--queue",
        queue,
        "--handlers",
        HANDLERS,
        "--max-attempts",
        "1",
        env=sns.env,
    )
    daemon.wait_for_log("inbox started", timeout=30)
    sent = {"all": 0, "bad": 0, "deep": 0}

    def count(sql: str) -> int:
        return int(rows(engine, sql, c=queue)[0][0])

    @settings(
        max_examples=3,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def example(data: st.DataObject) -> None:
        drawn = []
        for _ in range(8):
            nonce = uuid.uuid4().hex
            kind, text, envelope = data.draw(envelopes(nonce))
            if kind == "good":  # a unique id: no two of them one row by their Message
                attributes = envelope.setdefault("MessageAttributes", {})
                chosen = _value(attributes, "message_id") or ""
                attributes["message_id"] = {"Type": "String", "Value": nonce + chosen}
                text = json.dumps(envelope)
            drawn.append((kind, text))
        for kind, text in drawn:
            sns.sqs.client.send_message(QueueUrl=url, MessageBody=text)
            sent["all"] += 1
            sent["bad"] += kind == "bad"
            sent["deep"] += kind == "deep"
        wait_until(
            lambda: count("SELECT count(*) FROM inbox WHERE consumer = :c") == sent["all"],
            timeout=60,
            message=f"{sent['all']} rows",
        )
        assert daemon.proc.poll() is None, daemon.log

    await asyncio.to_thread(example)
    wait_until(lambda: sns.sqs.count(queue) == 0, timeout=30, message="the queue drained")
    assert count("SELECT count(*) FROM inbox WHERE consumer = :c") == sent["all"]
    unopened = count(
        "SELECT count(*) FROM inbox WHERE consumer = :c AND status = 'dead' "
        "AND last_error LIKE '%SNS notification%'"
    )
    assert sent["bad"] <= unopened <= sent["bad"] + sent["deep"]
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log


def test_the_sha256_of_an_opened_message_is_of_its_message_not_the_envelope():
    text = json.dumps({"Type": "Notification", "TopicArn": ARN + "t", "Message": '{"a": 1}'})
    stored = to_row(to_incoming({"Body": text, "ReceiptHandle": "rh"}, "q"))
    assert stored.message_id == "sha256:" + hashlib.sha256(b'{"a": 1}').hexdigest()
    assert (stored.status, stored.type, stored.payload) == ("pending", "t", '{"a": 1}')


def test_sns_errors_name_the_topic():
    from relay.brokers import aws

    error = botocore.exceptions.ClientError(
        {"Error": {"Code": "NotFound", "Message": "Topic does not exist"}}, "PublishBatch"
    )
    failure = aws.call_failure(error, "t", "SNS", "SNS topic", frozenset({"NotFound"}), frozenset())
    assert failure == Failure("SNS topic 't' does not exist")
