"""The outbox loop itself (claim → publish → mark, the workers, the wakeups),
in this process on the memory broker against the real PostgreSQL.

The broker is irrelevant to these behaviours, so it is the memory broker
(relay.brokers.memory) with faults injected where a test needs a nack, a
return, a slow confirm or a broken connection; what each real broker does
is the contract suite's (tests/brokers/test_contract.py), and `relay
outbox` end to end is tests/outbox/test_outbox.py's.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Self

import orjson
import pytest
import sqlalchemy as sa

import relay
import relay.db.session
from relay.brokers.memory import MemoryBroker
from relay.config import BrokerURL, OutboxSettings
from relay.db import NOTIFY_OUTBOX, Listener, OutboxSession, Store
from relay.db.session import SHARE_LOCK_CLASS, Claimed, share_key
from relay.outbox import WORKERS
from relay.wiring import outbox_relay
from tests.conftest import AMQP_URL, insert_outbox, keys_by_share, rows, until


class LoopRelay:
    """relay's outbox loop (and, if asked, its listener) in this process on a
    memory broker (its own, or one it shares with other LoopRelays: three
    relays on one broker). A 60 s poll by default: what it publishes, it
    publishes because of a notification. `claims` records the share of every
    claim it makes: (worker, WORKERS) for a worker's share of the keys,
    (0, 1) for every key; `blocked` how many rows each claim left for
    another relay (an earlier row of their key held there)."""

    def __init__(
        self,
        database: str,
        monkeypatch: pytest.MonkeyPatch,
        *,
        listen: bool = True,
        on_unroutable: str = "publish",
        broker: MemoryBroker | None = None,
        **settings: object,
    ) -> None:
        self.listen = listen
        self.claims: list[tuple[int, int]] = []
        self.blocked: list[int] = []
        settings.setdefault("poll_interval", 60)
        config = OutboxSettings(
            database_url=database,
            broker=BrokerURL.parse(AMQP_URL),
            exchange="relay",
            on_unroutable=on_unroutable,
            **settings,
        )  # type: ignore[arg-type]
        if broker is None:
            broker = MemoryBroker()
            broker.bind("all", "#")
        self.broker = broker
        self.store = Store(database)
        self._record_claims(monkeypatch)
        self.publisher = self.broker.publisher(on_unroutable=on_unroutable)
        self.relay = outbox_relay(config, self.store, self.publisher)
        self.listener = Listener(self.store.conninfo, NOTIFY_OUTBOX, self.relay.wake)
        self.tasks: list[asyncio.Task[None]] = []

    def _record_claims(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Every session of this relay's Store records its claims here."""
        opened = self.store.outbox_session

        def outbox_session(*args: Any, **kwargs: Any) -> OutboxSession:
            session = opened(*args, **kwargs)
            claim = session.claim

            async def recorded(
                limit: int, worker: int = 0, workers: int = 1, **kwargs: Any
            ) -> Claimed:
                self.claims.append((worker, workers))
                claimed = await claim(limit, worker, workers, **kwargs)
                self.blocked.append(claimed.blocked)
                return claimed

            monkeypatch.setattr(session, "claim", recorded)
            return session

        monkeypatch.setattr(self.store, "outbox_session", outbox_session)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.relay.run())]
        if self.listen:
            self.tasks.append(asyncio.create_task(self.listener.run()))

    async def __aenter__(self) -> Self:
        self.start()
        await self.settled()
        return self

    async def settled(self, timeout: float = 10) -> None:
        """Wait until the listener is up and every worker sleeps, none woken."""
        deadline = time.monotonic() + timeout
        while not ((self.listener.connected.is_set() or not self.listen) and self.relay.settled):
            assert time.monotonic() < deadline, "the relay did not settle"
            for task in self.tasks:
                if task.done():
                    task.result()
            await asyncio.sleep(0.01)

    async def received(self, count: int, timeout: float = 5) -> list[relay.brokers.memory.Message]:
        """Take `count` messages from the broker's catch-all queue (the poll would take 60 s)."""
        got: list[relay.brokers.memory.Message] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            got += self.broker.take("all")
            assert time.monotonic() < deadline, f"{len(got)} of {count} messages"
            await asyncio.sleep(0.01)
        return got

    async def __aexit__(self, *exc: object) -> None:
        self.relay.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.relay.close()
        await self.publisher.close()
        await self.store.close()


def keys_of_every_share(engine: sa.Engine) -> list[str]:
    """One key for each worker's share, as the claim hashes them."""
    shares = keys_by_share(engine, WORKERS)
    assert sorted(shares) == list(range(WORKERS))
    return [shares[share][0] for share in range(WORKERS)]


