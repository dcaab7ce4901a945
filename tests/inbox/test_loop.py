"""The inbox loop itself (receive → store → ack, claim → handlers → mark, the
savepoints, retries and dead rows), in this process on the memory broker
against the real PostgreSQL.

The broker is irrelevant to these behaviours, so the inbox is the one
relay.wiring.inbox_service builds, its receiver on this event loop and fed
by a memory broker's consumer (relay.brokers.memory). What each real broker
carries (id, type and its fallback, key, headers, body) is the contract
suite's (tests/brokers/test_contract.py); `relay inbox` end to end, with its
receiver process and its pacing, is tests/inbox/test_inbox.py's.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Self

import orjson
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection

import relay
from relay.brokers.memory import MemoryBroker
from relay.config import InboxSettings
from relay.db import Store
from relay.errors import DatabaseUnavailable
from relay.inbox import DISPATCHERS, Dispatcher, DispatcherThread
from relay.lifecycle import EXIT_OK, Daemon
from relay.metrics import InboxMetrics
from relay.rows import NewInboxRow, Reserved
from relay.wiring import inbox_dispatcher, inbox_service
from tests.apps.handlers import mixed_registry
from tests.apps.handlers import registry as sync_registry
from tests.conftest import effect_ids, inbox_rows, keys_by_share, rows, until

QUEUE = "in"  # the memory broker's queue, bound to every topic; the consumer's name too


class LoopInbox:
    """relay's inbox as inbox_service builds it (receiver, pace, three
    dispatcher threads, listener, jobs) under a lifecycle Daemon on this
    event loop, receiving from a memory broker, on the database settings
    `urls` (the loop_urls fixture). Short backoff (0.2 to 0.5 s) and poll
    (0.5 s), as the daemon tests run it."""

    def __init__(
        self, urls: dict[str, str], registry: relay.HandlerRegistry, **settings: Any
    ) -> None:
        settings = {"poll_interval": 0.5, "backoff_min": 0.2, "backoff_max": 0.5, **settings}
        self.broker = MemoryBroker()
        self.broker.bind(QUEUE, "#")
        config = InboxSettings(queue=QUEUE, **urls, **settings)
        service = inbox_service(config, registry, consumer=self.broker.consumer(QUEUE))
        self.daemon = Daemon("inbox", [service], shutdown_timeout=10)
        self.running: asyncio.Task[int] | None = None

    def send(self, body: bytes = b'{"n": 1}', topic: str = "orders.placed", **fields: Any) -> None:
        """A message from any producer (message_id, type, key, headers)."""
        self.broker.send(topic, body, **fields)

    def metric(self, name: str) -> float:
        """A counter's value, from the daemon's /metrics text."""
        text = (self.daemon.metrics() or b"").decode()
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        assert found is not None, f"no {name} in the metrics"
        return float(found[1])

    async def until(self, predicate: Callable[[], Any], timeout: float = 15) -> Any:
        """Wait for `predicate` (run on this loop, between the inbox's turns)."""

        def alive_and(check: Callable[[], Any]) -> Any:
            assert self.running is not None and not self.running.done(), "the inbox stopped"
            return check()

        return await until(lambda: alive_and(predicate), timeout)

    async def __aenter__(self) -> Self:
        self.running = asyncio.create_task(self.daemon.run())
        started = asyncio.ensure_future(self.daemon.started_event.wait())
        await asyncio.wait({self.running, started}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if not self.daemon.started:
            self.daemon.request_stop("not started in 30 s")
            raise AssertionError(f"the inbox did not start: {await self.running}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.daemon.request_stop("test over")
        assert self.running is not None
        assert await asyncio.wait_for(self.running, 30) == EXIT_OK


def state_of(engine: sa.Engine, message_id: str) -> str | None:
    found = rows(engine, "SELECT status FROM inbox WHERE message_id = :m", m=message_id)
    return found[0][0] if found else None


def store_rows(engine: sa.Engine, planned: list[tuple[str, str | None, str, object, int]]) -> None:
    """Inbox rows as the receiver stores them, pending, before a dispatcher
    claims them: (message_id, key, type, payload, attempts)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer, message_id, topic, key, type, payload, attempts) "
                "VALUES (:c, :m, 't', :k, :t, CAST(:p AS jsonb), :a)"
            ),
            [
                {"c": QUEUE, "m": m, "k": key, "t": t, "p": orjson.dumps(p).decode(), "a": a}
                for m, key, t, p, a in planned
            ],
        )


_INSERT_EFFECT = sa.text("INSERT INTO effects (message_id) VALUES (:m)")


def recording_registry(ran: list[str]) -> relay.HandlerRegistry:
    """Handlers that note each run in `ran` and write an effect: Record, Fail
    (then raises) and Swallow (catches a database error and returns)."""
    registry = relay.HandlerRegistry()

    @registry.handler("Record")
    def record(message: relay.Message, conn: sa.Connection) -> None:
        ran.append(message.id)
        conn.execute(_INSERT_EFFECT, {"m": message.id})

    @registry.handler("Fail")
    def fail(message: relay.Message, conn: sa.Connection) -> None:
        ran.append(message.id)
        conn.execute(_INSERT_EFFECT, {"m": message.id})
        raise RuntimeError("fails after writing")

    @registry.handler("Swallow")
    def swallow(message: relay.Message, conn: sa.Connection) -> None:
        ran.append(message.id)
        conn.execute(_INSERT_EFFECT, {"m": message.id})
        try:
            conn.execute(sa.text("SELECT 1 / 0"))
        except sa.exc.DBAPIError:
            pass  # and returns as if all went well

    return registry


# Each dispatcher path: sync handlers only (psycopg's blocking connection),
# and sync with async handlers (the async engine, an async handler failing).
BOTH_PATHS = pytest.mark.parametrize(
    ("handlers", "flaky", "effect"),
    [(sync_registry, "Flaky", "Effect"), (mixed_registry, "AsyncFlaky", "AsyncEffect")],
    ids=["sync", "mixed"],
)


# --------------------------------------------------------------------------
# What the receiver stores
# --------------------------------------------------------------------------


async def test_non_json_body_is_kept_and_dead(effects, loop_urls):
    body = b"\xff\xfe not json"
    async with LoopInbox(loop_urls, sync_registry) as inbox:
        inbox.send(body, message_id="bad-1", type="Effect")
        inbox.send(b'{"nul": "\\u0000"}', message_id="bad-2", type="Effect")
        inbox.send(message_id="ok-1", type="Effect")
        await inbox.until(lambda: effect_ids(effects) == ["ok-1"])
    stored = {
        r[0]: r
        for r in rows(effects, "SELECT message_id, status, payload, body, last_error FROM inbox")
    }
    assert stored["bad-1"][1:4] == ("dead", None, body)
    assert "not valid JSON" in stored["bad-1"][4]
    assert stored["bad-2"][1] == "dead" and bytes(stored["bad-2"][3]) == b'{"nul": "\\u0000"}'
    assert "NUL character" in stored["bad-2"][4]


async def test_missing_message_id_dedups_by_body_hash(effects, loop_urls):
    expected = "sha256:" + hashlib.sha256(b'{"n": 9}').hexdigest()
    async with LoopInbox(loop_urls, sync_registry) as inbox:
        for _ in range(3):
            inbox.send(b'{"n": 9}', type="Effect")
        await inbox.until(lambda: inbox.metric("relay_inbox_received_total") == 3)
        await inbox.until(lambda: state_of(effects, expected) == "processed")
        assert inbox.metric("relay_inbox_duplicates_total") == 2
    assert [r[0] for r in inbox_rows(effects)] == [expected]
    assert effect_ids(effects) == [expected]


async def test_every_handler_run_is_in_the_handler_seconds_histogram(effects, loop_urls):
    # The dispatchers put a batch's runs into the histogram at its end:
    # failed runs too, and the runs rolled back to run again.
    async with LoopInbox(loop_urls, sync_registry, max_attempts=1) as inbox:
        for n in range(40):
            inbox.send(b'{"n": 1}', message_id=f"h-{n}", type="Effect")
        inbox.send(b'{"n": 1}', message_id="h-fails", type="AlwaysFails")
        await inbox.until(lambda: inbox.metric("relay_inbox_processed_total") == 40)
        await inbox.until(lambda: inbox.metric("relay_inbox_failed_total") == 1)
        runs = 41 + inbox.metric("relay_inbox_handler_reruns_total")
        assert inbox.metric("relay_inbox_handler_seconds_count") == runs
        assert inbox.metric('relay_inbox_handler_seconds_bucket{le="+Inf"}') == runs
        assert 0 < inbox.metric("relay_inbox_handler_seconds_sum") < runs * 5


# --------------------------------------------------------------------------
# The handlers' runs, retries and dead rows
# --------------------------------------------------------------------------


async def test_sync_and_async_handlers_each_get_their_kind_of_connection(effects, loop_urls):
    seen: dict[str, object] = {}
    registry = relay.HandlerRegistry()

    @registry.handler("Sync")
    def on_sync(message: relay.Message, conn: sa.Connection) -> None:
        seen[message.id] = conn
        conn.execute(_INSERT_EFFECT, {"m": message.id})

    @registry.handler("Async")
    async def on_async(message: relay.Message, conn: AsyncConnection) -> None:
        seen[message.id] = conn
        await conn.execute(_INSERT_EFFECT, {"m": message.id})

    async with LoopInbox(loop_urls, registry) as inbox:
        inbox.send(message_id="s-1", type="Sync")
        inbox.send(message_id="a-1", type="Async")
        await inbox.until(lambda: sorted(r[1] for r in inbox_rows(effects)) == ["processed"] * 2)
    assert isinstance(seen["a-1"], AsyncConnection)
    assert isinstance(seen["s-1"], sa.Connection)
    assert sorted(effect_ids(effects)) == ["a-1", "s-1"]


@BOTH_PATHS
async def test_fail_then_succeed_retries_with_backoff(effects, loop_urls, handlers, flaky, effect):
    async with LoopInbox(loop_urls, handlers) as inbox:
        inbox.send(b'{"fail_times": 2, "n": 1}', message_id="f-1", type=flaky)
        await inbox.until(lambda: state_of(effects, "f-1") == "processed")
    [(_, status, attempts, error, *_)] = inbox_rows(effects)
    assert (status, attempts, error) == ("processed", 2, None)
    # The two failed runs rolled back their writes; the third stayed.
    assert effect_ids(effects) == ["f-1"]


@BOTH_PATHS
async def test_a_failing_handler_mid_batch_rolls_back_only_its_own_writes(
    effects, loop_urls, handlers, flaky, effect
):
    # Rows already stored before the inbox starts are claimed as one batch:
    # a failure in its middle rolls back only its own writes. Their keys are
    # all in the share of one dispatcher (the dispatchers split the keys by
    # hash).
    k = keys_by_share(effects, DISPATCHERS)[0][:12]
    planned = [(f"e{i}", k[i], "Record", {"n": i}) for i in range(5)]
    planned += [
        ("flaky", k[10], flaky, {"n": 99, "fail_times": 1}),
        ("after-flaky", k[10], effect, {"n": 100}),  # waits for its key
        ("unknown", k[11], "NobodyHandlesThis", {"n": 101}),
    ]
    planned += [(f"e{i}", k[i], effect, {"n": i}) for i in range(5, 10)]
    store_rows(effects, [(m, key, t, p, 0) for m, key, t, p in planned])
    ran: list[str] = []
    registry = relay.HandlerRegistry()
    registry.include(handlers)
    registry.include(recording_registry(ran))
    async with LoopInbox(loop_urls, registry) as inbox:
        await inbox.until(
            lambda: (
                rows(effects, "SELECT count(*) FROM inbox WHERE status <> 'pending'")
                == [(len(planned),)]
            )
        )
    state = {
        m: (status, attempts, processed_at)
        for m, status, attempts, processed_at in rows(
            effects, "SELECT message_id, status, attempts, processed_at FROM inbox"
        )
    }
    # Every handler's writes landed exactly once, the failed run's not at all.
    expected = sorted(m for m, _, t, _ in planned if t in (effect, "Record", flaky))
    assert sorted(effect_ids(effects)) == expected
    # The handlers before the failure ran again after the batch's roll back,
    # unless a checkpoint (CHECKPOINT_EVERY) fell between: once or twice
    # each, never more (the exact runs: test_handler_runs_of_one_batch_*).
    for i in range(5):
        assert ran.count(f"e{i}") in (1, 2), ran
    # The failure was counted once; the row succeeded on its retry.
    assert state["flaky"][:2] == ("processed", 1)
    assert state["unknown"][:2] == ("dead", 1)
    # The plain rows went in the first batch, together...
    first_batch = {state[f"e{i}"][2] for i in range(10)}
    assert len(first_batch) == 1 and all(state[f"e{i}"][:2] == ("processed", 0) for i in range(10))
    # ... and the row behind the failed one waited for it, untouched.
    assert state["after-flaky"][:2] == ("processed", 0)
    assert state["after-flaky"][2] >= state["flaky"][2] > first_batch.pop()


async def test_always_failing_handler_ends_dead_with_no_effect(effects, loop_urls):
    async with LoopInbox(loop_urls, sync_registry, max_attempts=3) as inbox:
        inbox.send(message_id="x-1", type="AlwaysFails")
        await inbox.until(lambda: state_of(effects, "x-1") == "dead")
    [(_, status, attempts, error, *_)] = inbox_rows(effects)
    assert (status, attempts) == ("dead", 3)
    assert error.startswith("Traceback")
    assert "ValueError: this handler always fails" in error
    assert "always_fails" in error  # the traceback names the handler
    assert effect_ids(effects) == []


async def test_unknown_type_is_dead_at_once_naming_the_type(effects, loop_urls):
    async with LoopInbox(loop_urls, sync_registry) as inbox:
        inbox.send(message_id="u-1", type="NobodyHandlesThis")
        await inbox.until(lambda: state_of(effects, "u-1") == "dead")
    [(_, _status, attempts, error, *_)] = inbox_rows(effects)
    assert attempts == 1
    assert "NobodyHandlesThis" in error


# --------------------------------------------------------------------------
# One batch of a Dispatcher: which handlers ran, how often and in what
# order, and what each savepoint kept
# --------------------------------------------------------------------------


async def one_batch(
    engine: sa.Engine,
    database: str,
    planned: list[tuple[str, str, str | None, int]],
    *,
    sync: bool = True,
) -> tuple[list[str], float | None, dict[str, tuple[str, int, str | None]]]:
    """Store `planned` rows (message_id, type, key, attempts) and run one batch;
    returns the handler runs in order, the reruns counted, and each
    row's (status, attempts, last_error)."""
    store_rows(engine, [(m, key, t, {}, a) for m, t, key, a in planned])
    ran: list[str] = []
    settings = InboxSettings(database_url=database, queue=QUEUE, backoff_min=30, backoff_max=60)
    metrics = InboxMetrics()
    store = Store(database, sync=sync)
    try:
        dispatcher = inbox_dispatcher(settings, store, recording_registry(ran), metrics)
        await dispatcher.dispatch_batch()
    finally:
        await store.close()
    state = {
        m: (status, attempts, error)
        for m, status, attempts, error in rows(
            engine, "SELECT message_id, status, attempts, last_error FROM inbox"
        )
    }
    return ran, metrics.registry.get_sample_value("relay_inbox_handler_reruns_total"), state


@pytest.mark.parametrize("sync", [True, False], ids=["sync-engine", "async-engine"])
async def test_handler_runs_of_one_batch_a_first_failure_runs_those_before_it_again(
    effects, database, monkeypatch, sync
):
    monkeypatch.setattr("relay.inbox.CHECKPOINT_EVERY", 3600.0)  # no checkpoint here
    ran, reruns, state = await one_batch(
        effects,
        database,
        [
            ("a", "Record", None, 0),
            ("b", "Record", "k", 0),
            ("f", "Fail", "k", 0),
            ("g", "Record", "k", 0),
            ("c", "Record", None, 0),
        ],
        sync=sync,
    )
    # The batch's one savepoint rolled back at f's failure, and the batch ran
    # on from its start, a savepoint per handler: a and b again, f not (its
    # failure is recorded), g waits behind f's key.
    assert ran == ["a", "b", "f", "a", "b", "c"]
    assert reruns == 2
    assert sorted(effect_ids(effects)) == ["a", "b", "c"]
    assert {m: v[:2] for m, v in state.items()} == {
        "a": ("processed", 0),
        "b": ("processed", 0),
        "f": ("pending", 1),
        "g": ("pending", 0),
        "c": ("processed", 0),
    }
    assert "RuntimeError: fails after writing" in state["f"][2]


async def test_handler_runs_of_one_batch_rows_that_failed_before_run_each_in_its_own_savepoint(
    effects, database
):
    ran, reruns, state = await one_batch(
        effects,
        database,
        [("a", "Record", None, 0), ("f", "Fail", None, 1), ("c", "Record", None, 0)],
    )
    assert ran == ["a", "f", "c"]  # nothing ran twice
    assert reruns == 0
    assert sorted(effect_ids(effects)) == ["a", "c"]
    assert state["f"][:2] == ("pending", 2)


async def test_handler_runs_of_one_batch_a_failure_goes_back_only_to_the_last_checkpoint(
    effects, database, monkeypatch
):
    # The batch's savepoint moves on before every handler here (as it does
    # every CHECKPOINT_EVERY seconds): f's failure undoes only its own run.
    monkeypatch.setattr("relay.inbox.CHECKPOINT_EVERY", -1.0)
    ran, reruns, state = await one_batch(
        effects,
        database,
        [
            ("a", "Record", None, 0),
            ("f", "Fail", "k", 0),
            ("g", "Record", "k", 0),
            ("c", "Record", None, 0),
        ],
    )
    assert ran == ["a", "f", "c"]
    assert reruns == 0  # f's own run rolled back, nobody else's
    assert sorted(effect_ids(effects)) == ["a", "c"]
    assert {m: v[:2] for m, v in state.items()} == {
        "a": ("processed", 0),
        "f": ("pending", 1),
        "g": ("pending", 0),
        "c": ("processed", 0),
    }


@pytest.mark.parametrize("attempts", [0, 1], ids=["first-run", "after-a-failure"])
async def test_a_handler_that_swallows_a_database_error_fails_its_row_only(
    effects, database, attempts
):
    # A caught database error leaves the transaction aborted: the handler's
    # run counts as failed (its writes roll back), its neighbours' stay.
    ran, reruns, state = await one_batch(
        effects,
        database,
        [("a", "Record", None, 0), ("s", "Swallow", None, attempts), ("c", "Record", None, 0)],
    )
    assert sorted(effect_ids(effects)) == ["a", "c"]
    assert state["a"][:2] == state["c"][:2] == ("processed", 0)
    status, tries, error = state["s"]
    assert (status, tries) == ("pending", attempts + 1)
    assert "left its transaction aborted" in error
    assert ran == (["a", "s", "a", "c"] if attempts == 0 else ["a", "s", "c"])
    assert reruns == (1 if attempts == 0 else 0)


async def test_a_handler_whose_statement_meets_a_read_only_database_did_not_fail(
    effects, loop_urls
):
    # The answer of a failing-over database (25006) inside a handler is the
    # database's, not the handler's: no attempt, no last_error; the row runs
    # again on a new connection once the database takes writes.
    registry = relay.HandlerRegistry()
    runs: list[int] = []

    @registry.handler("Write")
    def write(message: relay.Message, conn: sa.Connection) -> None:
        runs.append(message.attempts)
        if len(runs) == 1:  # as if the server turned read only under the handler
            conn.execute(sa.text("SET transaction_read_only = on"))
        conn.execute(_INSERT_EFFECT, {"m": message.id})

    async with LoopInbox(loop_urls, registry) as inbox:
        inbox.send(message_id="ro-1", type="Write")
        await inbox.until(lambda: state_of(effects, "ro-1") == "processed")
    assert effect_ids(effects) == ["ro-1"]
    assert rows(effects, "SELECT attempts, last_error FROM inbox") == [(0, None)]
    assert runs == [0, 0]


async def test_a_batch_handed_to_a_dispatcher_that_has_stopped_is_refused_for_redelivery(
    engine, database
):
    """Stopping, the receiver can still be storing a batch after a dispatcher
    thread has ended (relay demo's --duration met this): the batch is refused
    as unavailable, so that it stays unacknowledged for the broker to deliver
    again, instead of crashing the daemon on the thread's closed event loop."""
    settings = InboxSettings(database_url=database, queue=QUEUE)
    metrics = InboxMetrics()

    def make() -> tuple[Store, Dispatcher]:
        store = Store(database)
        return store, inbox_dispatcher(settings, store, sync_registry, metrics)

    thread = DispatcherThread(make)
    running = asyncio.ensure_future(thread.run())
    await until(lambda: thread.dispatcher is not None)
    thread.stop()
    await asyncio.wait_for(running, 10)
    row = NewInboxRow("late-1", None, "k", "Effect", "{}", None, "{}")
    future = thread.submit([row], Reserved([1], datetime.now(UTC)))
    with pytest.raises(DatabaseUnavailable, match="stopping"):
        future.result(timeout=5)
    assert inbox_rows(engine) == []
