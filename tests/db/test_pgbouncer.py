"""relay through PgBouncer (Debian's pgbouncer, started here), in session and
transaction mode.

The tests imported below are the outbox, inbox and fault tests of their own
modules, run again with every `relay` process's --database-url through
PgBouncer (the `relay_env` fixture of this module), and the inbox's loop
in this process likewise (`loop_urls`): in transaction mode with a direct
--listen-url, as README recommends; in session mode without, since LISTEN
works through a session pooler. The tests' own checks read the
database directly. The tests written here cover what only a pooler shows.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

import relay
from relay.db import Store
from relay.rows import Failure
from tests.conftest import PG_HOST, PG_PORT, PG_USER, Rabbit, insert_outbox, rows, wait_until
from tests.e2e.test_brokers import (  # noqa: F401
    AmqpBroker,
    test_kill_9_of_the_outbox_mid_stream_loses_nothing,
    test_per_key_order_holds_with_three_relays,
)
from tests.e2e.test_faults import (  # noqa: F401
    open_transactions,
    test_other_keys_flow_while_a_key_waits_for_an_open_transaction,
    test_relay_publishes_nothing_of_a_key_while_an_earlier_row_is_uncommitted,
)
from tests.inbox.test_hostile import (  # noqa: F401
    test_hung_sync_handler_counts_an_attempt_and_exits_for_a_restart,
)
from tests.inbox.test_inbox import (  # noqa: F401
    test_message_is_stored_handled_and_marked_processed,
    test_outbox_to_inbox_end_to_end_carries_id_key_and_traceparent,
    test_per_key_dispatch_order_with_three_inboxes,
    test_status_and_retry_commands,
)
from tests.inbox.test_loop import (  # noqa: F401
    test_a_failing_handler_mid_batch_rolls_back_only_its_own_writes,
    test_fail_then_succeed_retries_with_backoff,
    test_sync_and_async_handlers_each_get_their_kind_of_connection,
)
from tests.outbox.test_outbox import (  # noqa: F401
    test_dead_row_policy_skip_lets_the_key_go_on_and_block_holds_it,
    test_notify_publishes_a_new_row_without_waiting_for_the_poll,
    test_once_drains_a_backlog_and_marks_everything,
    test_once_publishes_with_the_contract_wire_format,
    test_sigterm_exits_zero_and_leaves_nothing_half_done,
)
from tests.pgbouncer import PgBouncer

POOLER_NOTICE = "goes through a pooler"
LISTEN_WARNING = "LISTEN/NOTIFY does not work"


@pytest.fixture(scope="module", params=["session", "transaction"])
def pgbouncer(request: pytest.FixtureRequest) -> Iterator[PgBouncer]:
    if shutil.which("pgbouncer") is None:
        message = "pgbouncer is not installed (apt-get install pgbouncer)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must provide it)")
        pytest.skip(message)
    bouncer = PgBouncer(request.param, PG_HOST, PG_PORT, PG_USER)
    yield bouncer
    bouncer.stop()


@pytest.fixture
def broker(rabbit: Rabbit) -> AmqpBroker:
    """RabbitMQ, for the end-to-end broker tests run here through PgBouncer."""
    return AmqpBroker(rabbit)


@pytest.fixture
def pooled(database: str, pgbouncer: PgBouncer) -> str:
    """The test database's URL through PgBouncer (started again, with a
    warning that carries its log, if it has exited since the last test)."""
    log = pgbouncer.ensure_running()
    if log is not None:
        warnings.warn(f"pgbouncer had exited; started again. Its log: {log}", stacklevel=1)
    return pgbouncer.url(database)


@pytest.fixture
def relay_env(
    relay_env: dict[str, str], database: str, pooled: str, pgbouncer: PgBouncer, tmp_path: Path
) -> Iterator[dict[str, str]]:
    env = {**relay_env, "RELAY_DATABASE_URL": pooled}
    if pgbouncer.pool_mode == "transaction":
        env["RELAY_LISTEN_URL"] = database
    yield env
    # Every daemon the test started went through PgBouncer, and knew it.
    for log in tmp_path.glob("relay*.log"):
        assert POOLER_NOTICE in log.read_text(errors="replace"), log.name


@pytest.fixture
def loop_urls(database: str, pooled: str, pgbouncer: PgBouncer) -> dict[str, str]:
    """The inbox's loop run in this process (tests/inbox/test_loop.py)
    through PgBouncer, as relay_env puts the daemons."""
    urls = {"database_url": pooled}
    if pgbouncer.pool_mode == "transaction":
        urls["listen_url"] = database
    return urls


# -- what only a pooler shows ----------------------------------------------------


async def test_worker_sessions_prepare_nothing_behind_a_pooler(engine, pooled):
    # Two sessions take turns: in transaction mode each batch may run on the
    # other's server connection, where a PREPAREd claim would be missing (or
    # already there, prepared by the other).
    insert_outbox(engine, 6, topic="t")
    sessions = [Store(pooled).outbox_session("skip") for _ in range(2)]
    try:
        for n in range(3):
            for session in sessions:
                [row], _ = (await session.claim(1))[:2]
                assert session.pooled
                if n == 0:
                    statuses = await session.finish(
                        [], [(row, Failure("nack"), 0.0)], max_attempts=100
                    )
                    assert statuses == {row.id: "pending"}
                    continue
                await session.finish([row.id])
        left, _ = (await sessions[0].claim(10))[:2]
        assert len(left) == 2
        await sessions[0].abort()
    finally:
        for session in sessions:
            await session.close()
    assert rows(engine, "SELECT status, count(*) FROM outbox GROUP BY 1 ORDER BY 1") == [
        ("pending", 2),
        ("published", 4),
    ]


async def test_a_direct_connection_is_not_taken_for_a_pooler(engine, database):
    insert_outbox(engine, 1, topic="t")
    session = Store(database).outbox_session("skip")
    try:
        [row], _ = (await session.claim(1))[:2]
        assert not session.pooled
        await session.finish([row.id])
    finally:
        await session.close()


async def test_store_connections_prepare_nothing_behind_a_pooler(pooled):
    store = Store(pooled)
    try:
        for _ in range(8):  # psycopg would prepare from the fifth run on
            await store.status()
        async with store.transaction() as conn:
            raw = await conn.get_raw_connection()
            assert raw.driver_connection.prepare_threshold is None
            # The server process's pid (the one the hung-handler watchdog
            # ends), not the made-up one PgBouncer gave the client.
            pid = await conn.run_sync(store.backend_pid)
            assert pid == await conn.scalar(sa.text("SELECT pg_backend_pid()"))
            assert pid != raw.driver_connection.info.backend_pid
    finally:
        await store.close()


# Transaction mode only: a session pooler keeps LISTEN (the next test).
@pytest.mark.parametrize("pgbouncer", ["transaction"], indirect=True)
async def test_without_listen_url_transaction_mode_warns_once_and_polls(
    engine, rabbit, start_relay, pgbouncer, relay_env
):
    assert pgbouncer.pool_mode == "transaction"
    queue = await rabbit.queue("poll")
    daemon = start_relay(
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--poll-interval",
        "0.5",
        env={"RELAY_LISTEN_URL": ""},
    )
    daemon.wait_for_log(LISTEN_WARNING, timeout=30)
    with engine.begin() as conn:
        relay.enqueue(conn, "poll", {"n": 1})
    [message] = await rabbit.drain(queue, 1, timeout=15)
    assert message.body == b'{"n":1}'
    assert daemon.log.count(LISTEN_WARNING) == 1
    assert "--listen-url" in daemon.log


async def test_listen_url_self_check_passes_and_the_password_stays_hidden(
    engine, rabbit, start_relay, pgbouncer, database
):
    # A session pooler keeps LISTEN, a direct --listen-url too: no warning,
    # and a row wakes the relay long before its 60 s poll.
    queue = await rabbit.queue("woken")
    listen = database.replace("postgres@", "postgres:s3cret-pw@")  # trust ignores it
    env = {"RELAY_LISTEN_URL": listen} if pgbouncer.pool_mode == "transaction" else {}
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "60", env=env)
    daemon.wait_for_log("outbox relay started")
    wait_until(
        lambda: rows(
            engine,
            "SELECT 1 FROM pg_stat_activity WHERE datname = "
            "current_database() AND query = 'LISTEN relay_outbox'",
        ),
        message="the LISTEN connection",
    )
    with engine.begin() as conn:
        relay.enqueue(conn, "woken", {"n": 2})
    [message] = await rabbit.drain(queue, 1, timeout=10)  # the poll would take 60 s
    assert message.body == b'{"n":2}'
    assert LISTEN_WARNING not in daemon.log
    assert "s3cret-pw" not in daemon.log


def test_schema_apply_and_status_through_pgbouncer(empty_database, pgbouncer, run_relay):
    url = pgbouncer.url(empty_database)
    applied = run_relay("schema", "apply", "--database-url", url)
    assert applied.returncode == 0, applied.stderr
    status = run_relay("status", "--json", "--database-url", url)
    assert status.returncode == 0, status.stderr
    with psycopg.connect(empty_database.replace("+psycopg", "")) as conn:
        assert conn.execute("SELECT to_regclass('outbox') IS NOT NULL").fetchone() == (True,)


async def test_server_connections_ended_behind_pgbouncer_lose_nothing_and_count_nothing(
    engine, rabbit, start_relay
):
    # PostgreSQL ends every backend of the database (a failover, a drill)
    # while relay publishes through PgBouncer: relay sees PgBouncer's error,
    # reconnects and goes on; no row gains an attempt.
    queue = await rabbit.queue("cut.#")
    insert_outbox(engine, 5000, topic="cut.x", keys=20)
    daemon = start_relay(
        "outbox", "--exchange", rabbit.exchange, "--batch-size", "50", "--poll-interval", "0.5"
    )

    def published() -> int:
        return int(rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0])

    wait_until(lambda: published() > 200, message="relay publishing")
    ended = rows(
        engine,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()",
    )
    assert ended[0][0] > 0
    wait_until(lambda: published() == 5000, timeout=60, message="all published")
    assert rows(engine, "SELECT count(*) FROM outbox WHERE attempts > 0") == [(0,)]
    expected = {str(r[0]) for r in rows(engine, "SELECT id FROM outbox")}
    seen: set[str | None] = set()
    deadline = time.monotonic() + 30
    while seen != expected and time.monotonic() < deadline:
        # At least once: a batch published as its mark was cut goes again.
        seen |= {m.message_id for m in await rabbit.drain(queue, 1)}
    assert seen == expected
    assert daemon.proc.poll() is None


async def test_schemas_through_pgbouncer_reach_their_own_tables(
    empty_database, pgbouncer, run_relay, rabbit
):
    """Behind a pooler the search_path of the startup options does not reach
    the server: relay sets it per transaction, so each --schema's commands
    and daemons still work on that schema's tables only."""
    url = pgbouncer.url(empty_database)
    for schema in ("t1", "t2"):
        applied = run_relay("schema", "apply", "--schema", schema, "--database-url", url)
        assert applied.returncode == 0, applied.stderr
    direct = sa.create_engine(empty_database)
    try:
        for schema, n in (("t1", 3), ("t2", 2)):
            rows(
                direct,
                f"INSERT INTO {schema}.outbox (topic, payload) "
                "SELECT 'x', '{}' FROM generate_series(1, :n)",
                n=n,
            )
        queue = await rabbit.queue("#")
        env = {"RELAY_DATABASE_URL": url}
        done = run_relay(
            "outbox", "--once", "--schema", "t1", "--exchange", rabbit.exchange, env=env
        )
        assert done.returncode == 0, done.stderr
        await rabbit.drain(queue, 3)
        assert [r[0] for r in rows(direct, "SELECT status FROM t2.outbox")] == ["pending"] * 2
        status = run_relay("status", "--json", "--schema", "t2", env=env)
        assert status.returncode == 0, status.stderr
        assert '"pending": 2' in status.stdout
    finally:
        direct.dispose()
