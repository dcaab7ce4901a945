"""An outbox of several sources listens on one connection per database,
shared by its schemas (relay.db.listener.SharedListeners): each source's
notifications reach that source's relay, the connections stay one per
database as sources come and go, and a killed one is made again; and it
polls each database with one query for all its sources, waking only those
with due rows; against the real PostgreSQL and RabbitMQ.

Every daemon here polls every 30 s, so a row that goes out within 10 s of
its commit went out on its own notification."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator

import psycopg
import pytest

from relay.db import SharedListeners, Store
from tests.conftest import _admin, free_port, wait_until
from tests.ops.test_operations import scrape
from tests.outbox.test_sources import insert, label, pending, tenant_databases

SCHEMAS = ("t1", "t2", "t3")
# An outbox of several sources holds up to 32 connections of the shared
# server (100 at most): these tests run one at a time, on one worker.
pytestmark = pytest.mark.xdist_group("many_sources")


@pytest.fixture
def databases(template_db: str, run_relay) -> Iterator[list[str]]:
    """Two databases, each with relay's tables in schemas t1, t2 and t3; their URLs."""
    with tenant_databases(run_relay, SCHEMAS) as urls:
        yield urls


def listening(url: str) -> list[int]:
    """The pids of relay's backends in `url`'s database whose last statement
    was a LISTEN or UNLISTEN: its LISTEN connections."""
    database = url.rsplit("/", 1)[1]
    with _admin() as conn:
        found = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s "
            "AND application_name = 'relay' AND query ~ '^(UN)?LISTEN '",
            (database,),
        ).fetchall()
    return sorted(pid for (pid,) in found)


def one_listener(url: str) -> int:
    """The one LISTEN connection of `url`'s database (waits for it)."""
    wait_until(lambda: len(listening(url)) == 1, timeout=20, message=f"one LISTEN in {url}")
    (pid,) = listening(url)
    return pid


def outbox(rabbit, port: int, *extra: str) -> list[str]:
    return [
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--poll-interval",
        "30",
        "--http-port",
        str(port),
        *extra,
    ]


def published(port: int, url: str, schema: str) -> float:
    return scrape(port).get(f'relay_outbox_published_total{{source="{label(url, schema)}"}}', 0.0)


async def each_source_wakes_alone(rabbit, port: int, sources: list[tuple[str, str]]) -> None:
    """A row in each source, one at a time: it arrives within 10 s (on its
    notification), and only its own source's count moves."""
    queue = await rabbit.queue("#")
    before = {source: published(port, *source) for source in sources}
    for url, schema in sources:
        insert(url, schema, f"to.{label(url, schema)}")
        got = await rabbit.drain(queue, 1, timeout=10)
        assert [m.routing_key for m in got] == [f"to.{label(url, schema)}"]
        wait_until(lambda u=url, s=schema: published(port, u, s) == before[(u, s)] + 1)
        before[(url, schema)] += 1
        assert {source: published(port, *source) for source in sources} == before
    await queue.delete(if_unused=False, if_empty=False)


async def test_one_listen_connection_per_database_wakes_each_schema(databases, rabbit, start_relay):
    port = free_port()
    relay = start_relay(
        *outbox(rabbit, port),
        *[arg for url in databases for arg in ("--database-url", url)],
        *[arg for schema in SCHEMAS for arg in ("--schema", schema)],
    )
    wait_until(lambda: relay.log.count("outbox relay started") == 6, timeout=30)
    pids = [one_listener(url) for url in databases]
    sources = [(url, schema) for url in databases for schema in SCHEMAS]
    await each_source_wakes_alone(rabbit, port, sources)
    # Several rows of several schemas at once: each to its own source.
    queue = await rabbit.queue("#")
    for url, schema in sources:
        insert(url, schema, f"many.{label(url, schema)}", 5)
    got = await rabbit.drain(queue, 5 * len(sources), timeout=10)
    counts: dict[str, int] = {}
    for message in got:
        counts[message.routing_key] = counts.get(message.routing_key, 0) + 1
    assert counts == {f"many.{label(u, s)}": 5 for u, s in sources}
    assert [listening(url) for url in databases] == [[pid] for pid in pids]
    assert relay.proc.poll() is None, relay.log


