"""`relay replay outbox|inbox`: finished rows back to pending, published or
handled again in key order, run as a user runs it (subprocesses) against the
real PostgreSQL and RabbitMQ; the topic pattern against RabbitMQ's rule."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import threading
import time

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.db import Store
from relay.db.jobs import delete_expired
from relay.errors import ReplayBusy
from relay.replay import ReplayFilter, parse_when, replay, topic_regex
from tests.conftest import effect_ids, insert_outbox, rows, until, wait_until

# -- the topic pattern ---------------------------------------------------------


def rabbit_matches(pattern: list[str], topic: list[str]) -> bool:
    """RabbitMQ's topic rule, word by word: `*` one word, `#` zero or more."""
    if not pattern:
        return not topic
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(rabbit_matches(rest, topic[i:]) for i in range(len(topic) + 1))
    if not topic:
        return False
    return (head in ("*", topic[0])) and rabbit_matches(rest, topic[1:])


words = st.lists(
    st.sampled_from(["a", "b", "ab", "", "x-y", "+", "(", "é"]), min_size=1, max_size=5
)
pattern_words = st.lists(
    st.sampled_from(["a", "b", "*", "#", "", "+", "(", "é"]), min_size=1, max_size=5
)


@given(pattern=pattern_words, topic=words)
def test_a_topic_pattern_matches_as_rabbitmq_binds(pattern, topic):
    regex = topic_regex(".".join(pattern))
    got = re.fullmatch(regex, "." + ".".join(topic)) is not None
    assert got == rabbit_matches(pattern, topic), (pattern, topic, regex)


def test_postgresql_reads_the_topic_pattern_as_python_does(engine):
    cases = [
        ("orders.#", "orders", True),
        ("orders.#", "orders.placed.eu", True),
        ("orders.*", "orders", False),
        ("orders.*", "orders.placed", True),
        ("*.placed", "orders.placed", True),
        ("#.placed", "placed", True),
        ("#", "anything.at.all", True),
        ("a+b.*", "a+b.c", True),
        ("a+b.*", "aab.c", False),
        ("o(r).#", "o(r)", True),
        ("orders.placed", "orders.placedx", False),
    ]
    for pattern, topic, expected in cases:
        (got,) = rows(engine, "SELECT ('.' || :t) ~ :r", t=topic, r=topic_regex(pattern))[0]
        assert got is expected, (pattern, topic)
        assert (re.fullmatch(topic_regex(pattern), "." + topic) is not None) is expected


def test_times_are_iso_or_durations_back_from_now():
    from datetime import UTC, datetime, timedelta

    now = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)
    assert parse_when("2h", now) == now - timedelta(hours=2)
    assert parse_when("7d", now) == now - timedelta(days=7)
    assert parse_when("2026-11-20T08:00:00", now) == datetime(2026, 11, 20, 8, tzinfo=UTC)
    assert parse_when("2026-11-20T08:00:00+01:00", now) == datetime(2026, 11, 20, 7, tzinfo=UTC)


# -- the command -------------------------------------------------------------------


def published(engine, n: int, *, topic: str = "orders.placed", keys: int = 0, type="Test"):
    insert_outbox(engine, n, topic=topic, keys=keys, type=type)
    rows(engine, "UPDATE outbox SET status = 'published', published_at = now(), attempts = 2")


def statuses(engine) -> dict[str, int]:
    return dict(rows(engine, "SELECT status, count(*) FROM outbox GROUP BY 1"))


