"""`relay outbox` against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Self

import orjson
import pytest
import sqlalchemy as sa

import relay
from relay.brokers import make_publisher
from relay.config import BrokerURL, OutboxSettings
from relay.errors import DatabaseUnavailable
from relay.outbox import WORKERS, OutboxRelay
from relay.rows import Failure
from relay.store import NOTIFY_OUTBOX, Listener, OutboxSession, Store
from tests.conftest import AMQP_URL, insert_outbox, keys_by_share, rows, wait_until


async def test_once_publishes_with_the_contract_wire_format(engine, rabbit, run_relay):
    queue = await rabbit.queue("orders.#")
    with engine.begin() as conn:
        message_id = relay.enqueue(
            conn, "orders.placed", {"order_id": 7, "note": "é"}, key="order-7",
            type="OrderPlaced", headers={"traceparent": "00-abc-def-01"},
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
        engine, "SELECT status, published_at, attempts FROM outbox")
    assert (status, attempts) == ("published", 0)
    assert published_at is not None


async def test_row_without_key_or_type_has_no_key_header_and_no_type(engine, rabbit, run_relay):
    queue = await rabbit.queue("plain")
    with engine.begin() as conn:
        relay.enqueue(conn, "plain", [1, 2, 3])
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"[1,2,3]"
    assert message.type is None
    assert message.headers == {}


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
        ("published", 3000)]


async def test_not_published_before_available_at(engine, rabbit, run_relay):
    queue = await rabbit.queue("later")
    with engine.begin() as conn:
        relay.enqueue(conn, "later", {"a": 1},
                      available_at=datetime.now(UTC) + timedelta(hours=1))
        relay.enqueue(conn, "later", {"a": 2})
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b'{"a":2}'
    assert await queue.get(fail=False, no_ack=True) is None
    assert sorted(r[0] for r in rows(engine, "SELECT status FROM outbox")) == [
        "pending", "published"]


async def test_notify_publishes_a_new_row_without_waiting_for_the_poll(
    engine, rabbit, start_relay
):
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


class QuietRelay:
    """relay's outbox loop and listener in this process, on the real servers,
    with a 60 s poll: what it publishes, it publishes because of a
    notification. `claims` records the share of every claim it makes:
    (worker, WORKERS) for a worker's share of the keys, (0, 1) for every key."""

    def __init__(self, database: str, exchange: str, monkeypatch: pytest.MonkeyPatch,
                 listen: bool = True, **settings: object) -> None:
        self.listen = listen
        self.claims: list[tuple[int, int]] = []
        claim = OutboxSession.claim

        async def recorded(session: OutboxSession, limit: int, worker: int = 0,
                           workers: int = 1) -> tuple[list[relay.rows.OutboxRow], int]:
            self.claims.append((worker, workers))
            return await claim(session, limit, worker, workers)

        monkeypatch.setattr(OutboxSession, "claim", recorded)
        config = OutboxSettings(database_url=database, broker=BrokerURL.parse(AMQP_URL),
                                exchange=exchange, poll_interval=60, **settings)
        self.store = Store(database)
        self.publisher = make_publisher(config.broker, exchange=exchange)
        self.relay = OutboxRelay(config, self.store, self.publisher)
        self.listener = Listener(self.store.conninfo, NOTIFY_OUTBOX, self.relay.wake)
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self.tasks = [asyncio.create_task(self.relay.run())]
        if self.listen:
            self.tasks.append(asyncio.create_task(self.listener.run()))
        await self.settled()
        return self

    async def settled(self) -> None:
        """Wait until the listener is up and every worker sleeps, none woken."""
        deadline = time.monotonic() + 10
        while not ((self.listener.connected.is_set() or not self.listen)
                   and len(self.relay._idle) == WORKERS
                   and not any(event.is_set() for event in self.relay._wakeups.values())):
            assert time.monotonic() < deadline, "the relay did not settle"
            for task in self.tasks:
                if task.done():
                    task.result()
            await asyncio.sleep(0.01)

    async def __aexit__(self, *exc: object) -> None:
        self.relay.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.relay.close()
        await self.publisher.close()
        await self.store.close()


