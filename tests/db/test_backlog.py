"""A long backlog (issue 24): the tables' storage settings and index, the
gauges that show operators their dead row versions and last vacuum, and
relay's own vacuum of a churning table, against the real PostgreSQL and
RabbitMQ."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import orjson
import psycopg
import pytest
import sqlalchemy as sa

from relay.db import Store, vacuum
from relay.maintenance import VACUUM_AFTER_DEAD, VACUUM_INTERVAL, Vacuums
from relay.metrics import OutboxMetrics
from tests.conftest import free_port, insert_outbox, rows, wait_until
from tests.ops.test_operations import metric_is, scrape


def _vacuum(engine: sa.Engine, table: str) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(sa.text(f"VACUUM {table}"))


def _gauge(port: int, name: str, table: str) -> float | None:
    try:
        return scrape(port).get(f'{name}{{table="{table}"}}')
    except OSError:  # not listening yet
        return None


def _reaches(port: int, name: str, table: str, ok: Callable[[float], bool]) -> Callable[[], bool]:
    def check() -> bool:
        value = _gauge(port, name, table)
        return value is not None and ok(value)

    return check


def _dead_tuples_then_vacuum(engine: sa.Engine, port: int, table: str, finished: int) -> None:
    """Each finished row left a dead version; a VACUUM clears them and is dated."""
    wait_until(
        _reaches(port, "relay_table_dead_tuples", table, lambda v: v >= finished),
        timeout=60,
        message=f"{table}'s dead tuples in /metrics",
    )
    assert _gauge(port, "relay_table_last_vacuum_timestamp_seconds", table) == 0.0
    before = time.time()
    _vacuum(engine, table)
    wait_until(
        _reaches(
            port, "relay_table_last_vacuum_timestamp_seconds", table, lambda v: v >= before - 1
        ),
        timeout=60,
        message=f"{table}'s last vacuum in /metrics",
    )
    assert _gauge(port, "relay_table_last_vacuum_timestamp_seconds", table) <= time.time() + 1
    wait_until(_reaches(port, "relay_table_dead_tuples", table, lambda v: v == 0), timeout=60)


async def test_outbox_exports_its_table_dead_tuples_and_last_vacuum(engine, rabbit, start_relay):
    await rabbit.queue("b.#")
    insert_outbox(engine, 30, topic="b.x", keys=3)
    port = free_port()
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--http-port", str(port))
    wait_until(metric_is(port, "relay_outbox_published_total", 30.0), timeout=30)
    _dead_tuples_then_vacuum(engine, port, "outbox", 30)
    daemon.stop()


# The stored path updates each row once it is handled, and leaves a dead
# version behind; the receiving transaction stores rows processed at once.
@pytest.mark.parametrize("dispatch", ["stored"])
async def test_inbox_exports_its_table_dead_tuples_and_last_vacuum(effects, rabbit, inbox):
    port = free_port()
    inbox("--http-port", str(port))
    for n in range(20):
        await rabbit.publish("b.x", orjson.dumps({"n": n}), message_id=f"b-{n}", type="Effect")
    wait_until(metric_is(port, "relay_inbox_processed_total", 20.0), timeout=30)
    _dead_tuples_then_vacuum(effects, port, "inbox", 20)


def test_schema_sets_queue_table_autovacuum_settings(engine):
    for table in ("outbox", "inbox"):
        [(options,)] = rows(
            engine, "SELECT reloptions FROM pg_class WHERE oid = CAST(:t AS regclass)", t=table
        )
        assert {
            "autovacuum_vacuum_scale_factor=0.02",
            "autovacuum_vacuum_threshold=10000",
            "autovacuum_vacuum_cost_limit=2000",
        } <= set(options)


def test_pending_index_holds_the_share_and_no_finished_row(engine):
    """The claim passes over other workers' rows in the index: the pending
    index carries the share's hash, and only pending rows."""
    defs = dict(
        rows(
            engine,
            "SELECT indexname, indexdef FROM pg_indexes WHERE tablename IN ('outbox', 'inbox')",
        )
    )
    assert "outbox_pending_seq" not in defs and "inbox_pending_seq" not in defs
    for name, column in (
        ("outbox_pending_share", "(id)::text"),
        ("inbox_pending_share", "message_id"),
    ):
        assert f"hashtext(COALESCE(key, {column}))" in defs[name]
        assert "WHERE (status = 'pending'::text)" in defs[name]


