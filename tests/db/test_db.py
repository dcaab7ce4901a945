"""relay.db: the named queries, their one placeholder style, the one error
translation, the receiver's process without SQLAlchemy, and the query files
inside an installed wheel."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from relay.db import sql
from relay.db.errors import (
    Refused,
    any_driver_error,
    failed_command,
    translate_errors,
    unavailable,
)
from relay.errors import DatabaseUnavailable
from tests.conftest import REPO

QUERIES = REPO / "relay" / "db" / "queries"

# The only modules of relay that may import SQLAlchemy or psycopg themselves.
DATABASE_MODULES = {
    "relay/db",
    "relay/producer.py",
    "relay/testing.py",
    "relay/handlers.py",
    "relay/config.py",
}


# -- the named queries ---------------------------------------------------------


def test_every_query_file_is_read_and_each_name_is_unique():
    names = sql.names()
    declared = re.findall(
        r"^-- name: (\w+)$",
        "\n".join(p.read_text() for p in sorted(QUERIES.glob("*.sql"))),
        re.MULTILINE,
    )
    assert sorted(declared) == names
    for name in ("outbox_claim", "inbox_claim", "inbox_insert", "outbox_mark_published"):
        assert sql.query(name)


def test_an_unknown_query_name_says_so():
    with pytest.raises(KeyError, match="no_such_query"):
        sql.query("no_such_query")


def test_queries_use_one_placeholder_style():
    """`:name` everywhere: no psycopg `%(name)s` or `%s`, no `$1` in the files."""
    for name in sql.names():
        text = sql.query(name)
        assert not re.search(r"%\(\w+\)s|%s\b|\$\d", text), name


def test_placeholders_convert_for_psycopg_and_prepare():
    text = "SELECT x::text FROM t WHERE a = :a AND b = CAST(:b AS int) AND c LIKE 'x%'"
    assert sql.parameters(text) == ["a", "b"]
    assert sql.pyformat(text) == (
        "SELECT x::text FROM t WHERE a = %(a)s AND b = CAST(%(b)s AS int) AND c LIKE 'x%%'"
    )
    assert sql.numbered(text, ["b", "a"]) == (
        "SELECT x::text FROM t WHERE a = $2 AND b = CAST($1 AS int) AND c LIKE 'x%'"
    )
    with pytest.raises(ValueError, match=":a"):
        sql.numbered(text, ["b"])


def test_sqlalchemy_reads_the_same_parameters():
    """The loader's idea of a parameter is SQLAlchemy's text(): both see the same names."""
    for name in sql.names():
        text = sql.query(name)
        if "{" in text:  # a template (relay.db.dead, the claims' {dead} slot)
            continue
        assert sorted(sa.text(text).compile().params) == sorted(sql.parameters(text)), name


def test_claims_fill_the_on_dead_slot():
    assert "{dead}" not in sql.claim("outbox", "skip")
    assert "d.status = 'dead'" in sql.claim("outbox", "block")
    assert "d.status = 'dead'" in sql.claim("inbox", "block")
    assert "d.status = 'dead'" not in sql.claim("inbox", "skip")


async def test_every_plain_query_prepares_on_the_real_schema(database):
    """Each named query without a template slot is valid SQL for the schema."""
    async with await psycopg.AsyncConnection.connect(
        database.replace("+psycopg", ""), autocommit=True
    ) as conn:
        await conn.execute(sql.query("demo_create_table"))  # `relay demo`'s table
        for name in sql.names():
            text = sql.query(name)
            if (
                "{" in text
                or not text
                or ";" in text
                or not re.match(r"\s*(SELECT|WITH|UPDATE|INSERT|DELETE)", text)
            ):
                continue
            numbered = sql.numbered(text, sql.parameters(text))
            await conn.execute(f"PREPARE relay_check AS {numbered}")
            await conn.execute("DEALLOCATE relay_check")


# -- the one error translation ---------------------------------------------------


def test_a_lost_connection_becomes_database_unavailable():
    with (
        pytest.raises(DatabaseUnavailable, match="OperationalError: gone") as caught,
        translate_errors(),
    ):
        raise psycopg.OperationalError("gone\nmore")
    assert isinstance(caught.value.__cause__, psycopg.OperationalError)
    with pytest.raises(DatabaseUnavailable), translate_errors():
        raise ConnectionResetError("reset")


def test_sqlalchemy_errors_of_a_lost_connection_become_database_unavailable():
    lost = sa_exc.OperationalError("SELECT 1", {}, psycopg.OperationalError("closed"))
    with pytest.raises(DatabaseUnavailable, match="OperationalError: closed"), translate_errors():
        raise lost
    invalidated = sa_exc.DBAPIError("SELECT 1", {}, Exception("x"), connection_invalidated=True)
    assert unavailable(invalidated) is not None


def test_other_errors_pass_unchanged():
    for error in (
        psycopg.errors.UniqueViolation("dup"),
        ValueError("bad"),
        sa_exc.IntegrityError("INSERT", {}, psycopg.errors.UniqueViolation("dup")),
    ):
        with pytest.raises(type(error)), translate_errors():
            raise error
    assert unavailable(DatabaseUnavailable("already")) is None


def test_the_writer_refuses_values_and_loses_connections():
    refused = unavailable(psycopg.errors.UntranslatableCharacter("bad\nbyte"), any_driver_error)
    assert isinstance(refused, Refused) and str(refused) == "bad"
    lost = unavailable(psycopg.errors.ReadOnlySqlTransaction("read only"), any_driver_error)
    assert isinstance(lost, DatabaseUnavailable)


def test_a_failed_savepoint_command_is_lost_only_with_its_connection():
    lost = failed_command("SAVEPOINT x", "server closed the connection\n", connection_bad=True)
    assert isinstance(lost, DatabaseUnavailable)
    assert str(lost) == "OperationalError: server closed the connection"
    failed = failed_command("SAVEPOINT x", "current transaction is aborted", connection_bad=False)
    assert isinstance(failed, psycopg.DatabaseError)
    assert str(failed) == "SAVEPOINT x: current transaction is aborted"


# -- who imports what ---------------------------------------------------------------


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_only_relay_db_imports_sqlalchemy_and_psycopg():
    """The loops and services reach PostgreSQL through relay.db alone. (The
    public API that works on the caller's own connection, the handlers'
    SQLAlchemy bridge and URL parsing keep their imports.)"""
    offenders = []
    for path in sorted((REPO / "relay").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        if any(rel == allowed or rel.startswith(allowed + "/") for allowed in DATABASE_MODULES):
            continue
        if _imports(path) & {"sqlalchemy", "psycopg"}:
            offenders.append(rel)
    assert offenders == []
    assert not (REPO / "relay" / "store.py").exists()
    assert not (REPO / "relay" / "pg.py").exists()


def test_receiver_process_loads_no_sqlalchemy(database):
    """The receiver's child process (python -m relay.receiver_process) writes through
    plain psycopg: importing what it runs, and inserting a batch, loads no
    SQLAlchemy."""
    script = f"""