def keys_of_every_share(engine: sa.Engine) -> list[str]:
    """One key for each worker's share, as the claim hashes them."""
    shares = keys_by_share(engine, WORKERS)
    assert sorted(shares) == list(range(WORKERS))
    return [shares[share][0] for share in range(WORKERS)]


async def test_a_quiet_relay_answers_a_notification_with_one_claim(
    engine, database, rabbit, monkeypatch
):
    queue = await rabbit.queue("quiet.#")
    async with QuietRelay(database, rabbit.exchange, monkeypatch) as quiet:
        quiet.claims.clear()
        keys = [*keys_of_every_share(engine), None]
        for n, key in enumerate(keys):
            with engine.begin() as conn:
                relay.enqueue(conn, f"quiet.{n}", {"n": n}, key=key)
            [message] = await rabbit.drain(queue, 1, timeout=5)  # the poll would take 60 s
            assert orjson.loads(message.body) == {"n": n}
            await quiet.settled()
        # One idle worker claimed each row, whatever share its key is in;
        # the others slept on (with a claim each, and one more by the worker
        # that published, this was 5 claims a row).
        assert quiet.claims == [(0, 1)] * len(keys)


async def test_a_full_batch_wakes_the_sleeping_workers_to_help(
    engine, database, rabbit, monkeypatch
):
    queue = await rabbit.queue("burst")
    async with QuietRelay(database, rabbit.exchange, monkeypatch, batch_size=10) as quiet:
        quiet.claims.clear()
        insert_outbox(engine, 200, topic="burst")
        assert len(await rabbit.drain(queue, 200, timeout=10)) == 200
        await quiet.settled()
    # The scout's full batch woke the rest, each to claim its own share.
    assert quiet.claims[0] == (0, 1)
    assert {worker for worker, workers in quiet.claims if workers == WORKERS} == set(
        range(WORKERS))
    assert rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'") == [(200,)]


async def test_a_key_held_by_another_relay_goes_back_to_its_own_worker(
    engine, database, rabbit, monkeypatch
):
    queue = await rabbit.queue("held")
    key = keys_of_every_share(engine)[1]  # not the scout's own share
    async with QuietRelay(database, rabbit.exchange, monkeypatch, listen=False) as quiet:
        with engine.begin() as conn:
            first = relay.enqueue(conn, "held", {"n": 1}, key=key)
            second = relay.enqueue(conn, "held", {"n": 2}, key=key)
        with engine.connect() as other:  # another relay, holding the key's head
            other.execute(sa.text("SELECT 1 FROM outbox WHERE id = :id FOR UPDATE"),
                          {"id": first})
            quiet.claims.clear()
            quiet.relay.wake()  # the notification of the commit above
            await asyncio.sleep(0.3)
            # The scout found the second row blocked and handed the keys back:
            # the key's own worker retries its share, the scout no longer
            # claims every key.
            assert quiet.claims[0] == (0, 1)
            assert (0, 1) not in quiet.claims[1:]
            assert quiet.claims.count((1, WORKERS)) > 3
            other.execute(sa.text("UPDATE outbox SET status = 'published' WHERE id = :id"),
                          {"id": first})
            other.commit()
        [message] = await rabbit.drain(queue, 1, timeout=5)  # the poll would take 60 s
        assert message.message_id == str(second)


async def test_the_listen_connection_shows_as_relay_like_the_others(
    engine, rabbit, start_relay
):
    # An operator, or a drill that ends relay's backends, finds every
    # connection of the daemon by application_name: the pooled ones, the
    # workers' sessions and the LISTEN connection.
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "60")
    daemon.wait_for_log("outbox relay started")

    def listening() -> list[tuple[str]]:
        return rows(engine, "SELECT application_name FROM pg_stat_activity "
                            "WHERE datname = current_database() AND query = 'LISTEN relay_outbox'")

    wait_until(listening, message="the LISTEN connection")
    assert listening() == [("relay",)]


