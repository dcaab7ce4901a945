"""No single message stops relay: each hostile case is kept as one row, and the rest flows.

The cases are what real clients can send (pika, amqplib, kombu, boto3 and
hand-written frames): NUL characters and invalid UTF-8 in every string the
inbox stores, header tables of odd types, timestamps that are no date,
JSON nested past any parser's limit, keys past PostgreSQL's index limit.
Each is followed by a well-formed message that must be handled; the
generated suite (tests/e2e/test_generated.py) covers the same ground at random.
"""

from __future__ import annotations

import base64
import json
import re
import time

import hypothesis
import orjson
import pytest
import sqlalchemy as sa
from hypothesis import strategies as st

import relay
from relay import storable
from tests import amqp_raw
from tests.conftest import effect_ids, rows, wait_until
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures


async def raw_channel(rabbit):
    channel = await rabbit.connection.channel(publisher_confirms=False)
    await channel.declare_exchange(rabbit.exchange, "topic", durable=True)
    return await channel.get_underlay_channel()


def stored(engine):
    return rows(
        engine,
        "SELECT message_id, status, topic, key, type, payload, headers, "
        "last_error, raw_properties, body FROM inbox ORDER BY seq",
    )


# name, routing key, properties, body, what last_error must say (None: not dead)
CASES = [
    (
        "nul-header-value",
        "t",
        {"message_id": "nul-header-value", "headers": {"h": ("S", "a\x00b")}},
        b"{}",
        "NUL",
    ),
    (
        "nul-header-name",
        "t",
        {"message_id": "nul-header-name", "headers": {"h\x00": ("S", "v")}},
        b"{}",
        "NUL",
    ),
    (
        "nul-nested",
        "t",
        {"message_id": "nul-nested", "headers": {"t": ("F", {"in": ("A", [("S", "x\x00")])})}},
        b"{}",
        "NUL",
    ),
    (None, "t", {"message_id": "nul\x00id"}, b"{}", "message_id contains a NUL"),
    ("nul-type", "t", {"message_id": "nul-type", "type": "Ty\x00pe"}, b"{}", "type contains"),
    ("nul-routing-key", "t\x00k", {"message_id": "nul-routing-key"}, b"{}", "topic contains"),
    (
        "nul-key",
        "t",
        {"message_id": "nul-key", "headers": {"x-relay-key": ("S", "k\x00")}},
        b"{}",
        "key (x-relay-key) contains",
    ),
    (None, "t", {"message_id": b"bad\xff\xfeid"}, b"{}", "message_id is not valid UTF-8"),
    (
        "utf8-type",
        "t",
        {"message_id": "utf8-type", "type": b"T\xc3"},
        b"{}",
        "type is not valid UTF-8",
    ),
    (
        "utf8-header-name",
        "t",
        {"message_id": "utf8-header-name", "headers": {b"h\xff": ("S", "v")}},
        b"{}",
        "not valid UTF-8",
    ),
    (
        "utf8-header-value",
        "t",
        {"message_id": "utf8-header-value", "headers": {"h": ("S", b"\xff")}},
        b"{}",
        "not valid UTF-8",
    ),
    (
        "utf8-routing-key",
        b"t\xff",
        {"message_id": "utf8-routing-key"},
        b"{}",
        "topic is not valid UTF-8",
    ),
    (
        "timestamp-past-9999",
        "t",
        {"message_id": "timestamp-past-9999", "type": "Effect", "timestamp": 2**63 - 1},
        b"{}",
        None,
    ),
    (
        "deep-body",
        "t",
        {"message_id": "deep-body", "type": "Effect"},
        b"[" * 1100 + b"]" * 1100,
        "nested 1100 levels",
    ),
    (
        "deep-body-big-int",
        "t",
        {"message_id": "deep-body-big-int", "type": "Effect"},
        b"[" * 1100 + b"123456789012345678901234567890" + b"]" * 1100,
        "nested 1100 levels",
    ),
    (
        "long-key",
        "t",
        {
            "message_id": "long-key",
            "type": "Effect",
            "headers": {"x-relay-key": ("S", "k" * 10_000)},
        },
        b"{}",
        "longer than relay's limit",
    ),
    (
        "byte-array-header",
        "t",
        {
            "message_id": "byte-array-header",
            "type": "Effect",
            "headers": {"b": ("x", b"bytes"), "bin": ("x", b"\xff\x00")},
        },
        b"{}",
        None,
    ),
    (
        "deep-headers",
        "t",
        {"message_id": "deep-headers", "type": "Effect", "headers": {"d": ("F", {})}},
        b"{}",
        "nested deeper",
    ),
]


