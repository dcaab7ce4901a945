"""`relay schema apply|sql`, the SQLAlchemy tables and the triggers, on the real PostgreSQL."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from relay.db import schema
from tests.conftest import PG_HOST, PG_PORT, PG_USER, RELAY, REPO, _require, drop_database, pg_url


def _env(database_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    if database_url is not None:
        env["RELAY_DATABASE_URL"] = database_url
    return env


def relay_cli(
    *args: str, database_url: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """`relay ARGS` with only the given RELAY_DATABASE_URL (none at all when None)."""
    return subprocess.run(
        [*RELAY, *args],
        env=_env(database_url),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def libpq(url: str) -> str:
    """A SQLAlchemy psycopg URL as a libpq one (psql, psycopg.connect)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


@pytest.fixture
def other_empty_database() -> Iterator[str]:
    """A second database without the relay schema; its URL."""
    _require(PG_HOST, PG_PORT, "PostgreSQL")
    name = f"relay_e2_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True
    ) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(name)
    finally:
        drop_database(name)


def versions(url: str) -> list[tuple[int, str]]:
    with psycopg.connect(libpq(url)) as conn:
        return conn.execute(
            "SELECT version, name FROM relay_schema_version ORDER BY version"
        ).fetchall()


def expected_versions() -> list[tuple[int, str]]:
    return [(m.version, m.name) for m in schema.migrations()]


# --------------------------------------------------------------------------
# relay schema apply
# --------------------------------------------------------------------------


def test_apply_creates_the_tables_then_is_idempotent(empty_database):
    first = relay_cli("schema", "apply", database_url=empty_database)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == "applied: " + ", ".join(m.name for m in schema.migrations())
    assert versions(empty_database) == expected_versions()

    second = relay_cli("schema", "apply", database_url=empty_database)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == "schema is up to date"
    assert versions(empty_database) == expected_versions()
    with psycopg.connect(libpq(empty_database)) as conn:
        tables = {
            r[0]
            for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        }
    assert {"outbox", "inbox", "relay_schema_version"} <= tables


def test_apply_upgrades_a_version_4_database_with_the_audit_trail(database):
    """A database of the release before the audit trail: apply adds it, once."""
    with psycopg.connect(libpq(database), autocommit=True) as conn:
        conn.execute("DROP TABLE relay_audit")
        conn.execute("DELETE FROM relay_schema_version WHERE version >= 5")
        conn.execute("INSERT INTO outbox (topic, payload) VALUES ('t', '{}')")
    first = relay_cli("schema", "apply", database_url=database)
    assert first.returncode == 0, first.stderr
    assert (
        first.stdout.strip()
        == "applied: 005_audit, 006_schemas, 007_inbox_retrying, 008_inbox_quiet"
    )
    second = relay_cli("schema", "apply", database_url=database)
    assert second.stdout.strip() == "schema is up to date"
    with psycopg.connect(libpq(database)) as conn:
        assert conn.execute("SELECT count(*) FROM relay_audit").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)


