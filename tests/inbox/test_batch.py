"""Batch handlers (`registry.batch_handler`): one call for the due messages
of a type, in seq order; a call that fails runs again in parts, each in a
savepoint, so that only the messages that fail on their own roll back.

One batch of a Dispatcher, run here against the real PostgreSQL, shows
exactly which calls were made; the inbox loop on the memory broker
(tests/inbox/test_loop.py's LoopInbox) shows the retries and dead rows;
`relay inbox` on RabbitMQ runs a batch handler end to end.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

import relay
from relay import batches
from relay.config import InboxSettings
from relay.db import Store
from relay.errors import ConfigError
from relay.metrics import InboxMetrics
from relay.testing import handle_batch, handle_batch_async, message
from relay.wiring import inbox_dispatcher
from tests.conftest import effect_ids, inbox_rows, rows, wait_until
from tests.inbox.test_loop import QUEUE, LoopInbox, state_of

# One statement for the whole batch's effects.
_INSERT_MANY = sa.text("INSERT INTO effects (message_id) SELECT unnest(CAST(:ids AS text[]))")


def readings(calls: list[list[str]], max_size: int = 500) -> relay.HandlerRegistry:
    """A batch handler for "Reading" that notes each call's ids in `calls`,
    writes every message's effect in one statement, then raises if any
    message of the call has {"fail": true}; and a handler for "Record"."""
    registry = relay.HandlerRegistry()

    @registry.batch_handler("Reading", max_size=max_size)
    def on_readings(messages: list[relay.Message], conn: sa.Connection) -> None:
        calls.append([m.id for m in messages])
        conn.execute(_INSERT_MANY, {"ids": [m.id for m in messages]})
        failing = [m.id for m in messages if m.payload.get("fail")]
        if failing:
            raise ValueError(f"bad readings: {failing}")

    @registry.handler("Record")
    def record(message: relay.Message, conn: sa.Connection) -> None:
        calls.append([message.id])
        conn.execute(_INSERT_MANY, {"ids": [message.id]})

    return registry


@dataclass(frozen=True)
class Planned:
    id: str
    key: str | None = None
    fail: bool = False
    type: str = "Reading"
    attempts: int = 0


def store(engine: sa.Engine, planned: list[Planned], consumer: str = QUEUE) -> None:
    """Pending inbox rows, in this order (seq), as the receiver stores them."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer, message_id, topic, key, type, payload, attempts) "
                "VALUES (:c, :m, 'readings', :k, :t, CAST(:p AS jsonb), :a)"
            ),
            [
                {
                    "c": consumer,
                    "m": p.id,
                    "k": p.key,
                    "t": p.type,
                    "p": orjson.dumps({"fail": p.fail}).decode(),
                    "a": p.attempts,
                }
                for p in planned
            ],
        )


async def dispatch_once(
    database: str,
    registry: relay.HandlerRegistry,
    *,
    consumer: str = QUEUE,
    sync: bool = True,
    **options: Any,
) -> InboxMetrics:
    """One claim and batch of a Dispatcher (the only one: every key is its share)."""
    config = InboxSettings(
        database_url=database, queue=consumer, backoff_min=30, backoff_max=60, **options
    )
    metrics = InboxMetrics()
    dispatch_store = Store(database, sync=sync)
    try:
        await inbox_dispatcher(config, dispatch_store, registry, metrics).dispatch_batch()
    finally:
        await dispatch_store.close()
    return metrics


def state(engine: sa.Engine, consumer: str = QUEUE) -> dict[str, tuple[str, int, str | None]]:
    """Each row's (status, attempts, last_error)."""
    return {
        m: (status, attempts, error)
        for m, status, attempts, error in rows(
            engine,
            "SELECT message_id, status, attempts, last_error FROM inbox WHERE consumer = :c",
            c=consumer,
        )
    }


# --------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------


def test_a_type_has_a_handler_or_a_batch_handler_not_both():
    registry = relay.HandlerRegistry()
    registry.handler("A")(lambda message, conn: None)
    with pytest.raises(ConfigError, match=r"'A' has a handler .* and a batch handler"):
        registry.batch_handler("A")(lambda messages, conn: None)
    registry.batch_handler("B", max_size=10)(lambda messages, conn: None)
    with pytest.raises(ConfigError, match=r"'B' has a handler .* and a batch handler"):
        registry.handler("B")(lambda message, conn: None)
    # Also when two registries are put together (several --handlers).
    other = relay.HandlerRegistry()
    other.handler("B")(lambda message, conn: None)
    with pytest.raises(ConfigError, match="'B'"):
        registry.include(other)
    assert registry.types == ["A", "B"]