async def test_every_hostile_delivery_is_one_row_and_the_rest_is_handled(effects, rabbit, inbox):
    daemon = inbox()
    channel = await raw_channel(rabbit)
    for name, routing_key, given, body, _ in CASES:
        properties = dict(given)
        if name == "deep-headers":
            properties["headers"] = {"d": amqp_raw.deep_table_value(300)}
        await amqp_raw.publish(channel, rabbit.exchange, routing_key, body, **properties)
    await amqp_raw.publish(channel, rabbit.exchange, "t", b"{}", message_id="canary", type="Effect")
    wait_until(lambda: "canary" in effect_ids(effects), timeout=30)
    assert daemon.proc.poll() is None, daemon.log

    wait_until(lambda: len(stored(effects)) == len(CASES) + 1, timeout=30)
    found = stored(effects)
    # Each case's row by its id (the rows of different keys need not be in
    # publishing order: a batch's keys are stored side by side).
    by_id = {r[0]: r for r in found}
    unnamed = [r for r in found if r[0] not in {case[0] for case in CASES} | {"canary"}]
    for name, _, _, _, reason in CASES:
        # A case without a name has an id relay made: found by its reason.
        row = (
            by_id[name]
            if name is not None
            else next(r for r in unnamed if reason is not None and reason in (r[7] or ""))
        )
        message_id, status, topic, key, type_, _payload, headers, error, raw, _kept = row
        if reason is None:
            assert status in ("processed", "pending", "dead") and message_id == name
            continue
        assert status == "dead", (name, row)
        assert reason in error, (name, row[:5], error)
        for text in (message_id, topic, key, type_, error, json.dumps(headers)):
            assert text is None or "\x00" not in text

    # Bytes a byte array carries come back as text, or as base64 when they
    # are not UTF-8 (or hold a NUL): never as a Python repr.
    headers = by_id["byte-array-header"][6]
    assert headers["b"] == "bytes" and headers["bin"] == {
        "base64": base64.b64encode(b"\xff\x00").decode()
    }
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
    effects, rabbit, inbox
):
    """Rows stored by hand (or by an older relay) that the dispatcher cannot
    decode fail only themselves, on the first try, and never crash it."""
    consumer = f"{rabbit.exchange}.in"
    deep_big = "[" * 1100 + "123456789012345678901234567890" + "]" * 1100
    rows(
        effects,
        "INSERT INTO inbox (consumer, message_id, type, payload) VALUES "
        "(:c, 'deep-big', 'Effect', CAST(:p AS jsonb)), "
        "(:c, 'after', 'Effect', '{}')",
        c=consumer,
        p=deep_big,
    )
    daemon = inbox()
    wait_until(lambda: effect_ids(effects) == ["after"])
    status, attempts, error = rows(
        effects, "SELECT status, attempts, last_error FROM inbox WHERE message_id = 'deep-big'"
    )[0]
    assert (status, attempts) == ("dead", 1)
    assert "nested 1100 levels" in error
    time.sleep(0.5)
    assert daemon.proc.poll() is None, daemon.log