async def test_unroutable_topic_under_on_unroutable_fail_fails_with_backoff_then_dies(
    engine, rabbit, run_relay
):
    with engine.begin() as conn:
        relay.enqueue(conn, "no.binding", {"x": 1})
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange,
                       "--backoff-min", "30", "--backoff-max", "60", "--max-attempts", "2",
                       env={"RELAY_ON_UNROUTABLE": "fail"})
    assert result.returncode == 0, result.stderr
    [(status, attempts, error, delay)] = rows(
        engine, "SELECT status, attempts, last_error, "
                "extract(epoch FROM available_at - now()) FROM outbox")
    assert (status, attempts) == ("pending", 1)
    assert "unroutable" in error and "no.binding" in error
    assert 25 <= delay <= 60

    # Due again: the second failure reaches --max-attempts.
    rows(engine, "UPDATE outbox SET available_at = now()")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange,
                     "--max-attempts", "2", "--on-unroutable", "fail").returncode == 0
    [(status, attempts)] = rows(engine, "SELECT status, attempts FROM outbox")
    assert (status, attempts) == ("dead", 2)


async def test_a_nack_fails_only_its_rows_and_a_return_only_its_own(engine, rabbit, run_relay):
    # A full queue that rejects publishes makes RabbitMQ nack them; one row
    # of the same batch is unroutable and comes back; the rest are acked.
    channel = await rabbit.connection.channel()
    exchange = await channel.declare_exchange(rabbit.exchange, "topic", durable=True)
    full = await channel.declare_queue(
        f"{rabbit.exchange}.full", durable=True,
        arguments={"x-max-length": 2, "x-overflow": "reject-publish"})
    rabbit.queues.append(full.name)
    await full.bind(exchange, "full")
    ok = await rabbit.queue("ok")
    with engine.begin() as conn:
        ids = [relay.enqueue(conn, "full", {"n": n}) for n in range(4)]
        lost = relay.enqueue(conn, "no.binding", {"n": 4})
        ids += [relay.enqueue(conn, "ok", {"n": n}) for n in range(5, 8)]
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange,
                       "--backoff-min", "30", "--backoff-max", "60", "--on-unroutable", "fail")
    assert result.returncode == 0, result.stderr
    outcome = {r[0]: r[1:] for r in rows(engine, "SELECT id, status, attempts, last_error "
                                                 "FROM outbox")}
    for message_id in ids[4:]:
        assert outcome[message_id] == ("published", 0, None)
    # The workers publish on one channel in no fixed order across batches:
    # whichever two of the four reached the full queue first are published,
    # exactly those, and the other two were nacked.
    accepted = {m.message_id for m in await rabbit.drain(full, 2)}
    assert {str(i) for i in ids[:4] if outcome[i] == ("published", 0, None)} == accepted
    for message_id in [i for i in ids[:4] if str(i) not in accepted]:
        status, attempts, error = outcome[message_id]
        assert (status, attempts) == ("pending", 1)
        assert error.startswith("rejected by RabbitMQ (nack)")
    assert outcome[lost][:2] == ("pending", 1) and "unroutable" in outcome[lost][2]
    assert len(await rabbit.drain(ok, 3)) == 3
    await channel.close()


async def test_bad_headers_and_empty_topic_go_dead_with_a_clear_error(engine, rabbit, run_relay):
    queue = await rabbit.queue("#")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO outbox (topic, payload, headers) VALUES "
            "('h', '{}', '{\"n\": 1}'), ('h', '{}', '[1]'), ('', '{}', '{}'), "
            "('ok', '{}', '{\"a\": \"b\"}')"))
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.routing_key == "ok"
    errors = dict(rows(engine, "SELECT headers::text || topic, last_error FROM outbox "
                               "WHERE status = 'dead'"))
    assert "header 'n' has a int value" in errors['{"n": 1}h']
    assert "headers must be a JSON object" in errors["[1]h"]
    assert errors["{}"] == "topic is empty"


