"""Where relay's tables live: the schema (`--schema`), and what follows from it.

One database may hold relay's tables in several schemas (a schema per
tenant). Each schema's relay must then see only its own: its tables (the
connection's search_path), its wake-ups (the notification channel) and its
advisory locks (the outbox workers' shares, retention), which PostgreSQL
keeps per database, not per schema.

The schema `public`, and a relay given no --schema whose tables are found
there, keep the names relay always used (channel `relay_outbox`, the same
lock ids), so that relays of earlier versions and this one share them on
the same tables. The schema's trigger (schema/006_schemas.sql) and the
`notify_wake` query name channels the same way as `channel()` here.

No SQLAlchemy and no psycopg here: the receiver's process uses it.
"""

from __future__ import annotations

import hashlib

DEFAULT = "public"
# PostgreSQL's longest identifier, a channel name included (NAMEDATALEN - 1).
NAME_BYTES = 63
# The outbox workers' share locks (relay.db.session): this class in the
# two-integer advisory key space for the default schema.
SHARE_LOCK_CLASS = 0x72656C73
# Other classes of that space relay uses: the producer trigger's per-key locks.
_TAKEN_CLASSES = {SHARE_LOCK_CLASS, 0x72656C79}


def quoted(schema: str) -> str:
    """The schema as a quoted SQL identifier (its exact name, case kept)."""
    return '"' + schema.replace('"', '""') + '"'


def search_path(schema: str) -> str:
    """The search_path relay's connections use for `schema`: the schema
    first, so that relay's unqualified names find its tables there, then
    `public`, so that a handler's own tables there are found as before."""
    if schema == DEFAULT:
        return DEFAULT
    return f"{quoted(schema)}, {DEFAULT}"


def path_option(schema: str) -> str:
    """search_path as a startup option (`options=-c ...`): no spaces."""
    return "-c search_path=" + search_path(schema).replace(" ", "")


def set_local(schema: str) -> str:
    """search_path for one transaction: behind a pooler, where neither the
    startup option nor a session SET reaches the next transaction."""
    return f"SET LOCAL search_path TO {search_path(schema)}"


def qualified(table: str, schema: str | None) -> str:
    """`table` in `schema` (None: as the search_path finds it)."""
    return table if schema is None else f"{quoted(schema)}.{table}"


def channel(base: str, schema: str | None) -> str:
    """The notification channel of `base` (relay_outbox, relay_inbox) in
    `schema`: `base.schema`, or `base.<md5 of schema>` when that would pass
    63 bytes; `base` itself in `public` (and where no schema is known)."""
    if schema is None or schema == DEFAULT:
        return base
    name = f"{base}.{schema}"
    if len(name.encode()) > NAME_BYTES:
        name = f"{base}.{hashlib.md5(schema.encode()).hexdigest()}"  # noqa: S324 - a name, not a secret
    return name


def _hash32(schema: str) -> int:
    """A stable signed 32-bit number for `schema`."""
    digest = hashlib.blake2b(schema.encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big", signed=True)


def share_lock_class(schema: str | None) -> int:
    """The advisory lock class of the outbox share locks of `schema`'s outbox:
    relays on one table share it; relays on other schemas' tables do not wait
    for them (a collision of two schemas' 32-bit hashes would only make them
    wait for each other's batches, never break an order)."""
    if schema is None or schema == DEFAULT:
        return SHARE_LOCK_CLASS
    number = _hash32(schema)
    return number ^ 1 if number in _TAKEN_CLASSES else number


def table_lock(lock_id: int, schema: str | None) -> int:
    """A one-bigint advisory lock id (retention's) made `schema`'s own: the
    schema's hash in the upper half, `lock_id` (32 bits) in the lower."""
    if schema is None or schema == DEFAULT:
        return lock_id
    return (_hash32(schema) << 32) | lock_id
