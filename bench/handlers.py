"""The benchmark's inbox handlers: `relay inbox --handlers bench.handlers`.

"Bench" does what a small real handler does: one INSERT into a table of
the app's, inside the transaction that marks the inbox row processed.
`--handlers bench.handlers:batch` handles it with a batch handler that
inserts the effects of its whole list in one statement (issue 33).
"""

from __future__ import annotations

import orjson
import sqlalchemy as sa

import relay

registry = relay.HandlerRegistry()

EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_effects ("
    "message_id text PRIMARY KEY, n text, at timestamptz NOT NULL DEFAULT now())"
)

_INSERT = sa.text("INSERT INTO bench_effects (message_id, n) VALUES (:m, :n)")

# The list travels as one JSON parameter (a text[] per column costs
# psycopg's array quoting of every value).
_INSERT_MANY = sa.text(
    "INSERT INTO bench_effects (message_id, n) "
    "SELECT m, n FROM json_to_recordset(CAST(:rows AS json)) AS r(m text, n text)"
)


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


# `--handlers bench.handlers:batch`: the same type, one statement per batch.
batch = relay.HandlerRegistry()


@batch.batch_handler("Bench", max_size=500)
def bench_batch(messages: list[relay.Message], conn: sa.Connection) -> None:
    rows = [
        {"m": m.id, "n": m.payload.get("i") if isinstance(m.payload, dict) else None}
        for m in messages
    ]
    conn.execute(_INSERT_MANY, {"rows": orjson.dumps(rows).decode()})