async def test_a_handler_error_holding_a_nul_is_recorded(effects, rabbit, inbox):
    """last_error is text PostgreSQL takes, whatever the exception said."""
    inbox()
    await rabbit.publish(
        "t",
        orjson.dumps({"message": "bad<NUL>news"}),
        message_id="nul-error",
        type="RaisesPayloadMessage",
    )
    await rabbit.publish("t", b"{}", message_id="after", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["after"])
    wait_until(
        lambda: (
            rows(effects, "SELECT attempts FROM inbox WHERE message_id = 'nul-error'")[0][0] >= 1
        )
    )
    error = rows(effects, "SELECT last_error FROM inbox WHERE message_id = 'nul-error'")[0][0]
    assert "bad\\x00news" in error


def test_a_content_header_pamqp_cannot_decode_becomes_an_empty_one_that_says_why():
    """RabbitMQ passes on what pamqp refuses (invalid UTF-8, timestamps past
    year 9999) but drops some of what it cannot parse itself, so the last
    fallback (a table nested past Python's recursion limit) is proved here,
    on the decoding function alone."""
    from pamqp import frame

    from relay.brokers.amqp import lenient as amqp_lenient

    amqp_lenient.install()
    lenient = amqp_raw.frame(
        2,
        1,
        amqp_raw.content_header(
            2, message_id=b"id\xff", timestamp=2**63 - 1, headers={b"n\xfe": ("S", "v")}
        ),
    )
    _, _, header = frame.unmarshal(lenient)
    assert header.properties.message_id == "id\udcff"  # lossless: surrogate escapes
    assert header.properties.timestamp == 2**63 - 1
    assert header.properties.headers == {"n\udcfe": "v"}
    assert b"\x02n\xfeS\x00\x00\x00\x01v" in header.relay_raw

    deep = amqp_raw.content_header(
        2, message_id="deep", headers={"d": amqp_raw.deep_table_value(3000)}
    )
    _, _, header = frame.unmarshal(amqp_raw.frame(2, 1, deep))
    assert header.body_size == 2 and header.properties.message_id is None
    assert "RecursionError" in header.relay_undecodable
    assert header.relay_raw == deep


def _attrs(**values):
    return {name: {"DataType": "String", "StringValue": value} for name, value in values.items()}


async def test_sqs_messages_whose_attributes_cannot_be_stored_are_kept_dead(
    effects, sqs, start_relay
):
    """The same rule through SQS: a `headers` attribute whose JSON holds a NUL
    (\\u0000) or nests too deep, an id or key past the index limit, binary
    attributes; each one row, the canary handled, the queue left empty."""
    queue = sqs.name("poison")
    sqs.create(queue)
    cases = [
        (
            "nul-header",
            _attrs(message_id="nul-header", type="Effect", headers='{"h": "a\\u0000b"}'),
            "NUL",
        ),
        (
            "deep-headers",
            _attrs(message_id="deep-headers", type="Effect", headers="[" * 300 + "]" * 300),
            None,
        ),
        (
            "deep-object-headers",
            _attrs(
                message_id="deep-object-headers",
                type="Effect",
                headers='{"a":' * 300 + "1" + "}" * 300,
            ),
            "nested deeper",
        ),
        (None, _attrs(message_id="i" * 2000, type="Effect"), "message_id is longer"),
        (
            "long-key",
            _attrs(message_id="long-key", type="Effect", key="k" * 10_000),
            "key (x-relay-key) is longer",
        ),
        (
            "binary",
            {
                **_attrs(message_id="binary", type="Effect"),
                "blob": {"DataType": "Binary", "BinaryValue": b"\xff\x00"},
            },
            None,
        ),
    ]
    for _, attributes, _ in cases:
        sqs.client.send_message(
            QueueUrl=sqs.urls[queue], MessageBody="{}", MessageAttributes=attributes
        )
    sqs.client.send_message(
        QueueUrl=sqs.urls[queue],
        MessageBody="{}",
        MessageAttributes=_attrs(message_id="canary", type="Effect"),
    )
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--handlers",
        "tests.apps.handlers:registry",
        env={"RELAY_BROKER_URL": "sqs://", **sqs.env},
    )
    wait_until(lambda: "canary" in effect_ids(effects), timeout=60)
    # Every row, not only the canary's: a batch's keys are stored side by side.
    wait_until(lambda: len(stored(effects)) == len(cases) + 1, timeout=30)
    found = {r[0]: r for r in stored(effects)}
    for name, _, reason in cases:
        if name is None:
            [row] = [r for r in found.values() if r[0].startswith("id-sha256:")]
        else:
            row = found[name]
        if reason is None:
            wait_until(
                lambda name=name: (
                    rows(effects, "SELECT status FROM inbox WHERE message_id = :m", m=name)[0][0]
                    == "processed"
                )
            )
            continue
        assert row[1] == "dead" and reason in row[7], (name, row[7])
        assert row[8]["message_attributes"]["message_id"]["StringValue"] == (name or "i" * 2000)
    assert found["long-key"][3] is None
    assert (
        found["nul-header"][8]["message_attributes"]["headers"]["StringValue"]
        == '{"h": "a\\u0000b"}'
    )
    assert daemon.proc.poll() is None, daemon.log
    daemon.stop()
    assert daemon.proc.returncode == 0
    wait_until(lambda: sqs.count(queue) == 0, timeout=30)


