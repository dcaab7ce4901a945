"""`relay outbox` and `relay inbox` on Redis Streams (a redis-server of the
tests' own), as subprocesses, with redis-py as the other side: what the
contract's Redis paragraphs say beyond the suites run over every broker
(tests/brokers, tests/e2e): the fields on the wire, --stream-maxlen, hostile
entries, a dead consumer's entries claimed, a cut connection, a restart."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import relay
from tests.conftest import effect_ids, free_port, inbox_args, rows, wait_until
from tests.redis_server import Redis, RedisServer

Fields = list[tuple[bytes, bytes]]


def env_of(redis: Redis | RedisServer) -> dict[str, str]:
    return {"RELAY_BROKER_URL": redis.url()}


def inbox_count(engine: sa.Engine) -> int:
    return int(rows(engine, "SELECT count(*) FROM inbox")[0][0])


def published(engine: sa.Engine) -> int:
    return int(rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0])


def check_key_order(entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
    last: dict[bytes, int] = {}
    for _, fields in entries:
        n = orjson.loads(fields[b"payload"])["n"]
        assert n > last.get(fields[b"key"], -1), (fields[b"key"], n)
        last[fields[b"key"]] = n


def http_status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


# --------------------------------------------------------------------------
# Outbox → stream → inbox
# --------------------------------------------------------------------------


def test_rows_reach_the_handlers_through_a_stream_with_the_contracts_fields(
    effects: sa.Engine, redis_streams: Redis, start_relay, run_relay
):
    stream = redis_streams.name("orders")
    inbox = start_relay(*inbox_args(stream), env=env_of(redis_streams))
    inbox.wait_for_log("inbox started", timeout=30)
    with effects.begin() as conn:
        first = str(
            relay.enqueue(
                conn, stream, {"n": 1}, key="k", type="Effect", headers={"traceparent": "00-a-b-01"}
            )
        )
        second = str(relay.enqueue(conn, stream, {"n": 2}, type="Effect"))
    done = run_relay("outbox", "--once", env=env_of(redis_streams))
    assert done.returncode == 0, done.stderr
    wait_until(lambda: sorted(effect_ids(effects)) == sorted([first, second]), timeout=30)
    # Rows of different keys: in either order.
    entries = {f[b"id"].decode(): f for _, f in redis_streams.read(stream)}
    one, two = entries[first], entries[second]
    assert one == {
        b"id": first.encode(),
        b"payload": b'{"n":1}',
        b"type": b"Effect",
        b"key": b"k",
        b"headers": b'{"traceparent":"00-a-b-01"}',
    }
    assert two == {b"id": second.encode(), b"payload": b'{"n":2}', b"type": b"Effect"}
    got = {r[0]: r[1:] for r in rows(effects, "SELECT message_id, key, headers FROM inbox")}
    assert got[first] == ("k", {"traceparent": "00-a-b-01"}) and got[second] == (None, {})
    wait_until(lambda: redis_streams.lag(stream, stream) == 0, timeout=30)
    inbox.stop()
    assert inbox.proc.returncode == 0, inbox.log
    # A clean stop with nothing held: the process's consumer leaves the group.
    assert redis_streams.consumers(stream, stream) == {}


def test_stream_maxlen_trims_the_stream_as_relay_adds(
    engine: sa.Engine, redis_streams: Redis, run_relay
):
    stream = redis_streams.name("trimmed")
    with engine.begin() as conn:
        for n in range(1000):
            relay.enqueue(conn, stream, {"n": n})
    done = run_relay("outbox", "--once", "--stream-maxlen", "10", env=env_of(redis_streams))
    assert done.returncode == 0, done.stderr
    assert published(engine) == 1000
    # MAXLEN ~: Redis trims whole nodes of the stream (100 entries by default).
    assert 10 <= redis_streams.client.xlen(stream) <= 200


# --------------------------------------------------------------------------
# Hostile entries
# --------------------------------------------------------------------------

DEEP = b"[" * 3000 + b"]" * 3000
HOSTILE: list[tuple[str, Fields]] = [
    # (id, fields after the id): each one row, dead, with the reason
    ("h-nonjson", [(b"type", b"Effect"), (b"payload", b"not json {")]),
    ("h-badname", [(b"type", b"Effect"), (b"payload", b"{}"), (b"\xff\xfe", b"x")]),
    ("h-badvalue", [(b"type", b"Effect"), (b"payload", b"{}"), (b"x", b"\xc3\x28")]),
    ("h-badpayload", [(b"type", b"Effect"), (b"payload", b'{"a": "\xc3\x28"}')]),
    ("h-nul", [(b"type", b"Effect"), (b"payload", b"{}"), (b"x", b"a\x00b")]),
    ("h-deep", [(b"type", b"Effect"), (b"payload", DEEP)]),
    ("h-headers", [(b"type", b"Effect"), (b"payload", b"{}"), (b"headers", b"[1]")]),
    ("h-nopayload", [(b"type", b"Effect"), (b"n", b"\xff")]),
]


@pytest.mark.timeout(300)
def test_hostile_entries_are_dead_rows_acknowledged_and_the_canaries_handled(
    effects: sa.Engine, redis_streams: Redis, start_relay
):
    stream = redis_streams.name("hostile")
    for message_id, fields in HOSTILE:
        redis_streams.add(stream, [(b"id", message_id.encode()), *fields])
        redis_streams.add(
            stream,
            [(b"id", f"canary-{message_id}".encode()), (b"type", b"Effect"), (b"payload", b"{}")],
        )
    # No payload: the fields are the body; no id: the entry's place.
    plain = redis_streams.add(stream, [(b"type", b"Effect"), (b"n", b"1")])
    daemon = start_relay(*inbox_args(stream), env=env_of(redis_streams))
    total = 2 * len(HOSTILE) + 1
    wait_until(lambda: inbox_count(effects) == total, timeout=60)
    wait_until(lambda: len(effect_ids(effects)) == len(HOSTILE) + 1, timeout=30)
    got = {
        r[0]: r[1:]
        for r in rows(effects, "SELECT message_id, status, last_error, payload FROM inbox")
    }
    for message_id, _ in HOSTILE:
        status, error, _payload = got[message_id]
        assert status == "dead" and error, (message_id, status)
        assert got[f"canary-{message_id}"][0] == "processed"
    assert "headers must be a JSON object" in got["h-headers"][1]
    assert "not valid UTF-8" in got["h-nopayload"][1]
    status, _, payload = got[f"redis:{stream}:{plain.decode()}"]
    assert (status, payload) == ("processed", {"type": "Effect", "n": "1"})
    wait_until(lambda: redis_streams.lag(stream, stream) == 0, timeout=30)
    assert daemon.proc.poll() is None, daemon.log
    daemon.stop()
    assert daemon.proc.returncode == 0


_BYTES = st.binary(max_size=12) | st.sampled_from([b"\xff\xfe", b"a\x00b", b"\xc3\x28", b""])
_VALUES = _BYTES | st.sampled_from([b'{"n": 1}', b"[" * 600, b'{"a": "\\u0000"}', b"[1]"])
_ENTRIES = st.lists(
    st.lists(
        st.tuples(
            (_BYTES | st.sampled_from([b"payload", b"headers", b"type", b"key"])).filter(
                lambda name: not name.startswith((b"id", b"message_id"))
            ),
            _VALUES,
        ),
        min_size=1,
        max_size=5,
    ),
    min_size=1,
    max_size=20,
)


@pytest.mark.timeout(300)
def test_any_entry_written_byte_by_byte_becomes_exactly_one_row(
    effects: sa.Engine, redis_streams: Redis, start_relay
):
    """Generated entries from a raw client: any field names and values (not
    UTF-8, NUL, not JSON, too deep, a `headers` that is no object): each one
    row, every entry acknowledged, the daemon running."""
    stream = redis_streams.name("generated")
    daemon = start_relay(*inbox_args(stream), env=env_of(redis_streams))
    sent = 0

    @settings(
        max_examples=8,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # a failure's example as found: shrinking re-runs the daemon
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_ENTRIES)
    def check(generated: list[Fields]) -> None:
        nonlocal sent
        # Each with an id of its own first (no generated name is `id`), so
        # that none is a duplicate.
        pipe = redis_streams.client.pipeline(transaction=False)
        for n, fields in enumerate(generated):
            flat = [part for pair in [(b"id", b"gen-%d" % (sent + n)), *fields] for part in pair]
            pipe.execute_command("XADD", stream, "*", *flat)
        pipe.execute()
        sent += len(generated)
        wait_until(
            lambda: daemon.proc.poll() is not None or inbox_count(effects) == sent, timeout=60
        )
        assert daemon.proc.poll() is None, daemon.log
        wait_until(lambda: redis_streams.lag(stream, stream) == 0, timeout=30)
        assert rows(
            effects, "SELECT count(*) FROM inbox WHERE status = 'dead' AND last_error IS NULL"
        ) == [(0,)]

    check()
    assert inbox_count(effects) == sent
    daemon.stop()
    assert daemon.proc.returncode == 0


# --------------------------------------------------------------------------
# Consumers of one group
# --------------------------------------------------------------------------


def test_a_dead_consumers_entries_are_claimed_after_claim_idle(
    effects: sa.Engine, redis_streams: Redis, start_relay
):
    stream = redis_streams.name("claimed")
    client = redis_streams.client
    client.xgroup_create(stream, stream, id="0", mkstream=True)
    for n in range(20):
        client.xadd(stream, {"id": f"c-{n}", "type": "Effect", "payload": b'{"n": %d}' % n})
    # A consumer that read them all, then died (never acknowledged).
    client.xreadgroup(stream, "dead-consumer", {stream: ">"}, count=100)
    assert redis_streams.consumers(stream, stream) == {"dead-consumer": 20}
    daemon = start_relay(*inbox_args(stream, "--claim-idle", "1"), env=env_of(redis_streams))
    wait_until(lambda: len(effect_ids(effects)) == 20, timeout=60)
    assert sorted(effect_ids(effects)) == sorted(f"c-{n}" for n in range(20))
    wait_until(lambda: redis_streams.pending(stream, stream) == 0, timeout=30)
    assert redis_streams.consumers(stream, stream)["dead-consumer"] == 0
    # Claimed, in as many XAUTOCLAIMs as the room in memory allowed.
    assert sum(int(n) for n in re.findall(r"claimed (\d+) entries", daemon.log)) == 20
    daemon.stop()
    assert daemon.proc.returncode == 0


# --------------------------------------------------------------------------
# Faults: a cut connection, a restarted server
# --------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_cut_connection_counts_no_attempt_readyz_says_so_and_both_daemons_resume(
    effects: sa.Engine, redis_streams: Redis, start_relay
):
    stream = redis_streams.name("cut")
    port = free_port()
    env = env_of(redis_streams)
    inbox = start_relay(*inbox_args(stream), env=env)
    outbox = start_relay(
        "outbox", "--http-port", str(port), "--poll-interval", "0.2", "--backoff-max", "1", env=env
    )
    outbox.wait_for_log("outbox relay started", timeout=30)
    with effects.begin() as conn:
        for n in range(10):
            relay.enqueue(conn, stream, {"n": n}, key=f"k{n % 3}", type="Effect")
    wait_until(lambda: len(effect_ids(effects)) == 10, timeout=30)
    redis_streams.proxy.stop()
    with effects.begin() as conn:
        for n in range(10, 30):
            relay.enqueue(conn, stream, {"n": n}, key=f"k{n % 3}", type="Effect")
    wait_until(lambda: http_status(port, "/readyz")[0] == 503, timeout=30)
    reason = http_status(port, "/readyz")[1]
    assert "outbox" in reason and "Redis at redis://127.0.0.1" in reason, reason
    time.sleep(1)
    assert rows(effects, "SELECT max(attempts) FROM outbox")[0][0] == 0
    redis_streams.proxy.start()
    wait_until(lambda: published(effects) == 30, timeout=90)
    wait_until(lambda: len(set(effect_ids(effects))) == 30, timeout=60)
    assert len(effect_ids(effects)) == 30  # each handled once
    assert rows(effects, "SELECT max(attempts) FROM outbox")[0][0] == 0
    check_key_order(redis_streams.read(stream))
    wait_until(lambda: http_status(port, "/readyz")[0] == 200, timeout=30)
    for daemon in (outbox, inbox):
        daemon.stop()
        assert daemon.proc.returncode == 0, daemon.log


@pytest.fixture
def durable_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, with an append-only file."""
    workdir = tmp_path / "redis"
    workdir.mkdir()
    server = RedisServer(workdir, durable=True)
    try:
        yield server
    finally:
        server.close()