@pytest.mark.parametrize("max_size", [0, -1, 1.5, "10", True])
def test_a_batch_handlers_max_size_is_a_positive_integer(max_size):
    with pytest.raises(ValueError, match="max_size"):
        relay.HandlerRegistry().batch_handler("A", max_size=max_size)


# --------------------------------------------------------------------------
# The units of a claimed batch (relay.batches.plan), a pure function
# --------------------------------------------------------------------------

claimed_rows = st.lists(
    st.tuples(st.sampled_from(["Reading", "Other", "Record"]), st.sampled_from([None, "a", "b"])),
    max_size=40,
)


@given(claimed=claimed_rows, max_size=st.integers(1, 6))
def test_units_keep_each_keys_order_and_the_max_size(claimed, max_size):
    planned = [Planned(str(i), key, type=t) for i, (t, key) in enumerate(claimed)]
    units = batches.plan(planned, {"Reading": max_size, "Other": 3})
    order = [position for unit in units for position in unit]
    assert sorted(order) == list(range(len(planned)))  # every row once
    for unit in units:
        types = {planned[p].type for p in unit}
        assert len(types) == 1 and list(unit) == sorted(unit)
        limit = {"Reading": max_size, "Other": 3}.get(types.pop(), 1)
        assert len(unit) <= limit
    for key in ("a", "b"):  # the execution order of a key's rows is their seq order
        of_key = [p for p in order if planned[p].key == key]
        assert of_key == sorted(of_key)


def test_units_take_the_rows_of_a_type_past_other_keys():
    planned = [
        Planned("r1", "a"),
        Planned("x", "b", type="Record"),
        Planned("r2", "c"),
        Planned("r3", "b"),  # behind x, of its key: a later unit
        Planned("r4", None),
    ]
    assert batches.plan(planned, {"Reading": 10}) == [(0, 2, 4), (1,), (3,)]


# --------------------------------------------------------------------------
# One batch of a Dispatcher
# --------------------------------------------------------------------------


async def test_the_batch_arrives_in_seq_order_in_one_call_up_to_max_size(effects, database):
    planned = [Planned(f"r{i:03}", key=f"k{i % 7}" if i % 3 else None) for i in range(250)]
    store(effects, planned)
    calls: list[list[str]] = []
    metrics = await dispatch_once(database, readings(calls, max_size=100))
    ids = [p.id for p in planned]
    assert calls == [ids[:100], ids[100:200], ids[200:]]
    assert set(state(effects).values()) == {("processed", 0, None)}
    # One statement per call wrote each message's effect, exactly once.
    assert sorted(effect_ids(effects)) == ids
    assert metrics.registry.get_sample_value("relay_inbox_processed_total") == 250


async def test_a_claimed_batch_of_several_types_keeps_each_keys_order(effects, database):
    planned = [
        Planned("r1", "a"),
        Planned("x1", "a", type="Record"),
        Planned("r2", "a"),
        Planned("r3", "b"),
        Planned("r4", None),
    ]
    store(effects, planned)
    calls: list[list[str]] = []
    await dispatch_once(database, readings(calls))
    assert calls == [["r1", "r3", "r4"], ["x1"], ["r2"]]
    assert effect_ids(effects) == ["r1", "r3", "r4", "x1", "r2"]


@pytest.mark.parametrize("sync", [True, False], ids=["sync-engine", "async-engine"])
async def test_one_poison_message_among_100_fails_alone(effects, database, sync):
    planned = [Planned(f"r{i:03}", key=f"k{i}", fail=i == 37) for i in range(100)]
    store(effects, planned)
    calls: list[list[str]] = []
    metrics = await dispatch_once(database, readings(calls), sync=sync)
    after = state(effects)
    status, attempts, error = after.pop("r037")
    assert (status, attempts) == ("pending", 1)
    assert error.startswith("Traceback") and "ValueError: bad readings: ['r037']" in error
    # The 99 others were processed in the same round, their effects once.
    assert set(after.values()) == {("processed", 0, None)}
    assert sorted(effect_ids(effects)) == sorted(m for m in after)
    # The halves that held it ran again, down to it alone: 1 + 2 per level.
    assert calls[0] == [p.id for p in planned]
    assert ["r037"] in calls and len(calls) <= 1 + 2 * 7
    assert metrics.registry.get_sample_value("relay_inbox_failed_total") == 1