HEAP_XMAX_IS_MULTI = 0x1000
HEAP_XMAX_LOCK_ONLY = 0x0080


@pytest.mark.parametrize("dispatch", ["stored"])  # the claim and its marks
async def test_inbox_marks_leave_no_multixact_row_versions(effects, rabbit, inbox):
    """A row the claim locked and a savepoint then updated would carry a
    MultiXact as its xmax, which index scans never take for dead: its entries
    stay for every claim to walk over until a vacuum (docs/backlog.md). The
    marks run outside the handlers' savepoints, so every replaced version of
    a processed row has a plain xmax: read off the heap pages themselves."""
    port = free_port()
    inbox("--http-port", str(port))
    # Few and small, so that the page is not full and nothing prunes the
    # replaced versions away before they are read.
    for n in range(8):
        await rabbit.publish("b.x", orjson.dumps({"n": n}), message_id=f"m-{n}", type="Effect")
    wait_until(metric_is(port, "relay_inbox_processed_total", 8.0), timeout=30)
    rows(effects, "CREATE EXTENSION IF NOT EXISTS pageinspect")
    versions = rows(
        effects,
        """
        SELECT t_infomask FROM generate_series(0, pg_relation_size('inbox') / 8192 - 1) AS p,
             heap_page_items(get_raw_page('inbox', p::int))
        WHERE t_xmax <> 0""",
    )
    updated = [m for (m,) in versions if not m & HEAP_XMAX_LOCK_ONLY]
    assert len(updated) == 8  # every processed row left its pending version
    assert [m for m in updated if m & HEAP_XMAX_IS_MULTI] == []


def test_inbox_marks_are_planned_for_the_table_as_it_is(database):
    """psycopg prepares a statement on its fifth run, and the server may then
    keep one generic plan for good: one made while the table held a few rows
    matched only the consumer in the primary key and filtered the ids row by
    row, so every later batch walked all of its consumer's rows. The
    dispatcher's marks run after `before_marks()`, which has them planned
    afresh each time: on the dispatcher's own connection, the prepared mark
    was never planned generically."""
    store = Store(database, pool_size=1, sync=True)
    consumer = "plans"
    try:
        for batch in range(16):
            with store.sync_transaction() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO inbox (consumer, message_id, payload) "
                        "SELECT :c, :b || '-' || i, '{}' FROM generate_series(1, 3) i"
                    ),
                    {"c": consumer, "b": str(batch)},
                )
            with store.sync_transaction() as conn:
                claimed, blocked, *_ = store.claim_inbox(conn, consumer, 100, "skip")
                assert (len(claimed), blocked) == (3, 0)
                savepoints = store.handler_savepoints(conn)
                savepoints.batch.set()
                savepoints.before_marks()
                store.mark_processed(conn, consumer, [row.message_id for row in claimed])
        with store.sync_transaction() as conn:
            plans = conn.execute(
                sa.text(
                    "SELECT generic_plans, custom_plans FROM pg_prepared_statements "
                    "WHERE statement LIKE 'UPDATE inbox SET status = ''processed''%'"
                )
            ).all()
            left = conn.execute(
                sa.text("SELECT count(*) FROM inbox WHERE status <> 'processed'")
            ).scalar()
    finally:
        asyncio.run(store.close())
    assert left == 0
    assert len(plans) == 1, plans  # prepared: the case this is about
    generic, custom = plans[0]
    # The server plans a prepared statement anew for its first five runs in
    # any case, and only then may keep a generic plan.
    assert generic == 0
    assert custom > 5