import asyncio, sys
import relay.receiver_process, relay.receiving, relay.brokers.amqp, relay.brokers.sqs
from relay.db.writer import InboxWriter
from relay.rows import NewInboxRow

async def main():
    writer = InboxWriter({database!r})
    row = NewInboxRow(message_id="m1", topic="t", key=None, type="T", payload='{{"a": 1}}',
                      body=None, headers="{{}}", status="pending", last_error=None,
                      raw_properties=None)
    assert await writer.insert("c", [row]) == {{"m1"}}
    await writer.close()

asyncio.run(main())
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "sqlalchemy")
assert not loaded, loaded
print("ok")
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# -- packaging ----------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_query_files_ship_in_the_wheel_and_are_found_there(tmp_path):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {built.stderr[-300:]}")
    wheel = next(tmp_path.glob("relay_outbox-*.whl"))
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        shipped = {n for n in archive.namelist() if n.startswith("relay/db/queries/")}
        archive.extractall(installed)
    assert {f"relay/db/queries/{p.name}" for p in QUERIES.glob("*.sql")} <= shipped
    script = (
        "import relay.db.sql as s, relay.db.schema as schema; "
        f"assert s.__file__.startswith({str(installed)!r}), s.__file__; "
        "assert 'outbox_claim' in s.names(); "
        "assert schema.migrations(); print(len(s.names()))"
    )
    # From elsewhere than the checkout, with the unpacked wheel first on the path.
    command = f"import sys; sys.path.insert(0, {str(installed)!r}); {script}"
    result = subprocess.run(
        [sys.executable, "-c", command], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(sql.names())