async def test_a_key_whose_first_message_fails_holds_its_later_ones(effects, database):
    planned = [
        Planned("a1", "a", fail=True),
        Planned("b1", "b"),
        Planned("a2", "a"),
        Planned("b2", "b"),
        Planned("a3", "a"),
        Planned("n1", None),
    ]
    store(effects, planned)
    calls: list[list[str]] = []
    await dispatch_once(database, readings(calls))
    after = state(effects)
    assert after["a1"][:2] == ("pending", 1)
    # Held, untouched: no attempt counted, no effect, never given to a call alone.
    assert after["a2"] == after["a3"] == ("pending", 0, None)
    assert {m: after[m][0] for m in ("b1", "b2", "n1")} == dict.fromkeys(
        ("b1", "b2", "n1"), "processed"
    )
    assert sorted(effect_ids(effects)) == ["b1", "b2", "n1"]
    assert ["a2"] not in calls and ["a3"] not in calls


async def test_a_message_that_failed_before_runs_alone_first(effects, database):
    planned = [Planned("r1"), Planned("r2", fail=True, attempts=1), Planned("r3")]
    store(effects, planned)
    calls: list[list[str]] = []
    await dispatch_once(database, readings(calls))
    assert calls == [["r1"], ["r2"], ["r3"]]
    assert state(effects)["r2"][:2] == ("pending", 2)


async def test_a_batch_handler_that_swallows_a_database_error_fails(effects, database):
    calls: list[list[str]] = []
    registry = relay.HandlerRegistry()

    @registry.batch_handler("Reading")
    def swallow(messages: list[relay.Message], conn: sa.Connection) -> None:
        calls.append([m.id for m in messages])
        conn.execute(_INSERT_MANY, {"ids": [m.id for m in messages]})
        if any(m.payload["fail"] for m in messages):
            try:
                conn.execute(sa.text("SELECT 1 / 0"))
            except sa.exc.DBAPIError:
                pass  # and returns as if all went well

    store(effects, [Planned("r1"), Planned("r2", fail=True), Planned("r3")])
    await dispatch_once(database, registry)
    after = state(effects)
    assert after["r2"][:2] == ("pending", 1) and "left its transaction aborted" in after["r2"][2]
    assert sorted(effect_ids(effects)) == ["r1", "r3"]


async def test_a_batch_call_over_the_handler_timeout_fails_and_runs_in_parts(effects, database):
    """--handler-timeout applies to one call: a call that takes too long
    fails, and its parts, each quicker, run again."""
    calls: list[int] = []
    registry = relay.HandlerRegistry()

    @registry.batch_handler("Reading")
    async def slow_in_bulk(messages: list[relay.Message], conn: AsyncConnection) -> None:
        calls.append(len(messages))
        await asyncio.sleep(0.3 * len(messages))
        await conn.execute(_INSERT_MANY, {"ids": [m.id for m in messages]})

    store(effects, [Planned(f"r{i}") for i in range(4)])
    await dispatch_once(database, registry, sync=False, handler_timeout=0.5)
    assert calls == [4, 2, 1, 1, 2, 1, 1]
    assert set(state(effects).values()) == {("processed", 0, None)}
    assert sorted(effect_ids(effects)) == [f"r{i}" for i in range(4)]


# Generated: batches with random keys and a random failing subset.