def test_three_concurrent_applies_all_succeed_once(empty_database):
    procs = [
        subprocess.Popen(
            [*RELAY, "schema", "apply"],
            env=_env(empty_database),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        for _ in range(3)
    ]
    results = [(p.wait(60), *p.communicate()) for p in procs]
    for code, _out, err in results:
        assert code == 0, err
        assert "Traceback" not in err
    outputs = sorted(out.strip() for _, out, _ in results)
    # Exactly one of them applied the files; the others found them done.
    applied = "applied: " + ", ".join(m.name for m in schema.migrations())
    assert outputs == sorted([applied, "schema is up to date", "schema is up to date"])
    assert versions(empty_database) == expected_versions()


def test_applies_released_at_the_same_instant_serialise(empty_database):
    """The subprocesses above rarely overlap exactly; here they are made to."""
    count = 4
    barrier = threading.Barrier(count)
    results: list[Any] = [None] * count
    engines = [sa.create_engine(empty_database) for _ in range(count)]

    def run(i: int) -> None:
        try:
            with engines[i].connect() as conn:
                conn.execute(sa.text("SELECT 1"))
                conn.rollback()
                barrier.wait(10)
                with conn.begin():
                    results[i] = schema.apply(conn)
        except BaseException as exc:  # reported by the assertions below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for eng in engines:
            eng.dispose()
    assert not any(isinstance(r, BaseException) for r in results), results
    names = [m.name for m in schema.migrations()]
    assert sorted(results, key=len) == [[]] * (count - 1) + [names]
    assert versions(empty_database) == expected_versions()


def test_apply_refuses_a_newer_schema(database):
    newer = schema.latest_version() + 1
    with psycopg.connect(libpq(database)) as conn:
        conn.execute(
            "INSERT INTO relay_schema_version (version, name) VALUES (%s, %s)",
            (newer, f"{newer:03d}_from_the_future"),
        )
    result = relay_cli("schema", "apply", database_url=database)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "newer than this relay" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert versions(database)[-1][0] == newer  # untouched


# --------------------------------------------------------------------------
# The SQLAlchemy tables describe what the SQL creates
# --------------------------------------------------------------------------


def family(t: Any) -> str:
    """A column type's family, the same for a declared and a reflected type."""
    if isinstance(t, JSONB):
        return "jsonb"
    if isinstance(t, sa.JSON):
        return "json"
    if isinstance(t, sa.Uuid):
        return "uuid"
    if isinstance(t, sa.BigInteger):
        return "bigint"
    if isinstance(t, sa.SmallInteger):
        return "smallint"
    if isinstance(t, sa.Integer):
        return "int"
    if isinstance(t, sa.DateTime):
        return "timestamptz" if t.timezone else "timestamp"
    if isinstance(t, sa.Text):
        return "text"
    if isinstance(t, sa.String):
        return "varchar"
    if isinstance(t, sa.LargeBinary):
        return "bytea"
    return type(t).__name__


# The contract's tables: name -> (type family, nullable).
CONTRACT_OUTBOX = {
    "id": ("uuid", False),
    "seq": ("bigint", False),
    "topic": ("text", False),
    "key": ("text", True),
    "type": ("text", True),
    "payload": ("jsonb", False),
    "headers": ("jsonb", False),
    "created_at": ("timestamptz", False),
    "available_at": ("timestamptz", False),
    "status": ("text", False),
    "attempts": ("int", False),
    "last_error": ("text", True),
    "published_at": ("timestamptz", True),
}
CONTRACT_INBOX = {
    "consumer": ("text", False),
    "message_id": ("text", False),
    "topic": ("text", True),
    "key": ("text", True),
    "type": ("text", True),
    "payload": ("jsonb", True),
    "headers": ("jsonb", False),
    "received_at": ("timestamptz", False),
    "available_at": ("timestamptz", False),
    "status": ("text", False),
    "attempts": ("int", False),
    "last_error": ("text", True),
    "processed_at": ("timestamptz", True),
}
CONTRACT_PKS = {"outbox": ["id"], "inbox": ["consumer", "message_id"]}
# Defaults the contract names: the reflected default text contains this.
CONTRACT_DEFAULTS = {
    "outbox": {
        "id": "gen_random_uuid()",
        "headers": "'{}'",
        "created_at": "now()",
        "available_at": "now()",
        "status": "'pending'",
        "attempts": "0",
    },
    "inbox": {
        "headers": "'{}'",
        "received_at": "now()",
        "available_at": "now()",
        "status": "'pending'",
        "attempts": "0",
    },
}


@pytest.mark.parametrize(
    ("table", "contract"),
    [(schema.outbox, CONTRACT_OUTBOX), (schema.inbox, CONTRACT_INBOX)],
    ids=["outbox", "inbox"],
)
def test_core_table_matches_the_database_and_the_contract(engine, table, contract):
    reflected, pk = matches_the_database(engine, table)
    assert sorted(pk) == sorted(CONTRACT_PKS[table.name])

    for name, (kind, nullable) in contract.items():
        assert name in reflected, f"{table.name}.{name} is missing"
        assert (family(reflected[name]["type"]), reflected[name]["nullable"]) == (kind, nullable), (
            name
        )
    for name, default in CONTRACT_DEFAULTS[table.name].items():
        assert default in (reflected[name]["default"] or ""), (name, reflected[name]["default"])
    if table.name == "outbox":
        assert reflected["seq"].get("identity") is not None


def matches_the_database(engine: sa.Engine, table: sa.Table) -> tuple[dict[str, Any], list[str]]:
    """Assert a Core table has the columns (types, nullability, defaults) and
    primary key of the database's; returns the reflected columns and key."""
    inspector = sa.inspect(engine)
    reflected = {c["name"]: c for c in inspector.get_columns(table.name)}
    declared = {c.name: c for c in table.columns}
    assert set(declared) == set(reflected)
    for name, column in declared.items():
        db = reflected[name]
        assert family(column.type) == family(db["type"]), name
        assert column.nullable == db["nullable"], name
        # A column the database fills in has a default in both descriptions.
        db_fills = db["default"] is not None or db.get("identity") is not None
        core_fills = column.server_default is not None or column.identity is not None
        assert core_fills == db_fills, name
    pk = inspector.get_pk_constraint(table.name)["constrained_columns"]
    assert sorted(pk) == sorted(c.name for c in table.primary_key.columns)
    return reflected, pk


@pytest.mark.parametrize("table", list(schema.metadata.tables.values()), ids=lambda t: t.name)
def test_every_core_table_matches_the_database(engine, table):
    """relay's own tables too (relay_discarded, relay_audit)."""
    matches_the_database(engine, table)


def test_check_constraints_reject_an_unknown_status(engine):
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO outbox (topic, payload, status) VALUES ('t', '{}', 'sent')")
        )
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO inbox (consumer, message_id, status) VALUES ('c', 'm', 'done')")
        )


