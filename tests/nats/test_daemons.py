"""`relay outbox` and `relay inbox` on NATS JetStream (nats-server 2.9, as
tests/nats_server.py starts it), as subprocesses, with nats-py (and bytes
written on the wire) as the other side: what the contract's NATS
paragraphs say beyond the suites run over every broker (tests/brokers,
tests/e2e)."""

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
from nats.js.api import AckPolicy, DeliverPolicy

import relay
from tests.conftest import effect_ids, free_port, inbox_args, rows, wait_until
from tests.nats_server import Nats

ACK_WAIT = 3.0  # the tests' consumers: what a killed inbox held comes back in seconds


def published(engine: sa.Engine) -> int:
    return rows(engine, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0]


def http_status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def readyz_body(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


def drained(nats: Nats, stream: str, consumer: str) -> bool:
    info = nats.run(nats.consumer_info(stream, consumer))
    return int(info.num_pending) == 0 and int(info.num_ack_pending) == 0


def check_key_order(messages: list[object]) -> None:
    last: dict[str, int] = {}
    for message in messages:
        headers = message.headers or {}  # type: ignore[attr-defined]
        n = orjson.loads(message.data)["n"]  # type: ignore[attr-defined]
        key = headers["key"]
        assert n > last.get(key, -1), f"{key}: {n} after {last[key]}"
        last[key] = n


def test_rows_go_through_a_stream_to_the_inbox_with_their_id_type_key_and_headers(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("e2e"))
    with effects.begin() as conn:
        ids = [
            relay.enqueue(
                conn,
                f"{subject}.orders",
                {"n": n, "note": "é"},
                key=f"k{n % 3}",
                type="Effect",
                headers={"traceparent": f"00-{n:032x}-{n:016x}-01"},
            )
            for n in range(30)
        ]
    env = {"RELAY_BROKER_URL": nats_helper.url}
    outbox = start_relay("outbox", "--poll-interval", "0.2", env=env)
    wait_until(lambda: published(effects) == 30, timeout=60)
    messages = nats_helper.run(nats_helper.messages(stream))
    by_id = {m.headers["Nats-Msg-Id"]: m for m in messages}
    assert len(messages) == 30 and set(by_id) == {str(i) for i in ids}
    check_key_order(messages)
    first = by_id[str(ids[0])]
    assert first.subject == f"{subject}.orders"
    assert first.headers == {
        "Nats-Msg-Id": str(ids[0]),
        "type": "Effect",
        "key": "k0",
        "Content-Type": "application/json",
        "traceparent": f"00-{0:032x}-{0:016x}-01",
    }
    assert first.data == '{"n":0,"note":"é"}'.encode()
    inbox = start_relay(*inbox_args(stream), env=env)
    wait_until(lambda: len(effect_ids(effects)) == 30, timeout=60)
    got = {
        r[0]: r[1:]
        for r in rows(effects, "SELECT message_id, type, key, topic, headers, status FROM inbox")
    }
    assert set(got) == {str(i) for i in ids}
    type_, key, topic, headers, status = got[str(ids[4])]
    assert (type_, key, topic, status) == ("Effect", "k1", f"{subject}.orders", "processed")
    assert headers["traceparent"] == f"00-{4:032x}-{4:016x}-01"
    wait_until(lambda: drained(nats_helper, stream, stream), timeout=30)
    info = nats_helper.run(nats_helper.consumer_info(stream, stream))
    assert info.config.ack_policy == AckPolicy.EXPLICIT  # a str enum: the server's text too
    assert info.config.deliver_policy == DeliverPolicy.ALL
    assert info.config.durable_name == stream
    for daemon in (outbox, inbox):
        daemon.stop()
        assert daemon.proc.returncode == 0


def test_a_message_over_max_payload_is_dead_at_once_with_its_size_and_the_limit(
    engine: sa.Engine, nats_helper: Nats, run_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("large"))
    with engine.begin() as conn:
        relay.enqueue(conn, f"{subject}.x", {"blob": "x" * 1_100_000}, key="k")
        relay.enqueue(conn, f"{subject}.x", {"n": 1}, key="k")  # waits behind it: released
        relay.enqueue(conn, f"{subject}.x", {"small": 1}, key="other")
    done = run_relay("outbox", "--once", env={"RELAY_BROKER_URL": nats_helper.url})
    assert done.returncode == 0, done.stderr
    got = {
        r[0]: r[1:]
        for r in rows(engine, "SELECT payload::text, status, attempts, last_error FROM outbox")
    }
    dead = next(v for k, v in got.items() if "blob" in k)
    assert dead[:2] == ("dead", 1)
    assert "over the NATS server's max_payload of 1048576 bytes" in dead[2], dead[2]
    assert "message is 1100" in dead[2]
    assert {v[0] for k, v in got.items() if "blob" not in k} == {"published"}
    assert len(nats_helper.run(nats_helper.messages(stream))) == 2


def test_a_subject_no_stream_captures_counts_an_attempt_and_no_stream_is_made(
    engine: sa.Engine, nats_helper: Nats, run_relay
):
    subject = nats_helper.name("nowhere")
    with engine.begin() as conn:
        relay.enqueue(conn, subject, {"n": 1})
    done = run_relay("outbox", "--once", env={"RELAY_BROKER_URL": nats_helper.url})
    assert done.returncode == 0, done.stderr
    [(status, attempts, error)] = rows(engine, "SELECT status, attempts, last_error FROM outbox")
    assert (status, attempts) == ("pending", 1)
    assert f"no NATS stream captures subject {subject!r} (no responders)" in error


@pytest.mark.timeout(300)
def test_a_cut_connection_counts_no_attempt_readyz_says_so_and_publishing_resumes(
    engine: sa.Engine, nats_helper: Nats, start_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("cut"))
    port = free_port()
    daemon = start_relay(
        "outbox",
        "--http-port",
        str(port),
        "--poll-interval",
        "0.2",
        env={"RELAY_BROKER_URL": nats_helper.url},
    )
    daemon.wait_for_log("outbox relay started", timeout=30)
    with engine.begin() as conn:
        for n in range(10):
            relay.enqueue(conn, f"{subject}.x", {"n": n}, key=f"k{n % 3}")
    wait_until(lambda: published(engine) == 10, timeout=30)
    nats_helper.proxy.stop()
    with engine.begin() as conn:
        for n in range(10, 30):
            relay.enqueue(conn, f"{subject}.x", {"n": n}, key=f"k{n % 3}")
    wait_until(lambda: http_status(port, "/readyz") == 503, timeout=30)
    reason = readyz_body(port)
    assert "NATS at nats://127.0.0.1" in reason, reason
    time.sleep(2)
    assert rows(engine, "SELECT max(attempts) FROM outbox")[0][0] == 0
    nats_helper.proxy.start()
    wait_until(lambda: published(engine) == 30, timeout=90)
    wait_until(lambda: http_status(port, "/readyz") == 200, timeout=30)
    assert rows(engine, "SELECT max(attempts) FROM outbox")[0][0] == 0
    messages = nats_helper.run(nats_helper.messages(stream))
    assert len(messages) == 30  # each once: a republish is a duplicate the stream drops
    check_key_order(messages)
    daemon.stop()
    assert daemon.proc.returncode == 0


@pytest.mark.timeout(300)
def test_the_server_restarted_mid_stream_loses_nothing_and_keeps_its_streams(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("restart"))
    nats_helper.run(nats_helper.add_consumer(stream, stream, ack_wait=ACK_WAIT))
    env = {"RELAY_BROKER_URL": nats_helper.url}
    outbox = start_relay("outbox", "--poll-interval", "0.2", "--batch-size", "50", env=env)
    inbox = start_relay(*inbox_args(stream, "--batch-size", "20"), env=env)
    total = 600
    for chunk in range(6):
        with effects.begin() as conn:
            for n in range(chunk * 100, chunk * 100 + 100):
                relay.enqueue(conn, f"{subject}.x", {"n": n}, key=f"k{n % 7}", type="Effect")
        if chunk == 2:
            wait_until(lambda: published(effects) > 0, timeout=60)
            nats_helper.server.restart()
    wait_until(lambda: published(effects) == total, timeout=120)
    wait_until(lambda: len(set(effect_ids(effects))) == total, timeout=120)
    ids = effect_ids(effects)
    assert len(ids) == total  # each handled once
    assert rows(effects, "SELECT max(attempts) FROM outbox")[0][0] == 0
    messages = nats_helper.run(nats_helper.messages(stream))
    assert len({m.headers["Nats-Msg-Id"] for m in messages}) == total
    check_key_order(messages)
    wait_until(lambda: drained(nats_helper, stream, stream), timeout=60)
    for daemon in (outbox, inbox):
        assert "NATS" in daemon.log and daemon.proc.poll() is None, daemon.log
        daemon.stop()
        assert daemon.proc.returncode == 0


def _header(*pairs: tuple[bytes, bytes]) -> bytes:
    return b"NATS/1.0\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in pairs) + b"\r\n"


HOSTILE = [
    # (id, header pairs besides Nats-Msg-Id and type, data): each a dead row, acknowledged
    (b"h-nonjson", (), b"not json {"),
    (b"h-badheader", ((b"x", b"\xc3\x28"),), b'{"n": 1}'),
    (b"h-badkey", ((b"key", b"\xff\xfe"),), b'{"n": 2}'),
    (b"h-badname", ((b"\xff\xfe", b"x"),), b'{"n": 3}'),
    (b"h-nul", ((b"x", b"a\x00b"),), b'{"n": 4}'),
    (b"h-nuldata", (), b'{"n": "a\\u0000b"}'),
    (b"h-deep", (), b"[" * 3000 + b"]" * 3000),
]


@pytest.mark.timeout(300)
def test_hostile_messages_are_dead_rows_acknowledged_and_the_canaries_handled(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("hostile"))
    messages: list[tuple[bytes, bytes | None, bytes]] = []
    for message_id, pairs, data in HOSTILE:
        header = _header((b"Nats-Msg-Id", message_id), (b"type", b"Effect"), *pairs)
        messages.append((f"{subject}.x".encode(), header, data))
        canary = _header((b"Nats-Msg-Id", b"canary-" + message_id), (b"type", b"Effect"))
        messages.append((f"{subject}.x".encode(), canary, b'{"canary": true}'))
    messages.append((f"{subject}.\xff".encode("latin-1"), None, b'{"subject": 1}'))  # not UTF-8
    messages.append((f"{subject}.x".encode(), None, b'{"n": 9}'))  # no header: no id, no type
    nats_helper.run(nats_helper.publish_raw(messages))
    daemon = start_relay(*inbox_args(stream), env={"RELAY_BROKER_URL": nats_helper.url})
    total = len(messages)
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) == total, timeout=60)
    wait_until(lambda: len(effect_ids(effects)) == len(HOSTILE), timeout=30)
    got = {r[0]: r[1:] for r in rows(effects, "SELECT message_id, status, last_error FROM inbox")}
    for message_id, _, _ in HOSTILE:
        text = message_id.decode()
        assert got[text][0] == "dead" and got[text][1], (text, got[text])
        assert got["canary-" + text][0] == "processed"
    # Without an id: the message's place in the stream; without a type: its subject.
    assert got[f"nats:{stream}:{total - 1}"][0] == "dead"  # not UTF-8
    assert got[f"nats:{stream}:{total}"][0] == "dead"  # no handler for the subject's type
    assert "no handler" in got[f"nats:{stream}:{total}"][1].lower()
    wait_until(lambda: drained(nats_helper, stream, stream), timeout=30)
    assert daemon.proc.poll() is None, daemon.log
    daemon.stop()
    assert daemon.proc.returncode == 0