@pytest.mark.parametrize("table", ["outbox", "inbox"])
def test_a_replay_needs_a_filter(run_relay, table):
    result = run_relay("replay", table)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "relay: error: replay which rows? give at least one filter: --since, --until, "
        "--topic, --type, --key" + (", --consumer" if table == "inbox" else "")
    ]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["outbox", "--since", "yesterday"], "invalid time 'yesterday'"),
        (["outbox", "--consumer", "c"], "--consumer applies to the inbox only"),
        (["outbox", "--since", "1h", "--until", "2h"], "--since must be before --until"),
    ],
)
def test_bad_replay_filters_exit_2_with_one_line(run_relay, args, expected):
    result = run_relay("replay", *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr


def test_a_dry_run_prints_the_count_and_changes_nothing(run_relay, engine):
    published(engine, 30, keys=3)
    before = rows(engine, "SELECT id, status, attempts, published_at FROM outbox ORDER BY seq")
    result = run_relay("replay", "outbox", "--topic", "orders.*", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "would replay 30 outbox rows (dry run: nothing changed)"
    assert rows(engine, "SELECT id, status, attempts, published_at FROM outbox ORDER BY seq") == (
        before
    )


def test_filters_that_match_nothing_move_nothing(run_relay, engine):
    published(engine, 5)
    for args in (["--topic", "payments.#"], ["--key", "nope"], ["--since", "2099-01-01"]):
        result = run_relay("replay", "outbox", *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "replayed 0 outbox rows"
    assert statuses(engine) == {"published": 5}


def test_the_filters_pick_the_rows(run_relay, engine):
    # name: (topic, key, type, hours ago); every row published.
    made = {
        "o1": ("orders.placed", "k1", "OrderPlaced", 1),
        "o2": ("orders.placed", "k2", "OrderPlaced", 2),
        "o3": ("orders.placed.eu", "k1", "OrderPlaced", 3),
        "p4": ("payments.taken", None, "PaymentTaken", 4),
        "p5": ("payments.taken", None, "PaymentTaken", 5),
        "p6": ("payments.taken", "k1", "PaymentTaken", 6),
    }
    for name, (topic, key, type_, hours) in made.items():
        rows(
            engine,
            "INSERT INTO outbox (topic, key, type, payload, status, published_at, created_at) "
            "VALUES (:topic, :key, :type, jsonb_build_object('name', CAST(:name AS text)), "
            "'published', now(), now() - make_interval(hours => :hours))",
            topic=topic,
            key=key,
            type=type_,
            name=name,
            hours=hours,
        )
    # A pending and a dead row are never moved by a replay.
    rows(engine, "INSERT INTO outbox (topic, payload) VALUES ('orders.placed', '{}')")
    rows(
        engine,
        "INSERT INTO outbox (topic, payload, status) VALUES ('orders.placed', '{}', 'dead')",
    )

    def moved(*args: str) -> list[str]:
        result = run_relay("replay", "outbox", *args)
        assert result.returncode == 0, result.stderr
        names = [
            r[0]
            for r in rows(
                engine,
                "UPDATE outbox SET status = 'published', published_at = now() "
                "WHERE payload ? 'name' AND status = 'pending' RETURNING payload->>'name'",
            )
        ]
        count = len(names)
        assert result.stdout.strip() == f"replayed {count} outbox row{'' if count == 1 else 's'}"
        return sorted(names)

    assert moved("--topic", "orders.#") == ["o1", "o2", "o3"]
    assert moved("--topic", "orders.*") == ["o1", "o2"]
    assert moved("--topic", "*.taken") == ["p4", "p5", "p6"]
    assert moved("--type", "PaymentTaken", "--since", "19800") == [
        "p4",
        "p5",
    ]
    assert moved("--until", "16200") == ["p5", "p6"]
    assert moved("--key", "k1") == ["o1", "o3", "p6"]
    assert moved("--key", "k1", "--topic", "orders.placed") == ["o1"]
    assert statuses(engine) == {"published": 6, "pending": 1, "dead": 1}


async def test_an_inbox_replay_runs_the_handlers_again(rabbit, inbox, effects, run_relay):
    proc = inbox()

    for n in range(20):
        await rabbit.publish(
            "orders.placed",
            json.dumps({"n": n}).encode(),
            message_id=f"m-{n}",
            type="Effect",
            headers={"x-relay-key": f"k{n % 3}"},
        )
    wait_until(lambda: len(effect_ids(effects)) == 20, message="20 handled")
    result = run_relay("replay", "inbox", "--key", "k1", "--consumer", proc.queue)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "replayed 7 inbox rows"
    wait_until(lambda: len(effect_ids(effects)) == 27, message="7 handled again")
    again = effect_ids(effects)[20:]
    assert again == [f"m-{n}" for n in range(20) if n % 3 == 1]  # in their key's order
    assert rows(effects, "SELECT DISTINCT status FROM inbox") == [("processed",)]
    result = run_relay("replay", "inbox", "--consumer", "someone-else")
    assert result.stdout.strip() == "replayed 0 inbox rows"


# -- under load ------------------------------------------------------------------------


async def test_a_replay_under_load_keeps_key_order_and_publishes_each_row_once(
    rabbit, start_relay, run_relay, inbox, effects
):
    """A live relay and producer: the replayed rows go out once more each, in
    their key's order and ahead of their key's pending rows; the inbox that
    had them drops them as duplicates; a queue bound before the replay gets
    them."""
    dedup = inbox(bind="orders.#")  # a consumer that had them
    seen = await rabbit.queue("orders.#")  # every publish, as it happens
    insert_outbox(effects, 3000, topic="orders.placed", keys=8, type="Effect")
    start_relay(
        "outbox", "--exchange", rabbit.exchange, "--poll-interval", "0.2", "--batch-size", "50"
    )
    await until(lambda: statuses(effects).get("published", 0) > 1000, message="first rows out")
    stop = threading.Event()

    def produce() -> None:
        while not stop.is_set():
            insert_outbox(effects, 20, topic="orders.placed", keys=8, type="Effect")
            time.sleep(0.02)

    producer = threading.Thread(target=produce)
    up_to = rows(effects, "SELECT now()")[0][0]
    producer.start()
    try:
        fresh = await rabbit.queue("orders.#")  # a new consumer, bound before the replay
        await asyncio.sleep(0.3)
        result = await asyncio.to_thread(
            run_relay, "replay", "outbox", "--topic", "orders.*", "--until", up_to.isoformat()
        )
        assert result.returncode == 0, result.stderr
        replayed = int(result.stdout.split()[1])
        await asyncio.sleep(1.0)
    finally:
        stop.set()
        await asyncio.to_thread(producer.join)
    assert replayed > 1000
    await until(lambda: set(statuses(effects)) == {"published"}, timeout=60, message="all out")
    total = rows(effects, "SELECT count(*) FROM outbox")[0][0]
    seq_of = dict(rows(effects, "SELECT id::text, seq FROM outbox"))
    key_of = dict(rows(effects, "SELECT id::text, key FROM outbox"))

    # Each row published once, and the replayed ones once more: never twice at once.
    everything = [m.message_id for m in await rabbit.drain(seen, total + replayed, timeout=60)]
    counts = collections.Counter(everything)
    assert set(counts) == set(seq_of)
    assert max(counts.values()) == 2
    twice = {i for i, c in counts.items() if c == 2}
    assert len(twice) == replayed

    # The new consumer, per key, from its key's first replayed row on: seq order
    # (the replayed rows among themselves, then the rows that were pending).
    fresh_ids = []
    while (message := await fresh.get(no_ack=True, fail=False)) is not None:
        fresh_ids.append(message.message_id)
    assert twice <= set(fresh_ids)
    # A replayed row's copy is its last in the stream (its first publish may
    # have come after the queue was bound, too).
    last = {message_id: n for n, message_id in enumerate(fresh_ids)}
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for n, message_id in enumerate(fresh_ids):
        key = key_of[message_id]
        if (message_id in twice and last[message_id] == n) or key in by_key:
            by_key[key].append(seq_of[message_id])
    assert len(by_key) == 8
    for key, seqs in by_key.items():
        assert seqs == sorted(seqs), key
        assert len(seqs) > len([i for i in twice if key_of[i] == key])  # pending rows after

    # The inbox that had them: each message handled once; the replays were duplicates.
    await until(
        lambda: len(effect_ids(effects)) == total, timeout=60, message="every message handled"
    )
    await asyncio.sleep(1.0)
    assert sorted(effect_ids(effects)) == sorted(seq_of)
    assert dedup.proc.poll() is None


# -- racing a retention run ------------------------------------------------------------


@pytest.mark.parametrize("table", ["outbox", "inbox"])
async def test_a_replay_racing_a_retention_run_keeps_every_replayed_row(database, engine, table):
    """A retention delete that read the rows as finished before the replay
    committed, and reaches them after: the rows it would delete are pending
    now, and it keeps them."""
    if table == "outbox":
        published(engine, 50)
        rows(engine, "UPDATE outbox SET published_at = now() - interval '2 days'")
        where = ReplayFilter(table="outbox", topic="#")
    else:
        rows(
            engine,
            "INSERT INTO inbox (consumer, message_id, topic, payload, status, processed_at) "
            "SELECT 'c', 'm-' || i, 't', '{}', 'processed', now() - interval '8 days' "
            "FROM generate_series(1, 50) i",
        )
        where = ReplayFilter(table="inbox", consumer="c")
    plain = database.replace("postgresql+psycopg://", "postgresql://")
    blocker = psycopg.connect(plain)
    # Holds the delete (which needs the rows' FOR UPDATE lock), not the replay.
    blocker.execute(f"SELECT 1 FROM {table} FOR KEY SHARE")
    store = Store(database, pool_size=3)
    try:
        deleting = asyncio.ensure_future(delete_expired(store, table, age=86400))
        await asyncio.sleep(0.5)  # the delete has read the rows and waits on their locks
        assert not deleting.done()
        moved = await replay(store, where, hold_timeout=0.2)
        blocker.rollback()
        deleted = await deleting
    finally:
        blocker.close()
        await store.close()
    assert moved == 50
    assert deleted == 0
    assert rows(engine, f"SELECT status, count(*) FROM {table} GROUP BY 1") == [("pending", 50)]


# -- the hold ----------------------------------------------------------------------


async def test_the_hold_keeps_the_keys_pending_rows_until_older_statements_end(database, engine):
    """While a statement that began before the replay committed still runs
    (a claim reading the key in its old snapshot, here a sleep), the key's
    pending rows stay locked, so such a claim skips them; once it ends, the
    hold ends, not at its time-out."""
    published(engine, 4, keys=1)  # key k0
    rows(engine, "INSERT INTO outbox (topic, key, payload) VALUES ('orders.placed', 'k0', '{}')")
    rows(engine, "INSERT INTO outbox (topic, key, payload) VALUES ('orders.placed', 'k9', '{}')")
    plain = database.replace("postgresql+psycopg://", "postgresql://")
    skip_locked = (
        "SELECT key FROM outbox WHERE status = 'pending' AND attempts = 0 "
        "AND published_at IS NULL AND payload = '{}' ORDER BY key FOR UPDATE SKIP LOCKED"
    )

    def older_statement() -> None:
        with psycopg.connect(plain) as conn:
            conn.execute("SELECT pg_sleep(1.5)")

    def claimable() -> list[str]:
        with psycopg.connect(plain) as conn:
            return [r[0] for r in conn.execute(skip_locked)]

    sleeper = asyncio.ensure_future(asyncio.to_thread(older_statement))
    await asyncio.sleep(0.3)
    store = Store(database, pool_size=2)
    try:
        started = time.monotonic()
        replaying = asyncio.ensure_future(
            replay(store, ReplayFilter(table="outbox", key="k0"), hold_timeout=10)
        )
        await until(lambda: statuses(engine).get("published") is None, message="committed")
        assert await asyncio.to_thread(claimable) == ["k9"]  # k0's pending row is held
        assert await replaying == 4
        took = time.monotonic() - started
        await sleeper
    finally:
        await store.close()
    assert 0.5 < took < 3.0, took  # the sleep's end, not the hold's 10 s
    assert await asyncio.to_thread(claimable) == ["k0", "k9"]


async def test_a_replay_whose_keys_stay_held_moves_nothing_and_says_so(database, engine):
    published(engine, 3, keys=1)
    rows(engine, "INSERT INTO outbox (topic, key, payload) VALUES ('orders.placed', 'k0', '{}')")
    plain = database.replace("postgresql+psycopg://", "postgresql://")
    batch = psycopg.connect(plain)  # a batch in flight, holding the key's pending row
    batch.execute("SELECT 1 FROM outbox WHERE status = 'pending' FOR UPDATE")
    store = Store(database, pool_size=2)
    try:
        with pytest.raises(ReplayBusy, match="nothing was replayed"):
            await replay(store, ReplayFilter(table="outbox", key="k0"), lock_timeout=0.3)
    finally:
        batch.close()
        await store.close()
    assert statuses(engine) == {"published": 3, "pending": 1}