# --------------------------------------------------------------------------
# relay's own vacuum of a churning table (relay.maintenance.Vacuums)
# --------------------------------------------------------------------------


def _churn(engine: sa.Engine, table: str, count: int) -> None:
    """`count` finished rows, each updated once more: `count` dead row
    versions, with autovacuum off for the table so that only relay (or the
    test) vacuums it. Returns once the statistics count them."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
        if table == "outbox":
            conn.execute(
                sa.text(
                    "INSERT INTO outbox (topic, key, type, payload, status, published_at) "
                    "SELECT 'churn', 'k' || (i % 10), 'T', '{}', 'published', now() "
                    "FROM generate_series(1, :n) AS i"
                ),
                {"n": count},
            )
        else:
            conn.execute(
                sa.text(
                    "INSERT INTO inbox (consumer, message_id, payload, status, processed_at) "
                    "SELECT 'churn', 'm-' || i, '{}', 'processed', now() "
                    "FROM generate_series(1, :n) AS i"
                ),
                {"n": count},
            )
    with engine.begin() as conn:
        conn.execute(sa.text(f"UPDATE {table} SET attempts = attempts + 1"))
    wait_until(
        lambda: _dead(engine, table) >= count,
        timeout=30,
        message=f"{table}'s dead versions in pg_stat_user_tables",
    )


def _as(database: str, role: str) -> str:
    """The test database's URL for another user (trust authentication)."""
    return sa.make_url(database).set(username=role).render_as_string(hide_password=False)


def _table_stat(engine: sa.Engine, table: str, column: str) -> int:
    """One counter of the table's row in pg_stat_user_tables."""
    [(value,)] = rows(
        engine,
        f"SELECT {column} FROM pg_stat_user_tables WHERE relid = CAST(:t AS regclass)",
        t=table,
    )
    return int(value)


def _dead(engine: sa.Engine, table: str) -> int:
    return _table_stat(engine, table, "n_dead_tup")


def _vacuumed(engine: sa.Engine, table: str) -> int:
    return _table_stat(engine, table, "vacuum_count")


def test_vacuum_is_due_past_the_dead_rows_and_the_interval():
    """Pure policy: enough dead versions, and no vacuum (relay's or
    autovacuum's) within VACUUM_INTERVAL."""
    vacuums = Vacuums(None, "outbox", None)  # type: ignore[arg-type]
    now = 1_000_000.0
    assert vacuums.due(VACUUM_AFTER_DEAD, 0.0, now)
    assert not vacuums.due(VACUUM_AFTER_DEAD - 1, 0.0, now)
    assert not vacuums.due(VACUUM_AFTER_DEAD, now - VACUUM_INTERVAL + 1, now)
    assert vacuums.due(VACUUM_AFTER_DEAD, now - VACUUM_INTERVAL, now)
    vacuums.last = now - 1  # relay's own, which the statistics may not show yet
    assert not vacuums.due(10 * VACUUM_AFTER_DEAD, 0.0, now)
    vacuums.last, vacuums.allowed = 0.0, False
    assert not vacuums.due(10 * VACUUM_AFTER_DEAD, 0.0, now)


@pytest.mark.parametrize("table", ["outbox", "inbox"])
async def test_vacuum_clears_dead_versions_skips_a_held_table_and_tells_a_refusal(
    database, engine, table
):
    """vacuum() runs outside a transaction and clears the dead versions; a
    table another vacuum holds is skipped at once (55P03), not waited for;
    a user who does not own the table gets PostgreSQL's refusal back."""
    store = Store(database)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"ALTER TABLE {table} SET (autovacuum_enabled = false)"))
        # Another vacuum (here: its lock) holds the table: skipped, at once.
        holder = psycopg.connect(database.replace("+psycopg", ""))
        try:
            holder.execute(f"LOCK TABLE {table} IN SHARE UPDATE EXCLUSIVE MODE")
            began = time.monotonic()
            warnings = await vacuum(store, table)
            assert time.monotonic() - began < 5
            assert [state for state, _ in warnings] == ["55P03"]
        finally:
            holder.close()
        _churn(engine, table, 2000)
        before = _vacuumed(engine, table)
        assert await vacuum(store, table) == []
        wait_until(lambda: _vacuumed(engine, table) == before + 1, timeout=30)
        assert _dead(engine, table) < 2000
        # A user who may not vacuum the table: PostgreSQL's warning, no error.
        role = f"relay_nv_{uuid.uuid4().hex[:8]}"
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
        other = Store(_as(database, role))
        try:
            warnings = await vacuum(other, table)
            assert len(warnings) == 1 and warnings[0][0] != "55P03"
        finally:
            await other.close()
            with engine.begin() as conn:
                conn.execute(sa.text(f'DROP ROLE "{role}"'))
    finally:
        await store.close()


