"""`relay inbox` against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa

import relay
from relay.config import InboxSettings
from relay.db import Store
from relay.inbox import DISPATCHERS, Dispatcher
from relay.metrics import InboxMetrics
from relay.pacing import PACE_BATCHES
from tests.conftest import (
    HANDLERS,
    MIXED_HANDLERS,
    keys_by_share,
    process_gone,
    receiver_processes,
    rows,
    wait_until,
)


def inbox_rows(engine):
    return rows(
        engine,
        "SELECT message_id, status, attempts, last_error, type, key, topic FROM inbox ORDER BY seq",
    )


def effect_ids(engine):
    return [r[0] for r in rows(engine, "SELECT message_id FROM effects ORDER BY id")]


def one_dispatchers_keys(engine, count):
    """`count` keys that the same dispatcher of a daemon claims."""
    return keys_by_share(engine, DISPATCHERS)[0][:count]


def store_rows(engine, consumer, planned):
    """Inbox rows as the receiver stores them, pending, before a dispatcher
    claims them: (message_id, key, type, payload, attempts)."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer, message_id, topic, key, type, payload, attempts) "
                "VALUES (:c, :m, 't', :k, :t, CAST(:p AS jsonb), :a)"
            ),
            [
                {"c": consumer, "m": m, "k": key, "t": t, "p": orjson.dumps(p).decode(), "a": a}
                for m, key, t, p, a in planned
            ],
        )


async def publish(rabbit, routing_key="orders.placed", body=b'{"n": 1}', **props):
    await rabbit.publish(routing_key, body, **props)


async def test_message_is_stored_handled_and_marked_processed(effects, rabbit, inbox):
    daemon = inbox()
    await publish(
        rabbit,
        body=b'{"n": 5}',
        message_id="m-1",
        type="Effect",
        headers={"x-relay-key": "order-5", "traceparent": "00-aa-bb-01"},
    )
    wait_until(lambda: effect_ids(effects) == ["m-1"])
    wait_until(lambda: inbox_rows(effects)[0][1] == "processed")
    [(message_id, status, attempts, error, type_, key, topic)] = inbox_rows(effects)
    assert (message_id, status, attempts, error) == ("m-1", "processed", 0, None)
    assert (type_, key, topic) == ("Effect", "order-5", "orders.placed")
    [(payload, headers, processed_at)] = rows(
        effects, "SELECT payload, headers, processed_at FROM inbox"
    )
    assert payload == {"n": 5}
    assert headers["traceparent"] == "00-aa-bb-01"
    assert processed_at is not None
    assert rows(effects, "SELECT n, key, traceparent FROM effects") == [
        (5, "order-5", "00-aa-bb-01")
    ]
    daemon.stop()
    assert daemon.proc.returncode == 0


async def test_async_handler_gets_an_async_connection(effects, rabbit, inbox):
    inbox(handlers=MIXED_HANDLERS)
    await publish(rabbit, message_id="a-1", type="AsyncEffect")
    wait_until(lambda: effect_ids(effects) == ["a-1"])
    wait_until(lambda: inbox_rows(effects)[0][1] == "processed")


async def test_same_message_three_times_to_three_inboxes_gives_one_row_and_one_effect(
    effects, rabbit, inbox
):
    daemons = [inbox() for _ in range(3)]
    for _ in range(3):
        await asyncio.gather(
            *[
                publish(rabbit, message_id=f"dup-{i}", type="Effect", body=b'{"n": %d}' % i)
                for i in range(20)
            ]
        )
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox WHERE status = 'processed'")) == 20)
    time.sleep(1)  # any second effect would have landed by now
    assert sorted(effect_ids(effects)) == sorted(f"dup-{i}" for i in range(20))
    assert len(rows(effects, "SELECT 1 FROM inbox")) == 20
    # Every copy was acknowledged: the queue is empty.
    probe = await rabbit.connection.channel()
    declared = await probe.declare_queue(daemons[0].queue, passive=True)
    wait_until(lambda: True)
    assert declared.declaration_result.message_count == 0


# Each dispatcher path: sync handlers only (psycopg's blocking connection),
# and sync with async handlers (the async engine, an async handler failing).
BOTH_PATHS = pytest.mark.parametrize(
    ("handlers", "flaky", "effect"),
    [(HANDLERS, "Flaky", "Effect"), (MIXED_HANDLERS, "AsyncFlaky", "AsyncEffect")],
    ids=["sync", "mixed"],
)


