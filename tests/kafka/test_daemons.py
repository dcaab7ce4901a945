"""`relay outbox` and `relay inbox` on Kafka (Tansu), as subprocesses, with
confluent-kafka as the other side: what the contract's Kafka paragraphs say
beyond the suites run over every broker (tests/brokers, tests/e2e)."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

import orjson
import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import relay
from tests import kafka_raw
from tests.conftest import effect_ids, free_port, inbox_args, rows, wait_until
from tests.kafka_server import Kafka


def test_a_record_too_large_is_dead_at_once_with_its_size_and_the_limit(
    engine: sa.Engine, kafka: Kafka, run_relay
):
    topic = kafka.topic("large")
    with engine.begin() as conn:
        relay.enqueue(conn, topic, {"blob": "x" * 5000}, key="k")
        relay.enqueue(conn, topic, {"small": 1}, key="other")
    done = run_relay(
        "outbox", "--once", env={"RELAY_BROKER_URL": kafka.url("message.max.bytes=2000")}
    )
    assert done.returncode == 0, done.stderr
    got = {
        r[0]: r[1:] for r in rows(engine, "SELECT key, status, attempts, last_error FROM outbox")
    }
    status, attempts, error = got["k"]
    assert (status, attempts) == ("dead", 1)
    assert "over the 2000-byte limit" in error and "5" in error.split(" bytes")[0]
    assert got["other"][:2] == ("published", 0)
    assert [r.key() for r in kafka.read(topic, 1)] == [b"other"]


def test_a_missing_topic_counts_an_attempt_and_is_never_created(
    engine: sa.Engine, kafka: Kafka, run_relay
):
    missing = kafka.name("missing")
    with engine.begin() as conn:
        relay.enqueue(conn, missing, {"n": 1})
    done = run_relay("outbox", "--once", env={"RELAY_BROKER_URL": kafka.url()})
    assert done.returncode == 0, done.stderr
    [(status, attempts, error)] = rows(engine, "SELECT status, attempts, last_error FROM outbox")
    assert (status, attempts) == ("pending", 1)
    assert f"Kafka topic {missing!r} does not exist" in error
    assert not kafka.exists(missing)


HOSTILE = [
    # (value, key, headers): each kept as a dead row, its offset committed
    (b"not json {", None, [("id", b"h-nonjson"), ("type", b"Effect")]),
    (b'{"n": 1}', b"\xff\xfekey", [("id", b"h-badkey"), ("type", b"Effect")]),
    (b'{"n": 2}', None, [("id", b"h-badheader"), ("type", b"Effect"), ("x", b"\xc3\x28")]),
    (b'{"n": 3}', None, [("id", b"h-nul"), ("type", b"Effect"), ("x", b"a\x00b")]),
    (b"[" * 3000 + b"]" * 3000, None, [("id", b"h-deep"), ("type", b"Effect")]),
]


@pytest.mark.timeout(300)
def test_hostile_records_are_dead_rows_their_offsets_committed_and_the_canaries_handled(
    effects: sa.Engine, kafka: Kafka, start_relay
):
    topic = kafka.topic("hostile")
    for value, key, headers in HOSTILE:
        kafka.produce(topic, value, key=key, headers=headers, flush=False)
        kafka.produce(
            topic,
            b'{"canary": true}',
            headers=[("id", b"canary-" + headers[0][1]), ("type", b"Effect")],
            flush=False,
        )
    kafka.produce(topic, b'{"n": 9}', headers=[("type", b"Effect")], flush=False)  # no id
    kafka.flush()
    daemon = start_relay(*inbox_args(topic), env={"RELAY_BROKER_URL": kafka.url()})
    total = 2 * len(HOSTILE) + 1
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == total, timeout=60)
    wait_until(lambda: len(effect_ids(effects)) == len(HOSTILE) + 1, timeout=30)
    got = {r[0]: r[1:] for r in rows(effects, "SELECT message_id, status, last_error FROM inbox")}
    for _, _, headers in HOSTILE:
        message_id = headers[0][1].decode()
        status, _error = got[message_id]
        assert status in ("dead", "processed"), (message_id, status)
        assert got["canary-" + message_id][0] == "processed"
    for message_id in ("h-nonjson", "h-badkey", "h-badheader", "h-deep"):
        assert got[message_id][0] == "dead" and got[message_id][1], message_id
    assert got[f"kafka:{topic}:0:{total - 1}"][0] == "processed"  # the record's own place
    wait_until(lambda: kafka.committed(topic, topic) == {0: total}, timeout=30)
    daemon.stop()
    assert daemon.proc.returncode == 0


def test_records_no_client_library_writes_are_dead_rows_and_the_next_is_handled(
    effects: sa.Engine, kafka: Kafka, start_relay
):
    """From a producer of its own (tests/kafka_raw.py): a header name that is
    not UTF-8, which confluent-kafka cannot decode for relay, and a null
    value (a tombstone). Each is one dead row, the record after each is
    handled, every offset is committed, the daemon runs on."""
    topic = kafka.topic("raw")
    records: list[kafka_raw.RawRecord] = [
        (None, b'{"n": 1}', [(b"id", b"raw-badname"), (b"type", b"Effect"), (b"\xff\xfe", b"x")]),
        (None, b'{"canary": 1}', [(b"id", b"raw-canary-1"), (b"type", b"Effect")]),
        (b"k", None, [(b"id", b"raw-tombstone"), (b"type", b"Effect")]),
        (None, b'{"canary": 2}', [(b"id", b"raw-canary-2"), (b"type", b"Effect")]),
    ]
    assert kafka_raw.produce(kafka.bootstrap, topic, records) == 0
    daemon = start_relay(*inbox_args(topic), env={"RELAY_BROKER_URL": kafka.url()})
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == len(records), timeout=60)
    wait_until(lambda: sorted(effect_ids(effects)) == ["raw-canary-1", "raw-canary-2"], timeout=30)
    got = {
        r[0]: r[1:]
        for r in rows(effects, "SELECT message_id, status, last_error, payload, key FROM inbox")
    }
    status, error, payload, key = got[f"kafka:{topic}:0:0"]  # its id header unread
    assert status == "dead" and "a header name is not valid UTF-8" in error, error
    assert payload == {"n": 1}
    status, error, _payload, key = got["raw-tombstone"]
    assert status == "dead" and "JSON" in error and key == "k", error
    wait_until(lambda: kafka.committed(topic, topic) == {0: len(records)}, timeout=30)
    assert daemon.proc.poll() is None, daemon.log
    daemon.stop()
    assert daemon.proc.returncode == 0


_HEADER_BYTES = st.binary(max_size=12) | st.sampled_from([b"\xff\xfe", b"a\x00b", b"\xc3\x28"])
_RAW_RECORDS = st.lists(
    st.tuples(
        st.none() | st.binary(max_size=20),  # key
        st.none() | st.binary(max_size=60) | st.sampled_from([b'{"n": 1}', b"[" * 600]),
        st.lists(
            st.tuples(
                _HEADER_BYTES.filter(lambda name: not name.startswith((b"id", b"message_id"))),
                st.none() | _HEADER_BYTES,
            ),
            max_size=4,
        ),
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.timeout(300)
def test_any_record_written_byte_by_byte_becomes_exactly_one_row(
    effects: sa.Engine, kafka: Kafka, start_relay
):
    """Generated records from a producer of relay's own tests: any key, any
    value (null, not JSON, too deep), any header names and values (not UTF-8,
    NUL): each one row, every offset committed, the daemon running."""
    topic = kafka.topic("generated")
    daemon = start_relay(*inbox_args(topic), env={"RELAY_BROKER_URL": kafka.url()})
    sent = 0

    @settings(
        max_examples=8,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # a failure's example as found: shrinking re-runs the daemon
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_RAW_RECORDS)
    def check(generated: list[kafka_raw.RawRecord]) -> None:
        nonlocal sent
        # Each with an id of its own first (a later one cannot override: no
        # generated name starts with "id"), so that none is a duplicate.
        records = [
            (key, value, [(b"id", b"gen-%d" % (sent + n)), *headers])
            for n, (key, value, headers) in enumerate(generated)
        ]
        assert kafka_raw.produce(kafka.bootstrap, topic, records) == sent
        sent += len(records)
        wait_until(
            lambda: (
                daemon.proc.poll() is not None or len(rows(effects, "SELECT 1 FROM inbox")) == sent
            ),
            timeout=60,
        )
        assert daemon.proc.poll() is None, daemon.log
        wait_until(lambda: kafka.committed(topic, topic) == {0: sent}, timeout=30)
        assert rows(
            effects, "SELECT count(*) FROM inbox WHERE status = 'dead' AND last_error IS NULL"
        ) == [(0,)]
        assert daemon.proc.poll() is None, daemon.log

    check()
    daemon.stop()
    assert daemon.proc.returncode == 0


def test_a_redelivered_record_is_a_duplicate(effects: sa.Engine, kafka: Kafka, start_relay):
    topic = kafka.topic("dup")
    for n in range(3):
        kafka.produce(topic, b'{"n": %d}' % n, headers=[("id", b"same"), ("type", b"Effect")])
    daemon = start_relay(*inbox_args(topic), env={"RELAY_BROKER_URL": kafka.url()})
    wait_until(lambda: kafka.committed(topic, topic) == {0: 3}, timeout=60)
    wait_until(lambda: effect_ids(effects) == ["same"], timeout=30)
    assert rows(effects, "SELECT message_id, status FROM inbox") == [("same", "processed")]
    daemon.stop()


@pytest.mark.timeout(300)
def test_two_inboxes_share_the_partitions_and_a_kill_9_loses_nothing(
    effects: sa.Engine, kafka: Kafka, start_relay
):
    topic = kafka.topic("shared", 4)
    total = 2000
    for n in range(total):
        kafka.produce(
            topic,
            orjson.dumps({"n": n}),
            key=f"k{n % 40}".encode(),
            headers=[("id", f"s-{n}".encode()), ("type", b"Effect")],
            flush=False,
        )
    kafka.flush()
    env = {"RELAY_BROKER_URL": kafka.url()}
    first = start_relay(*inbox_args(topic, "--batch-size", "20"), env=env)
    second = start_relay(*inbox_args(topic, "--batch-size", "20"), env=env)
    first.wait_for_log("assigned", timeout=60)
    second.wait_for_log("assigned", timeout=60)
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) > total // 10, timeout=60)
    first.signal(signal.SIGKILL)
    first.wait()
    wait_until(lambda: len(set(effect_ids(effects))) == total, timeout=120)
    ids = effect_ids(effects)
    assert len(ids) == total and set(ids) == {f"s-{n}" for n in range(total)}
    wait_until(
        lambda: sum(kafka.committed(topic, topic).values()) == total,
        timeout=60,
        message="every partition committed to its end",
    )
    second.stop()
    assert second.proc.returncode == 0


def test_batch_handlers_and_the_lag_metric(effects: sa.Engine, kafka: Kafka, start_relay):
    topic = kafka.topic("lag", 2)
    for n in range(50):
        kafka.produce(
            topic,
            b'{"n": %d}' % n,
            key=f"k{n}".encode(),
            headers=[("id", f"b-{n}".encode()), ("type", b"BatchEffect")],
            flush=False,
        )
    kafka.flush()
    port = free_port()
    daemon = start_relay(
        *inbox_args(topic, "--http-port", str(port)), env={"RELAY_BROKER_URL": kafka.url()}
    )
    wait_until(lambda: len(effect_ids(effects)) == 50, timeout=60)
    assert sorted(effect_ids(effects)) == sorted(f"b-{n}" for n in range(50))

    def lag() -> dict[str, float]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("relay_inbox_kafka_lag{")
        }

    # Both partitions shown, at 0 once committed. (Tansu's end offset after
    # batched produces is the last batch's first offset plus one, so the
    # lag it gives is never above the truth: only 0 is asserted.)
    wait_until(lambda: len(lag()) == 2 and set(lag().values()) == {0.0}, timeout=30)
    assert all(f'topic="{topic}"' in name for name in lag())
    daemon.stop()


@pytest.mark.timeout(300)
def test_a_cluster_cut_off_counts_no_attempt_readyz_says_so_and_publishing_resumes(
    engine: sa.Engine, kafka: Kafka, start_relay
):
    topic = kafka.topic("cut", 3)
    port = free_port()
    daemon = start_relay(
        "outbox",
        "--http-port",
        str(port),
        "--poll-interval",
        "0.2",
        env={"RELAY_BROKER_URL": kafka.url()},
    )
    daemon.wait_for_log("outbox relay started", timeout=30)
    with engine.begin() as conn:
        for n in range(10):
            relay.enqueue(conn, topic, {"n": n}, key=f"k{n % 3}")
    wait_until(lambda: published(engine) == 10, timeout=30)
    kafka.proxy.stop()
    wait_until(lambda: http_status(port, "/readyz") == 503, timeout=30)
    reason = readyz_body(port)
    assert "outbox" in reason and "Kafka at kafka://127.0.0.1" in reason, reason
    with engine.begin() as conn:
        for n in range(10, 30):
            relay.enqueue(conn, topic, {"n": n}, key=f"k{n % 3}")
    time.sleep(3)
    assert rows(engine, "SELECT max(attempts) FROM outbox")[0][0] == 0
    kafka.proxy.start()
    wait_until(lambda: published(engine) == 30, timeout=90)
    wait_until(lambda: http_status(port, "/readyz") == 200, timeout=30)
    assert rows(engine, "SELECT max(attempts) FROM outbox")[0][0] == 0
    records = kafka.read(topic, 30)
    last: dict[bytes, int] = {}
    for record in records:  # each key's rows in order, each once
        n = orjson.loads(record.value())["n"]
        assert n > last.get(record.key(), -1)
        last[record.key()] = n
    assert len(records) == 30
    daemon.stop()
    assert daemon.proc.returncode == 0


def published(engine: sa.Engine) -> int:
    return rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0]


def readyz_body(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_relay_demo_runs_on_kafka(engine: sa.Engine, kafka: Kafka, run_relay):
    topic = kafka.topic("demo", 2)
    result = run_relay(
        "demo",
        "--duration",
        "8",
        "--rate",
        "50",
        "--queue",
        topic,
        env={"RELAY_BROKER_URL": kafka.url()},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "relay demo: produced" in result.stdout
    [(handled, consumers)] = rows(
        engine, "SELECT count(*), array_agg(DISTINCT consumer) FROM relay_demo_events"
    )
    assert handled > 0 and consumers == [topic], result.stdout
    assert len(kafka.read(topic, handled)) >= handled


def test_one_inbox_reads_several_topics_as_the_first_ones_group(
    effects: sa.Engine, kafka: Kafka, start_relay
):
    first, second = kafka.topic("first"), kafka.topic("second", 2)
    kafka.produce(first, b'{"n": 1}', headers=[("id", b"t-1"), ("type", b"Effect")])
    kafka.produce(second, b'{"n": 2}', key=b"k", headers=[("id", b"t-2"), ("type", b"Effect")])
    daemon = start_relay(*inbox_args(f"{first},{second}"), env={"RELAY_BROKER_URL": kafka.url()})
    wait_until(lambda: sorted(effect_ids(effects)) == ["t-1", "t-2"], timeout=60)
    assert {r[0] for r in rows(effects, "SELECT DISTINCT consumer FROM inbox")} == {first}
    wait_until(lambda: kafka.committed(first, first) == {0: 1}, timeout=30)
    # The keyed record's partition committed past it (the other holds none).
    wait_until(lambda: max(kafka.committed(first, second).values()) == 1, timeout=30)
    daemon.stop()
