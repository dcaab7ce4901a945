"""The schema: SQLAlchemy Core tables that mirror schema/*.sql, and applying it.

The SQL files are the source of truth; `tests/db/test_schema.py` proves the
tables below describe what they create. Files are applied in order, each
recorded in `relay_schema_version`, in one transaction under an advisory
lock, so several pods may run `relay schema apply` at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import BYTEA, JSON, JSONB, UUID

from relay.db import namespace
from relay.db.sql import query
from relay.errors import SchemaError, SchemaNotReady

metadata = sa.MetaData()

outbox = sa.Table(
    "outbox",
    metadata,
    sa.Column(
        "id", UUID(as_uuid=True), primary_key=True, server_default=sa.text("gen_random_uuid()")
    ),
    sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False),
    sa.Column("topic", sa.Text, nullable=False),
    sa.Column("key", sa.Text),
    sa.Column("type", sa.Text),
    sa.Column("payload", JSONB(none_as_null=True), nullable=False),
    sa.Column("headers", JSONB, nullable=False, server_default=sa.text("'{}'")),
    sa.Column(
        "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.Column(
        "available_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("published_at", sa.DateTime(timezone=True)),
)

inbox = sa.Table(
    "inbox",
    metadata,
    sa.Column("consumer", sa.Text, primary_key=True),
    sa.Column("message_id", sa.Text, primary_key=True),
    sa.Column("seq", sa.BigInteger, sa.Identity(), nullable=False),
    sa.Column("topic", sa.Text),
    sa.Column("key", sa.Text),
    sa.Column("type", sa.Text),
    sa.Column("payload", JSONB(none_as_null=True)),
    sa.Column("body", BYTEA),
    sa.Column("headers", JSONB, nullable=False, server_default=sa.text("'{}'")),
    sa.Column(
        "received_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.Column(
        "available_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
    sa.Column("status", sa.Text, nullable=False, server_default="pending"),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("last_error", sa.Text),
    sa.Column("processed_at", sa.DateTime(timezone=True)),
    sa.Column("raw_properties", JSON),
)

# Discarded dead rows, kept whole (schema/004_dead_messages.sql, relay.dead).
discarded = sa.Table(
    "relay_discarded",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("source", sa.Text, nullable=False),
    sa.Column("message_id", sa.Text, nullable=False),
    sa.Column("consumer", sa.Text),
    sa.Column("row_data", JSONB, nullable=False),
    sa.Column("reason", sa.Text),
    sa.Column(
        "discarded_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()
    ),
)

# The audit trail (schema/005_audit.sql, relay.audit).
audit = sa.Table(
    "relay_audit",
    metadata,
    sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
    sa.Column("at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    sa.Column("actor", sa.Text, nullable=False),
    sa.Column("via", sa.Text, nullable=False),
    sa.Column("action", sa.Text, nullable=False),
    sa.Column("target", sa.Text),
    sa.Column("filter", JSONB),
    sa.Column("ids", JSONB),
    sa.Column("count", sa.BigInteger),
    sa.Column("before", JSONB),
    sa.Column("after", JSONB),
    sa.Column("detail", sa.Text),
)

VERSION_TABLE_DDL = query("schema_version_table") + "\n"

# Any constant works; this one spells "rely" and keeps clear of app locks.
APPLY_LOCK_ID = 0x72656C79

_FILE_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str


def _schema_dir() -> Path:
    # Installed wheels carry the SQL as relay/schema/; a source checkout
    # (editable install, tests) has it at the top of the repo.
    packaged = resources.files("relay") / "schema"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "schema"


def migrations() -> list[Migration]:
    """The SQL files in version order."""
    found = []
    for path in sorted(_schema_dir().iterdir()):
        match = _FILE_NAME.match(path.name)
        if match:
            found.append(Migration(int(match.group(1)), path.stem, path.read_text()))
    if not found:
        raise SchemaError(f"no schema files found in {_schema_dir()}")
    return found


def latest_version() -> int:
    return migrations()[-1].version


def _into_schema(schema: str) -> list[str]:
    """The statements that make `schema` and point this transaction's DDL at
    it (relay.db.namespace: only it on the search_path, so that nothing
    lands in `public` or is taken from there)."""
    return [
        query("schema_create").replace("{schema}", namespace.quoted(schema)),
        f"SET LOCAL search_path TO {namespace.quoted(schema)}",
    ]


def sql_script(schema: str | None = None) -> str:
    """Everything `apply` would run on an empty database (with `schema`:
    making the schema and creating the tables in it), as one script."""
    parts = ["BEGIN;"]
    if schema is not None:
        parts.extend(statement + ";" for statement in _into_schema(schema))
    parts.append(VERSION_TABLE_DDL)
    for m in migrations():
        parts.append(f"-- {m.name}\n{m.sql.rstrip()}\n")
        parts.append(
            "INSERT INTO relay_schema_version (version, name) "
            f"VALUES ({m.version}, '{m.name}') ON CONFLICT (version) DO NOTHING;\n"
        )
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def apply(conn: sa.Connection, schema: str | None = None) -> list[str]:
    """Apply the missing migrations in the caller's transaction (with
    `schema`: in that schema, made if missing); returns their names.

    One lock for every schema of the database: applies run one at a time,
    and two that make the same schema do not collide."""
    conn.execute(sa.text(query("schema_apply_lock")), {"id": APPLY_LOCK_ID})
    if schema is not None:
        for statement in _into_schema(schema):
            conn.exec_driver_sql(statement)
    conn.execute(sa.text(VERSION_TABLE_DDL))
    done = set(conn.execute(sa.text(query("schema_versions_applied"))).scalars())
    known = migrations()
    _refuse_newer(max(done, default=0))
    applied = []
    for m in known:
        if m.version in done:
            continue
        conn.exec_driver_sql(m.sql)
        conn.execute(
            sa.text(query("schema_record_version")),
            {"v": m.version, "n": m.name},
        )
        applied.append(m.name)
    return applied


def _refuse_newer(version: int) -> None:
    if version > latest_version():
        raise SchemaError(
            f"the database schema is version {version}, newer than this relay "
            f"understands ({latest_version()}): upgrade relay"
        )


CHECK_VERSION_SQL = sa.text(query("schema_version"))


def check_version(version: int | None) -> None:
    """Raise SchemaError unless `version` (from CHECK_VERSION_SQL) is usable."""
    if version is None:
        raise SchemaNotReady("the relay tables do not exist yet: run `relay schema apply`")
    _refuse_newer(version)
    if version < latest_version():
        raise SchemaNotReady(
            f"the database schema is version {version}, older than this relay needs "
            f"({latest_version()}): run `relay schema apply`"
        )