generated_batches = st.lists(
    st.tuples(st.sampled_from([None, "a", "b", "c", "d"]), st.booleans()),
    min_size=1,
    max_size=30,
).map(lambda batch: [(key, fail and i % 3 == 0) for i, (key, fail) in enumerate(batch)])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batch=generated_batches, max_size=st.integers(1, 12))
def test_generated_batches_exactly_the_failing_ones_and_their_keys_later_ones_wait(
    effects, database, batch, max_size
):
    consumer = f"c-{uuid.uuid4().hex[:8]}"  # one per example, in the test's database
    planned = [Planned(f"{consumer}-{i:02}", key, fail) for i, (key, fail) in enumerate(batch)]
    store(effects, planned, consumer)
    calls: list[list[str]] = []
    asyncio.run(dispatch_once(database, readings(calls, max_size), consumer=consumer))
    # What the contract says: a message that fails alone fails; later ones
    # of its key wait; all others are processed.
    failing_keys: set[str] = set()
    expected = {}
    for p in planned:
        if p.key is not None and p.key in failing_keys:
            expected[p.id] = ("pending", 0)
        elif p.fail:
            expected[p.id] = ("pending", 1)
            if p.key is not None:
                failing_keys.add(p.key)
        else:
            expected[p.id] = ("processed", 0)
    assert {m: v[:2] for m, v in state(effects, consumer).items()} == expected
    done = {m for m, v in expected.items() if v[0] == "processed"}
    mine = [m for m in effect_ids(effects) if m.startswith(consumer)]
    assert sorted(mine) == sorted(done)  # each effect once, none of the others
    for call in calls:  # each call in seq order, within max_size
        assert call == sorted(call) and len(call) <= max_size


def store_too_deep(engine: sa.Engine) -> None:
    """A pending "Reading" row without a key, 'deep', whose payload is nested
    deeper than relay gives a handler."""
    rows(
        engine,
        "INSERT INTO inbox (consumer, message_id, type, payload) "
        "VALUES (:c, 'deep', 'Reading', CAST(:p AS jsonb))",
        c=QUEUE,
        p="[" * 1100 + "1" + "]" * 1100,
    )


async def test_a_row_no_batch_handler_can_be_given_is_dead_and_the_rest_run(effects, database):
    store(effects, [Planned("r1"), Planned("r3")])
    store_too_deep(effects)
    calls: list[list[str]] = []
    await dispatch_once(database, readings(calls))
    after = state(effects)
    assert after["deep"][:2] == ("dead", 1) and "nested 1100 levels" in after["deep"][2]
    assert calls == [["r1", "r3"]]
    assert sorted(effect_ids(effects)) == ["r1", "r3"]


async def test_such_a_row_fails_once_when_its_units_call_fails_past_a_checkpoint(
    effects, database, monkeypatch, caplog
):
    # The batch's savepoint moves on before every unit here (as it does every
    # CHECKPOINT_EVERY seconds); the call fails, the batch goes back to it and
    # runs the unit again, carefully: the row without a key that cannot be
    # given to the handler is recorded failed once, not once a run.
    monkeypatch.setattr("relay.inbox.CHECKPOINT_EVERY", -1.0)
    store_too_deep(effects)
    store(effects, [Planned("r1", "a", fail=True)])
    calls: list[list[str]] = []
    metrics = await dispatch_once(database, readings(calls))
    assert calls == [["r1"], ["r1"]]
    assert metrics.registry.get_sample_value("relay_inbox_failed_total") == 2
    assert metrics.registry.get_sample_value("relay_inbox_dead_total") == 1
    assert sum("failed (dead)" in r.getMessage() for r in caplog.records) == 1
    after = state(effects)
    assert after["deep"][:2] == ("dead", 1) and after["r1"][:2] == ("pending", 1)


# --------------------------------------------------------------------------
# Tracing: one span per message, linked to the spans of its batch's calls
# --------------------------------------------------------------------------


async def test_each_message_has_a_span_linked_to_its_batch_calls(effects, database, monkeypatch):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind, StatusCode

    from relay import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "enabled", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("relay"))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    store(effects, [Planned("r1"), Planned("r2", fail=True)])
    rows(
        effects,
        "UPDATE inbox SET headers = CAST(:h AS jsonb) WHERE message_id = 'r1'",
        h=orjson.dumps({"traceparent": f"00-{trace_id}-{parent_id}-01"}).decode(),
    )
    await dispatch_once(database, readings([]))
    spans = exporter.get_finished_spans()
    calls = {s.context.span_id: s for s in spans if s.name == "process batch Reading"}
    assert len(calls) == 3  # the whole batch, then each half
    by_id = {s.attributes["messaging.message.id"]: s for s in spans if s.name == "process readings"}
    assert set(by_id) == {"r1", "r2"}
    r1, r2 = by_id["r1"], by_id["r2"]
    assert r1.kind == SpanKind.CONSUMER
    assert (f"{r1.context.trace_id:032x}", f"{r1.parent.span_id:016x}") == (trace_id, parent_id)
    assert r2.parent is None  # no traceparent: a trace of its own
    # Each is linked to the calls it took part in: the whole, then its half.
    for span in (r1, r2):
        linked = [calls[link.context.span_id] for link in span.links]
        assert [c.attributes["messaging.batch.message_count"] for c in linked] == [2, 1]
    assert r1.status.status_code == StatusCode.UNSET
    assert r2.status.status_code == StatusCode.ERROR
    assert "bad readings" in r2.status.description