# --------------------------------------------------------------------------
# relay schema sql
# --------------------------------------------------------------------------


def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """What the schema created in `public`: columns, indexes, triggers, functions."""
    with psycopg.connect(libpq(url)) as conn:
        return {
            "columns": conn.execute(
                "SELECT table_name, column_name, ordinal_position, data_type, is_nullable, "
                "column_default, is_identity FROM information_schema.columns "
                "WHERE table_schema = 'public' ORDER BY table_name, ordinal_position"
            ).fetchall(),
            "indexes": conn.execute(
                "SELECT tablename, indexname, indexdef FROM pg_indexes "
                "WHERE schemaname = 'public' ORDER BY tablename, indexname"
            ).fetchall(),
            "triggers": conn.execute(
                "SELECT event_object_table, trigger_name, action_timing, event_manipulation, "
                "action_orientation, action_statement FROM information_schema.triggers "
                "WHERE trigger_schema = 'public' ORDER BY 1, 2, 4"
            ).fetchall(),
            "functions": conn.execute(
                "SELECT p.proname, p.prosrc FROM pg_proc p "
                "JOIN pg_namespace n ON n.oid = p.pronamespace "
                "WHERE n.nspname = 'public' ORDER BY 1"
            ).fetchall(),
            "constraints": conn.execute(
                "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) "
                "FROM pg_constraint WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2"
            ).fetchall(),
            "versions": conn.execute(
                "SELECT version, name FROM relay_schema_version ORDER BY version"
            ).fetchall(),
        }


