"""relay.db: everything relay says to PostgreSQL, and every way it gets there.

The queries are named, in relay/db/queries/*.sql (relay.db.sql reads them,
with `:name` parameters throughout); errors of the driver and of SQLAlchemy
become relay's own in relay.db.errors. The rest of relay imports this
package, never SQLAlchemy or psycopg itself.

| module | what it owns |
|---|---|
| `sql` | the named queries: loading them once, placeholder conversion |
| `errors` | the one error translation (DatabaseUnavailable, Refused) |
| `connect` | plain psycopg connections: timeouts, application_name, pooler detection |
| `writer` | the inbox receiver's INSERT (its process loads no SQLAlchemy) |
| `store` | `Store`: the pooled SQLAlchemy engines, the inbox claim and marks, commands |
| `session` | `OutboxSession`: an outbox worker's prepared claim and mark |
| `listener` | `Listener`: LISTEN with its self-check; one per database shared by schemas |
| `jobs` | retention, gauges and the churn vacuum |
| `schema` | SQLAlchemy tables mirroring schema/*.sql, applying them |
| `slot` | `SlotReader`: the outbox's replication slot (--capture wal): made, read, moved |
| `stream` | `SlotStream`: the slot read through the replication protocol, in a thread |
| `pgoutput` | decoding the `pgoutput` plugin's messages (no psycopg) |

Names load on first use (PEP 562), so that `relay.db.writer`, in the
receiver's process, brings no SQLAlchemy along.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.ext.asyncio import AsyncConnection

    from relay.db.connect import create_database_if_missing, libpq_url
    from relay.db.errors import (
        Refused,
        connection_invalidated,
        describe,
        translate_errors,
    )
    from relay.db.jobs import (
        RETENTION_LOCK,
        delete_expired,
        pending_gauge,
        table_health,
        vacuum,
    )
    from relay.db.listener import Listener, SharedListeners
    from relay.db.pgoutput import Transaction
    from relay.db.session import OutboxSession
    from relay.db.slot import SlotLost, SlotReader, SlotUnreadable, slot_name
    from relay.db.store import NOTIFY_INBOX, NOTIFY_OUTBOX, Store, named, retry_in
    from relay.db.writer import InboxWriter

_LAZY = {
    "AsyncConnection": "sqlalchemy.ext.asyncio",
    "Connection": "sqlalchemy",
    "create_database_if_missing": "relay.db.connect",
    "InboxWriter": "relay.db.writer",
    "Listener": "relay.db.listener",
    "SharedListeners": "relay.db.listener",
    "NOTIFY_INBOX": "relay.db.store",
    "NOTIFY_OUTBOX": "relay.db.store",
    "OutboxSession": "relay.db.session",
    "SlotLost": "relay.db.slot",
    "SlotReader": "relay.db.slot",
    "SlotUnreadable": "relay.db.slot",
    "Transaction": "relay.db.pgoutput",
    "slot_name": "relay.db.slot",
    "RETENTION_LOCK": "relay.db.jobs",
    "Refused": "relay.db.errors",
    "Store": "relay.db.store",
    "connection_invalidated": "relay.db.errors",
    "delete_expired": "relay.db.jobs",
    "describe": "relay.db.errors",
    "libpq_url": "relay.db.connect",
    "pending_gauge": "relay.db.jobs",
    "retry_in": "relay.db.store",
    "table_health": "relay.db.jobs",
    "vacuum": "relay.db.jobs",
    "named": "relay.db.store",
    "translate_errors": "relay.db.errors",
}

__all__ = [
    "NOTIFY_INBOX",
    "NOTIFY_OUTBOX",
    "RETENTION_LOCK",
    "AsyncConnection",
    "Connection",
    "InboxWriter",
    "Listener",
    "OutboxSession",
    "Refused",
    "SharedListeners",
    "SlotLost",
    "SlotReader",
    "SlotUnreadable",
    "Store",
    "Transaction",
    "connection_invalidated",
    "create_database_if_missing",
    "delete_expired",
    "describe",
    "libpq_url",
    "named",
    "pending_gauge",
    "retry_in",
    "slot_name",
    "table_health",
    "translate_errors",
    "vacuum",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relay.db' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
