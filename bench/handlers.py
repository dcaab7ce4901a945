"""The benchmark's inbox handlers: `relay inbox --handlers bench.handlers`.

"Bench" does what a small real handler does: one INSERT into a table of
the app's, inside the transaction that marks the inbox row processed.
"""

from __future__ import annotations

import sqlalchemy as sa

import relay

registry = relay.HandlerRegistry()

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effects ("
    "message_id text PRIMARY KEY, n text, at timestamptz NOT NULL DEFAULT now())"
)

_INSERT = sa.text("INSERT INTO bench_effects (message_id, n) VALUES (:m, :n)")


@registry.handler("Bench")
def bench(message: relay.Message, conn: sa.Connection) -> None:
    payload = message.payload if isinstance(message.payload, dict) else {}
    conn.execute(_INSERT, {"m": message.id, "n": payload.get("i")})


# `--handlers bench.handlers:noop`: the same type handled by doing nothing,
# to tell the handler's own statement from the rest of the inbox's work.
noop = relay.HandlerRegistry()


@noop.handler("Bench")
def nothing(message: relay.Message, conn: sa.Connection) -> None:
    pass
