"""--dispatch received (the default, docs/inbox.md): what only this path
does. Every other test in tests/inbox runs under both paths (conftest.py)."""

from __future__ import annotations

import time

import orjson
import psycopg
import pytest

from tests.conftest import effect_ids, rows, wait_until

pytestmark = pytest.mark.parametrize("dispatch", ["received"])


async def publish(rabbit, message_id: str, type_: str, key: str, body: bytes) -> None:
    await rabbit.publish("t", body, message_id=message_id, type=type_, headers={"x-relay-key": key})


def notifications(conn: psycopg.Connection, seconds: float) -> list[str]:
    """The channels of the wake-ups `conn` (listening) gets in `seconds` (not
    the listener's self-check, which carries a payload)."""
    return [n.channel for n in conn.notifies(timeout=seconds, stop_after=100) if not n.payload]


async def test_a_receiving_commit_wakes_the_dispatchers_only_when_it_leaves_a_row_for_them(
    database, effects, rabbit, inbox
):
    """Schema 8's quiet trigger: handled rows notify nobody (no notify lock
    at each commit); a row left pending behind a failure sends the wake-up
    that the dispatchers, here and in other daemons, need."""
    listener = psycopg.connect(
        database.replace("postgresql+psycopg://", "postgresql://"), autocommit=True
    )
    try:
        listener.execute("LISTEN relay_inbox")
        inbox()
        for n in range(30):
            await publish(rabbit, f"e-{n}", "Effect", f"k{n % 7}", orjson.dumps({"n": n}))
        wait_until(lambda: len(effect_ids(effects)) == 30)
        assert notifications(listener, 1.0) == []
        assert rows(effects, "SELECT count(*) FROM inbox WHERE status <> 'processed'")[0][0] == 0

        # A handler that fails once: its row waits for a retry, and the next
        # row of its key waits behind it, both for the dispatchers.
        await publish(rabbit, "flaky", "Flaky", "k0", b'{"n": 100, "fail_times": 1}')
        assert notifications(listener, 10.0)[:1] == ["relay_inbox"]
    finally:
        listener.close()
    wait_until(
        lambda: (
            rows(effects, "SELECT status, attempts FROM inbox WHERE message_id = 'flaky'")
            == [("processed", 1)]
        )
    )


async def test_the_rows_of_a_key_behind_a_failure_wait_and_keep_their_order(effects, rabbit, inbox):
    """A failed handler in a receiving transaction: its row is retried by the
    dispatchers, and the later rows of its key in the batch (stored
    processed, then set back to pending) are handled after it, in order;
    other keys are handled in the receiving transaction."""
    daemon = inbox("--batch-size", "50")
    await publish(rabbit, "first", "Flaky", "a", b'{"n": 0, "fail_times": 2}')
    for n in range(1, 20):
        key = "a" if n % 2 else "b"
        await publish(rabbit, f"a-{n}", "Effect", key, orjson.dumps({"n": n}))
    wait_until(lambda: len(set(effect_ids(effects))) == 20, timeout=30)
    handled = [
        n for key, n in rows(effects, "SELECT key, n FROM effects ORDER BY at, id") if key == "a"
    ]
    # The flaky row's effect is written on each attempt and rolled back on
    # the failures: the one kept is its last, before every later row of "a".
    assert handled == sorted(handled) and handled[0] == 0, handled
    [(status, attempts)] = rows(
        effects, "SELECT status, attempts FROM inbox WHERE message_id = 'first'"
    )
    assert (status, attempts) == ("processed", 2)
    assert rows(effects, "SELECT count(*) FROM inbox WHERE status <> 'processed'")[0][0] == 0
    time.sleep(0.5)
    assert daemon.proc.poll() is None