@BOTH_PATHS
async def test_fail_then_succeed_retries_with_backoff(
    effects, rabbit, inbox, handlers, flaky, effect
):
    inbox(handlers=handlers)
    await publish(rabbit, message_id="f-1", type=flaky, body=b'{"fail_times": 2, "n": 1}')
    wait_until(lambda: inbox_rows(effects) and inbox_rows(effects)[0][1] == "processed")
    [(_, status, attempts, error, *_)] = inbox_rows(effects)
    assert (status, attempts, error) == ("processed", 2, None)
    # The two failed runs rolled back their writes; the third stayed.
    assert effect_ids(effects) == ["f-1"]


@BOTH_PATHS
async def test_a_failing_handler_mid_batch_rolls_back_only_its_own_writes(
    effects, rabbit, inbox, handlers, flaky, effect
):
    # Rows already stored before the daemon starts are claimed as one batch:
    # a failure in its middle rolls back only its own writes. Their keys are
    # all in the share of one dispatcher (the daemon's dispatchers split the
    # keys by hash).
    consumer = f"{rabbit.exchange}.in"
    k = one_dispatchers_keys(effects, 12)
    planned = [(f"e{i}", k[i], "Logs", {"n": i}) for i in range(5)]
    planned += [
        ("flaky", k[10], flaky, {"n": 99, "fail_times": 1}),
        ("after-flaky", k[10], effect, {"n": 100}),  # waits for its key
        ("unknown", k[11], "NobodyHandlesThis", {"n": 101}),
    ]
    planned += [(f"e{i}", k[i], effect, {"n": i}) for i in range(5, 10)]
    store_rows(effects, consumer, [(m, key, t, p, 0) for m, key, t, p in planned])
    daemon = inbox(handlers=handlers)
    wait_until(
        lambda: len(rows(effects, "SELECT 1 FROM inbox WHERE status <> 'pending'")) == len(planned)
    )
    state = {
        m: (status, attempts, processed_at)
        for m, status, attempts, processed_at in rows(
            effects, "SELECT message_id, status, attempts, processed_at FROM inbox"
        )
    }
    # Every handler's writes landed exactly once, the failed run's not at all.
    expected = sorted(m for m, _, t, _ in planned if t in (effect, "Logs", flaky))
    assert sorted(effect_ids(effects)) == expected
    # The "Logs" handlers before the failure ran again after the batch's roll
    # back, unless a checkpoint (CHECKPOINT_EVERY) fell between: once or twice
    # each, never more (the exact runs: test_handler_runs_of_one_batch_*).
    runs = [line for line in daemon.log.splitlines() if "handling" in line]
    for i in range(5):
        assert len([r for r in runs if re.search(rf"message_id=e{i}\b", r)]) in (1, 2), runs
    # The failure was counted once; the row succeeded on its retry.
    assert state["flaky"][:2] == ("processed", 1)
    assert state["unknown"][:2] == ("dead", 1)
    # The plain rows went in the first batch, together...
    first_batch = {state[f"e{i}"][2] for i in range(10)}
    assert len(first_batch) == 1 and all(state[f"e{i}"][:2] == ("processed", 0) for i in range(10))
    # ... and the row behind the failed one waited for it, untouched.
    assert state["after-flaky"][:2] == ("processed", 0)
    assert state["after-flaky"][2] >= state["flaky"][2] > first_batch.pop()


# One batch of a Dispatcher in this process, on the test's database: which
# handlers ran, how often and in what order (a daemon's process cannot say).

_INSERT_EFFECT = sa.text("INSERT INTO effects (message_id) VALUES (:m)")


def recording_registry(ran: list[str]) -> relay.HandlerRegistry:
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
    store_rows(engine, "q", [(m, key, t, {}, a) for m, t, key, a in planned])
    ran: list[str] = []
    settings = InboxSettings(database_url=database, queue="q", backoff_min=30, backoff_max=60)
    metrics = InboxMetrics()
    store = Store(database, sync=sync)
    try:
        dispatcher = Dispatcher(settings, store, recording_registry(ran), metrics)
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