async def test_dead_row_policy_skip_lets_the_key_go_on_and_block_holds_it(
    engine, rabbit, run_relay
):
    queue = await rabbit.queue("k")
    with engine.begin() as conn:
        conn.execute(sa.text(
            "INSERT INTO outbox (topic, key, payload, status, attempts) "
            "VALUES ('k', 'a', '1', 'dead', 3)"))
        relay.enqueue(conn, "k", 2, key="a")
        relay.enqueue(conn, "k", 3, key="b")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange,
                     "--on-dead", "block").returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"3"
    assert await queue.get(fail=False, no_ack=True) is None

    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"2"


async def test_a_key_waits_behind_its_row_in_backoff(engine, rabbit, run_relay):
    queue = await rabbit.queue("k")
    with engine.begin() as conn:
        relay.enqueue(conn, "k", 1, key="a",
                      available_at=datetime.now(UTC) + timedelta(hours=1))
        relay.enqueue(conn, "k", 2, key="a")
        relay.enqueue(conn, "k", 3, key="b")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    assert [m.body for m in await rabbit.drain(queue, 1)] == [b"3"]
    assert await queue.get(fail=False, no_ack=True) is None


async def test_three_relays_keep_per_key_order_over_60_keys(engine, rabbit, start_relay):
    queue = await rabbit.queue("ord.#")
    relays = [start_relay("outbox", "--exchange", rabbit.exchange, "--batch-size", "50",
                          "--poll-interval", "0.2") for _ in range(3)]
    for proc in relays:
        proc.wait_for_log("outbox relay started")
    # Committed in many small transactions while the relays run.
    for chunk in range(30):
        with engine.begin() as conn:
            for i in range(100):
                n = chunk * 100 + i
                relay.enqueue(conn, "ord.e", {"n": n}, key=f"key-{n % 60}")
    messages = await rabbit.drain(queue, 3000, timeout=60)
    last: dict[str, int] = {}
    for message in messages:
        key, n = message.headers["x-relay-key"], orjson.loads(message.body)["n"]
        assert n > last.get(key, -1), f"{key}: {n} after {last[key]}"
        last[key] = n
    assert len({m.message_id for m in messages}) == 3000
    wait_until(lambda: rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")
               [0][0] == 3000)
    published = [r[0] for r in rows(engine, "SELECT count(*) FROM outbox")]
    assert published == [3000]
    # Every relay took part.
    assert all("outbox relay started" in proc.log for proc in relays)


async def test_kill_9_mid_stream_loses_nothing(engine, rabbit, start_relay):
    queue = await rabbit.queue("kill.#")
    insert_outbox(engine, 20000, topic="kill.x", keys=50)
    first = start_relay("outbox", "--exchange", rabbit.exchange, "--batch-size", "100")
    wait_until(lambda: rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")
               [0][0] > 500, message="first relay publishing")
    first.signal(signal.SIGKILL)
    first.wait()
    second = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "0.5")
    wait_until(lambda: rows(engine, "SELECT count(*) FROM outbox WHERE status <> 'published'")
               [0][0] == 0, timeout=60, message="all published after restart")
    messages = await rabbit.drain(queue, 20000, timeout=30)
    while (extra := await queue.get(fail=False, no_ack=True)) is not None:
        messages.append(extra)
    ids = [m.message_id for m in messages]
    assert set(ids) == {str(r[0]) for r in rows(engine, "SELECT id FROM outbox")}
    # Duplicates on the wire are bounded by what was in flight when killed:
    # a batch per worker.
    assert len(ids) - len(set(ids)) <= WORKERS * 100
    second.stop()
    assert second.proc.returncode == 0


async def test_sigterm_exits_zero_and_leaves_nothing_half_done(engine, rabbit, start_relay):
    await rabbit.queue("t.#")
    insert_outbox(engine, 20000, topic="t.x")
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--shutdown-timeout", "10")
    wait_until(lambda: rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")
               [0][0] > 0)
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(15) == 0
    assert time.monotonic() - started < 10
    # No row stays locked: a new claim can take every pending row at once.
    with engine.begin() as conn:
        pending = conn.execute(sa.text(
            "SELECT count(*) FROM outbox WHERE status = 'pending'")).scalar()
        locked = conn.execute(sa.text(
            "SELECT count(*) FROM (SELECT id FROM outbox WHERE status = 'pending' "
            "FOR UPDATE SKIP LOCKED) t")).scalar()
    assert locked == pending


