"""No single message stops relay: each hostile case is kept as one row, and the rest flows.

The cases are what real clients can send (pika, amqplib, kombu, boto3 and
hand-written frames): NUL characters and invalid UTF-8 in every string the
inbox stores, header tables of odd types, timestamps that are no date,
JSON nested past any parser's limit, keys past PostgreSQL's index limit.
Each is followed by a well-formed message that must be handled; the
generated suite (tests/test_generated.py) covers the same ground at random.
"""

from __future__ import annotations

import base64
import json
import time

import orjson

from tests import amqp_raw
from tests.conftest import rows, wait_until
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures


def effect_ids(engine):
    return [r[0] for r in rows(engine, "SELECT message_id FROM effects ORDER BY id")]


async def raw_channel(rabbit):
    channel = await rabbit.connection.channel(publisher_confirms=False)
    await channel.declare_exchange(rabbit.exchange, "topic", durable=True)
    return await channel.get_underlay_channel()


def stored(engine):
    return rows(engine, "SELECT message_id, status, topic, key, type, payload, headers, "
                        "last_error, raw_properties, body FROM inbox ORDER BY seq")


# name, routing key, properties, body, what last_error must say (None: not dead)
CASES = [
    ("nul-header-value", "t", {"message_id": "nul-header-value",
                               "headers": {"h": ("S", "a\x00b")}}, b"{}", "NUL"),
    ("nul-header-name", "t", {"message_id": "nul-header-name",
                              "headers": {"h\x00": ("S", "v")}}, b"{}", "NUL"),
    ("nul-nested", "t", {"message_id": "nul-nested",
                         "headers": {"t": ("F", {"in": ("A", [("S", "x\x00")])})}}, b"{}", "NUL"),
    (None, "t", {"message_id": "nul\x00id"}, b"{}", "message_id contains a NUL"),
    ("nul-type", "t", {"message_id": "nul-type", "type": "Ty\x00pe"}, b"{}", "type contains"),
    ("nul-routing-key", "t\x00k", {"message_id": "nul-routing-key"}, b"{}", "topic contains"),
    ("nul-key", "t", {"message_id": "nul-key", "headers": {"x-relay-key": ("S", "k\x00")}},
     b"{}", "key (x-relay-key) contains"),
    (None, "t", {"message_id": b"bad\xff\xfeid"}, b"{}", "message_id is not valid UTF-8"),
    ("utf8-type", "t", {"message_id": "utf8-type", "type": b"T\xc3"}, b"{}",
     "type is not valid UTF-8"),
    ("utf8-header-name", "t", {"message_id": "utf8-header-name",
                               "headers": {b"h\xff": ("S", "v")}}, b"{}", "not valid UTF-8"),
    ("utf8-header-value", "t", {"message_id": "utf8-header-value",
                                "headers": {"h": ("S", b"\xff")}}, b"{}", "not valid UTF-8"),
    ("utf8-routing-key", b"t\xff", {"message_id": "utf8-routing-key"}, b"{}",
     "topic is not valid UTF-8"),
    ("timestamp-past-9999", "t", {"message_id": "timestamp-past-9999", "type": "Effect",
                                  "timestamp": 2**63 - 1}, b"{}", None),
    ("deep-body", "t", {"message_id": "deep-body", "type": "Effect"},
     b"[" * 1100 + b"]" * 1100, "nested 1100 levels"),
    ("deep-body-big-int", "t", {"message_id": "deep-body-big-int", "type": "Effect"},
     b"[" * 1100 + b"123456789012345678901234567890" + b"]" * 1100, "nested 1100 levels"),
    ("long-key", "t", {"message_id": "long-key", "type": "Effect",
                       "headers": {"x-relay-key": ("S", "k" * 10_000)}}, b"{}",
     "longer than relay's limit"),
    ("byte-array-header", "t", {"message_id": "byte-array-header", "type": "Effect",
                                "headers": {"b": ("x", b"bytes"), "bin": ("x", b"\xff\x00")}},
     b"{}", None),
    ("deep-headers", "t", {"message_id": "deep-headers", "type": "Effect",
                           "headers": {"d": ("F", {})}}, b"{}", "nested deeper"),
]


