"""The claims bounded by bytes (issue 43): PostgreSQL measures the payloads
before any is read, a claim takes a prefix of its rows in seq order whose
sizes fit the budget, a first row larger than the budget is taken alone
only when allowed, and the row it stopped at says how large it is.

relay.budget's ledger is pure arithmetic, tested here without a database."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.budget import Budget
from relay.db import Store
from tests.conftest import rows

KiB = 1024


def insert_sized(engine: sa.Engine, sizes: list[int], *, compressible: bool = False) -> None:
    """One outbox row and one inbox row per size, in order, key 'k' for all:
    payload {"n": i, "s": <size bytes>}, random hex or (compressible) one
    repeated letter, which PostgreSQL compresses to almost nothing."""
    fill = (
        "repeat('x', :size)"
        if compressible
        else (
            "(SELECT string_agg(md5(CAST(:n AS text) || j::text), '') "
            "FROM generate_series(1, :size / 32) j)"
        )
    )
    for n, size in enumerate(sizes):
        payload = f"jsonb_build_object('n', :n, 's', coalesce({fill}, ''))"
        rows(
            engine,
            f"INSERT INTO outbox (topic, key, payload) VALUES ('t', 'k', {payload})",
            n=n,
            size=size,
        )
        rows(
            engine,
            "INSERT INTO inbox (consumer, message_id, key, payload) "
            f"VALUES ('c', 'm' || :n, 'k', {payload})",
            n=n,
            size=size,
        )


async def outbox_claim(
    database: str, budget: int, alone: bool
) -> tuple[list[int], int, int | None]:
    session = Store(database).outbox_session("skip")
    try:
        claimed = await session.claim(500, budget=budget, alone=alone)
        await session.finish(())
        return (
            [int(r.payload.split('"n": ')[1].split(",")[0]) for r in claimed.rows],
            claimed.used,
            claimed.need,
        )
    finally:
        await session.close()


def inbox_claim(database: str, budget: int, alone: bool) -> tuple[list[int], int, int | None]:
    store = Store(database, pool_size=1, sync=True)
    try:
        with store.sync_transaction() as conn:
            claimed = store.claim_inbox(conn, "c", 500, "skip", budget=budget, alone=alone)
        return [int(r.message_id[1:]) for r in claimed.rows], claimed.used, claimed.need
    finally:
        asyncio.run(store.close())


@pytest.mark.parametrize("compressible", [False, True], ids=["random", "compressible"])
async def test_claims_take_what_fits_the_budget_in_seq_order(
    engine: sa.Engine, database: str, compressible: bool
) -> None:
    sizes = [10, 300 * KiB, 300 * KiB, 10, 900 * KiB, 10]
    insert_sized(engine, sizes, compressible=compressible)
    stored = [s for (s,) in rows(engine, "SELECT pg_column_size(payload) FROM outbox ORDER BY seq")]
    if compressible:  # stored compressed: measured as text, not as stored
        assert stored[4] < 100 * KiB
    for claim in (outbox_claim, inbox_claim):
        run = claim if claim is outbox_claim else (lambda *a: asyncio.to_thread(inbox_claim, *a))
        # 700 KiB: the first four rows, stopped at the fifth (900 KiB),
        # whose size it reports.
        taken, used, need = await run(database, 700 * KiB, False)
        assert taken == [0, 1, 2, 3]
        assert 600 * KiB < used <= 700 * KiB
        assert need is not None and 900 * KiB <= need < 1000 * KiB
        # A first row larger than the budget: alone when allowed, else none.
        taken, used, need = await run(database, 5, True)
        assert taken == [0] and need is not None and need > 300 * KiB  # stopped at row 1
        taken, used, need = await run(database, 5, False)
        assert taken == [] and used == 0 and need is not None and need < 100
        # Unbounded: everything, as before.
        taken, used, need = await run(database, 1 << 40, True)
        assert (taken, need) == (list(range(len(sizes))), None)


@given(
    st.lists(st.integers(min_value=1, max_value=1000), min_size=1, max_size=30),
    st.integers(min_value=1, max_value=3000),
    st.integers(min_value=1, max_value=4),
)
@settings(max_examples=200, deadline=None)
def test_the_ledger_never_grants_past_the_budget(
    sizes: list[int], total: int, workers: int
) -> None:
    """Claims in turn, each taking rows while they fit its grant (a first
    row alone only with the whole budget), some batches released as they
    go: what is held never passes the budget but for one row held alone."""

    async def run() -> None:
        budget = Budget(total, workers)
        pending = list(sizes)
        open_batches: list[int] = []
        need: int | None = None
        while pending:
            # The other workers' batches end (a worker waiting for bytes
            # waits for them; here, in turn, they end before it asks).
            if need is not None or budget.held >= total or len(open_batches) >= workers:
                while open_batches:
                    budget.release(open_batches.pop())
            grant = await asyncio.wait_for(budget.take(need), 1)
            used, taken = 0, 0
            for size in pending:
                if used + size <= grant or (taken == 0 and budget.alone(grant)):
                    used, taken = used + size, taken + 1
                else:
                    break
            need = pending[taken] if taken < len(pending) else None
            del pending[:taken]
            budget.claimed(grant, used)
            assert budget.held <= total or (taken == 1 and budget.held == used)
            open_batches.append(used)
        for used in open_batches:
            budget.release(used)
        assert budget.held == 0

    asyncio.run(run())