async def test_sources_added_and_dropped_keep_one_listen_connection(
    databases, rabbit, start_relay, tmp_path
):
    first, second = databases
    path = tmp_path / "sources"
    path.write_text(f"{first} t1\n{second} t1\n")
    port = free_port()
    relay = start_relay(*outbox(rabbit, port), "--sources", str(path))
    relay.wait_for_log("outbox of 2 sources started", timeout=30)
    pid = one_listener(first)
    await each_source_wakes_alone(rabbit, port, [(first, "t1"), (second, "t1")])

    # Two schemas of the first database added (SIGHUP): its listener takes
    # their channels on the same connection.
    path.write_text(f"{first} t1\n{first} t2\n{first} t3\n{second} t1\n")
    relay.signal(signal.SIGHUP)
    wait_until(lambda: relay.log.count("outbox relay started") == 4, timeout=30)
    time.sleep(1)  # the added sources' relays have subscribed
    await each_source_wakes_alone(rabbit, port, [(first, s) for s in SCHEMAS])
    assert listening(first) == [pid]

    # t1 of the first database dropped (the file's change alone): its rows
    # wait, t2 and t3 still wake on the same connection.
    path.write_text(f"{first} t2\n{first} t3\n{second} t1\n")
    wait_until(lambda: f"dropped {label(first, 't1')}" in relay.log, timeout=15)
    insert(first, "t1", "left")
    await each_source_wakes_alone(rabbit, port, [(first, "t2"), (first, "t3"), (second, "t1")])
    assert pending(first, "t1") == 1
    assert listening(first) == [pid]

    # Every source of the first database dropped: its LISTEN connection closes.
    path.write_text(f"{second} t1\n")
    wait_until(lambda: f"dropped {label(first, 't2')}" in relay.log, timeout=15)
    wait_until(lambda: listening(first) == [], timeout=15, message="the LISTEN closed")
    await each_source_wakes_alone(rabbit, port, [(second, "t1")])
    assert len(listening(second)) == 1
    assert relay.proc.poll() is None, relay.log


async def test_a_killed_listen_connection_is_made_again(databases, rabbit, start_relay):
    url = databases[0]
    port = free_port()
    relay = start_relay(
        *outbox(rabbit, port),
        "--database-url",
        url,
        *[arg for schema in SCHEMAS for arg in ("--schema", schema)],
    )
    wait_until(lambda: relay.log.count("outbox relay started") == 3, timeout=30)
    killed = one_listener(url)
    with _admin() as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (killed,))
    wait_until(lambda: listening(url) not in ([], [killed]), timeout=20, message="a new LISTEN")
    assert "connection lost" in relay.log
    # Rows committed while it was away went out on its first look after
    # connecting (or come now); and each schema's wake-ups work again.
    sources = [(url, schema) for schema in SCHEMAS]
    await each_source_wakes_alone(rabbit, port, sources)
    assert len(listening(url)) == 1
    assert relay.proc.poll() is None, relay.log


def insert_later(url: str, schema: str, topic: str, seconds: float) -> None:
    """A row that is due `seconds` from now: its commit notifies while it
    is not due yet, and nothing notifies when it is."""
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {schema}.outbox (topic, payload, available_at) "
            "VALUES (%s, '{}', now() + make_interval(secs => %s))",
            (topic, seconds),
        )