async def test_every_hostile_delivery_is_one_row_and_the_rest_is_handled(
        effects, rabbit, inbox):
    daemon = inbox()
    channel = await raw_channel(rabbit)
    for name, routing_key, properties, body, _ in CASES:
        properties = dict(properties)
        if name == "deep-headers":
            properties["headers"] = {"d": amqp_raw.deep_table_value(300)}
        await amqp_raw.publish(channel, rabbit.exchange, routing_key, body, **properties)
    await amqp_raw.publish(channel, rabbit.exchange, "t", b"{}", message_id="canary",
                           type="Effect")
    wait_until(lambda: "canary" in effect_ids(effects), timeout=30)
    assert daemon.proc.poll() is None, daemon.log

    found = stored(effects)
    assert len(found) == len(CASES) + 1, [r[0] for r in found]
    for (name, _, _, body, reason), row in zip(CASES, found, strict=False):
        message_id, status, topic, key, type_, payload, headers, error, raw, kept = row
        if name is not None:
            assert message_id == name
        if reason is None:
            assert status in ("processed", "pending", "dead") and message_id == name
            continue
        assert status == "dead", (name, row)
        assert reason in error, (name, row[:5], error)
        for text in (message_id, topic, key, type_, error, json.dumps(headers)):
            assert text is None or "\x00" not in text
    by_id = {r[0]: r for r in found}

    # Bytes a byte array carries come back as text, or as base64 when they
    # are not UTF-8 (or hold a NUL): never as a Python repr.
    headers = by_id["byte-array-header"][6]
    assert headers["b"] == "bytes" and headers["bin"] == {"base64": base64.b64encode(
        b"\xff\x00").decode()}
    # The properties as received: the content header's exact bytes.
    raw = by_id["nul-type"][8]
    assert raw["routing_key"] == "t"
    header = base64.b64decode(raw["content_header"]["base64"])
    assert b"Ty\x00pe" in header
    # A key past the index limit: the row is kept, its key column left empty.
    assert by_id["long-key"][3] is None
    assert b"k" * 10_000 in base64.b64decode(by_id["long-key"][8]["content_header"]["base64"])
    # A body nested too deep keeps its raw bytes.
    assert bytes(by_id["deep-body"][9]) == b"[" * 1100 + b"]" * 1100
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log
    depth = await (await rabbit.connection.channel()).declare_queue(daemon.queue, passive=True)
    assert depth.declaration_result.message_count == 0


async def test_pending_rows_that_no_handler_can_be_given_go_dead_and_the_rest_run(
        effects, rabbit, inbox):
    """Rows stored by hand (or by an older relay) that the dispatcher cannot
    decode fail only themselves, on the first try, and never crash it."""
    consumer = f"{rabbit.exchange}.in"
    deep_big = "[" * 1100 + "123456789012345678901234567890" + "]" * 1100
    rows(effects, "INSERT INTO inbox (consumer, message_id, type, payload) VALUES "
                  "(:c, 'deep-big', 'Effect', CAST(:p AS jsonb)), "
                  "(:c, 'after', 'Effect', '{}')", c=consumer, p=deep_big)
    daemon = inbox()
    wait_until(lambda: effect_ids(effects) == ["after"])
    status, attempts, error = rows(
        effects, "SELECT status, attempts, last_error FROM inbox WHERE message_id = 'deep-big'")[0]
    assert (status, attempts) == ("dead", 1)
    assert "nested 1100 levels" in error
    time.sleep(0.5)
    assert daemon.proc.poll() is None, daemon.log


async def test_a_handler_error_holding_a_nul_is_recorded(effects, rabbit, inbox):
    """last_error is text PostgreSQL takes, whatever the exception said."""
    inbox()
    await rabbit.publish("t", orjson.dumps({"message": "bad<NUL>news"}), message_id="nul-error",
                         type="RaisesPayloadMessage")
    await rabbit.publish("t", b"{}", message_id="after", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["after"])
    wait_until(lambda: rows(effects, "SELECT attempts FROM inbox "
                                     "WHERE message_id = 'nul-error'")[0][0] >= 1)
    error = rows(effects, "SELECT last_error FROM inbox WHERE message_id = 'nul-error'")[0][0]
    assert "bad\\x00news" in error