async def test_receiver_stores_at_most_two_batches_per_dispatcher_ahead_of_slow_handlers(
    effects, rabbit, inbox
):
    # Batches of 5, each handler 50 ms: the backlog stays in the broker,
    # where another daemon could take it, instead of piling up in the table.
    limit = PACE_BATCHES * DISPATCHERS * 5
    assert limit < 100 / 2  # else the bound below would not show pacing
    inbox("--batch-size", "5")
    await asyncio.gather(
        *[
            publish(
                rabbit, message_id=f"s-{i}", type="Slow", body=b'{"n": %d, "seconds": 0.05}' % i
            )
            for i in range(100)
        ]
    )
    most_pending = 0
    while True:
        [(stored, pending)] = rows(
            effects, "SELECT count(*), count(*) FILTER (WHERE status = 'pending') FROM inbox"
        )
        most_pending = max(most_pending, pending)
        if stored == 100 and pending == 0:
            break
        time.sleep(0.05)
    # The limit, plus the batch taken while a dispatcher finished one.
    assert 0 < most_pending <= limit + 5
    assert sorted(effect_ids(effects)) == sorted(f"s-{i}" for i in range(100))


async def test_always_failing_handler_ends_dead_with_no_effect(effects, rabbit, inbox):
    inbox("--max-attempts", "3")
    await publish(rabbit, message_id="x-1", type="AlwaysFails")
    wait_until(lambda: inbox_rows(effects) and inbox_rows(effects)[0][1] == "dead")
    [(_, status, attempts, error, *_)] = inbox_rows(effects)
    assert (status, attempts) == ("dead", 3)
    assert error.startswith("Traceback")
    assert "ValueError: this handler always fails" in error
    assert "always_fails" in error  # the traceback names the handler
    assert effect_ids(effects) == []


async def test_unknown_type_is_dead_at_once_naming_the_type(effects, rabbit, inbox):
    inbox()
    await publish(rabbit, message_id="u-1", type="NobodyHandlesThis")
    wait_until(lambda: inbox_rows(effects) and inbox_rows(effects)[0][1] == "dead")
    [(_, _status, attempts, error, *_)] = inbox_rows(effects)
    assert attempts == 1
    assert "NobodyHandlesThis" in error


async def test_type_falls_back_to_the_routing_key(effects, rabbit, inbox):
    inbox()
    await publish(rabbit, routing_key="Effect", message_id="r-1")
    wait_until(lambda: effect_ids(effects) == ["r-1"])
    assert inbox_rows(effects)[0][4] == "Effect"


