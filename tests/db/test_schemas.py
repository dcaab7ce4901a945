"""`--schema`: relay's tables, triggers and notifications in a schema of
their own, several schemas in one database (a schema per tenant), on the
real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import json
import time
import uuid

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.config import check_schema_name
from relay.db import namespace
from relay.db.session import SHARE_LOCK_CLASS, share_key
from relay.errors import ConfigError
from relay.outbox import WORKERS
from tests.apps.handlers import EFFECTS_DDL
from tests.conftest import rows, until, wait_until

SCHEMAS = ("t1", "T2")


def libpq(url: str) -> str:
    return "postgresql://" + url.partition("://")[2]


@pytest.fixture
def tenants(empty_database, run_relay):
    """An empty database with relay's tables in two schemas; its URL."""
    for name in SCHEMAS:
        result = run_relay(
            "schema", "apply", "--schema", name, env={"RELAY_DATABASE_URL": empty_database}
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("applied: 001_initial")
    return empty_database


@pytest.fixture
def tenant_env(tenants):
    return {"RELAY_DATABASE_URL": tenants}


def insert(engine: sa.Engine, schema: str, topic: str, n: int = 1, key: str | None = None) -> None:
    table = namespace.qualified("outbox", schema)
    rows(
        engine,
        f"INSERT INTO {table} (topic, key, payload) "
        "SELECT :topic, :key, jsonb_build_object('i', i) FROM generate_series(1, :n) i",
        topic=topic,
        key=key,
        n=n,
    )


def statuses(engine: sa.Engine, schema: str, table: str = "outbox") -> list[str]:
    return [r[0] for r in rows(engine, f"SELECT status FROM {namespace.qualified(table, schema)}")]


# -- the schema itself --------------------------------------------------------


def test_apply_creates_the_schema_and_nothing_in_public(tenants, run_relay, tenant_env):
    engine = sa.create_engine(tenants)
    try:
        tables = rows(
            engine,
            "SELECT schemaname, tablename FROM pg_tables "
            "WHERE schemaname NOT IN ('pg_catalog', 'information_schema') ORDER BY 1, 2",
        )
    finally:
        engine.dispose()
    names = ["inbox", "outbox", "relay_audit", "relay_discarded", "relay_schema_version"]
    assert [tuple(r) for r in tables] == [("T2", n) for n in names] + [("t1", n) for n in names]
    again = run_relay("schema", "apply", "--schema", "t1", env=tenant_env)
    assert (again.returncode, again.stdout.strip()) == (0, "schema is up to date")
    # Without --schema, the search_path (public) holds no relay tables.
    status = run_relay("status", "--json", env=tenant_env)
    assert status.returncode == 1
    assert "relay schema apply" in status.stderr


def test_schema_sql_makes_the_same_tables_in_the_schema(empty_database, run_relay):
    script = run_relay("schema", "sql", "--schema", "t9")
    assert script.returncode == 0, script.stderr
    assert script.stdout.startswith('BEGIN;\nCREATE SCHEMA IF NOT EXISTS "t9";\n')
    with psycopg.connect(libpq(empty_database), autocommit=True) as conn:
        conn.execute(script.stdout)
        found = conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 't9' ORDER BY 1"
        ).fetchall()
    assert [r[0] for r in found] == [
        "inbox",
        "outbox",
        "relay_audit",
        "relay_discarded",
        "relay_schema_version",
    ]
    status = run_relay(
        "status", "--json", "--schema", "t9", env={"RELAY_DATABASE_URL": empty_database}
    )
    assert status.returncode == 0, status.stderr


@pytest.mark.parametrize("name", ["", "1abc", "pg_x", "a-b", "a b", 'a"b', "x" * 64, "é"])
def test_a_bad_schema_name_exits_2_for_every_command(name, run_relay):
    for args in (["schema", "sql"], ["status"], ["outbox", "--once"]):
        result = run_relay(*args, "--schema", name)
        assert result.returncode == 2, (args, result.stderr)
        assert "invalid --schema" in result.stderr
        assert "Traceback" not in result.stderr


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_check_schema_name_takes_only_plain_identifiers(name):
    try:
        checked = check_schema_name(name)
    except ConfigError:
        plain = (
            0 < len(name) <= 63
            and name.isascii()
            and (name[0].isalpha() or name[0] == "_")
            and all(c.isalnum() or c == "_" for c in name)
            and not name.startswith("pg_")
        )
        assert not plain, name
    else:
        assert checked == name
        assert namespace.quoted(name) == f'"{name}"'