# --------------------------------------------------------------------------
# The inbox loop: retries, dead rows, --on-dead, async batch handlers
# --------------------------------------------------------------------------


async def test_an_always_failing_message_ends_dead_at_max_attempts(effects, loop_urls):
    async with LoopInbox(loop_urls, readings([]), max_attempts=3) as inbox:
        for i in range(20):
            body = orjson.dumps({"fail": i == 5})
            inbox.send(body, message_id=f"r{i:02}", type="Reading")
        await inbox.until(lambda: state_of(effects, "r05") == "dead")
        await inbox.until(lambda: len(effect_ids(effects)) == 19)
    found = {r[0]: r[1:3] for r in inbox_rows(effects)}
    assert found.pop("r05") == ("dead", 3)
    assert set(found.values()) == {("processed", 0)}
    assert sorted(effect_ids(effects)) == sorted(found)


@pytest.mark.parametrize("on_dead", ["skip", "block"])
async def test_on_dead_holds_or_frees_the_dead_messages_key(effects, loop_urls, on_dead):
    store(effects, [Planned("a1", "a", fail=True), Planned("b1", "b")])
    async with LoopInbox(loop_urls, readings([]), max_attempts=1, on_dead=on_dead) as inbox:
        await inbox.until(lambda: state_of(effects, "a1") == "dead")
        store(effects, [Planned("a2", "a"), Planned("b2", "b")])
        await inbox.until(lambda: state_of(effects, "b2") == "processed")
        if on_dead == "skip":
            await inbox.until(lambda: state_of(effects, "a2") == "processed")
        else:
            await asyncio.sleep(1.5)  # three polls
            assert state_of(effects, "a2") == "pending"


async def test_an_async_batch_handler_gets_an_async_connection(effects, loop_urls):
    seen: list[tuple[list[str], object]] = []
    registry = relay.HandlerRegistry()

    @registry.batch_handler("Reading", max_size=50)
    async def on_readings(messages: list[relay.Message], conn: AsyncConnection) -> None:
        seen.append(([m.id for m in messages], conn))
        await conn.execute(_INSERT_MANY, {"ids": [m.id for m in messages]})
        if any(m.payload["fail"] for m in messages):
            raise RuntimeError("bad reading")

    store(effects, [Planned(f"r{i:02}", fail=i == 3) for i in range(10)])
    async with LoopInbox(loop_urls, registry, max_attempts=1) as inbox:
        await inbox.until(lambda: state_of(effects, "r03") == "dead")
        await inbox.until(lambda: len(effect_ids(effects)) == 9)
    assert all(isinstance(conn, AsyncConnection) for _, conn in seen)
    assert sorted(effect_ids(effects)) == [f"r{i:02}" for i in range(10) if i != 3]
    assert all(ids == sorted(ids) for ids, _ in seen)


async def test_a_hung_batch_call_fails_its_messages_once_then_only_the_one_that_hangs(
    effects, rabbit, inbox
):
    """Which message of a hung call hangs is not known: the attempt counts on
    each, the daemon exits for a restart, and then each runs alone (they
    failed before): only the one that hangs again fails again."""
    rows(
        effects,
        "INSERT INTO inbox (consumer, message_id, key, type, payload) VALUES "
        "(:c, 'm1', 'a', 'BatchHang', '{}'), (:c, 'm2', 'a', 'BatchHang', '{\"hang\": true}'), "
        "(:c, 'm3', 'a', 'BatchHang', '{}')",
        c=f"{rabbit.exchange}.in",
    )
    args = ("--handler-timeout", "1", "--max-attempts", "2")

    def attempts() -> dict[str, tuple[str, int]]:
        return {m: (s, a) for m, s, a, *_ in inbox_rows(effects)}

    first = inbox(*args)
    assert first.wait(60) == 1
    assert "handler hung: still running after" in first.log
    assert attempts() == {"m1": ("pending", 1), "m2": ("pending", 1), "m3": ("pending", 1)}
    second = inbox(*args)  # the supervisor's restart: m1 alone, then m2 alone hangs
    assert second.wait(60) == 1
    assert attempts()["m2"] == ("dead", 2)
    third = inbox(*args)
    wait_until(lambda: sorted(effect_ids(effects)) == ["m1", "m3"], timeout=30)
    assert attempts() == {"m1": ("processed", 1), "m2": ("dead", 2), "m3": ("processed", 1)}
    third.stop()
    assert third.proc.returncode == 0