# Header names and values as bytes a producer may write (no CR, LF or ':' in
# a name: those would be another line or another split, not another name).
_NAME_BYTES = st.binary(min_size=1, max_size=10).filter(
    lambda b: not (set(b) & set(b"\r\n:")) and b.strip() and not b.strip().startswith(b"Nats-")
)
_VALUE_BYTES = st.binary(max_size=12).filter(
    lambda b: not (set(b) & set(b"\r\n"))
) | st.sampled_from([b"\xff\xfe", b"a\x00b", b"\xc3\x28"])
_RAW_MESSAGES = st.lists(
    st.tuples(
        st.lists(st.tuples(_NAME_BYTES, _VALUE_BYTES), max_size=4),
        st.binary(max_size=60) | st.sampled_from([b'{"n": 1}', b"[" * 600, b""]),
    ),
    min_size=1,
    max_size=25,
)


@pytest.mark.timeout(300)
def test_any_message_written_byte_by_byte_becomes_exactly_one_row(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    """Generated messages written on the wire (HPUB): any header names and
    values (not UTF-8, NUL), any data (empty, not JSON, too deep): each one
    row, each acknowledged, the daemon running; one bad message fails only
    itself."""
    stream, subject = nats_helper.run(nats_helper.stream("generated"))
    daemon = start_relay(*inbox_args(stream), env={"RELAY_BROKER_URL": nats_helper.url})
    sent = 0

    @settings(
        max_examples=8,
        deadline=None,
        database=None,
        phases=[Phase.generate],  # a failure's example as found: shrinking re-runs the daemon
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(_RAW_MESSAGES)
    def check(generated: list[tuple[list[tuple[bytes, bytes]], bytes]]) -> None:
        nonlocal sent
        # Each with an id of its own first, and a canary after it.
        messages: list[tuple[bytes, bytes | None, bytes]] = []
        for n, (pairs, data) in enumerate(generated):
            header = _header((b"Nats-Msg-Id", b"gen-%d" % (sent + n)), *pairs)
            messages.append((f"{subject}.x".encode(), header, data))
        canary_id = b"canary-%d" % sent
        canary = _header((b"Nats-Msg-Id", canary_id), (b"type", b"Effect"))
        messages.append((f"{subject}.x".encode(), canary, b'{"canary": 1}'))
        nats_helper.run(nats_helper.publish_raw(messages))
        sent += len(messages)
        wait_until(
            lambda: (
                daemon.proc.poll() is not None or len(rows(effects, "SELECT 1 FROM inbox")) == sent
            ),
            timeout=60,
        )
        assert daemon.proc.poll() is None, daemon.log
        wait_until(lambda: canary_id.decode() in effect_ids(effects), timeout=30)
        wait_until(lambda: drained(nats_helper, stream, stream), timeout=30)
        assert rows(
            effects, "SELECT count(*) FROM inbox WHERE status = 'dead' AND last_error IS NULL"
        ) == [(0,)]

    check()
    daemon.stop()
    assert daemon.proc.returncode == 0


def test_relay_demo_runs_on_nats(engine: sa.Engine, nats_helper: Nats, run_relay):
    queue = nats_helper.name("demo")
    nats_helper.streams.append(queue)  # the demo makes it; the test removes it
    result = run_relay(
        "demo",
        "--duration",
        "6",
        "--rate",
        "50",
        "--queue",
        queue,
        env={"RELAY_BROKER_URL": nats_helper.url},
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "relay demo: produced" in result.stdout
    [(handled, consumers)] = rows(
        engine, "SELECT count(*), array_agg(DISTINCT consumer) FROM relay_demo_events"
    )
    assert handled > 0 and consumers == [queue], result.stdout
    assert len(nats_helper.run(nats_helper.messages(queue))) >= handled


@pytest.mark.timeout(300)
def test_two_inboxes_share_one_consumer_and_a_kill_9_loses_nothing(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    stream, subject = nats_helper.run(nats_helper.stream("shared"))
    nats_helper.run(nats_helper.add_consumer(stream, stream, ack_wait=ACK_WAIT))
    total = 1500
    nats_helper.run(
        nats_helper.publish_many(
            [
                (
                    f"{subject}.x",
                    orjson.dumps({"n": n}),
                    {"Nats-Msg-Id": f"s-{n}", "type": "Effect"},
                )
                for n in range(total)
            ]
        )
    )
    env = {"RELAY_BROKER_URL": nats_helper.url}
    first = start_relay(*inbox_args(stream, "--batch-size", "20"), env=env)
    second = start_relay(*inbox_args(stream, "--batch-size", "20"), env=env)
    for daemon in (first, second):
        daemon.wait_for_log("consuming NATS stream", timeout=60)
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox")) > total // 10, timeout=60)
    first.signal(signal.SIGKILL)
    first.wait()
    assert len(rows(effects, "SELECT 1 FROM inbox")) < total, "killed too late to prove anything"
    wait_until(lambda: len(set(effect_ids(effects))) == total, timeout=120)
    ids = effect_ids(effects)
    assert len(ids) == total and set(ids) == {f"s-{n}" for n in range(total)}
    wait_until(lambda: drained(nats_helper, stream, stream), timeout=60)
    second.stop()
    assert second.proc.returncode == 0


def test_an_inbox_on_a_missing_stream_says_so_and_starts_once_it_is_made(
    effects: sa.Engine, nats_helper: Nats, start_relay
):
    stream = nats_helper.name("later")
    daemon = start_relay(*inbox_args(stream), env={"RELAY_BROKER_URL": nats_helper.url})
    daemon.wait_for_log(f"NATS stream {stream!r} does not exist", timeout=30)
    assert daemon.proc.poll() is None, daemon.log
    nats_helper.run(nats_helper.create(stream, [stream]))
    nats_helper.run(nats_helper.publish(stream, b"{}", {"Nats-Msg-Id": "late", "type": "Effect"}))
    wait_until(lambda: effect_ids(effects) == ["late"], timeout=60)
    daemon.stop()
    assert daemon.proc.returncode == 0