# --------------------------------------------------------------------------
# The outbox: enqueue refuses what relay cannot carry; rows that reach the
# table anyway fail only themselves
# --------------------------------------------------------------------------


def _nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"topic": "t\x00"}, "topic contains a NUL"),
        ({"key": "k" * 1025}, "key is longer than 1024 bytes"),
        ({"key": "k\ud800"}, "key is not valid UTF-8"),
        ({"type": "T" * 256}, "type is longer than 255 bytes"),
        ({"topic": "t" * 256}, "topic is longer than 255 bytes"),
        ({"headers": {"h" * 256: "v"}}, "longer than 255 bytes"),
        ({"headers": {"h": "v\x00"}}, "header 'h' contains a NUL"),
        ({"payload": {"a": "\x00"}}, "a string in the payload contains a NUL"),
        ({"payload": {"\x00": 1}}, "a key in the payload contains a NUL"),
        ({"payload": [float("nan")]}, "JSON cannot carry"),
        ({"payload": {"x": float("inf")}}, "JSON cannot carry"),
        ({"payload": _nested(513)}, "nested more than 512 levels"),
    ],
)
def test_enqueue_refuses_what_relay_cannot_carry_and_writes_nothing(engine, arguments, says):
    call = {"topic": "t", "payload": {}, **arguments}
    with engine.begin() as conn, pytest.raises(ValueError, match=re.escape(says)):
        relay.enqueue(conn, call.pop("topic"), call.pop("payload"), **call)
    assert rows(engine, "SELECT count(*) FROM outbox")[0][0] == 0


def test_enqueue_takes_what_relay_can_carry_at_its_limits(engine):
    with engine.begin() as conn:
        relay.enqueue(
            conn,
            "t" * 255,
            _nested(512),
            key="k" * 1024,
            type="T" * 255,
            headers={"h" * 255: "v" * 10_000},
        )
    assert rows(engine, "SELECT count(*) FROM outbox")[0][0] == 1


