"""`relay outbox --capture wal` against a PostgreSQL cluster of the tests' own
with wal_level = logical (the shared server keeps replica): one cluster for
the module, a database and a slot of each test's own.

The order rows were committed in is read from the server itself, through
a second slot with PostgreSQL's `test_decoding` plugin (its text output,
independent of relay's pgoutput decoder)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Self

import aio_pika
import pytest

from relay.brokers.memory import MemoryBroker
from relay.capture import WalCapture
from relay.config import BrokerURL, OutboxSettings
from relay.db import SlotReader, Store
from relay.metrics import OutboxMetrics
from relay.wiring import outbox_relay
from tests.conftest import AMQP_URL, RELAY, REPO, Rabbit, RelayProcess, until
from tests.pgcluster import OWN_SERVER_TESTS, Cluster, cluster
from tests.proxy import Proxy

pytestmark = [OWN_SERVER_TESTS, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def logical() -> Iterator[Cluster]:
    """The module's server (wal_level = logical) with a template database
    that has relay's schema."""
    with cluster(
        "relay_wal_", wal_level="logical", max_replication_slots="30", max_wal_senders="10"
    ) as server:
        server.execute("CREATE DATABASE relay_wal_tpl")
        apply_schema(server.url("relay_wal_tpl"))
        yield server


def apply_schema(url: str) -> None:
    done = subprocess.run(
        [*RELAY, "schema", "apply", "--database-url", url],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr


class WalDb:
    """A test's database on the logical cluster and its slot's name."""

    def __init__(self, server: Cluster, name: str | None = None, slot: str | None = None) -> None:
        self.server = server
        self.name = name or f"wal_{uuid.uuid4().hex[:10]}"
        self.slot = slot or f"s_{uuid.uuid4().hex[:10]}"
        self.url = server.url(self.name)
        if name is None:
            server.execute(f"CREATE DATABASE {self.name} TEMPLATE relay_wal_tpl")

    def execute(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with self.server.connect(self.name) as conn:
            cursor = conn.execute(sql, params or None)
            return cursor.fetchall() if cursor.description else []

    def slot_row(self) -> tuple[Any, ...] | None:
        found = self.execute(
            "SELECT active, confirmed_flush_lsn, wal_status FROM pg_replication_slots "
            "WHERE slot_name = %s",
            self.slot,
        )
        return found[0] if found else None

    def drop(self) -> None:
        for (name,) in self.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = current_database()"
        ):
            with contextlib.suppress(Exception):
                self.execute("SELECT pg_drop_replication_slot(%s)", name)
        self.server.execute(f"DROP DATABASE IF EXISTS {self.name} WITH (FORCE)")


@pytest.fixture
def wal_db(logical: Cluster) -> Iterator[WalDb]:
    db = WalDb(logical)
    yield db
    db.drop()


def commit_order(db: WalDb, slot: str) -> list[str]:
    """The ids inserted into the outbox, in the order their transactions
    committed, as test_decoding's slot `slot` tells it."""
    found = db.execute("SELECT data FROM pg_logical_slot_peek_changes(%s, NULL, NULL)", slot)
    ids = []
    for (data,) in found:
        match = re.match(r"table public\.outbox: INSERT: id\[uuid\]:'([0-9a-f-]+)'", data)
        if match:
            ids.append(match[1])
    return ids


def insert(db: WalDb, count: int, *, keys: list[str | None] | None = None) -> list[str]:
    """`count` rows in one transaction, of one key of `keys` (two keys in
    one transaction could deadlock with another's: the producer trigger's
    key locks); their ids."""
    ids = [str(uuid.uuid4()) for _ in range(count)]
    key = random.choice(keys) if keys else None
    with db.server.connect(db.name) as conn, conn.transaction():
        for row_id in ids:
            conn.execute(
                "INSERT INTO outbox (id, topic, key, payload) VALUES (%s, 'wal.test', %s, '{}')",
                (row_id, key),
            )
    return ids


def confirmed_at_least(db: WalDb, position: str) -> bool:
    """Whether the test's slot is confirmed to `position` (a pg_lsn's text)."""
    found = db.execute(
        "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
        position,
        db.slot,
    )
    return bool(found and found[0][0])


def statuses(db: WalDb) -> dict[str, int]:
    return dict(db.execute("SELECT status, count(*) FROM outbox GROUP BY status"))


@pytest.fixture
def wal_relay_env(rabbit: Rabbit, tmp_path: Any) -> Iterator[Callable[..., RelayProcess]]:
    """Start `relay outbox --capture wal` on a database URL, to the test's exchange."""
    started: list[RelayProcess] = []

    def start(url: str, *args: str, broker: str = AMQP_URL) -> RelayProcess:
        env = {
            "PATH": "/usr/bin:/bin",
            "RELAY_DATABASE_URL": url,
            "RELAY_BROKER_URL": broker,
            "RELAY_EXCHANGE": rabbit.exchange,
            "RELAY_LOG_LEVEL": os.environ.get("TEST_RELAY_LOG_LEVEL", "INFO"),
            "PYTHONUNBUFFERED": "1",
        }

        env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(REPO))
        proc = RelayProcess(
            ["outbox", "--capture", "wal", *args], env, tmp_path / f"relay{len(started)}.log"
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def wal_relay(
    wal_db: WalDb, wal_relay_env: Callable[..., RelayProcess]
) -> Callable[..., RelayProcess]:
    """Start `relay outbox --capture wal` on the test's database and slot."""

    def start(*args: str, broker: str = AMQP_URL) -> RelayProcess:
        return wal_relay_env(wal_db.url, "--slot", wal_db.slot, *args, broker=broker)

    return start


async def received(rabbit: Rabbit, queue: aio_pika.abc.AbstractQueue, count: int) -> list[str]:
    return [m.message_id or "" for m in await rabbit.drain(queue, count, timeout=60)]


# -- bad configuration ---------------------------------------------------------


def test_a_server_without_logical_wal_exits_2_with_one_line(run_relay):
    """The shared server runs wal_level = replica."""
    done = run_relay("outbox", "--capture", "wal", timeout=60)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "wal_level" in line]
    assert len(lines) == 1, done.stderr
    assert "wal_level = logical" in lines[0]
    assert "rds.logical_replication" in lines[0]


