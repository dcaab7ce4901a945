"""The inbox claim's per-key order, against a model of it: whatever rows of
a few keys are due, processed, dead, failed (due again, or waiting for their
retry) or locked by another dispatcher, the claim hands out exactly the rows
the contract allows and counts as blocked exactly those behind a row of
their key that another holds. Real PostgreSQL, generated tables; the claim
answers "did an earlier row of this key fail?" from inbox_retrying_key and
"does another hold an earlier one?" once a key (queries/inbox.sql)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay.db import Store

# A row's state as relay leaves it: (status, attempts, due now?), and
# "held": pending and due, but locked by another dispatcher's transaction.
STATES = {
    "due": ("pending", 0, True),
    "failed_due": ("pending", 1, True),  # its backoff is over: it runs next
    "failed_waiting": ("pending", 2, False),  # waits for its retry
    "processed": ("processed", 0, True),
    "dead": ("dead", 5, True),
    "held": ("pending", 0, True),
}
PENDING = {"due", "failed_due", "failed_waiting", "held"}

_rows = st.lists(
    st.tuples(st.sampled_from([None, "a", "b", "c"]), st.sampled_from(sorted(STATES))),
    min_size=1,
    max_size=24,
)


def expected(rows: list[tuple[str | None, str]], on_dead: str) -> tuple[list[int], int]:
    """The rows a claim of every key hands out (their places) and how many
    it finds blocked: a pending, due row not held elsewhere is claimed
    unless an earlier row of its key failed (or, with --on-dead block, is
    dead); a claimed row is blocked when an earlier pending row of its key
    is not among the claimed (another dispatcher holds it)."""
    claimed: list[int] = []
    for n, (key, state) in enumerate(rows):
        if state not in ("due", "failed_due"):
            continue
        earlier = [s for k, s in rows[:n] if key is not None and k == key]
        if any(s in ("failed_due", "failed_waiting") for s in earlier):
            continue
        if on_dead == "block" and "dead" in earlier:
            continue
        claimed.append(n)
    mine = set(claimed)
    blocked = [
        n
        for n in claimed
        if rows[n][0] is not None
        and any(
            k == rows[n][0] and s in PENDING and m not in mine for m, (k, s) in enumerate(rows[:n])
        )
    ]
    return [n for n in claimed if n not in blocked], len(blocked)


@pytest.fixture
def store(database: str) -> Iterator[Store]:
    store = Store(database, pool_size=1, sync=True)
    yield store
    asyncio.run(store.close())


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=_rows, on_dead=st.sampled_from(["skip", "block"]))
def test_the_claim_keeps_each_keys_order(
    engine: sa.Engine, store: Store, rows: list[tuple[str | None, str]], on_dead: str
) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("TRUNCATE inbox"))
        for n, (key, state) in enumerate(rows):
            status, attempts, due = STATES[state]
            conn.execute(
                sa.text(
                    "INSERT INTO inbox (consumer, message_id, key, payload, status, attempts, "
                    "available_at) VALUES ('c', :id, :key, '{}', :status, :attempts, "
                    "now() + CASE WHEN :due THEN interval '-1 second' ELSE interval '1 hour' END)"
                ),
                {"id": f"m{n}", "key": key, "status": status, "attempts": attempts, "due": due},
            )
    with engine.connect() as other:
        # Another dispatcher's claim, open while this one runs.
        held = [f"m{n}" for n, (_, state) in enumerate(rows) if state == "held"]
        other.execute(
            sa.text("SELECT 1 FROM inbox WHERE message_id = ANY(:held) FOR UPDATE"),
            {"held": held},
        )
        with store.sync_transaction() as conn:
            claimed = store.claim_inbox(conn, "c", 500, on_dead)
        other.rollback()
    got = [int(row.message_id[1:]) for row in claimed.rows]
    assert (got, claimed.blocked) == expected(rows, on_dead)