def outcome(engine: sa.Engine) -> dict[object, tuple[object, ...]]:
    return {
        r[0]: r[1:]
        for r in rows(
            engine,
            "SELECT id, status, attempts, last_error, "
            "extract(epoch FROM available_at - now()) FROM outbox",
        )
    }


# --------------------------------------------------------------------------
# The workers and their wakeups
# --------------------------------------------------------------------------


async def test_a_quiet_relay_answers_a_notification_with_one_claim(engine, database, monkeypatch):
    async with LoopRelay(database, monkeypatch) as quiet:
        quiet.claims.clear()
        keys = [*keys_of_every_share(engine), None]
        for n, key in enumerate(keys):
            with engine.begin() as conn:
                relay.enqueue(conn, f"quiet.{n}", {"n": n}, key=key)
            [message] = await quiet.received(1)
            assert orjson.loads(message.body) == {"n": n}
            await quiet.settled()
        # One idle worker claimed each row, whatever share its key is in;
        # the others slept on (with a claim each, and one more by the worker
        # that published, this was 5 claims a row).
        assert quiet.claims == [(0, 1)] * len(keys)


async def test_a_full_batch_wakes_the_sleeping_workers_to_help(engine, database, monkeypatch):
    async with LoopRelay(database, monkeypatch, batch_size=10) as quiet:
        quiet.claims.clear()
        insert_outbox(engine, 200, topic="burst")
        assert len(await quiet.received(200)) == 200
        await quiet.settled()
    # The scout's full batch woke the rest, each to claim its own share.
    assert quiet.claims[0] == (0, 1)
    assert {worker for worker, workers in quiet.claims if workers == WORKERS} == set(range(WORKERS))
    assert rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'") == [(200,)]


async def test_a_key_held_by_another_relay_goes_back_to_its_own_worker(
    engine, database, monkeypatch
):
    key = keys_of_every_share(engine)[1]  # not the scout's own share
    async with LoopRelay(database, monkeypatch, listen=False) as quiet:
        with engine.begin() as conn:
            first = relay.enqueue(conn, "held", {"n": 1}, key=key)
            second = relay.enqueue(conn, "held", {"n": 2}, key=key)
        with engine.connect() as other:  # another relay, holding the key's head
            other.execute(sa.text("SELECT 1 FROM outbox WHERE id = :id FOR UPDATE"), {"id": first})
            quiet.claims.clear()
            quiet.relay.wake()  # the notification of the commit above
            await asyncio.sleep(0.3)
            # The scout found the second row blocked and handed the keys back:
            # the key's own worker retries its share, the scout no longer
            # claims every key.
            assert quiet.claims[0] == (0, 1)
            assert (0, 1) not in quiet.claims[1:]
            assert quiet.claims.count((1, WORKERS)) > 3
            other.execute(
                sa.text("UPDATE outbox SET status = 'published' WHERE id = :id"), {"id": first}
            )
            other.commit()
        [message] = await quiet.received(1)
        assert message.message_id == str(second)


async def test_three_relays_drain_one_table_in_key_order_without_claiming_blocked_rows(
    engine, database, monkeypatch
):
    # Issue 21: worker i of every relay took the same keys, so two of three
    # claims locked rows behind the third's, all `blocked`, and published
    # nothing. One broker for the three: its queue holds the publishing order.
    insert_outbox(engine, 6000, topic="three", keys=20)
    broker = MemoryBroker()
    broker.bind("all", "#")
    relays = [
        LoopRelay(database, monkeypatch, listen=False, broker=broker, batch_size=100)
        for _ in range(3)
    ]
    try:
        await asyncio.wait_for(
            asyncio.gather(*(loop.relay.run(once=True) for loop in relays)), timeout=120
        )
    finally:
        for loop in relays:
            await loop.__aexit__()
    published = broker.take("all")
    assert sorted(m.message_id for m in published) == sorted(
        str(id_) for (id_,) in rows(engine, "SELECT id FROM outbox")
    )  # every row, once
    by_key: dict[str | None, list[int]] = {}
    for message in published:
        by_key.setdefault(message.key, []).append(orjson.loads(message.body)["i"])
    assert len(by_key) == 20
    assert all(numbers == sorted(numbers) for numbers in by_key.values())
    assert rows(engine, "SELECT status, count(*) FROM outbox GROUP BY 1") == [("published", 6000)]
    # Each relay did its part, and none claimed rows held back by another.
    assert all(loop.claims for loop in relays)
    assert [sum(1 for n in loop.blocked if n) for loop in relays] == [0, 0, 0]