async def test_rows_that_become_due_unannounced_are_found_by_the_shared_poll(
    databases, rabbit, start_relay
):
    # The workers' own polls come every 60 s under the shared one: a row
    # published within a few seconds of becoming due was found by it.
    port = free_port()
    relay = start_relay(
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--poll-interval",
        "1",
        "--http-port",
        str(port),
        *[arg for url in databases for arg in ("--database-url", url)],
        *[arg for schema in SCHEMAS for arg in ("--schema", schema)],
    )
    wait_until(lambda: relay.log.count("outbox relay started") == 6, timeout=30)
    queue = await rabbit.queue("#")
    sources = [(url, schema) for url in databases for schema in SCHEMAS]
    for url, schema in sources:
        insert_later(url, schema, f"later.{label(url, schema)}", 2)
    committed = time.monotonic()
    got = await rabbit.drain(queue, len(sources), timeout=15)
    took = time.monotonic() - committed
    assert sorted(m.routing_key for m in got) == sorted(f"later.{label(u, s)}" for u, s in sources)
    assert took < 2 + 5, took  # due after 2 s; the poll: 1.25 s at most, and the claim
    # Marked when its batch commits, just after the broker has it.
    wait_until(lambda: all(pending(url, schema) == 0 for url, schema in sources), timeout=10)
    await queue.delete(if_unused=False, if_empty=False)
    assert relay.proc.poll() is None, relay.log


async def ready_stores(url: str) -> dict[str, Store]:
    """A store of each of SCHEMAS in the database at `url`, its schema located."""
    stores = {schema: Store(url, pool_size=1, schema=schema) for schema in SCHEMAS}
    for store in stores.values():
        await store.check_schema()
    return stores


@contextlib.asynccontextmanager
async def polled(
    stores: dict[str, Store], woken: list[str], swept: Callable[[str], float]
) -> AsyncIterator[tuple[SharedListeners, list[asyncio.Task[None]]]]:
    """Each store polled through one SharedListeners (every 0.4 s), its
    schema appended to `woken` when woken; then every poll stopped, the
    listeners and the stores closed."""
    listeners = SharedListeners()
    polls = [
        asyncio.create_task(
            listeners.poll(store, lambda s=schema: woken.append(s), lambda s=schema: swept(s), 0.4)
        )
        for schema, store in stores.items()
    ]
    try:
        yield listeners, polls
    finally:
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        await listeners.close()
        for store in stores.values():
            await store.close()


async def test_one_poll_query_a_database_wakes_only_sources_with_due_rows(databases):
    # SharedListeners.poll on real stores: three sources of one database,
    # a due row in t2 alone, a row not due yet in t3. Each tick asks once
    # (one connection of one store) for all three, and wakes t2 alone; a
    # source that claimed every key within the interval is not asked about.
    url = databases[0]
    stores = await ready_stores(url)
    insert(url, "t2", "due")
    insert_later(url, "t3", "later", 60)
    woken: list[str] = []
    asked: list[str] = []
    swept = {schema: -float("inf") for schema in SCHEMAS}
    for schema, store in stores.items():
        connection = store.connection

        @contextlib.asynccontextmanager
        async def counted(schema=schema, connection=connection):
            asked.append(schema)
            async with connection() as conn:
                yield conn

        store.connection = counted  # type: ignore[method-assign]
    async with polled(stores, woken, swept.__getitem__) as (listeners, _):
        await asyncio.sleep(1.0)  # two polls at least (0.4 s, ticks of 0.1 s)
        assert set(woken) == {"t2"}
        polls_made = len(asked)
        assert 2 <= woken.count("t2") == polls_made <= 4, (woken, asked)
        assert len(listeners.polls) == 1  # one database, one poll
        # t2 claims every key now and then (a notification woke it): it is
        # not asked about, nor woken, while its claims come within the interval.
        woken.clear()
        for _ in range(8):
            swept["t2"] = time.monotonic()
            await asyncio.sleep(0.1)
        assert woken == []
    assert listeners.polls == {}


async def test_a_failing_shared_poll_wakes_every_source_it_asked_about(databases):
    # One source's outbox gone (its schema dropped under the running relay):
    # the one query fails, and every source it asked about is woken, to
    # claim on its own and meet (or not) the failure there.
    url = databases[1]
    stores = await ready_stores(url)
    with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute("DROP SCHEMA t3 CASCADE")
    woken: list[str] = []
    async with polled(stores, woken, lambda _: -float("inf")) as (_, polls):
        await asyncio.sleep(0.6)
        assert set(woken) == set(SCHEMAS), woken
        assert all(task.done() is False for task in polls)  # the poll goes on
