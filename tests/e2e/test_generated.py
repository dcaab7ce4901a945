"""No single message stops relay, proved on generated inputs (Hypothesis).

Each test runs ONE real daemon against the real servers and sends it
generated messages (or rows), each between two well-formed canaries. For
every example: the daemon is alive, both canaries are handled, the example
is exactly one row (processed or published, or dead with a reason), and at
the end nothing is left in the queue and the daemon exits 0 on SIGTERM.

    .venv/bin/pytest -q tests/e2e/test_generated.py                 # CI: a short, fixed profile
    RELAY_GENERATED_EXAMPLES=2000 .venv/bin/pytest -q tests/e2e/test_generated.py -n 0 -s \\
        --timeout 3600                                          # the long one, random

The short profile is derandomized (the same examples on every run, so CI
never fails on a newly drawn input without a change to explain it); the
long one draws new examples each run and prints its counts.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from typing import Any

import aio_pika
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests import amqp_raw
from tests.conftest import AMQP_URL, rows, wait_until
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures

LONG = int(os.environ.get("RELAY_GENERATED_EXAMPLES", "0"))
pytestmark = pytest.mark.timeout(3600 if LONG else 300)


def profile(short: int) -> settings:
    return settings(
        max_examples=LONG or short,
        deadline=None,
        derandomize=not LONG,
        suppress_health_check=list(HealthCheck),
        database=None,
        print_blob=True,
        # Each example costs a round trip through real servers: report a
        # failing one as drawn rather than spend many minutes shrinking it.
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    )


# --------------------------------------------------------------------------
# Strategies
# --------------------------------------------------------------------------

# Strings as AMQP carries them: text (NUL included) or raw bytes that need
# not be UTF-8.
raw_strings = st.one_of(st.text(max_size=24), st.binary(max_size=24))

_ints = {
    "b": (-(2**7), 2**7 - 1),
    "B": (0, 2**8 - 1),
    "s": (-(2**15), 2**15 - 1),
    "u": (0, 2**16 - 1),
    "I": (-(2**31), 2**31 - 1),
    "i": (0, 2**32 - 1),
    "l": (-(2**63), 2**63 - 1),
}
field_scalars = st.one_of(
    st.tuples(st.just("S"), raw_strings),
    st.tuples(st.just("x"), st.binary(max_size=24)),
    st.tuples(st.just("t"), st.booleans()),
    *(st.tuples(st.just(kind), st.integers(lo, hi)) for kind, (lo, hi) in _ints.items()),
    st.tuples(st.just("f"), st.floats(width=32)),
    st.tuples(st.just("d"), st.floats()),
    st.tuples(st.just("D"), st.tuples(st.integers(0, 255), st.integers(-(2**31), 2**31 - 1))),
    st.tuples(st.just("T"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("V"), st.none()),
)
field_values = st.recursive(
    field_scalars,
    lambda children: st.one_of(
        st.tuples(st.just("F"), st.dictionaries(raw_strings, children, max_size=4)),
        st.tuples(st.just("A"), st.lists(children, max_size=4)),
    ),
    max_leaves=12,
)
header_tables = st.one_of(
    st.none(),
    st.dictionaries(raw_strings, field_values, max_size=5),
    # Nested past anything a list of leaves reaches.
    st.integers(1, 400).map(lambda depth: {"deep": amqp_raw.deep_table_value(depth)}),
)
relay_keys = st.one_of(st.none(), raw_strings, st.integers(900, 10_000).map(lambda n: "k" * n))

json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=20),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=15,
)


def _json_text(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


bodies = st.one_of(
    st.binary(max_size=64),
    json_values.map(_json_text),
    st.tuples(st.integers(1, 1500), json_values).map(
        lambda d: b"[" * d[0] + _json_text(d[1]) + b"]" * d[0]
    ),
    st.integers(2**64, 2**200).map(lambda n: b'{"big": ' + str(n).encode() + b"}"),
)


# --------------------------------------------------------------------------
# The inbox over RabbitMQ
# --------------------------------------------------------------------------


def _between(engine, consumer: str, before: str, after: str) -> list[Any]:
    return rows(
        engine,
        """
        SELECT message_id, status, last_error FROM inbox
        WHERE consumer = :c
          AND seq > (SELECT seq FROM inbox WHERE consumer = :c AND message_id = :b)
          AND seq < (SELECT seq FROM inbox WHERE consumer = :c AND message_id = :a)
        ORDER BY seq""",
        c=consumer,
        b=before,
        a=after,
    )


def _handled(engine, *ids: str) -> bool:
    found = rows(engine, "SELECT count(*) FROM effects WHERE message_id = ANY(:ids)", ids=list(ids))
    return found[0][0] == len(ids)


def _tally(found: list[Any], counts: Counter[str]) -> None:
    """Each row settled: processed, or dead with a reason (counted by it)."""
    for _, status, error in found:
        assert status in ("processed", "dead")
        if status == "dead":
            assert error
            counts[f"dead: {error.split(':')[0][:40]}"] += 1
        counts[status] += 1


def _settled(
    engine, consumer: str, before: str, after: str, at_least: int = 0
) -> tuple[list[Any]] | None:
    """The rows between the canaries once none is pending and there are
    `at_least` (wrapped: a duplicate leaves no row, and an empty list would
    read as "not yet"). Under --dispatch received a batch's parts commit
    side by side: the canary after a row can be in the table before it."""
    found = _between(engine, consumer, before, after)
    if len(found) < at_least or any(status == "pending" for _, status, _ in found):
        return None
    return (found,)


# With CloudEvents (issue 42): some examples carry an event's attributes as
# cloudEvents_ headers beside everything else generated, valid (one row,
# deduplicated by source and id) or missing a required one (dead).
# Through both paths of the inbox (--dispatch, docs/inbox.md).
@pytest.mark.parametrize(
    ("dispatch", "cloudevents"),
    [("received", False), ("received", True), ("stored", False)],
    ids=["plain", "cloudevents", "stored"],
)
async def test_generated_amqp_deliveries_each_become_one_row(
    effects, rabbit, inbox, dispatch, cloudevents
):
    daemon = inbox()
    consumer = daemon.queue
    seen_bodies: set[bytes] = set()
    counts: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    # The producer's own connection: RabbitMQ itself closes it on a few
    # frames it cannot take (its channel process crashes on them), and the
    # test then opens another; such an example never reaches relay.
    producer: dict[str, Any] = {}

    async def connect() -> None:
        if producer:
            await producer["connection"].close()
        producer["connection"] = await aio_pika.connect(AMQP_URL)
        plain = await producer["connection"].channel(publisher_confirms=False)
        producer["channel"] = await plain.get_underlay_channel()

    await connect()

    async def canary(name: str) -> None:
        await amqp_raw.publish(
            producer["channel"], rabbit.exchange, "canary", b"{}", message_id=name, type="Effect"
        )

    @profile(short=40)
    # Half the examples name a type with a handler, so they reach it.
    @given(
        message_id=st.one_of(st.none(), raw_strings),
        type_=st.one_of(st.just("Effect"), st.none(), raw_strings),
        routing_key=raw_strings,
        headers=header_tables,
        key=relay_keys,
        body=bodies,
        timestamp=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
        extra=st.fixed_dictionaries(
            {},
            optional={
                "content_type": raw_strings,
                "correlation_id": raw_strings,
                "app_id": raw_strings,
                "delivery_mode": st.sampled_from([1, 2]),
                "priority": st.integers(0, 9),
            },
        ),
        event=st.sampled_from([None, "valid", "broken"]) if cloudevents else st.none(),
    )
    def example(message_id, type_, routing_key, headers, key, body, timestamp, extra, event):
        n = counts["examples"]
        counts["examples"] += 1
        before, after = f"canary-{n}-a", f"canary-{n}-b"
        if message_id is not None:  # unique per example, still a short string
            raw = message_id if isinstance(message_id, bytes) else message_id.encode()
            message_id = raw[:200] + f"-{n}".encode()
        table = dict(headers or {})
        if key is not None:
            table["x-relay-key"] = ("S", key)
        if event is not None:
            attributes = {
                "specversion": "1.0",
                "id": f"gen-{n}",
                "source": "urn:gen",
                "type": "Effect",
            }
            if event == "broken":
                del attributes[("specversion", "id", "source", "type")[n % 4]]
            table.update({f"cloudEvents_{k}": ("S", v) for k, v in attributes.items()})
        properties = {
            "message_id": message_id,
            "type": type_,
            "timestamp": timestamp,
            "headers": table or None,
            **extra,
        }

        async def send() -> bool:
            """True when RabbitMQ took the example (a round trip behind it says so)."""
            await canary(before)
            try:
                channel = producer["channel"]
                await amqp_raw.publish(channel, rabbit.exchange, routing_key, body, **properties)
                await asyncio.wait_for(
                    channel.exchange_declare(exchange=rabbit.exchange, passive=True), 10
                )
                taken = True
            except Exception:  # noqa: BLE001 - whatever RabbitMQ closed, it refused the frame
                await connect()
                taken = False
            await canary(after)
            return taken

        taken = asyncio.run_coroutine_threadsafe(send(), loop).result(40)
        if not taken:
            counts["refused by RabbitMQ"] += 1
        wait_until(
            lambda: _handled(effects, before, after),
            timeout=30,
            message=f"canaries around example {n}",
        )
        assert daemon.proc.poll() is None, daemon.log
        duplicate = message_id is None and body in seen_bodies
        expected = 0 if duplicate or not taken else 1
        [found] = wait_until(
            lambda: _settled(effects, consumer, before, after, expected),
            timeout=30,
            message=f"example {n} settled",
        )
        if event == "valid":
            # Deduplicated by its source and id, unless its properties could
            # not be decoded at all (then as any message: sha256 of the body).
            assert len(found) == (0 if not taken else 1) or duplicate, found
            if found and found[0][0].startswith("sha256:"):
                seen_bodies.add(body)
            elif found:
                assert found[0][0] == f"urn:gen gen-{n}", found
            _tally(found, counts)
            return
        if message_id is None and taken:
            seen_bodies.add(body)
        assert len(found) == (0 if duplicate or not taken else 1), found
        if event == "broken" and found:
            assert found[0][1] == "dead", found
        _tally(found, counts)

    await asyncio.to_thread(example)
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log
    queue = await (await rabbit.connection.channel()).declare_queue(consumer, passive=True)
    assert queue.declaration_result.message_count == 0
    await producer["connection"].close()
    print(f"\namqp inbox: {dict(counts)}")


# --------------------------------------------------------------------------
# The inbox over SQS
# --------------------------------------------------------------------------

# What SQS accepts in a string (its documented character set).
sqs_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]).filter(
        lambda c: (
            c in "\t\n\r"
            or 0x20 <= ord(c) <= 0xD7FF
            or 0xE000 <= ord(c) <= 0xFFFD
            or ord(c) >= 0x10000
        )
    ),
    max_size=40,
)
attribute_names = st.from_regex(r"\A[A-Za-z0-9_-][A-Za-z0-9_.-]{0,30}\Z").filter(
    lambda name: (
        not name.lower().startswith(("aws.", "amazon."))
        and ".." not in name
        and not name.endswith(".")
    )
)
odd_json = st.one_of(
    json_values.map(json.dumps),
    st.just('{"h": "a\\u0000b"}'),
    st.just('{"h": "\\ud800"}'),
    st.integers(1, 1200).map(lambda d: '{"a":' * d + "1" + "}" * d),
    st.integers(1, 1200).map(lambda d: "[" * d + "]" * d),
    sqs_text,
)


def _sqs_attribute(kind_value: tuple[str, Any]) -> dict[str, Any]:
    kind, value = kind_value
    if kind == "Binary":
        return {"DataType": "Binary", "BinaryValue": value}
    return {"DataType": kind, "StringValue": value}


sqs_attribute_values = st.one_of(
    st.tuples(st.just("String"), sqs_text.filter(bool)),
    st.tuples(st.just("Number"), st.integers(-(10**20), 10**20).map(str)),
    st.tuples(st.just("Binary"), st.binary(min_size=1, max_size=20)),
).map(_sqs_attribute)


# moto answers a FIFO queue's messages one group turn at a time: about 17 s
# an example here, so the short profile keeps to four (CI's 20 minutes) and
# a long time-out; the long profile is where this test draws many.
@pytest.mark.timeout(3600 if LONG else 600)
async def test_generated_sqs_messages_each_become_one_row(effects, sqs, start_relay):
    queue = sqs.name("gen") + ".fifo"
    sqs.create(queue, FifoQueue="true")
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--handlers",
        "tests.apps.handlers:registry",
        env={"RELAY_BROKER_URL": "sqs://", **sqs.env},
    )
    counts: Counter[str] = Counter()

    def send(body: str, attributes: dict[str, Any], n: int, part: str) -> None:
        sqs.client.send_message(
            QueueUrl=sqs.urls[queue],
            MessageBody=body,
            MessageAttributes=attributes,
            MessageGroupId="g",
            MessageDeduplicationId=f"{n}-{part}",
        )

    def canary(name: str, n: int) -> None:
        send(
            "{}",
            {
                "message_id": {"DataType": "String", "StringValue": name},
                "type": {"DataType": "String", "StringValue": "Effect"},
            },
            n,
            name,
        )

    @profile(short=4)
    @given(
        body=st.one_of(sqs_text.filter(bool), odd_json.filter(bool)),
        attributes=st.dictionaries(attribute_names, sqs_attribute_values, max_size=4),
        message_id=st.one_of(
            st.none(), sqs_text.filter(bool), st.integers(1000, 3000).map(lambda n: "i" * n)
        ),
        type_=st.one_of(st.just("Effect"), st.none(), sqs_text.filter(bool)),
        key=st.one_of(
            st.none(), sqs_text.filter(bool), st.integers(1000, 10_000).map(lambda n: "k" * n)
        ),
        headers=st.one_of(st.none(), odd_json.filter(bool)),
    )
    def example(body, attributes, message_id, type_, key, headers):
        n = counts["examples"]
        counts["examples"] += 1
        before, after = f"canary-{n}-a", f"canary-{n}-b"
        attributes = dict(attributes)
        for name, value in (
            ("message_id", message_id and f"{message_id}-{n}"),
            ("type", type_),
            ("key", key),
            ("headers", headers),
        ):
            if value:
                attributes[name] = {"DataType": "String", "StringValue": value}
            else:
                attributes.pop(name, None)
        attributes = dict(list(attributes.items())[:10])  # SQS takes ten at most
        canary(before, n)
        try:
            send(body, attributes, n, "example")
        except sqs.client.exceptions.ClientError as exc:  # SQS itself refused it
            counts["refused by SQS"] += 1
            del exc
        canary(after, n)
        wait_until(
            lambda: _handled(effects, before, after),
            timeout=60,
            message=f"canaries around example {n}",
        )
        assert daemon.proc.poll() is None, daemon.log
        [found] = wait_until(
            lambda: _settled(effects, queue, before, after),
            timeout=30,
            message=f"example {n} settled",
        )
        assert len(found) <= 1, found
        _tally(found, counts)

    await asyncio.to_thread(example)
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log
    wait_until(lambda: sqs.count(queue) == 0, timeout=30)
    print(f"\nsqs inbox: {dict(counts)}")


# --------------------------------------------------------------------------
# The outbox: rows by plain SQL
# --------------------------------------------------------------------------

row_texts = st.text(max_size=30)


def _deep(depth: int, inner: str) -> str:
    return "[" * depth + inner + "]" * depth


# With CloudEvents on (issue 42), each published message is also an event
# the CloudEvents SDK reads, with the row's id and type.
CLOUDEVENTS_SOURCE = "https://generated.example.com/relay"


@pytest.mark.parametrize("cloudevents", [False, True], ids=["plain", "cloudevents"])
async def test_generated_outbox_rows_each_end_published_or_dead(
    engine, rabbit, start_relay, cloudevents
):
    queue = await rabbit.queue("#")
    daemon = start_relay(
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--poll-interval",
        "0.2",
        "--max-attempts",
        "1",
        *(("--cloudevents-source", CLOUDEVENTS_SOURCE) if cloudevents else ()),
    )
    daemon.wait_for_log("outbox relay started")
    counts: Counter[str] = Counter()
    loop = asyncio.get_running_loop()

    def insert(
        topic: str, key: str | None, type_: str | None, payload: str, headers: str
    ) -> str | None:
        try:
            with engine.begin() as conn:
                return conn.execute(
                    sa.text(
                        "INSERT INTO outbox (topic, key, type, payload, headers) "
                        "VALUES (:t, :k, :y, CAST(:p AS jsonb), CAST(:h AS jsonb)) "
                        "RETURNING id::text"
                    ),
                    {"t": topic, "k": key, "y": type_, "p": payload, "h": headers},
                ).scalar()
        except (sa.exc.DataError, sa.exc.OperationalError, ValueError):
            return None  # PostgreSQL (or psycopg) refused it: no row, nothing to relay

    @profile(short=40)
    @given(
        topic=row_texts.filter(bool) | st.integers(200, 400).map(lambda n: "t" * n),
        key=st.one_of(st.none(), row_texts, st.integers(900, 3000).map(lambda n: "k" * n)),
        type_=st.one_of(st.none(), row_texts, st.just("T" * 300)),
        payload=st.one_of(
            json_values.map(json.dumps),
            st.tuples(st.integers(1, 700), json_values).map(
                lambda d: _deep(d[0], json.dumps(d[1]))
            ),
            st.integers(2**64, 2**300).map(lambda n: f'{{"big": {n}}}'),
        ),
        headers=st.one_of(
            json_values.map(json.dumps),
            st.dictionaries(row_texts, row_texts, max_size=3).map(json.dumps),
        ),
    )
    def example(topic, key, type_, payload, headers):
        n = counts["examples"]
        counts["examples"] += 1
        # The canaries share a key, so they go out in order; the example's own
        # key (or none) gives it no order against them.
        before = insert("canary", "canary", f"canary-{n}-a", "{}", "{}")
        row = insert(topic, key, type_, payload, headers)
        after = insert("canary", "canary", f"canary-{n}-b", "{}", "{}")
        if row is None:
            counts["refused by PostgreSQL"] += 1

        async def collect(until: str) -> None:
            deadline = time.monotonic() + 30
            while until not in [m.message_id for m in got]:
                message = await queue.get(no_ack=True, fail=False)
                if message is None:
                    assert time.monotonic() < deadline, f"{until} of example {n} not received"
                    await asyncio.sleep(0.02)
                else:
                    got.append(message)

        got: list[Any] = []
        asyncio.run_coroutine_threadsafe(collect(after), loop).result(40)
        assert daemon.proc.poll() is None, daemon.log
        ids = [m.message_id for m in got]
        assert before in ids and ids.index(before) < ids.index(after)
        if row is None:
            return
        status, error, stored = wait_until(
            lambda: rows(
                engine,
                "SELECT status, last_error, payload::text FROM outbox "
                "WHERE id = CAST(:i AS uuid) AND status <> 'pending'",
                i=row,
            ),
            timeout=30,
        )[0]
        counts[status] += 1
        if status == "dead":
            assert error and row not in ids
            counts[f"dead: {error.split(':')[0][:40]}"] += 1
        else:
            assert status == "published"
            asyncio.run_coroutine_threadsafe(collect(row), loop).result(40)
            [message] = [m for m in got if m.message_id == row]
            # Exactly the stored value (jsonb's own rendering of each number).
            assert json.loads(message.body) == json.loads(stored)
            if cloudevents:
                _check_event(message, row, topic, type_, key)

    await asyncio.to_thread(example)
    daemon.stop()
    assert daemon.proc.returncode == 0, daemon.log
    assert rows(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'")[0][0] == 0
    print(f"\noutbox: {dict(counts)}")


def _check_event(message: Any, row: str, topic: str, type_: str | None, key: str | None) -> None:
    """The SDK reads the message as the row's event (its attributes; the
    data is the body, compared above)."""
    from cloudevents.core.bindings import amqp as sdk_amqp
    from cloudevents.core.formats.json import JSONFormat
    from cloudevents.core.v1.event import CloudEvent

    event = sdk_amqp.from_binary(
        sdk_amqp.AMQPMessage(
            properties={"content-type": message.content_type},
            application_properties=dict(message.headers),
            application_data=b"",
        ),
        JSONFormat(),
        CloudEvent,
    )
    attributes = event.get_attributes()
    assert (attributes["id"], attributes["source"]) == (row, CLOUDEVENTS_SOURCE)
    assert attributes["type"] == (type_ or topic)
    assert attributes.get("subject") == (key or None)


# --------------------------------------------------------------------------
# relay.enqueue: refused before anything is written, or carried
# --------------------------------------------------------------------------


async def test_generated_enqueue_arguments_are_refused_or_published(engine, rabbit, run_relay):
    import relay

    queue = await rabbit.queue("#")
    accepted = []

    @profile(short=60)
    @given(
        topic=st.text(max_size=300),
        key=st.one_of(st.none(), st.text(max_size=1100)),
        type_=st.one_of(st.none(), st.text(max_size=300)),
        headers=st.dictionaries(st.text(max_size=300), st.text(max_size=20), max_size=3),
        payload=st.one_of(
            json_values,
            st.floats(),
            st.tuples(st.integers(500, 520), json_values).map(lambda d: _nest(*d)),
        ),
    )
    def example(topic, key, type_, headers, payload):
        before = rows(engine, "SELECT count(*) FROM outbox")[0][0]
        try:
            with engine.begin() as conn:
                accepted.append(
                    relay.enqueue(conn, topic, payload, key=key, type=type_, headers=headers)
                )
        except (ValueError, TypeError):
            assert rows(engine, "SELECT count(*) FROM outbox")[0][0] == before

    await asyncio.to_thread(example)
    result = await asyncio.to_thread(
        run_relay, "outbox", "--once", "--exchange", rabbit.exchange, "--max-attempts", "1"
    )
    assert result.returncode == 0, result.stderr
    # Everything enqueue took, relay carried.
    statuses = dict(rows(engine, "SELECT status, count(*) FROM outbox GROUP BY status"))
    assert statuses == ({"published": len(accepted)} if accepted else {}), rows(
        engine, "SELECT topic, last_error FROM outbox WHERE status <> 'published'"
    )
    assert len(await rabbit.drain(queue, len(accepted))) == len(accepted)


def _nest(depth: int, value: Any) -> Any:
    for _ in range(depth):
        value = [value]
    return value