def hold_share(conn: sa.Connection, share: int) -> None:
    """Take worker `share`'s lock as another relay's batch would, until the
    connection's transaction ends."""
    conn.execute(
        sa.text("SELECT pg_advisory_xact_lock(:c, :k)"),
        {"c": SHARE_LOCK_CLASS, "k": share_key(share, WORKERS)},
    )


def waiting_for_share(engine: sa.Engine, share: int) -> bool:
    """Does a backend wait for share `share`'s lock?"""
    return rows(
        engine,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = :c AND objid = :k AND objsubid = 2",
        c=SHARE_LOCK_CLASS,
        k=share_key(share, WORKERS),
    ) == [(1,)]


async def test_a_worker_waits_for_its_share_without_counting_and_stops_promptly(
    engine, database, monkeypatch, caplog
):
    monkeypatch.setattr(relay.db.session, "SHARE_WAIT_MS", 300)
    key = keys_of_every_share(engine)[1]
    with engine.begin() as conn:
        message_id = relay.enqueue(conn, "held", {}, key=key)
    loop = LoopRelay(database, monkeypatch, listen=False)
    with engine.connect() as other, caplog.at_level("DEBUG", logger="relay"):
        hold_share(other, 1)
        task = asyncio.create_task(loop.relay.run())
        try:
            await until(lambda: waiting_for_share(engine, 1), timeout=10)
            # Past its lock_timeout three times: asked again each time,
            # counting nothing, logging nothing above DEBUG.
            await until(lambda: loop.claims.count((1, WORKERS)) >= 4, timeout=10)
            assert rows(engine, "SELECT status, attempts FROM outbox") == [("pending", 0)]
            assert not [r for r in caplog.records if r.levelname != "DEBUG"]
            assert any("share busy" in r.getMessage() for r in caplog.records)
            # Stopped while it waits: it returns within one wait.
            monkeypatch.setattr(relay.db.session, "SHARE_WAIT_MS", 1000)
            await until(lambda: waiting_for_share(engine, 1), timeout=10)
            started = time.monotonic()
            loop.relay.stop()
            await asyncio.wait_for(task, timeout=5)
            assert time.monotonic() - started < 2
        finally:
            task.cancel()
            await loop.__aexit__()
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("pending", 0)]

    # Released, the share's worker takes it at once.
    async with LoopRelay(database, monkeypatch, listen=False) as loop:
        [message] = await loop.received(1)
    assert message.message_id == str(message_id)
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("published", 0)]


async def test_a_scout_that_finds_a_share_held_elsewhere_hands_the_keys_back(
    engine, database, monkeypatch
):
    keys = keys_of_every_share(engine)
    async with LoopRelay(database, monkeypatch, listen=False) as quiet:
        with engine.connect() as other:
            hold_share(other, 2)  # another relay's batch of share 2
            with engine.begin() as conn:
                first = relay.enqueue(conn, "scout", {"n": 1}, key=keys[1])
                held = relay.enqueue(conn, "scout", {"n": 2}, key=keys[2])
            quiet.claims.clear()
            quiet.relay.wake()  # the notification of the commit above
            # The scout claimed nothing; share 1's worker published its row,
            # share 2's waits for the lock.
            [message] = await quiet.received(1)
            assert message.message_id == str(first)
            assert quiet.claims[0] == (0, 1)
            assert (0, 1) not in quiet.claims[1:]
            assert (1, WORKERS) in quiet.claims
            await until(lambda: waiting_for_share(engine, 2), timeout=10)
            other.rollback()
        [message] = await quiet.received(1)
        assert message.message_id == str(held)
        await quiet.settled()
    assert sum(quiet.blocked) == 0


# --------------------------------------------------------------------------
# What the broker answers, and what the loop marks
# --------------------------------------------------------------------------


async def test_a_nack_fails_only_its_row_with_backoff_and_its_batch_mates_are_published(
    engine, database, monkeypatch
):
    async with LoopRelay(database, monkeypatch, backoff_min=30, backoff_max=60) as loop:
        loop.broker.nack_when(lambda row: row.topic == "refused")
        with engine.begin() as conn:
            ok_1 = relay.enqueue(conn, "ok", {"n": 1})
            bad = relay.enqueue(conn, "refused", {"n": 2})
            ok_3 = relay.enqueue(conn, "ok", {"n": 3})
        assert {m.message_id for m in await loop.received(2)} == {str(ok_1), str(ok_3)}
        await loop.settled()
    got = outcome(engine)
    assert got[ok_1][:3] == got[ok_3][:3] == ("published", 0, None)
    status, attempts, error, delay = got[bad]
    assert (status, attempts, error) == ("pending", 1, "rejected by the memory broker (nack)")
    assert 25 <= delay <= 60