async def test_vacuums_stop_for_a_user_that_may_not_vacuum(database, engine, caplog):
    """Refused once, relay says so and stops trying; autovacuum does the work."""
    role = f"relay_nv_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE ROLE "{role}" LOGIN'))
    store = Store(_as(database, role))
    metrics = OutboxMetrics()
    vacuums = Vacuums(store, "outbox", metrics)
    try:
        with caplog.at_level(logging.WARNING, logger="relay.maintenance"):
            await vacuums.check(VACUUM_AFTER_DEAD, 0.0)
        assert not vacuums.allowed
        assert "may not vacuum outbox" in caplog.text
        assert metrics.vacuums.labels(table="outbox")._value.get() == 0
    finally:
        await store.close()
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP ROLE "{role}"'))


async def test_vacuums_run_one_at_a_time_beside_the_job_that_looks(database, engine):
    """start() leaves the look and its vacuum to a task and returns: the job
    that starts it every VACUUM_CHECK seconds does not wait for it, and
    while it runs a second start() starts nothing."""
    with engine.begin() as conn:
        conn.execute(sa.text("ALTER TABLE outbox SET (autovacuum_enabled = false)"))
    _churn(engine, "outbox", 2000)
    store = Store(database)
    metrics = OutboxMetrics()
    vacuums = Vacuums(store, "outbox", metrics)

    async def look() -> None:
        await vacuums.check(VACUUM_AFTER_DEAD, 0.0)

    try:
        vacuums.start(look)
        first = vacuums.running
        assert first is not None and not first.done()
        vacuums.start(look)
        assert vacuums.running is first
        await first
        assert metrics.vacuums.labels(table="outbox")._value.get() == 1
        wait_until(lambda: _dead(engine, "outbox") < 2000, timeout=30)
        # Done, and within VACUUM_INTERVAL of it: the next look starts a
        # task that vacuums nothing.
        vacuums.start(look)
        assert vacuums.running is not first
        await vacuums.stop()
        assert metrics.vacuums.labels(table="outbox")._value.get() == 1
    finally:
        await store.close()


async def test_outbox_vacuums_its_churned_table_itself(engine, rabbit, start_relay):
    """Past VACUUM_AFTER_DEAD dead versions the daemon vacuums its table
    itself (autovacuum is off for it here), counts it in /metrics, and does
    not vacuum again while the table stays clean."""
    _churn(engine, "outbox", VACUUM_AFTER_DEAD + 5_000)
    before = _vacuumed(engine, "outbox")
    port = free_port()
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--http-port", str(port))
    wait_until(
        metric_is(port, 'relay_table_vacuums_total{table="outbox"}', 1.0),
        timeout=60,
        message="relay's own vacuum of outbox",
    )
    assert _vacuumed(engine, "outbox") == before + 1
    wait_until(lambda: _dead(engine, "outbox") < VACUUM_AFTER_DEAD, timeout=30)
    wait_until(
        _reaches(port, "relay_table_last_vacuum_timestamp_seconds", "outbox", lambda v: v > 0),
        timeout=30,
    )
    # Two more gauge rounds (every 5 s) with the table clean: no second vacuum.
    time.sleep(11)
    assert scrape(port)['relay_table_vacuums_total{table="outbox"}'] == 1.0
    daemon.stop()