def test_a_role_that_may_not_replicate_exits_2(wal_db: WalDb, run_relay):
    wal_db.execute("CREATE ROLE plain LOGIN PASSWORD 'secret'")
    wal_db.execute(f"GRANT ALL ON DATABASE {wal_db.name} TO plain")
    wal_db.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO plain")
    url = wal_db.server.url(wal_db.name, user="plain").replace("plain@", "plain:secret@")
    try:
        done = run_relay("outbox", "--capture", "wal", env={"RELAY_DATABASE_URL": url}, timeout=60)
    finally:
        wal_db.execute(f"REVOKE ALL ON DATABASE {wal_db.name} FROM plain")
        wal_db.execute("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM plain")
        wal_db.execute("DROP ROLE plain")
    assert done.returncode == 2, done.stderr
    assert "ALTER ROLE plain REPLICATION" in done.stderr
    assert wal_db.slot_row() is None


def test_a_role_that_does_not_own_the_table_is_told_how_to_make_the_publication(
    wal_db: WalDb, run_relay
):
    wal_db.execute("CREATE ROLE replicator LOGIN REPLICATION PASSWORD 'secret'")
    wal_db.execute("GRANT ALL ON ALL TABLES IN SCHEMA public TO replicator")
    url = wal_db.server.url(wal_db.name, user="replicator").replace(
        "replicator@", "replicator:secret@"
    )
    try:
        done = run_relay(
            "outbox",
            "--capture",
            "wal",
            "--slot",
            wal_db.slot,
            env={"RELAY_DATABASE_URL": url},
            timeout=60,
        )
    finally:
        wal_db.execute("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM replicator")
        wal_db.execute("DROP ROLE replicator")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert f'CREATE PUBLICATION "{wal_db.slot}" FOR TABLE "public"."outbox"' in last
    assert "Traceback" not in done.stderr


# -- the stream ------------------------------------------------------------------