async def test_unreachable_broker_is_retried_and_counts_no_attempt(engine, start_relay):
    with engine.begin() as conn:
        relay.enqueue(conn, "x", {})
    daemon = start_relay("outbox", env={"RELAY_BROKER_URL": "amqp://guest:s3cret@127.0.0.1:1/"})
    daemon.wait_for_log("retrying in", timeout=20)
    time.sleep(1.5)
    assert daemon.proc.poll() is None
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("pending", 0)]
    daemon.stop()
    assert daemon.proc.returncode == 0
    assert "s3cret" not in daemon.log


def test_unreachable_database_is_retried_without_leaking_the_password(start_relay):
    daemon = start_relay(
        "outbox", env={"RELAY_DATABASE_URL": "postgresql://u:hunter2@127.0.0.1:1/db"})
    daemon.wait_for_log("retrying in", timeout=20)
    assert daemon.proc.poll() is None
    daemon.stop()
    assert daemon.proc.returncode == 0
    assert "hunter2" not in daemon.log


def test_bad_configuration_exits_2_with_one_clear_line(run_relay):
    cases = {
        ("--broker-url", "kafka://x"): "unsupported broker URL scheme 'kafka'",
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
    result = run_relay("outbox", "--once", "--broker-url", "bogus://",
                       env={"RELAY_BROKER_URL": "amqp://guest:guest@127.0.0.1/"})
    assert result.returncode == 2 and "bogus" in result.stderr


def test_message_id_is_stable_and_unique(engine):
    with engine.begin() as conn:
        given = relay.enqueue(conn, "t", {}, id=str(uuid.UUID(int=5)))
        fresh = relay.enqueue(conn, "t", {})
    assert given == uuid.UUID(int=5)
    assert {r[0] for r in rows(engine, "SELECT id FROM outbox")} == {given, fresh}
    assert json.loads(json.dumps(str(fresh)))


# -- the workers' own connections (relay.store.OutboxSession) -----------------


async def test_worker_session_commits_without_waiting_for_the_disk_and_plans_by_index(
    engine, database
):
    insert_outbox(engine, 3, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        rows_, blocked = await session.claim(10)
        assert ([r.payload for r in rows_], blocked) == (
            ['{"i": 1}', '{"i": 2}', '{"i": 3}'], 0)
        conn = session._conn
        settings = await (await conn.execute(
            "SELECT current_setting('synchronous_commit'), current_setting('enable_seqscan'), "
            "current_setting('jit')")).fetchone()
        assert settings == ("off", "off", "off")
        assert await session.finish([r.id for r in rows_[:2]]) == {}
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox ORDER BY seq") == [
        ("published",), ("published",), ("pending",)]


async def test_worker_session_keeps_its_statements_through_failures_and_rollbacks(
    engine, database
):
    # psycopg prepares a statement run five times on its own, and answers a
    # ROLLBACK by deallocating every prepared statement of the session: the
    # claim's too, had the session let it prepare MARK_OUTBOX_FAILED.
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        for attempt in range(8):
            [row], _ = await session.claim(10)
            statuses = await session.finish(
                [], [(row, Failure("nack"), 0.0)], max_attempts=100)
            assert statuses == {row.id: "pending"}, attempt
        [row], _ = await session.claim(10)
        await session.abort()
        [again], _ = await session.claim(10)
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
        await session._conn.execute("DEALLOCATE ALL")  # as a pooler's reset would
        with pytest.raises(DatabaseUnavailable, match="relay_claim"):
            await session.claim(10)
        [row], _ = await session.claim(10)  # a new connection, prepared again
        await session.finish([row.id])
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox") == [("published",)]


async def test_worker_session_marks_only_uuids(engine, database):
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        [row], _ = await session.claim(10)
        with pytest.raises(ValueError, match="not a list of UUIDs"):
            await session.finish([row.id, "x'); DELETE FROM outbox; --"])
        await session.abort()
    finally:
        await session.close()
    assert rows(engine, "SELECT status FROM outbox") == [("pending",)]