async def test_outbox_once_fails_only_the_rows_it_cannot_carry(engine, rabbit, run_relay):
    """Rows written by plain SQL that no broker can carry: each dead with a
    reason, every other row of the batch published and marked, exit 0."""
    queue = await rabbit.queue("#")
    deep_300 = json.dumps(_nested(300, {"n": 12345678901234567890123}))
    deep_1100 = "[" * 1100 + "1" + "]" * 1100
    bad = {
        "deep-1100": ("t", None, deep_1100, "{}", "nested 1100 levels"),
        "headers-array": ("t", None, "{}", "[1]", "headers must be a JSON object"),
        "header-number": ("t", None, "{}", '{"h": 1}', "headers must be strings"),
        "long-topic": ("t" * 300, None, "{}", "{}", "longer than 255 bytes"),
        "held-head": ("t", "held", deep_1100, "{}", "nested 1100 levels"),
    }
    with engine.begin() as conn:
        relay.enqueue(conn, "t", {"n": 1})
        for name, (topic, key, payload, headers, _) in bad.items():
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (topic, key, type, payload, headers) "
                    "VALUES (:topic, :key, :type, CAST(:payload AS jsonb), CAST(:headers AS jsonb))"
                ),
                {"topic": topic, "key": key, "type": name, "payload": payload, "headers": headers},
            )
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, type, payload) "
                "VALUES ('t', 'deep-300', CAST(:p AS jsonb))"
            ),
            {"p": deep_300},
        )
        relay.enqueue(conn, "t", {"n": 2}, key="held", type="after-held-head")
        relay.enqueue(conn, "t", {"n": 3})
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange)
    assert result.returncode == 0, result.stderr
    got = await rabbit.drain(queue, 4)
    # Rows without a key (or of other keys) have no order between them: the
    # workers split them by hash. The row behind the dead head of its key
    # went out once the head was settled (dead: under --on-dead skip its key
    # goes on).
    assert sorted(m.type or "" for m in got) == ["", "", "after-held-head", "deep-300"]
    deep = next(m for m in got if m.type == "deep-300")
    assert deep.body == deep_300.replace(" ", "").encode()  # compact, the big number exact
    status = {
        t: (s, e)
        for t, s, e in rows(
            engine, "SELECT type, status, last_error FROM outbox WHERE type IS NOT NULL"
        )
    }
    for name, (*_, says) in bad.items():
        assert status[name][0] == "dead" and says in status[name][1], (name, status[name])
    assert status["after-held-head"][0] == "published"
    assert status["deep-300"][0] == "published"


# --------------------------------------------------------------------------
# Per-key order after a failure: the key goes head first and alone
# --------------------------------------------------------------------------


async def _rejecting_queue(rabbit, pattern: str):
    """A queue that nacks every publish routed to it (length 0, reject-publish)."""
    channel = await rabbit.connection.channel()
    exchange = await channel.declare_exchange(rabbit.exchange, "topic", durable=True)
    queue = await channel.declare_queue(
        f"{rabbit.exchange}.rejecting",
        durable=True,
        arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
    )
    rabbit.queues.append(queue.name)
    await queue.bind(exchange, pattern)
    return channel, queue


def _outbox(engine, key):
    return rows(
        engine, "SELECT id, status, attempts FROM outbox WHERE key = :k ORDER BY seq", k=key
    )