def test_a_content_header_pamqp_cannot_decode_becomes_an_empty_one_that_says_why():
    """RabbitMQ passes on what pamqp refuses (invalid UTF-8, timestamps past
    year 9999) but drops some of what it cannot parse itself, so the last
    fallback (a table nested past Python's recursion limit) is proved here,
    on the decoding function alone."""
    from pamqp import frame

    from relay.brokers import amqp_lenient

    amqp_lenient.install()
    lenient = amqp_raw.frame(2, 1, amqp_raw.content_header(
        2, message_id=b"id\xff", timestamp=2**63 - 1, headers={b"n\xfe": ("S", "v")}))
    _, _, header = frame.unmarshal(lenient)
    assert header.properties.message_id == "id\udcff"  # lossless: surrogate escapes
    assert header.properties.timestamp == 2**63 - 1
    assert header.properties.headers == {"n\udcfe": "v"}
    assert header.relay_raw.endswith(b"v")

    deep = amqp_raw.content_header(2, message_id="deep",
                                   headers={"d": amqp_raw.deep_table_value(3000)})
    _, _, header = frame.unmarshal(amqp_raw.frame(2, 1, deep))
    assert header.body_size == 2 and header.properties.message_id is None
    assert "RecursionError" in header.relay_undecodable
    assert header.relay_raw == deep


def _attrs(**values):
    return {name: {"DataType": "String", "StringValue": value} for name, value in values.items()}


async def test_sqs_messages_whose_attributes_cannot_be_stored_are_kept_dead(
        effects, sqs, start_relay):
    """The same rule through SQS: a `headers` attribute whose JSON holds a NUL
    (\\u0000) or nests too deep, an id or key past the index limit, binary
    attributes; each one row, the canary handled, the queue left empty."""
    queue = sqs.name("poison")
    sqs.create(queue)
    cases = [
        ("nul-header", _attrs(message_id="nul-header", type="Effect",
                              headers='{"h": "a\\u0000b"}'), "NUL"),
        ("deep-headers", _attrs(message_id="deep-headers", type="Effect",
                                headers="[" * 300 + "]" * 300), None),
        ("deep-object-headers", _attrs(message_id="deep-object-headers", type="Effect",
                                       headers='{"a":' * 300 + "1" + "}" * 300), "nested deeper"),
        (None, _attrs(message_id="i" * 2000, type="Effect"), "message_id is longer"),
        ("long-key", _attrs(message_id="long-key", type="Effect", key="k" * 10_000),
         "key (x-relay-key) is longer"),
        ("binary", {**_attrs(message_id="binary", type="Effect"),
                    "blob": {"DataType": "Binary", "BinaryValue": b"\xff\x00"}}, None),
    ]
    for _, attributes, _ in cases:
        sqs.client.send_message(QueueUrl=sqs.urls[queue], MessageBody="{}",
                                MessageAttributes=attributes)
    sqs.client.send_message(QueueUrl=sqs.urls[queue], MessageBody="{}",
                            MessageAttributes=_attrs(message_id="canary", type="Effect"))
    daemon = start_relay("inbox", "--queue", queue, "--handlers",
                         "tests.apps.handlers:registry",
                         env={"RELAY_BROKER_URL": "sqs://", **sqs.env})
    wait_until(lambda: "canary" in effect_ids(effects), timeout=60)
    found = {r[0]: r for r in stored(effects)}
    assert len(found) == len(cases) + 1, sorted(found)
    for name, _, reason in cases:
        if name is None:
            [row] = [r for r in found.values() if r[0].startswith("id-sha256:")]
        else:
            row = found[name]
        if reason is None:
            wait_until(lambda name=name: rows(
                effects, "SELECT status FROM inbox WHERE message_id = :m",
                m=name)[0][0] == "processed")
            continue
        assert row[1] == "dead" and reason in row[7], (name, row[7])
        assert row[8]["message_attributes"]["message_id"]["StringValue"] == (name or "i" * 2000)
    assert found["long-key"][3] is None
    assert found["nul-header"][8]["message_attributes"]["headers"]["StringValue"] == \
        '{"h": "a\\u0000b"}'
    assert daemon.proc.poll() is None, daemon.log
    daemon.stop()
    assert daemon.proc.returncode == 0
    wait_until(lambda: sqs.count(queue) == 0, timeout=30)