@pytest.mark.timeout(300)
def test_the_server_restarted_loses_nothing_and_each_message_is_handled_once(
    effects: sa.Engine, durable_redis: RedisServer, start_relay
):
    stream = "restarted"
    env = env_of(durable_redis)
    inbox = start_relay(*inbox_args(stream, "--batch-size", "20"), env=env)
    outbox = start_relay("outbox", "--poll-interval", "0.2", "--backoff-max", "1", env=env)
    outbox.wait_for_log("outbox relay started", timeout=30)
    inbox.wait_for_log("inbox started", timeout=30)

    def enqueue(start: int, stop: int) -> None:
        with effects.begin() as conn:
            for n in range(start, stop):
                relay.enqueue(conn, stream, {"n": n}, key=f"k{n % 7}", type="Effect")

    enqueue(0, 300)
    wait_until(lambda: len(effect_ids(effects)) > 0, timeout=30)
    durable_redis.stop()
    enqueue(300, 400)
    time.sleep(1)
    durable_redis.start()
    wait_until(lambda: published(effects) == 400, timeout=90)
    wait_until(lambda: len(set(effect_ids(effects))) == 400, timeout=90)
    ids = effect_ids(effects)
    assert len(ids) == len(set(ids)) == 400
    assert rows(effects, "SELECT max(attempts) FROM outbox")[0][0] == 0
    entries = durable_redis.client_entries(stream)
    assert {f[b"id"] for _, f in entries} == {i.encode() for i in ids}
    check_key_order(entries)
    for daemon in (outbox, inbox):
        daemon.stop()
        assert daemon.proc.returncode == 0, daemon.log


def test_relay_demo_runs_on_redis(engine: sa.Engine, redis_streams: Redis, run_relay):
    stream = redis_streams.name("demo")
    result = run_relay(
        "demo",
        "--duration",
        "6",
        "--rate",
        "50",
        "--queue",
        stream,
        env=env_of(redis_streams),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "relay demo: produced" in result.stdout
    [(handled, consumers)] = rows(
        engine, "SELECT count(*), array_agg(DISTINCT consumer) FROM relay_demo_events"
    )
    assert handled > 0 and consumers == [stream], result.stdout
    assert len(redis_streams.read(stream)) >= handled