# --------------------------------------------------------------------------
# relay.testing
# --------------------------------------------------------------------------


def test_relay_testing_runs_a_batch_handler_as_the_daemon_would(effects):
    calls: list[list[str]] = []
    items = [
        message("Reading", {"fail": False}, id="m1", key="a"),
        message("Reading", {"fail": True}, id="m2", key="a"),
        message("Reading", {"fail": False}, id="m3", key="b"),
        message("Reading", {"fail": False}, id="m4", key="a"),  # held behind m2
    ]
    with effects.begin() as conn:
        result = handle_batch(readings(calls, max_size=3), conn, "Reading", items)
        written = [r[0] for r in conn.execute(sa.text("SELECT message_id FROM effects"))]
    assert [m.id for m in result.processed] == ["m1", "m3"]
    [(failed, exc)] = result.failed
    assert failed.id == "m2" and isinstance(exc, ValueError)
    assert [m.id for m in result.held] == ["m4"]
    assert sorted(written) == ["m1", "m3"]
    assert calls[0] == ["m1", "m2", "m3"]  # up to max_size per call
    with effects.begin() as conn, pytest.raises(TypeError, match="handle_batch_async"):
        registry = relay.HandlerRegistry()
        registry.batch_handler("A")(_async_noop)
        handle_batch(registry, conn, "A", [{}])


async def _async_noop(messages: list[relay.Message], conn: Any) -> None:
    return None


async def test_relay_testing_runs_an_async_batch_handler(effects, database):
    registry = relay.HandlerRegistry()

    @registry.batch_handler("Reading")
    async def on_readings(messages: list[relay.Message], conn: AsyncConnection) -> None:
        await conn.execute(_INSERT_MANY, {"ids": [m.id for m in messages]})
        if any(m.payload["fail"] for m in messages):
            raise RuntimeError("bad reading")

    engine = create_async_engine(database.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        async with engine.begin() as conn:
            payloads = [{"fail": n == 2} for n in range(5)]
            result = await handle_batch_async(registry, conn, "Reading", payloads)
            written = (await conn.execute(sa.text("SELECT count(*) FROM effects"))).scalar()
    finally:
        await engine.dispose()
    assert [m.payload for m, _ in result.failed] == [{"fail": True}]
    assert len(result.processed) == 4 and written == 4


# --------------------------------------------------------------------------
# `relay inbox` on RabbitMQ
# --------------------------------------------------------------------------


async def test_relay_inbox_runs_a_batch_handler_end_to_end(effects, rabbit, inbox):
    daemon = inbox("--max-attempts", "2", "--prefetch", "200")
    for i in range(60):
        await rabbit.publish(
            "readings",
            orjson.dumps({"n": i, "fail": i == 7}),
            message_id=f"r{i:02}",
            type="BatchEffect",
            headers={"x-relay-key": f"k{i % 4}"},
        )
    wait_until(
        lambda: rows(effects, "SELECT status FROM inbox WHERE message_id = 'r07'") == [("dead",)]
    )
    held = [f"r{i:02}" for i in range(8, 60, 4)]  # later messages of r07's key k3
    wait_until(lambda: len(effect_ids(effects)) == 60 - 1)
    daemon.stop()
    found = {r[0]: r[1:3] for r in inbox_rows(effects)}
    assert found.pop("r07") == ("dead", 2)
    assert set(found.values()) == {("processed", 0)}, found
    effects_by_id = effect_ids(effects)
    assert sorted(effects_by_id) == sorted(found)
    # Per key, the effects are in seq order; r07's key waited for it.
    for k in range(4):
        of_key = [m for m in effects_by_id if int(m[1:]) % 4 == k]
        assert of_key == sorted(of_key)
    assert all(m in found for m in held)