async def test_non_json_body_is_kept_and_dead(effects, rabbit, inbox):
    inbox()
    body = b"\xff\xfe not json"
    await publish(rabbit, message_id="bad-1", type="Effect", body=body)
    await publish(rabbit, message_id="bad-2", type="Effect", body=b'{"nul": "\\u0000"}')
    await publish(rabbit, message_id="ok-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["ok-1"])
    stored = {
        r[0]: r
        for r in rows(effects, "SELECT message_id, status, payload, body, last_error FROM inbox")
    }
    assert stored["bad-1"][1:4] == ("dead", None, body)
    assert "not valid JSON" in stored["bad-1"][4]
    assert stored["bad-2"][1] == "dead" and bytes(stored["bad-2"][3]) == b'{"nul": "\\u0000"}'
    assert "NUL character" in stored["bad-2"][4]


async def test_missing_message_id_dedups_by_body_hash(effects, rabbit, inbox):
    inbox()
    for _ in range(3):
        await rabbit.publish_without_message_id("orders", b'{"n": 9}', message_type="Effect")
    expected = "sha256:" + hashlib.sha256(b'{"n": 9}').hexdigest()
    wait_until(lambda: effect_ids(effects) == [expected])
    time.sleep(0.5)
    assert [r[0] for r in inbox_rows(effects)] == [expected]
    assert effect_ids(effects) == [expected]


async def test_per_key_dispatch_order_with_three_inboxes(effects, rabbit, inbox):
    for _ in range(3):
        inbox("--batch-size", "20")
    for n in range(600):
        await publish(
            rabbit,
            message_id=f"o-{n}",
            type="Effect",
            body=orjson.dumps({"n": n}),
            headers={"x-relay-key": f"k{n % 12}"},
        )
    wait_until(lambda: len(effect_ids(effects)) == 600, timeout=60)
    last: dict[str, int] = {}
    for key, n in rows(effects, "SELECT key, n FROM effects ORDER BY at, id"):
        assert n > last.get(key, -1), f"{key}: {n} handled after {last[key]}"
        last[key] = n


async def test_kill_9_of_the_inbox_takes_its_receiver_process_along(effects, rabbit, inbox):
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    wait_until(lambda: process_gone(receiver), timeout=5, message="receiver process gone")
    # Nothing is left consuming the queue: a message stays there for the next daemon.
    probe = await rabbit.connection.channel()
    for _ in range(100):
        declared = await probe.declare_queue(daemon.queue, passive=True)
        if declared.declaration_result.consumer_count == 0:
            break
        await asyncio.sleep(0.05)
    assert declared.declaration_result.consumer_count == 0
    await publish(rabbit, message_id="after-kill", type="Effect")
    await asyncio.sleep(0.5)
    declared = await probe.declare_queue(daemon.queue, passive=True)
    assert declared.declaration_result.message_count == 1
    inbox()
    wait_until(lambda: effect_ids(effects) == ["after-kill"])


async def test_a_receiver_process_that_dies_stops_the_inbox_with_status_1(effects, rabbit, inbox):
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    os.kill(receiver, signal.SIGKILL)
    assert daemon.wait(30) == 1
    assert "the receiver process exited with status -9" in daemon.log
    inbox()  # the supervisor's restart
    await publish(rabbit, message_id="after-restart", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["after-restart"])


async def test_ctrl_c_reaching_both_processes_still_stops_cleanly(effects, rabbit, inbox):
    # A terminal sends SIGINT to the whole process group: the receiver
    # process leaves stopping to the daemon, which stops it in order.
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    await publish(rabbit, message_id="before-stop", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["before-stop"])
    os.kill(receiver, signal.SIGINT)
    daemon.signal(signal.SIGINT)
    assert daemon.wait(30) == 0, daemon.log
    assert process_gone(receiver)
    assert "Traceback" not in daemon.log and "exited with status" not in daemon.log


async def test_status_and_retry_commands(effects, rabbit, inbox, run_relay):
    inbox("--max-attempts", "1")
    await publish(rabbit, message_id="s-1", type="AlwaysFails")
    await publish(rabbit, message_id="s-2", type="Effect")
    wait_until(lambda: sorted(r[1] for r in inbox_rows(effects)) == ["dead", "processed"])
    with effects.begin() as conn:
        relay.enqueue(conn, "t", {})
    result = run_relay("status", "--json")
    assert result.returncode == 0, result.stderr
    report = orjson.loads(result.stdout)
    assert report["inbox"] == {
        "pending": 0,
        "processed": 1,
        "dead": 1,
        "oldest_pending_seconds": None,
    }
    assert report["outbox"]["pending"] == 1
    assert report["outbox"]["oldest_pending_seconds"] >= 0
    text = run_relay("status")
    assert "inbox: pending 0, processed 1, dead 1" in text.stdout

    result = run_relay("retry", "inbox", "--id", "s-1", "--consumer", "someone-else")
    assert result.stdout.strip() == "retried 0 inbox rows"
    result = run_relay("retry", "inbox", "--all-dead")
    assert result.returncode == 0 and result.stdout.strip() == "retried 1 inbox row"
    # Retried and woken at once: it fails again (max-attempts 1) and is dead again.
    wait_until(
        lambda: (
            rows(effects, "SELECT attempts, status FROM inbox WHERE message_id = 's-1'")
            == [(1, "dead")]
        )
    )
    assert run_relay("retry", "outbox").returncode == 2
    bad = run_relay("retry", "outbox", "--id", "not-a-uuid")
    assert bad.returncode == 2 and "not-a-uuid" in bad.stderr


async def test_handlers_module_is_found_in_the_working_directory(
    effects, rabbit, relay_env, tmp_path
):
    """`relay inbox --handlers app_handlers` run from the app's own checkout
    finds app_handlers.py there, as Celery and uvicorn find theirs."""
    (tmp_path / "cwd_handlers.py").write_text(
        "import relay\nimport sqlalchemy as sa\nregistry = relay.HandlerRegistry()\n"
        "@registry.handler('CwdEffect')\n"
        "def effect(message, conn):\n"
        "    conn.execute(sa.text('INSERT INTO effects (message_id) VALUES (:m)'), "
        "{'m': message.id})\n"
    )
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)
    log = tmp_path / "inbox.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # The console script, as users run it (`python -m` would put the
            # working directory on sys.path by itself).
            [
                str(Path(sys.executable).parent / "relay"),
                "inbox",
                "--queue",
                queue,
                "--exchange",
                rabbit.exchange,
                "--bind",
                "#",
                "--handlers",
                "cwd_handlers",
            ],
            env=relay_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        wait_until(
            lambda: "inbox started" in log.read_text() or proc.poll() is not None, timeout=30
        )
        assert proc.poll() is None, log.read_text()
        await rabbit.publish("t", b"{}", message_id="cwd-1", type="CwdEffect")
        wait_until(lambda: effect_ids(effects) == ["cwd-1"])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_handler_loading_errors_exit_2(run_relay):
    base = ["inbox", "--queue", "q"]
    cases = {
        "tests.apps.broken_handlers": "cannot import handler module 'tests.apps.broken_handlers'",
        "tests.apps.nope": "cannot import handler module 'tests.apps.nope'",
        "tests.apps.other_handlers:missing": "has no attribute 'missing'",
        "tests.apps.other_handlers:not_a_registry": "not a relay.HandlerRegistry",
    }
    for spec, expected in cases.items():
        result = run_relay(*base, "--handlers", spec)
        assert result.returncode == 2, (spec, result.stderr)
        assert expected in result.stderr, (spec, result.stderr)
        assert "Traceback" not in result.stderr
    clash = run_relay(*base, "--handlers", HANDLERS, "--handlers", "tests.apps.other_handlers")
    assert clash.returncode == 2
    assert "two handlers for message type 'Effect'" in clash.stderr
    assert "tests.apps.handlers.effect" in clash.stderr
    assert "tests.apps.other_handlers.clashing_effect" in clash.stderr