async def test_concurrent_commits_are_published_once_in_commit_order(
    wal_db: WalDb, rabbit: Rabbit, wal_relay
):
    queue = await rabbit.queue("#")
    wal_db.execute(
        "SELECT pg_create_logical_replication_slot(%s, 'test_decoding')", "order_" + wal_db.slot
    )
    relay = wal_relay("--poll-interval", "0.5")
    relay.wait_for_log("reading replication slot")
    await asyncio.sleep(1.0)  # the claim's drain of the empty table is over

    keys: list[str | None] = ["a", "b", "c", None]

    def produce() -> None:
        for _ in range(25):
            insert(wal_db, random.randint(1, 5), keys=keys)

    threads = [threading.Thread(target=produce) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    order = commit_order(wal_db, "order_" + wal_db.slot)
    got = await received(rabbit, queue, len(order))
    assert len(set(order)) == len(order) >= 100
    assert got == order  # each once, in commit order
    await until(lambda: statuses(wal_db) == {"published": len(order)}, timeout=30)
    # The slot is confirmed past them all.
    last = wal_db.execute("SELECT pg_current_wal_lsn()::text")[0][0]
    insert(wal_db, 1)
    await received(rabbit, queue, 1)

    def confirmed_past() -> bool:
        return confirmed_at_least(wal_db, last)

    await until(confirmed_past, timeout=30)
    await asyncio.sleep(0.5)
    assert await queue.get(fail=False) is None  # nothing twice


async def test_kill_9_mid_stream_loses_nothing(wal_db: WalDb, rabbit: Rabbit, wal_relay):
    queue = await rabbit.queue("#")
    first = wal_relay()
    first.wait_for_log("reading replication slot")
    ids = [row_id for _ in range(20) for row_id in insert(wal_db, 100, keys=["a", "b", None])]
    await until(lambda: statuses(wal_db).get("published", 0) > 0, timeout=60)
    first.signal(signal.SIGKILL)
    first.wait()
    second = wal_relay()
    second.wait_for_log("reading replication slot")
    await until(lambda: statuses(wal_db) == {"published": len(ids)}, timeout=90)
    got = await received(rabbit, queue, len(ids))
    # At least once: a batch may come twice, so the first len(ids) messages
    # need not hold every id; every row is published (confirmed), so what
    # the queue still holds is all there is.
    while (more := await queue.get(no_ack=True, fail=False)) is not None:
        got.append(more.message_id or "")
    assert set(got) == set(ids)


async def test_an_unreachable_broker_holds_the_slot_behind_unpublished_rows(
    wal_db: WalDb, rabbit: Rabbit, wal_relay
):
    queue = await rabbit.queue("#")
    proxy = Proxy(5672)
    proxy.start()
    try:
        relay = wal_relay(
            "--poll-interval", "0.5", broker=AMQP_URL.replace(":5672", f":{proxy.port}")
        )
        relay.wait_for_log("reading replication slot")
        insert(wal_db, 3)
        await received(rabbit, queue, 3)
        # Cut only once the three are marked: a confirm cut on its way back
        # leaves its row pending, to go out again (at least once).
        await until(lambda: statuses(wal_db) == {"published": 3}, timeout=30)
        proxy.stop()
        ids = insert(wal_db, 5, keys=["k"])
        after = wal_db.execute("SELECT pg_current_wal_lsn()::text")[0][0]
        relay.wait_for_log("reconnect_wait", timeout=30)
        # Other databases write on; the relay tries again and again.
        for _ in range(3):
            wal_db.server.execute("SELECT pg_switch_wal()")
            await asyncio.sleep(1.0)
        assert statuses(wal_db) == {"published": 3, "pending": 5}
        assert not confirmed_at_least(wal_db, after)  # not past the unpublished rows
        proxy.start()
        got = await received(rabbit, queue, 5)
        assert got == ids
        await until(lambda: confirmed_at_least(wal_db, after), timeout=30)
    finally:
        proxy.close()


async def test_a_slot_dropped_under_the_daemon_loses_nothing(
    wal_db: WalDb, rabbit: Rabbit, wal_relay
):
    queue = await rabbit.queue("#")
    relay = wal_relay("--poll-interval", "0.5")
    relay.wait_for_log("reading replication slot")
    ids = insert(wal_db, 10)

    def dropped() -> bool:
        # The reader's stream holds the slot active: end it, then drop it
        # before the reader starts it again (else: again).
        wal_db.execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            "WHERE slot_name = %s AND active_pid IS NOT NULL",
            wal_db.slot,
        )
        try:
            wal_db.execute("SELECT pg_drop_replication_slot(%s)", wal_db.slot)
        except Exception:
            return False
        return True

    await until(dropped, timeout=30)
    ids += insert(wal_db, 10)  # committed while no slot was there
    relay.wait_for_log("lost", timeout=30)
    relay.wait_until_logged("reading replication slot", 2, timeout=30)
    ids += insert(wal_db, 10)  # and after it was made again
    await until(lambda: statuses(wal_db) == {"published": 30}, timeout=60)
    assert sorted(await received(rabbit, queue, 30)) == sorted(ids)
    await until(lambda: wal_db.slot_row() is not None, timeout=30)