def run_script(url: str, script: str) -> None:
    if shutil.which("psql"):
        result = subprocess.run(
            ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", libpq(url), "-f", "-"],
            input=script,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
    else:  # the simple query protocol runs a multi-statement script as is
        with psycopg.connect(libpq(url), autocommit=True) as conn:
            conn.execute(script.encode())


def test_schema_sql_needs_no_database_and_matches_apply(empty_database, other_empty_database):
    printed = relay_cli("schema", "sql", database_url=None)
    assert printed.returncode == 0, printed.stderr
    assert "CREATE TABLE IF NOT EXISTS outbox" in printed.stdout

    run_script(empty_database, printed.stdout)
    applied = relay_cli("schema", "apply", database_url=other_empty_database)
    assert applied.returncode == 0, applied.stderr

    by_script, by_apply = catalog(empty_database), catalog(other_empty_database)
    assert by_script["columns"] and by_script["indexes"] and by_script["triggers"]
    assert {t[1] for t in by_script["triggers"]} >= {
        "outbox_notify",
        "inbox_notify",
        "outbox_order_key",
    }
    for part in by_apply:
        assert by_script[part] == by_apply[part], part

    again = relay_cli("schema", "apply", database_url=empty_database)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "schema is up to date"


def test_schema_sql_run_twice_is_harmless(empty_database):
    script = schema.sql_script()
    run_script(empty_database, script)
    run_script(empty_database, script)
    assert versions(empty_database) == expected_versions()


# --------------------------------------------------------------------------
# Triggers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("channel", "insert"),
    [
        ("relay_outbox", "INSERT INTO outbox (topic, payload) VALUES ('t', '{}')"),
        ("relay_inbox", "INSERT INTO inbox (consumer, message_id) VALUES ('c', 'm1')"),
    ],
    ids=["outbox", "inbox"],
)
def test_insert_notifies_listeners_at_commit(database, channel, insert):
    with (
        psycopg.connect(libpq(database), autocommit=True) as listener,
        psycopg.connect(libpq(database)) as writer,
    ):
        listener.execute(f"LISTEN {channel}")
        writer.execute(insert)
        writer.execute(insert.replace("'m1'", "'m2'"))
        before = list(listener.notifies(timeout=0.3, stop_after=1))
        assert before == []  # nothing while the transaction is open
        writer.commit()
        after = list(listener.notifies(timeout=5, stop_after=1))
        assert [n.channel for n in after] == [channel]
        # Notifications of one transaction merge: no second one follows.
        assert list(listener.notifies(timeout=0.3, stop_after=1)) == []


def test_rolled_back_insert_does_not_notify(database):
    with (
        psycopg.connect(libpq(database), autocommit=True) as listener,
        psycopg.connect(libpq(database)) as writer,
    ):
        listener.execute("LISTEN relay_outbox")
        writer.execute("INSERT INTO outbox (topic, payload) VALUES ('t', '{}')")
        writer.rollback()
        assert list(listener.notifies(timeout=0.5, stop_after=1)) == []


def insert_keyed(conn: psycopg.Connection, key: str | None) -> int:
    return conn.execute(
        "INSERT INTO outbox (topic, key, payload) VALUES ('t', %s, '{}') RETURNING seq", (key,)
    ).fetchone()[0]


def test_same_key_insert_waits_for_the_open_transaction(database):
    url = libpq(database)
    with psycopg.connect(url) as first, psycopg.connect(url) as second:
        insert_keyed(first, "order-1")  # open, holds the key

        second.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            insert_keyed(second, "order-1")
        second.rollback()

        # Other keys and keyless rows go on while order-1 is held.
        second.execute("SET lock_timeout = '200ms'")
        insert_keyed(second, "order-2")
        insert_keyed(second, None)
        second.commit()
        first.rollback()


def test_same_key_seq_is_drawn_after_the_earlier_transaction_commits(database):
    url = libpq(database)
    with (
        psycopg.connect(url) as first,
        psycopg.connect(url) as second,
        psycopg.connect(url, autocommit=True) as other,
    ):
        first_seq = insert_keyed(first, "order-1")

        result: dict[str, Any] = {}

        def blocked_insert() -> None:
            try:
                result["seq"] = insert_keyed(second, "order-1")
                second.commit()
            except BaseException as exc:  # reported by the assertion below
                result["error"] = exc

        thread = threading.Thread(target=blocked_insert)
        thread.start()
        try:
            time.sleep(0.4)
            assert thread.is_alive(), result  # waiting for `first`
            assert "seq" not in result
            # A row committed meanwhile takes a later seq than `first`'s...
            middle_seq = insert_keyed(other, None)
            first.commit()
            thread.join(10)
            assert not thread.is_alive()
        finally:
            if thread.is_alive():
                first.rollback()
                thread.join(10)
        assert "error" not in result, result
        # ...and the blocked row drew its seq only once it held the key.
        assert first_seq < middle_seq < result["seq"]

    with psycopg.connect(url) as conn:
        ordered = conn.execute(
            "SELECT seq FROM outbox WHERE key = 'order-1' ORDER BY seq"
        ).fetchall()
    assert [r[0] for r in ordered] == [first_seq, result["seq"]]