# -- notifications and locks per schema ---------------------------------------------


@pytest.mark.parametrize("schema", ["t1", "T2", "s" * 63])
def test_the_trigger_notifies_the_channel_relay_listens_on(empty_database, run_relay, schema):
    result = run_relay(
        "schema", "apply", "--schema", schema, env={"RELAY_DATABASE_URL": empty_database}
    )
    assert result.returncode == 0, result.stderr
    channel = namespace.channel("relay_outbox", schema)
    assert len(channel.encode()) <= 63
    with psycopg.connect(libpq(empty_database), autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
        conn.execute("LISTEN relay_outbox")
        table = namespace.qualified("outbox", schema)
        conn.execute(f"INSERT INTO {table} (topic, payload) VALUES ('a', '{{}}')")
        got = [n.channel for n in conn.notifies(timeout=2, stop_after=1)]
    assert got == [channel]


def test_no_wake_up_crosses_schemas(tenants):
    with psycopg.connect(libpq(tenants), autocommit=True) as conn:
        conn.execute('LISTEN "relay_outbox.t1"')
        conn.execute('LISTEN "relay_inbox.t1"')
        conn.execute("INSERT INTO \"T2\".outbox (topic, payload) VALUES ('a', '{}')")
        conn.execute(
            "INSERT INTO \"T2\".inbox (consumer, message_id, payload) VALUES ('c', 'm', '{}')"
        )
        assert list(conn.notifies(timeout=0.5)) == []
        conn.execute("INSERT INTO t1.outbox (topic, payload) VALUES ('a', '{}')")
        assert [n.channel for n in conn.notifies(timeout=2, stop_after=1)] == ["relay_outbox.t1"]


def test_public_keeps_the_channels_and_locks_relay_always_used():
    assert namespace.channel("relay_outbox", None) == "relay_outbox"
    assert namespace.channel("relay_outbox", "public") == "relay_outbox"
    assert namespace.share_lock_class("public") == SHARE_LOCK_CLASS
    assert namespace.share_lock_class("t1") != SHARE_LOCK_CLASS
    assert namespace.share_lock_class("t1") != namespace.share_lock_class("T2")
    assert namespace.table_lock(7, None) == 7
    assert namespace.table_lock(7, "t1") != namespace.table_lock(7, "T2")


# -- the daemons, each on its own schema ----------------------------------------------


async def test_outbox_once_publishes_only_its_schemas_rows(tenants, rabbit, run_relay, tenant_env):
    queue = await rabbit.queue("#")
    engine = sa.create_engine(tenants)
    try:
        insert(engine, "t1", "one", 3)
        insert(engine, "T2", "two", 2)
        result = run_relay(
            "outbox", "--once", "--schema", "t1", "--exchange", rabbit.exchange, env=tenant_env
        )
        assert result.returncode == 0, result.stderr
        got = await rabbit.drain(queue, 3)
        assert {m.routing_key for m in got} == {"one"}
        assert statuses(engine, "t1") == ["published"] * 3
        assert statuses(engine, "T2") == ["pending"] * 2
        report = run_relay("status", "--json", "--schema", "T2", env=tenant_env)
        assert report.returncode == 0, report.stderr
        assert json.loads(report.stdout)["outbox"]["pending"] == 2
        report = run_relay("status", "--json", "--schema", "t1", env=tenant_env)
        assert json.loads(report.stdout)["outbox"]["published"] == 3
    finally:
        engine.dispose()


async def test_each_daemon_is_woken_by_its_own_schema(tenants, rabbit, start_relay, tenant_env):
    """With a poll of a minute, a row goes out within seconds only if its
    schema's notification woke its daemon; the other schema's daemon neither
    takes it nor is woken by it."""
    queue = await rabbit.queue("#")
    engine = sa.create_engine(tenants)
    try:
        daemons = {
            schema: start_relay(
                "outbox",
                "--schema",
                schema,
                "--exchange",
                rabbit.exchange,
                "--poll-interval",
                "60",
                env=tenant_env,
            )
            for schema in SCHEMAS
        }
        for daemon in daemons.values():
            daemon.wait_for_log("outbox relay started", timeout=30)
        time.sleep(1)  # the listeners' first look (LISTEN, self-check) is done
        for schema in SCHEMAS:
            insert(engine, schema, f"topic.{schema}", 2, key=f"k-{schema}")
        got = await rabbit.drain(queue, 4, timeout=10)
        assert sorted(m.routing_key for m in got) == ["topic.T2"] * 2 + ["topic.t1"] * 2
        for schema in SCHEMAS:
            # The rows are marked once the confirms are in, a moment after
            # the consumer may have the messages (a busy machine stretches it).
            await until(
                lambda schema=schema: statuses(engine, schema) == ["published"] * 2,
                message=f"{schema}'s rows published",
            )
        assert "LISTEN/NOTIFY does not work" not in daemons["t1"].log
    finally:
        engine.dispose()


async def test_a_schema_does_not_wait_for_another_schemas_share_locks(
    tenants, rabbit, run_relay, tenant_env
):
    """The outbox workers' share locks (database-wide advisory locks) are
    per schema: a relay of `public` holding every share does not hold up t1's."""
    queue = await rabbit.queue("#")
    engine = sa.create_engine(tenants)
    try:
        insert(engine, "t1", "one", 2)
        with psycopg.connect(libpq(tenants)) as holder:
            for share in range(WORKERS):
                holder.execute(
                    "SELECT pg_advisory_xact_lock(%s, %s)",
                    (SHARE_LOCK_CLASS, share_key(share, WORKERS)),
                )
            started = time.monotonic()
            result = run_relay(
                "outbox", "--once", "--schema", "t1", "--exchange", rabbit.exchange, env=tenant_env
            )
            assert result.returncode == 0, result.stderr
            assert time.monotonic() - started < 20
            holder.rollback()
        await rabbit.drain(queue, 2)
    finally:
        engine.dispose()


async def test_inbox_daemons_each_on_their_own_schema(tenants, rabbit, start_relay, tenant_env):
    """Two inboxes, one per schema, each on its own queue: each message lands
    in its schema's inbox, and the handler's unqualified table is its schema's."""
    engine = sa.create_engine(tenants)
    try:
        for schema in SCHEMAS:
            rows(engine, EFFECTS_DDL.replace("effects", f"{namespace.quoted(schema)}.effects", 1))
        for schema in SCHEMAS:
            queue = f"{rabbit.exchange}.{schema}"
            rabbit.queues.append(queue)
            start_relay(
                "inbox",
                "--schema",
                schema,
                "--queue",
                queue,
                "--exchange",
                rabbit.exchange,
                "--bind",
                f"to.{schema}",
                "--handlers",
                "tests.apps.handlers:registry",
                "--poll-interval",
                "60",
                env=tenant_env,
            ).wait_for_log("inbox started", timeout=30)
        ids = {schema: [str(uuid.uuid4()) for _ in range(3)] for schema in SCHEMAS}
        for schema in SCHEMAS:
            for message_id in ids[schema]:
                await rabbit.publish(
                    f"to.{schema}", b'{"n": 1}', message_id=message_id, type="Effect"
                )

        def processed(schema: str) -> list[str]:
            return statuses(engine, schema, "inbox")

        for schema in SCHEMAS:
            wait_until(lambda s=schema: processed(s) == ["processed"] * 3, timeout=20)
            effects = rows(engine, f"SELECT message_id FROM {namespace.quoted(schema)}.effects")
            assert sorted(r[0] for r in effects) == sorted(ids[schema])
    finally:
        engine.dispose()


async def test_retry_wakes_the_daemon_of_its_own_schema(
    tenants, rabbit, start_relay, run_relay, tenant_env
):
    """`relay retry --schema` notifies its schema's channel: a daemon with a
    poll of a minute publishes the retried row at once."""
    queue = await rabbit.queue("#")
    engine = sa.create_engine(tenants)
    try:
        for schema in SCHEMAS:
            rows(
                engine,
                f"INSERT INTO {namespace.quoted(schema)}.outbox (topic, payload, status) "
                "VALUES ('again', '{}', 'dead')",
            )
        daemon = start_relay(
            "outbox",
            "--schema",
            "t1",
            "--exchange",
            rabbit.exchange,
            "--poll-interval",
            "60",
            env=tenant_env,
        )
        daemon.wait_for_log("outbox relay started", timeout=30)
        time.sleep(1)
        listed = run_relay("dead", "list", "--json", "--schema", "T2", env=tenant_env)
        assert listed.returncode == 0, listed.stderr
        assert [row["topic"] for row in json.loads(listed.stdout)] == ["again"]
        retried = run_relay("retry", "outbox", "--all-dead", "--schema", "t1", env=tenant_env)
        assert (retried.returncode, retried.stdout.strip()) == (0, "retried 1 outbox row")
        [message] = await rabbit.drain(queue, 1, timeout=10)
        assert message.routing_key == "again"
        assert statuses(engine, "T2") == ["dead"]
    finally:
        engine.dispose()