async def test_a_stand_by_takes_over_when_the_reader_goes(wal_db: WalDb, rabbit: Rabbit, wal_relay):
    queue = await rabbit.queue("#")
    first = wal_relay()
    first.wait_for_log("reading replication slot")
    second = wal_relay()
    second.wait_for_log("outbox relay started")
    ids = insert(wal_db, 5)
    assert sorted(await received(rabbit, queue, 5)) == sorted(ids)
    # Marked before the kill: a row published and not yet marked may go out
    # again from the stand-by (at least once), which this test is not about.
    await until(lambda: statuses(wal_db) == {"published": 5}, timeout=30)
    assert "reading replication slot" not in second.log
    first.signal(signal.SIGKILL)
    first.wait()
    second.wait_for_log("reading replication slot", timeout=30)
    ids = insert(wal_db, 5)
    assert sorted(await received(rabbit, queue, 5)) == sorted(ids)


# -- in-process: the memory broker's nacks, the slot's moves ----------------------


class Capture:
    """The outbox loop and the slot's reader in the test's process, on the
    memory broker."""

    def __init__(self, db: WalDb, **settings: Any) -> None:
        settings.setdefault("poll_interval", 0.3)
        config = OutboxSettings(
            database_url=db.url,
            broker=BrokerURL.parse(AMQP_URL),
            exchange="relay",
            backoff_min=0.5,
            backoff_max=0.5,
            **settings,
        )  # type: ignore[arg-type]
        self.broker = MemoryBroker()
        self.broker.bind("all", "#")
        self.store = Store(db.url)
        self.metrics = OutboxMetrics()
        self.metrics.slot_gauges()
        self.relay = outbox_relay(config, self.store, self.broker.publisher(), self.metrics)
        self.reader = SlotReader(self.store.conninfo, self.store.session_options, db.slot, None)
        self.capture = WalCapture(
            self.relay,
            self.reader,
            self.metrics,
            poll_interval=config.poll_interval,
            batch_size=config.batch_size,
        )
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Self:
        self.tasks = [
            asyncio.create_task(self.relay.run()),
            asyncio.create_task(self.capture.run()),
        ]
        await until(lambda: self.capture.reading, timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.relay.stop()
        self.capture.wake()
        await asyncio.wait_for(asyncio.gather(*self.tasks), 30)
        await self.relay.close()
        await self.store.close()

    def gauge(self, name: str) -> float | None:
        return self.metrics.registry.get_sample_value(name)


async def test_a_failed_row_holds_its_key_and_the_slot(wal_db: WalDb):
    async with Capture(wal_db, max_attempts=5) as run:
        run.broker.nack_when(lambda row: row.key == "k" and row.attempts < 2)
        first = insert(wal_db, 1, keys=["k"])[0]
        first_end = wal_db.execute("SELECT pg_current_wal_lsn()::text")[0][0]
        later = insert(wal_db, 3, keys=["k"]) + insert(wal_db, 1, keys=["k"])
        others = insert(wal_db, 2, keys=["other"])
        run.capture.wake()

        def attempts() -> int:
            return int(wal_db.execute("SELECT attempts FROM outbox WHERE id = %s", first)[0][0])

        await until(lambda: attempts() >= 2, timeout=30)
        # Nothing of key k went out past its failed head, and the slot
        # stays before the head's commit.
        sent = [m.message_id for m in run.broker.take("all")]
        assert set(others) <= set(sent)
        assert not set(sent) & {first, *later}
        assert not confirmed_at_least(wal_db, first_end)
        assert run.gauge("relay_outbox_slot_active") == 1
        await until(lambda: statuses(wal_db) == {"published": 7}, timeout=30)
        sent += [m.message_id for m in run.broker.take("all")]
        assert [i for i in sent if i in {first, *later}] == [first, *later]
        end = wal_db.execute("SELECT pg_current_wal_lsn()::text")[0][0]
        insert(wal_db, 1)
        run.capture.wake()
        await until(lambda: confirmed_at_least(wal_db, end), timeout=30)


def insert_one_transaction(db: WalDb, keys: list[str | None]) -> list[str]:
    """One row of each of `keys`, in that order, in one transaction; their ids."""
    ids = [str(uuid.uuid4()) for _ in keys]
    with db.server.connect(db.name) as conn, conn.transaction():
        for row_id, key in zip(ids, keys, strict=True):
            conn.execute(
                "INSERT INTO outbox (id, topic, key, payload) VALUES (%s, 'wal.test', %s, '{}')",
                (row_id, key),
            )
    return ids


async def test_batches_claimed_ahead_go_out_in_commit_order_with_every_key(wal_db: WalDb):
    # --batch-size 1: the slot's rows go in batches of four (one per worker),
    # each claimed while the one before it is out. Rows of one key in
    # consecutive batches: the batch before holds none of the next back.
    keys: list[str | None] = [random.choice(["a", "b", "c", None]) for _ in range(41)]
    async with Capture(wal_db, batch_size=1, poll_interval=30.0) as run:
        await asyncio.sleep(0.5)  # the claim's drain of the empty table is over
        ids = insert_one_transaction(wal_db, keys)
        run.capture.wake()
        await until(lambda: statuses(wal_db) == {"published": len(ids)}, timeout=30)
        sent = [m.message_id for m in run.broker.take("all")]
    # Each once, in commit order: none was left to the claim (whose
    # --poll-interval of 30 s is past the test's wait).
    assert sent == ids


async def test_a_failed_row_holds_its_key_in_the_batch_claimed_after_it(wal_db: WalDb):
    keys: list[str | None] = ["k", "x", "y", "z", "k", "x", "k", "y", "z", "k", "x", "y"]
    async with Capture(wal_db, batch_size=1, max_attempts=5) as run:
        await asyncio.sleep(0.5)
        ids = insert_one_transaction(wal_db, keys)
        first = ids[0]
        run.broker.nack_when(lambda row: row.id == first and row.attempts < 2)
        run.broker.slow_confirms(0.2)  # the next batch is claimed before the answer
        run.capture.wake()
        await until(lambda: statuses(wal_db) == {"published": len(ids)}, timeout=30)
        sent = [m.message_id for m in run.broker.take("all")]
    of_k = [row_id for row_id, key in zip(ids, keys, strict=True) if key == "k"]
    # The head of key k failed twice: no later row of k went out before it,
    # those of the batches claimed ahead neither; each row once.
    assert [i for i in sent if i in of_k] == of_k
    assert sorted(sent) == sorted(ids)


@pytest.mark.parametrize("failing", [False, True], ids=["clean", "a-head-fails"])
async def test_rows_committed_while_a_read_goes_out_follow_it_in_order(
    wal_db: WalDb, failing: bool
):
    # Transactions committed one after another while the rows before them
    # are out (confirms slowed): a round takes them behind what it sends
    # (WalCapture._publish_all's `more`), in commit order, with the claim's
    # per-key rules; a key's head failing holds its later rows, whichever
    # read brought them.
    rng = random.Random()
    # Key k first in the third transaction, which reaches the broker while
    # the first two go out: its rows fail twice each, when `failing`.
    batches: list[list[str | None]] = [
        [rng.choice(["k", "x", "y", None]) if n > 2 else rng.choice(["x", "y", None])]
        + [rng.choice(["k", "x", "y", None]) for _ in range(rng.randint(0, 3))]
        for n in range(8)
    ]
    batches[2][0] = "k"
    for keys in batches[:2]:
        keys[:] = ["x" if key == "k" else key for key in keys]
    # A failed row is retried by the table's claim, at --poll-interval; clean,
    # the claim (30 s) never runs within the test: the slot brought them all.
    poll = 0.5 if failing else 30.0
    async with Capture(wal_db, batch_size=1, poll_interval=poll, max_attempts=5) as run:
        await asyncio.sleep(0.5)  # the claim's drain of the empty table is over
        run.broker.slow_confirms(0.05)
        if failing:
            run.broker.nack_when(lambda row: row.key == "k" and row.attempts < 2)
        ids: list[str] = []
        for keys in batches:
            ids += await asyncio.to_thread(insert_one_transaction, wal_db, keys)
            run.capture.wake()
            await asyncio.sleep(0.03)
        end = wal_db.execute("SELECT pg_current_wal_lsn()::text")[0][0]
        await until(lambda: statuses(wal_db) == {"published": len(ids)}, timeout=60)
        sent = [m.message_id for m in run.broker.take("all")]
        insert(wal_db, 1)  # a commit after: the slot moves past every row
        run.capture.wake()
        await until(lambda: confirmed_at_least(wal_db, end), timeout=30)
    keys_of = dict(zip(ids, [k for keys in batches for k in keys], strict=True))
    # Each once (a failed attempt is not a delivery), per key in commit order.
    assert sorted(sent) == sorted(ids)
    for key in ("k", "x", "y"):  # per key, commit order
        assert [i for i in sent if keys_of[i] == key] == [i for i in ids if keys_of[i] == key]
    if not failing:  # nothing held back: commit order across keys too
        assert sent == ids


async def test_a_quiet_outbox_does_not_hold_back_other_databases_wal(
    wal_db: WalDb, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("relay.capture.STATUS_INTERVAL", 0.5)
    other = f"other_{uuid.uuid4().hex[:8]}"
    wal_db.server.execute(f"CREATE DATABASE {other}")
    try:
        async with Capture(wal_db) as run:
            with wal_db.server.connect(other) as conn:
                conn.execute("CREATE TABLE t AS SELECT g FROM generate_series(1, 20000) g")
            written = wal_db.server.execute("SELECT pg_current_wal_lsn()::text")[0][0]
            await until(lambda: confirmed_at_least(wal_db, written), timeout=30)
            lag = await run.reader.lag()
            assert lag is not None and lag < 1_000_000
            assert statuses(wal_db) == {}  # no outbox row at all
    finally:
        wal_db.server.execute(f"DROP DATABASE {other} WITH (FORCE)")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--capture", "stream"], "invalid --capture 'stream': use poll or wal"),
        (["--capture", "wal", "--slot", "Orders-Outbox"], "invalid --slot 'Orders-Outbox'"),
    ],
)
def test_bad_capture_settings_exit_2(run_relay, flags: list[str], says: str):
    done = run_relay("outbox", *flags, timeout=60)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr


@pytest.mark.timeout(300)
async def test_a_standby_promoted_without_the_slot_loses_nothing(rabbit: Rabbit, wal_relay_env):
    """PostgreSQL 15: logical slots are not on standbys. The standby (which
    the primary waits for at each commit) is promoted after the primary
    stops hard; the relay follows the writer, finds no slot there, makes it
    and drains the table."""
    with cluster(
        "relay_wal_failover_",
        wal_level="logical",
        synchronous_standby_names="'standby'",
        wal_keep_size="'256MB'",
    ) as primary:
        standby = primary.standby("standby")
        try:
            await until(
                lambda: primary.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                )[0][0],
                timeout=60,
            )
            primary.execute("CREATE DATABASE relay_fo")
            await asyncio.to_thread(apply_schema, primary.url("relay_fo"))
            hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
            url = f"postgresql://postgres@{hosts}/relay_fo?target_session_attrs=read-write"
            queue = await rabbit.queue("#")
            relay = wal_relay_env(url)
            relay.wait_for_log("reading replication slot")
            ids = insert(WalDb(primary, "relay_fo", "relay_outbox"), 10)
            assert sorted(await received(rabbit, queue, 10)) == sorted(ids)
            relay_slot = primary.execute(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'relay_outbox'"
            )[0][0]
            assert relay_slot == 1
            primary.stop("immediate")
            standby.promote()
            standby.wait_writable()
            after = WalDb(standby, "relay_fo", "relay_outbox")
            ids = insert(after, 10)  # committed while no slot was there
            relay.wait_until_logged("reading replication slot", 2, timeout=60)
            ids += insert(after, 10)
            await until(lambda: statuses(after) == {"published": 30}, timeout=90)
            got = await received(rabbit, queue, 20)
            while (message := await queue.get(no_ack=True, fail=False)) is not None:
                got.append(message.message_id or "")
            assert set(ids) <= set(got)  # at least once
            assert after.slot_row() is not None
        finally:
            standby.stop("immediate")


def test_what_is_held_behind_a_waiting_row_is_compacted():
    """Behind a transaction whose row waits (failed, delayed), relay keeps
    only the rows still pending and, of each run of finished transactions,
    the last one's position: not every id committed since."""
    from types import SimpleNamespace

    from relay.db import Transaction

    metrics = OutboxMetrics()
    metrics.slot_gauges()
    capture = WalCapture(
        SimpleNamespace(), SimpleNamespace(), metrics, poll_interval=1.0, batch_size=10
    )  # type: ignore[arg-type]
    rows = {name: (str(uuid.uuid4()), n) for n, name in enumerate("abcdefg")}
    held = [["a"], ["b"], ["c", "d"], ["e"], ["f"], ["g"]]
    capture._inflight.extend(
        Transaction(100 * (n + 1), [rows[r] for r in names], n) for n, names in enumerate(held)
    )
    capture._compact({rows["a"][0], rows["e"][0]})
    assert [(t.end_lsn, [r[0] for r in t.rows]) for t in capture._inflight] == [
        (100, [rows["a"][0]]),
        (300, []),
        (400, [rows["e"][0]]),
        (600, []),
    ]