@pytest.mark.parametrize("on_dead", ["skip", "block"])
async def test_a_key_whose_head_keeps_failing_holds_its_later_rows(
    engine, rabbit, start_relay, run_relay, on_dead
):
    """The head of key k is nacked again and again; rows of k committed after
    its first failure wait (other keys flow), and once the head goes out
    (fixed, or retried from dead) the key resumes in order."""
    channel, rejecting = await _rejecting_queue(rabbit, "stuck")
    ok = await rabbit.queue("later", "other")
    with engine.begin() as conn:
        head = relay.enqueue(conn, "stuck", {"n": 1}, key="k")
    daemon = start_relay(
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--poll-interval",
        "0.2",
        "--backoff-min",
        "0.2",
        "--backoff-max",
        "0.3",
        "--on-dead",
        on_dead,
        "--max-attempts",
        "4" if on_dead == "block" else "1000",
    )
    wait_until(lambda: _outbox(engine, "k")[0][2] >= 1)
    with engine.begin() as conn:
        later = [relay.enqueue(conn, "later", {"n": n}, key="k") for n in (2, 3)]
        relay.enqueue(conn, "other", {"n": 4}, key="other")
    [other] = await rabbit.drain(ok, 1)  # other keys flow
    assert orjson.loads(other.body) == {"n": 4}
    wait_until(lambda: _outbox(engine, "k")[0][2] >= 3)  # two more failures of the head
    assert await ok.get(fail=False) is None  # and none of k's later rows went out
    assert [r[1:] for r in _outbox(engine, "k")[1:]] == [("pending", 0), ("pending", 0)]

    if on_dead == "block":  # dead after 4 attempts: the key stays held
        wait_until(lambda: _outbox(engine, "k")[0][1] == "dead")
        time.sleep(0.5)
        assert [r[1:] for r in _outbox(engine, "k")[1:]] == [("pending", 0), ("pending", 0)]
    # Fix the route: the head goes out on its next try (under block, once
    # `relay retry` sends it again), then the rest of its key, in order.
    fixed = await rabbit.queue("stuck", "later")
    await rejecting.delete(if_unused=False, if_empty=False)
    rabbit.queues.remove(rejecting.name)
    await channel.close()
    if on_dead == "block":
        assert run_relay("retry", "outbox", "--id", str(head)).returncode == 0
    got = await rabbit.drain(fixed, 3)
    assert [m.message_id for m in got] == [str(head), *map(str, later)]
    daemon.stop()
    assert daemon.proc.returncode == 0


async def test_inbox_dispatches_a_failing_heads_key_head_first(effects, rabbit, inbox):
    """The same for the inbox: rows of a key that arrive while its head is
    failing wait, untouched, until the head is dead (skip) and then run."""
    inbox("--max-attempts", "4")
    await rabbit.publish(
        "t", b"{}", message_id="a-1", type="AlwaysFails", headers={"x-relay-key": "a"}
    )
    wait_until(
        lambda: (
            rows(effects, "SELECT attempts >= 1 FROM inbox WHERE message_id = 'a-1'") == [(True,)]
        )
    )
    await rabbit.publish("t", b"{}", message_id="a-2", type="Effect", headers={"x-relay-key": "a"})
    await rabbit.publish("t", b"{}", message_id="b-1", type="Effect", headers={"x-relay-key": "b"})
    wait_until(lambda: effect_ids(effects) == ["b-1"])
    assert rows(effects, "SELECT status, attempts FROM inbox WHERE message_id = 'a-2'") == [
        ("pending", 0)
    ]
    wait_until(
        lambda: rows(effects, "SELECT status FROM inbox WHERE message_id = 'a-1'") == [("dead",)]
    )
    wait_until(lambda: effect_ids(effects) == ["b-1", "a-2"])


_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(value=_JSON_VALUES, pad=st.integers(min_value=0, max_value=60))
def test_the_dispatchers_json_reading_keeps_every_number_exact(value, pad):
    # storable.loads reads with orjson, which takes an integer past 64 bits
    # for a float, and searches for long numbers only when it must: what
    # it gives is what the json module gives, short texts and long alike.
    text = json.dumps({"v": value, "pad": " " * pad}, ensure_ascii=False)
    loaded = storable.loads(text)
    assert loaded == json.loads(text)
    assert repr(loaded) == repr(json.loads(text))  # 1 stays 1, never 1.0


@pytest.mark.parametrize("pad", [0, 60])
@pytest.mark.parametrize(
    "text",
    [
        "[1, 2",
        "NaN",
        "[" * 600 + "]" * 600,
        "[" * 1000 + "]" * 1000,  # orjson reads up to 1,024 levels
        '{"a": 123456789012345678901234567890,}',
    ],
)
def test_the_dispatchers_json_reading_refuses_what_is_not_json_short_or_long(text, pad):
    with pytest.raises(ValueError, match="JSON"):
        storable.loads(text + " " * pad)