async def test_a_return_is_published_and_counted_or_under_fail_dies_at_max_attempts(
    engine, database, monkeypatch
):
    with engine.begin() as conn:
        counted = relay.enqueue(conn, "nowhere.a", {"n": 1})
    loop = LoopRelay(database, monkeypatch)
    loop.broker.return_when(lambda row: row.topic.startswith("nowhere"))
    async with loop:
        assert 'relay_outbox_unroutable_total{topic="nowhere.a"} 1.0' in (
            loop.relay.metrics.render().decode()
        )
    assert outcome(engine)[counted][:2] == ("published", 0)

    with engine.begin() as conn:
        failed = relay.enqueue(conn, "nowhere.b", {"n": 2})
    settings = {"backoff_min": 30, "backoff_max": 60, "max_attempts": 2}
    loop = LoopRelay(database, monkeypatch, on_unroutable="fail", **settings)
    loop.broker.return_when(lambda row: row.topic.startswith("nowhere"))
    async with loop:
        status, attempts, error, delay = outcome(engine)[failed]
        assert (status, attempts) == ("pending", 1)
        assert "unroutable" in error and "nowhere.b" in error and 25 <= delay <= 60
        rows(engine, "UPDATE outbox SET available_at = now() WHERE id = :id", id=failed)
        loop.relay.wake()
        await asyncio.sleep(0.05)
        await loop.settled()
    assert outcome(engine)[failed][:2] == ("dead", 2)


async def test_rows_stay_claimed_while_their_confirms_are_slow(engine, database, monkeypatch):
    async with LoopRelay(database, monkeypatch) as loop:
        loop.broker.slow_confirms(1.0)
        insert_outbox(engine, 5, topic="slow")
        await loop.received(5)  # on the broker, not yet confirmed
        # Claimed: locked by the worker's transaction, so another relay skips them.
        assert rows(
            engine, "SELECT count(*) FROM (SELECT id FROM outbox FOR UPDATE SKIP LOCKED) t"
        ) == [(0,)]
        assert rows(engine, "SELECT DISTINCT status FROM outbox") == [("pending",)]
        await loop.settled(timeout=5)
    assert rows(engine, "SELECT status, attempts, count(*) FROM outbox GROUP BY 1, 2") == [
        ("published", 0, 5)
    ]


async def test_a_connection_lost_mid_batch_releases_the_unconfirmed_rows_uncounted(
    engine, database, monkeypatch
):
    async with LoopRelay(database, monkeypatch, batch_size=10) as loop:
        loop.broker.disconnect(after=3)  # three confirms, then the connection breaks
        insert_outbox(engine, 8, topic="cut", keys=2)
        # The rest waits for a new connection (0.5 s), then goes out.
        assert len(await loop.received(8)) == 8
        await loop.settled()
    assert rows(engine, "SELECT status, attempts, count(*) FROM outbox GROUP BY 1, 2") == [
        ("published", 0, 8)
    ]


async def test_an_unreachable_broker_is_retried_and_counts_no_attempt(
    engine, database, monkeypatch
):
    with engine.begin() as conn:
        message_id = relay.enqueue(conn, "x", {})
    loop = LoopRelay(database, monkeypatch)
    loop.broker.go_down()
    loop.start()
    try:
        await asyncio.sleep(0.7)  # a first retry (after 0.5 s) failed too
        assert rows(engine, "SELECT status, attempts FROM outbox") == [("pending", 0)]
        loop.broker.come_back()
        [message] = await loop.received(1, timeout=10)
    finally:
        await loop.__aexit__()
    assert message.message_id == str(message_id)
    assert rows(engine, "SELECT status, attempts FROM outbox") == [("published", 0)]


async def test_a_blocked_broker_holds_publishing_without_claiming_or_counting(
    engine, database, monkeypatch
):
    async with LoopRelay(database, monkeypatch) as loop:
        loop.broker.block("memory alarm")
        insert_outbox(engine, 3, topic="blocked")
        await asyncio.sleep(0.3)
        assert loop.publisher.blocked == "memory alarm"
        assert loop.broker.take("all") == []
        assert rows(engine, "SELECT status, attempts, count(*) FROM outbox GROUP BY 1, 2") == [
            ("pending", 0, 3)
        ]
        loop.broker.unblock()
        assert len(await loop.received(3)) == 3
        await loop.settled()
    assert rows(engine, "SELECT status, count(*) FROM outbox GROUP BY 1") == [("published", 3)]
