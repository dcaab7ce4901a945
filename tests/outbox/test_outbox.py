"""`relay outbox` end to end against the real PostgreSQL and RabbitMQ, and
the workers' own database sessions.

The loop's behaviour with each broker answer (nack, return, slow confirm,
lost connection) is tests/outbox/test_loop.py's, on the memory broker; per-key
order across relays and kill -9 are tests/e2e/test_brokers.py's."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

import relay
from relay.db import Store
from relay.errors import DatabaseUnavailable
from relay.rows import Failure
from tests.conftest import insert_outbox, rows, wait_until


async def test_once_publishes_with_the_contract_wire_format(engine, rabbit, run_relay):
    queue = await rabbit.queue("orders.#")
    with engine.begin() as conn:
        message_id = relay.enqueue(
            conn,
            "orders.placed",
            {"order_id": 7, "note": "é"},
            key="order-7",
            type="OrderPlaced",
            headers={"traceparent": "00-abc-def-01"},
        )
    created_at = rows(engine, "SELECT created_at FROM outbox")[0][0]

    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange)
    assert result.returncode == 0, result.stderr

    [message] = await rabbit.drain(queue, 1)
    # jsonb keeps its own key order; the body is compact UTF-8 JSON of it.
    assert message.body == '{"note":"é","order_id":7}'.encode()
    assert message.routing_key == "orders.placed"
    assert message.exchange == rabbit.exchange
    assert message.content_type == "application/json"
    assert message.delivery_mode == 2
    assert message.message_id == str(message_id)
    assert message.type == "OrderPlaced"
    assert message.timestamp == created_at.replace(microsecond=0)
    assert message.headers == {"traceparent": "00-abc-def-01", "x-relay-key": "order-7"}
    [(status, published_at, attempts)] = rows(
        engine, "SELECT status, published_at, attempts FROM outbox"
    )
    assert (status, attempts) == ("published", 0)
    assert published_at is not None


async def test_payload_json_null_is_published_as_null(engine, rabbit, run_relay):
    queue = await rabbit.queue("nulls")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO outbox (topic, payload) VALUES ('nulls', 'null')"))
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"null"
    assert rows(engine, "SELECT status FROM outbox")[0][0] == "published"


async def test_once_drains_a_backlog_and_marks_everything(engine, rabbit, run_relay):
    queue = await rabbit.queue("bulk.#")
    insert_outbox(engine, 3000, topic="bulk.x", keys=20)
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange, "--batch-size", "200")
    assert result.returncode == 0, result.stderr
    assert len(await rabbit.drain(queue, 3000)) == 3000
    assert rows(engine, "SELECT status, count(*) FROM outbox GROUP BY status") == [
        ("published", 3000)
    ]


async def test_not_published_before_available_at(engine, rabbit, run_relay):
    queue = await rabbit.queue("later")
    with engine.begin() as conn:
        relay.enqueue(conn, "later", {"a": 1}, available_at=datetime.now(UTC) + timedelta(hours=1))
        relay.enqueue(conn, "later", {"a": 2})
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b'{"a":2}'
    assert await queue.get(fail=False, no_ack=True) is None
    assert sorted(r[0] for r in rows(engine, "SELECT status FROM outbox")) == [
        "pending",
        "published",
    ]


async def test_notify_publishes_a_new_row_without_waiting_for_the_poll(engine, rabbit, start_relay):
    queue = await rabbit.queue("fast")
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "60")
    daemon.wait_for_log("outbox relay started")
    await asyncio.sleep(0.3)  # the listener is up before the first idle wait
    with engine.begin() as conn:
        relay.enqueue(conn, "fast", {"n": 1})
    started = time.monotonic()
    [message] = await rabbit.drain(queue, 1, timeout=5)
    assert time.monotonic() - started < 5  # the poll would take 60 s
    assert message.body == b'{"n":1}'


async def test_the_listen_connection_shows_as_relay_like_the_others(engine, rabbit, start_relay):
    # An operator, or a drill that ends relay's backends, finds every
    # connection of the daemon by application_name: the pooled ones, the
    # workers' sessions and the LISTEN connection.
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "60")
    daemon.wait_for_log("outbox relay started")

    def listening() -> list[tuple[str]]:
        return rows(
            engine,
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND query = 'LISTEN relay_outbox'",
        )

    wait_until(listening, message="the LISTEN connection")
    assert listening() == [("relay",)]


async def test_dead_row_policy_skip_lets_the_key_go_on_and_block_holds_it(
    engine, rabbit, run_relay
):
    queue = await rabbit.queue("k")
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, key, payload, status, attempts) "
                "VALUES ('k', 'a', '1', 'dead', 3)"
            )
        )
        relay.enqueue(conn, "k", 2, key="a")
        relay.enqueue(conn, "k", 3, key="b")
    assert (
        run_relay(
            "outbox", "--once", "--exchange", rabbit.exchange, "--on-dead", "block"
        ).returncode
        == 0
    )
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"3"
    assert await queue.get(fail=False, no_ack=True) is None

    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"2"


async def test_a_key_waits_behind_its_row_in_backoff(engine, rabbit, run_relay):
    queue = await rabbit.queue("k")
    with engine.begin() as conn:
        relay.enqueue(conn, "k", 1, key="a", available_at=datetime.now(UTC) + timedelta(hours=1))
        relay.enqueue(conn, "k", 2, key="a")
        relay.enqueue(conn, "k", 3, key="b")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    assert [m.body for m in await rabbit.drain(queue, 1)] == [b"3"]
    assert await queue.get(fail=False, no_ack=True) is None


async def test_sigterm_exits_zero_and_leaves_nothing_half_done(engine, rabbit, start_relay):
    await rabbit.queue("t.#")
    insert_outbox(engine, 20000, topic="t.x")
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--shutdown-timeout", "10")
    wait_until(
        lambda: rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0] > 0
    )
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(15) == 0
    assert time.monotonic() - started < 10
    # No row stays locked: a new claim can take every pending row at once.
    with engine.begin() as conn:
        pending = conn.execute(
            sa.text("SELECT count(*) FROM outbox WHERE status = 'pending'")
        ).scalar()
        locked = conn.execute(
            sa.text(
                "SELECT count(*) FROM (SELECT id FROM outbox WHERE status = 'pending' "
                "FOR UPDATE SKIP LOCKED) t"
            )
        ).scalar()
    assert locked == pending


def test_unreachable_database_is_retried_without_leaking_the_password(start_relay):
    daemon = start_relay(
        "outbox", env={"RELAY_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/db"}
    )
    daemon.wait_for_log("retrying in", timeout=20)
    assert daemon.proc.poll() is None
    daemon.stop()
    assert daemon.proc.returncode == 0
    assert "hunter2" not in daemon.log


def test_bad_configuration_exits_2_with_one_clear_line(run_relay):
    cases = {
        ("--broker-url", "kafka://x?acks=0"): "acks=0 is against relay's guarantees",
        ("--broker-url", "mqtt://x"): "unsupported broker URL scheme 'mqtt'",
        ("--database-url", "mysql://u:pw@h/db"): "unsupported database URL scheme 'mysql'",
        ("--batch-size", "lots"): "'lots' is not a valid integer",
        ("--retention", "forever"): "invalid duration 'forever'",
        ("--on-dead", "explode"): "'explode' is not one of",
    }
    for args, expected in cases.items():
        result = run_relay("outbox", "--once", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert "pw" not in result.stderr.replace("pw@", "") or "pw@" not in result.stderr


def test_environment_variables_configure_and_flags_win(run_relay):
    result = run_relay("outbox", "--once", env={"RELAY_BATCH_SIZE": "0"})
    assert result.returncode == 2 and "RELAY_BATCH_SIZE" in result.stderr
    result = run_relay(
        "outbox",
        "--once",
        "--broker-url",
        "bogus://",
        env={"RELAY_BROKER_URL": "amqp://guest:guest@127.0.0.1/"},
    )
    assert result.returncode == 2 and "bogus" in result.stderr


def test_message_id_is_stable_and_unique(engine):
    with engine.begin() as conn:
        given = relay.enqueue(conn, "t", {}, id=str(uuid.UUID(int=5)))
        fresh = relay.enqueue(conn, "t", {})
    assert given == uuid.UUID(int=5)
    assert {r[0] for r in rows(engine, "SELECT id FROM outbox")} == {given, fresh}
    assert json.loads(json.dumps(str(fresh)))


# -- the workers' own connections (relay.db.OutboxSession) -----------------


async def test_worker_session_commits_without_waiting_for_the_disk_and_plans_by_index(
    engine, database
):
    insert_outbox(engine, 3, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        rows_, blocked = (await session.claim(10))[:2]
        assert ([r.payload for r in rows_], blocked) == (['{"i": 1}', '{"i": 2}', '{"i": 3}'], 0)
        conn = session.connection
        assert conn is not None
        settings = await (
            await conn.execute(
                "SELECT current_setting('synchronous_commit'), current_setting('enable_seqscan'), "
                "current_setting('jit')"
            )
        ).fetchone()
        assert settings == ("off", "off", "off")
        assert await session.finish([r.id for r in rows_[:2]]) == {}
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox ORDER BY seq") == [
        ("published",),
        ("published",),
        ("pending",),
    ]


async def test_worker_session_keeps_its_statements_through_failures_and_rollbacks(engine, database):
    # psycopg prepares a statement run five times on its own, and answers a
    # ROLLBACK by deallocating every prepared statement of the session: the
    # claim's too, had the session let it prepare MARK_OUTBOX_FAILED.
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        for attempt in range(8):
            [row], _ = (await session.claim(10))[:2]
            statuses = await session.finish([], [(row, Failure("nack"), 0.0)], max_attempts=100)
            assert statuses == {row.id: "pending"}, attempt
        [row], _ = (await session.claim(10))[:2]
        await session.abort()
        [again], _ = (await session.claim(10))[:2]
        assert again.id == row.id and again.attempts == 8
        await session.finish([again.id])
    finally:
        await session.close()
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("published", 8)]


async def test_worker_session_that_lost_its_statements_reconnects(engine, database):
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        await session.claim(10)
        await session.abort()
        assert session.connection is not None
        await session.connection.execute("DEALLOCATE ALL")  # as a pooler's reset would
        with pytest.raises(DatabaseUnavailable, match="relay_claim"):
            await session.claim(10)
        [row], _ = (await session.claim(10))[:2]  # a new connection, prepared again
        await session.finish([row.id])
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox") == [("published",)]


async def test_worker_session_marks_only_uuids(engine, database):
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        [row], _ = (await session.claim(10))[:2]
        with pytest.raises(ValueError, match="not a list of UUIDs"):
            await session.finish([row.id, "x'); DELETE FROM outbox; --"])
        await session.abort()
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox") == [("pending",)]


async def test_a_claim_by_id_takes_only_uuids_and_names_the_list_that_is_not(engine, database):
    insert_outbox(engine, 1, topic="t")
    [(row_id,)] = rows(engine, "SELECT id FROM outbox")
    session = Store(database).outbox_session("skip")
    hostile = "x'); DELETE FROM outbox; --"
    try:
        # The rows before (a WAL batch claimed behind another) as well as the ids.
        with pytest.raises(ValueError, match=re.escape(f"not a list of UUIDs: {hostile!r}")):
            await session.claim(10, ids=[str(row_id)], before=[hostile])
        with pytest.raises(ValueError, match=re.escape(f"not a list of UUIDs: {hostile!r}")):
            await session.claim(10, ids=[hostile], before=[str(row_id)])
        await session.abort()
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox") == [("pending",)]