async def test_entry_point_registries_load_when_no_handlers_flag(
    effects, rabbit, inbox, tmp_path, relay_env
):
    dist = tmp_path / "orders_app-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orders-app\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[relay.handlers]\norders = tests.apps.handlers:registry\n"
    )
    relay_env["PYTHONPATH"] = str(tmp_path)
    inbox(handlers=None)
    await publish(rabbit, message_id="ep-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["ep-1"])


async def test_outbox_to_inbox_end_to_end_carries_id_key_and_traceparent(
    effects, rabbit, inbox, run_relay
):
    inbox(bind="orders.#")
    with effects.begin() as conn:
        ids = [
            relay.enqueue(
                conn,
                "orders.placed",
                {"n": n},
                key="order-1",
                type="Effect",
                headers={"traceparent": f"00-{n:032x}-{n:016x}-01"},
            )
            for n in range(5)
        ]
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(lambda: len(effect_ids(effects)) == 5)
    got = rows(effects, "SELECT message_id, key, n, traceparent FROM effects ORDER BY id")
    assert [g[0] for g in got] == [str(i) for i in ids]
    assert [g[2] for g in got] == [0, 1, 2, 3, 4]
    assert all(g[1] == "order-1" and g[3].startswith("00-") for g in got)


def test_relay_message_is_importable_and_registry_rejects_bad_types():
    registry = relay.HandlerRegistry()
    with pytest.raises(ValueError):
        registry.handler("")
    assert (
        relay.Message(id=str(uuid.uuid4()), type="T", topic=None, key=None, payload={}).attempts
        == 0
    )
    assert isinstance(sa.text("SELECT 1"), sa.TextClause)


async def test_consumes_a_queue_declared_with_arguments_of_its_own(effects, rabbit, start_relay):
    queue_name = f"{rabbit.exchange}.quorum"
    rabbit.queues.append(queue_name)
    channel = await rabbit.connection.channel()
    await channel.declare_queue(queue_name, durable=True, arguments={"x-queue-type": "quorum"})
    await channel.close()
    daemon = start_relay(
        "inbox",
        "--queue",
        queue_name,
        "--exchange",
        rabbit.exchange,
        "--bind",
        "#",
        "--handlers",
        HANDLERS,
    )
    daemon.wait_for_log("inbox started")
    await publish(rabbit, message_id="q-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["q-1"])
