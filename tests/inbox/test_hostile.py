"""Hostile input and poison messages: each gets a clear error, and nothing is lost.

Poison policy per key (`--on-dead skip|block`) for the inbox, `relay status`
listing the keys dead rows hold, handlers that hang, bodies far larger than
usual, a huge batch of tiny rows, payloads over the broker's size limit,
numbers that only JSON can carry exactly, and the security rules (SQL only
with bound parameters, a read-only HTTP port, no secret in `relay status`).
"""

from __future__ import annotations

import ast
import asyncio
import re
import socket
import time
import uuid
from datetime import UTC
from pathlib import Path

import orjson
import psycopg
import sqlalchemy as sa

import relay
from tests.conftest import (
    MIXED_HANDLERS,
    REPO,
    effect_ids,
    free_port,
    insert_outbox,
    left_in_the_queue,
    rows,
    sync_hang_holds_its_transaction,
    wait_until,
)


def status_of(engine, message_id):
    found = rows(
        engine, "SELECT status, attempts, last_error FROM inbox WHERE message_id = :m", m=message_id
    )
    return found[0] if found else None


async def queue_depth(rabbit, name: str) -> int:
    channel = await rabbit.connection.channel()
    try:
        declared = await channel.declare_queue(name, passive=True)
        return declared.declaration_result.message_count
    finally:
        await channel.close()


# --------------------------------------------------------------------------
# Poison policy per key, and what `relay status` shows of it
# --------------------------------------------------------------------------


async def test_inbox_on_dead_block_holds_the_key_until_retried(effects, rabbit, inbox, run_relay):
    daemon = inbox("--on-dead", "block", "--max-attempts", "1")
    await rabbit.publish(
        "t", b'{"n": 1}', message_id="a-1", type="AlwaysFails", headers={"x-relay-key": "a"}
    )
    wait_until(lambda: (status_of(effects, "a-1") or ("",))[0] == "dead")
    await rabbit.publish(
        "t", b'{"n": 2}', message_id="a-2", type="Effect", headers={"x-relay-key": "a"}
    )
    await rabbit.publish(
        "t", b'{"n": 3}', message_id="b-1", type="Effect", headers={"x-relay-key": "b"}
    )
    wait_until(lambda: effect_ids(effects) == ["b-1"])
    time.sleep(1.5)  # three polls: a-2 would have run by now
    assert effect_ids(effects) == ["b-1"]
    assert status_of(effects, "a-2")[:2] == ("pending", 0)

    text = run_relay("status")
    assert text.returncode == 0, text.stderr
    consumer = f"{rabbit.exchange}.in"
    assert (
        f"inbox (consumer {consumer}): keys held by dead rows (under --on-dead block): a"
        in text.stdout
    ), text.stdout

    # The dead row, retried, fails again (the handler always fails): the key
    # stays held. The retry command is what releases it once fixed; here we
    # stand in for a fix by rewriting the row's type.
    rows(effects, "UPDATE inbox SET type = 'Effect' WHERE message_id = 'a-1'")
    assert run_relay("retry", "inbox", "--id", "a-1").returncode == 0
    wait_until(lambda: effect_ids(effects) == ["b-1", "a-1", "a-2"])
    daemon.stop()
    assert daemon.proc.returncode == 0


async def test_inbox_on_dead_skip_lets_later_rows_of_the_key_go_on(effects, rabbit, inbox):
    inbox("--max-attempts", "1")  # skip is the default
    await rabbit.publish(
        "t", b'{"n": 1}', message_id="a-1", type="AlwaysFails", headers={"x-relay-key": "a"}
    )
    wait_until(lambda: (status_of(effects, "a-1") or ("",))[0] == "dead")
    await rabbit.publish(
        "t", b'{"n": 2}', message_id="a-2", type="Effect", headers={"x-relay-key": "a"}
    )
    wait_until(lambda: effect_ids(effects) == ["a-2"])
    assert status_of(effects, "a-1")[:2] == ("dead", 1)


def test_status_text_lists_keys_held_by_dead_rows_and_json_keeps_its_shape(engine, run_relay):
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, key, payload, status) VALUES "
                "('t', 'k2', '1', 'dead'), ('t', 'k1', '2', 'dead'), ('t', 'k2', '3', 'dead'), "
                "('t', NULL, '4', 'dead'), ('t', 'k3', '5', 'pending'), "
                "('t', 'line\nbreak', '6', 'dead')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer, message_id, key, status) VALUES "
                "('c1', 'm1', 'x', 'dead'), ('c1', 'm2', 'y', 'processed'), "
                "('c2', 'm1', 'y', 'dead')"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO inbox (consumer, message_id, key, status) "
                "SELECT 'many', 'm' || i, 'key-' || i, 'dead' FROM generate_series(1, 25) i"
            )
        )
    text = run_relay("status")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    assert (
        'outbox: keys held by dead rows (under --on-dead block): k2, k1, "line\\nbreak"' in lines
    ), text.stdout
    assert "inbox (consumer c1): keys held by dead rows (under --on-dead block): x" in lines
    assert "inbox (consumer c2): keys held by dead rows (under --on-dead block): y" in lines
    [many] = [line for line in lines if line.startswith("inbox (consumer many)")]
    assert many.endswith("key-20 and 5 more")
    # The outbox line follows the outbox counts, the inbox lines the inbox counts.
    assert lines[0].startswith("outbox: pending 1, published 0, dead 5;")
    assert lines[1].startswith("outbox: keys held")

    report = orjson.loads(run_relay("status", "--json").stdout)
    assert set(report) == {"outbox", "inbox"}
    assert set(report["outbox"]) == {"pending", "published", "dead", "oldest_pending_seconds"}
    assert set(report["inbox"]) == {"pending", "processed", "dead", "oldest_pending_seconds"}


def test_status_never_shows_the_database_password(database, run_relay):
    url = database.replace("postgres@", "postgres:pw-s3cret@")
    good = run_relay("status", env={"RELAY_DATABASE_URL": url})
    assert good.returncode == 0, good.stderr  # trust auth ignores the password
    unreachable = "postgresql://postgres:pw-s3cret@127.0.0.1:1/nowhere"
    bad = run_relay("status", env={"RELAY_DATABASE_URL": unreachable})
    assert bad.returncode == 1
    for result in (good, bad):
        assert "pw-s3cret" not in result.stdout + result.stderr


# --------------------------------------------------------------------------
# Handlers that hang
# --------------------------------------------------------------------------


async def test_async_handler_over_the_timeout_is_cancelled_and_fails_the_attempt(
    effects, rabbit, inbox
):
    inbox("--handler-timeout", "0.5", "--max-attempts", "2", handlers=MIXED_HANDLERS)
    await rabbit.publish("t", b'{"n": 1}', message_id="h-1", type="AsyncHang")
    await rabbit.publish("t", b'{"n": 2}', message_id="e-1", type="Effect")
    wait_until(lambda: (status_of(effects, "h-1") or ("",))[0] == "dead", timeout=30)
    _status, attempts, error = status_of(effects, "h-1")
    assert attempts == 2
    assert "did not finish within --handler-timeout 0.5s and was cancelled" in error
    # Its write rolled back with the cancelled attempt; the other row went on.
    wait_until(lambda: effect_ids(effects) == ["e-1"])


async def test_sync_handler_over_the_timeout_fails_the_attempt_when_it_returns(
    effects, rabbit, inbox
):
    # A sync handler cannot be interrupted: one that returns late (0.8 s of a
    # 0.5 s timeout, under the 1 s at which it would count as hung) fails.
    inbox("--handler-timeout", "0.5", "--max-attempts", "1")
    await rabbit.publish("t", b'{"n": 1, "seconds": 0.8}', message_id="s-1", type="Slow")
    await rabbit.publish("t", b'{"n": 2, "seconds": 0}', message_id="s-2", type="Slow")
    wait_until(lambda: (status_of(effects, "s-1") or ("",))[0] == "dead", timeout=30)
    _, attempts, error = status_of(effects, "s-1")
    assert attempts == 1
    # What it ran as measured: 0.8 s, more on a busy machine.
    ran = re.search(r"TimeoutError: handler ran (\d+\.\d)s, over --handler-timeout 0\.5s", error)
    assert ran is not None and float(ran.group(1)) >= 0.8, error
    # Its write rolled back with the failed attempt; the other row went on.
    wait_until(lambda: effect_ids(effects) == ["s-2"])


async def test_hung_sync_handler_counts_an_attempt_and_exits_for_a_restart(effects, rabbit, inbox):
    args = ("--handler-timeout", "1", "--max-attempts", "2")
    first = inbox(*args)
    await rabbit.publish(
        "t", b'{"n": 1}', message_id="hang-1", type="SyncHang", headers={"x-relay-key": "a"}
    )
    assert first.wait(60) == 1
    assert "handler hung: still running after" in first.log
    status, attempts, error = status_of(effects, "hang-1")
    assert (status, attempts) == ("pending", 1)
    assert "--handler-timeout 1s" in error
    assert effect_ids(effects) == []  # its write rolled back with the batch

    # The supervisor restarts it; the row hangs it once more, and is dead.
    second = inbox(*args)
    assert second.wait(60) == 1
    assert status_of(effects, "hang-1")[:2] == ("dead", 2)

    # The next start is not wedged: it handles other messages and stays up.
    third = inbox(*args)
    await rabbit.publish(
        "t", b'{"n": 2}', message_id="ok-1", type="Effect", headers={"x-relay-key": "a"}
    )
    wait_until(lambda: effect_ids(effects) == ["ok-1"], timeout=30)
    assert third.proc.poll() is None
    third.stop()
    assert third.proc.returncode == 0


async def test_sigterm_with_a_hung_handler_still_exits(effects, rabbit, inbox, dispatch):
    daemon = inbox("--handler-timeout", "30", "--shutdown-timeout", "1")
    await rabbit.publish("t", b'{"n": 1}', message_id="hang-1", type="SyncHang")
    if dispatch == "received":
        # The handler runs in the transaction that stores the row: once it
        # is in it, a stop leaves no row and the message in the queue.
        wait_until(lambda: sync_hang_holds_its_transaction(effects))
        daemon.signal(15)
        assert daemon.wait(30) == 0
        assert status_of(effects, "hang-1") is None
        await left_in_the_queue(effects, rabbit, daemon, "hang-1")
        return
    # The row stored and a dispatcher in its transaction (the receiver's
    # own INSERT is idle in transaction for a moment too, before the row).
    wait_until(
        lambda: (
            status_of(effects, "hang-1") is not None
            and rows(
                effects,
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() "
                "AND application_name = 'relay' "
                "AND state = 'idle in transaction'",
            )[0][0]
            > 0
        )
    )
    daemon.signal(15)
    assert daemon.wait(30) == 0
    # Nothing counted, nothing stuck: the row is pending for the next daemon.
    assert status_of(effects, "hang-1")[:2] == ("pending", 0)


# --------------------------------------------------------------------------
# Large and many
# --------------------------------------------------------------------------


async def test_ten_megabyte_message_is_stored_and_handled(effects, rabbit, inbox):
    inbox()
    blob = "x" * (10 * 1024 * 1024)
    body = orjson.dumps({"n": 1, "blob": blob})
    await rabbit.publish("t", body, message_id="big-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["big-1"], timeout=60)
    [(status, size)] = rows(
        effects,
        "SELECT status, octet_length(payload ->> 'blob') FROM inbox WHERE message_id = 'big-1'",
    )
    assert (status, size) == ("processed", len(blob))


async def test_json_with_invalid_utf8_is_kept_dead_and_the_rest_goes_on(effects, rabbit, inbox):
    inbox()
    bad = b'{"n": 1, "name": "caf\xe9"}'  # Latin-1, not UTF-8
    await rabbit.publish("t", bad, message_id="latin-1", type="Effect")
    await rabbit.publish("t", b'{"n": 2}', message_id="ok-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["ok-1"])
    [(status, payload, body, error)] = rows(
        effects, "SELECT status, payload, body, last_error FROM inbox WHERE message_id = 'latin-1'"
    )
    assert (status, payload, bytes(body)) == ("dead", None, bad)
    assert "UTF-8" in error or "not valid JSON" in error
    assert "inbox.body" in error


async def test_empty_body_is_kept_dead_and_the_rest_goes_on(effects, rabbit, inbox):
    # A delivery with no content frame at all (body size 0) next to a
    # multi-frame one (over the 128 KiB frame size) and a plain one.
    inbox()
    await rabbit.publish("t", b"", message_id="empty-1", type="Effect")
    await rabbit.publish(
        "t", orjson.dumps({"n": 1, "blob": "y" * 300_000}), message_id="frames-1", type="Effect"
    )
    await rabbit.publish("t", b'{"n": 2}', message_id="ok-2", type="Effect")
    wait_until(lambda: sorted(effect_ids(effects)) == ["frames-1", "ok-2"])
    [(status, body, error)] = rows(
        effects, "SELECT status, body, last_error FROM inbox WHERE message_id = 'empty-1'"
    )
    assert (status, bytes(body)) == ("dead", b"")
    assert "not valid JSON" in error
    [(size,)] = rows(
        effects, "SELECT octet_length(payload ->> 'blob') FROM inbox WHERE message_id = 'frames-1'"
    )
    assert size == 300_000


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


async def test_fifty_thousand_tiny_rows_from_one_transaction_drain_in_flat_memory(
    engine, rabbit, start_relay
):
    queue = await rabbit.queue("tiny.#")
    insert_outbox(engine, 50_000, topic="tiny.x", keys=500)
    daemon = start_relay("outbox", "--once", "--exchange", rabbit.exchange)
    peak = 0
    while daemon.proc.poll() is None:
        peak = max(peak, _rss_kib(daemon.proc.pid))
        await asyncio.sleep(0.05)
    assert daemon.proc.returncode == 0, daemon.log
    assert rows(engine, "SELECT status, count(*) FROM outbox GROUP BY status") == [
        ("published", 50_000)
    ]
    assert await queue_depth(rabbit, queue.name) == 50_000
    # Batches of --batch-size rows: the process never holds the backlog.
    # (A relay process starts at about 80 MiB; the bound is generous.)
    assert peak < 400 * 1024, f"peak RSS {peak} KiB"


async def test_payload_over_rabbitmqs_limit_is_dead_and_its_key_goes_on(engine, rabbit, run_relay):
    queue = await rabbit.queue("size.#")
    limit = 128 * 1024 * 1024
    with engine.begin() as conn:
        relay.enqueue(conn, "size.x", {"n": 1}, key="k")
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, key, payload) "
                "VALUES ('size.x', 'k', jsonb_build_object('blob', repeat('x', :n)))"
            ),
            {"n": limit},
        )
        relay.enqueue(conn, "size.x", {"n": 3}, key="k")
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange, timeout=120)
    assert result.returncode == 0, result.stderr
    got = await rabbit.drain(queue, 2)
    assert [orjson.loads(m.body)["n"] for m in got] == [1, 3]
    [(status, attempts, error)] = rows(
        engine, "SELECT status, attempts, last_error FROM outbox WHERE payload ? 'blob'"
    )
    assert (status, attempts) == ("dead", 1)
    assert f"payload is {limit + 11} bytes" in error
    assert f"message size limit ({limit} bytes)" in error


async def test_broker_refusing_a_message_as_too_big_fails_that_row_and_releases_the_rest(
    rabbit, monkeypatch
):
    """RabbitMQ closes the channel (PRECONDITION_FAILED) on a message over its
    max_message_size. With relay's own check above the broker's limit (as when
    an operator lowered max_message_size), the broker's refusal is what the
    publisher sees: the big row fails for good, the rest of the batch is
    released (no attempt), and the broker's limit is adopted."""
    from datetime import datetime

    from relay.brokers import Outcome
    from relay.brokers.amqp import publishing
    from relay.rows import Failure, OutboxRow
    from tests.conftest import AMQP_URL

    queue = await rabbit.queue("size.#")
    monkeypatch.setattr(publishing, "MAX_MESSAGE_SIZE", 1 << 30)
    publisher = publishing.AmqpPublisher(AMQP_URL, exchange=rabbit.exchange)
    limit = 128 * 1024 * 1024

    def row(n: int, payload: str) -> OutboxRow:
        return OutboxRow(
            id=str(uuid.uuid4()),
            seq=n,
            topic="size.x",
            key="k",
            type=None,
            payload=payload,
            headers="{}",
            created_at=datetime.now(UTC),
            attempts=0,
        )

    big = row(2, '"' + "x" * limit + '"')
    batch = [row(1, '{"n": 1}'), big, row(3, '{"n": 3}')]
    try:
        results = await publisher.publish(batch)
        assert results[0] is None
        assert isinstance(results[1], Failure) and results[1].permanent
        assert f"payload is {limit + 2} bytes" in results[1].error
        assert "the broker refused it" in results[1].error
        assert results[2] is Outcome.RELEASE
        assert publisher.max_message_size == limit

        # The next batch is checked before publishing: no channel is lost.
        # The row after it, of the same key, waits for the next batch (a row
        # that fails before it is sent holds its key's later rows back).
        results = await publisher.publish([big, batch[2]])
        assert isinstance(results[0], Failure) and results[0].permanent
        assert results[1] is Outcome.RELEASE
        assert await publisher.publish([batch[2]]) == [None]
        assert publisher.connected
    finally:
        await publisher.close()
    got = await rabbit.drain(queue, 2)
    assert [m.body for m in got] == [b'{"n":1}', b'{"n":3}']


async def test_integers_beyond_64_bits_cross_outbox_and_inbox_exactly(
    effects, rabbit, inbox, run_relay
):
    big = 123456789012345678901234567890
    inbox()
    with effects.begin() as conn:
        relay.enqueue(conn, "exact", {"n": 1, "big": big, "neg": -big, "small": 0.1}, type="Effect")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(lambda: len(effect_ids(effects)) == 1)
    [(payload,)] = rows(effects, "SELECT payload::text FROM inbox")
    assert str(big) in payload and f"-{big}" in payload


def test_big_integer_payload_body_is_exact_compact_json():
    from relay.brokers import row_body
    from relay.rows import OutboxRow

    def body(payload_text: str) -> bytes:
        row = OutboxRow(
            id=str(uuid.uuid4()),
            seq=1,
            topic="t",
            key=None,
            type=None,
            payload=payload_text,
            headers="{}",
            created_at=None,
            attempts=0,
        )
        return row_body(row)

    # As PostgreSQL renders jsonb: ", " and ": " between items.
    assert body('{"a": 123456789012345678901234567890, "s": "x, y: z", "f": 0.1}') == (
        b'{"a":123456789012345678901234567890,"s":"x, y: z","f":0.1}'
    )
    assert body('[1.000000000000000000001, "\\"q\\", \\\\", {"k": []}]') == (
        b'[1.000000000000000000001,"\\"q\\", \\\\",{"k":[]}]'
    )
    assert body('{"a": 1, "b": [true, null]}') == b'{"a":1,"b":[true,null]}'


# --------------------------------------------------------------------------
# Security
# --------------------------------------------------------------------------

# SQL built from strings: only these, each from constants, never from input.
_DYNAMIC_SQL_ALLOWED = {
    # relay.db.sql.claim fills the claim's {dead} slot from a fixed choice
    # (--on-dead), with str.replace; the LISTEN channel is a constant.
    ("relay/db/listener.py", 'f"LISTEN {self.channel}"'),
    # OutboxSession's simple-protocol commands: prepared once per connection,
    # then run with integers (int()) and UUIDs the claim returned (checked).
    (
        "relay/db/session.py",
        (
            '"PREPARE relay_claim(int, int, int, bigint, int) AS " + self._claim_sql\n'
            '                    + "; PREPARE relay_mark(uuid[]) AS " + MARK_PUBLISHED'
        ),
    ),
    # `claim`: EXECUTE relay_claim(the integers), or behind a pooler the
    # claim itself with those integers written in (relay.db.session._POOLED_SESSION).
    ("relay/db/session.py", 'f"BEGIN; {claim}"'),
    ("relay/db/session.py", "f\"EXECUTE relay_mark('{{{ids}}}'); COMMIT\""),
    (
        "relay/db/session.py",
        (
            'MARK_PUBLISHED.replace("$1", f"\'{{{ids}}}\'::uuid[]")\n'
            '                                   + "; COMMIT"'
        ),
    ),
    # relay.dead's statements are templates of relay/db/queries/dead.sql,
    # filled by relay.db.dead with table and column names from its fixed
    # COLUMNS and conditions of bound parameters (relay.db.dead.condition).
    # psycopg's own composition: the name quoted as an identifier.
    ("relay/db/connect.py", 'sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(name)))'),
}
_SQL_CALLS = {"execute", "exec_driver_sql", "text", "statement", "scalar", "scalars"}


def _dynamic(node: ast.expr) -> bool:
    if isinstance(node, ast.IfExp):
        return _dynamic(node.body) or _dynamic(node.orelse)
    return isinstance(node, (ast.JoinedStr, ast.BinOp)) or (
        isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "format"
    )


def _squeezed(segment: str) -> str:
    """The expression's text with its line breaks and indents as one space,
    so that the formatter's layout does not matter."""
    return " ".join(segment.split())


def test_every_value_in_sql_is_a_bound_parameter():
    """No SQL is assembled with f-strings, %, + or .format, except the
    allow-listed constants: values always travel as bound parameters."""
    found = set()
    for path in sorted((REPO / "relay").rglob("*.py")):
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name not in _SQL_CALLS:
                continue
            arg = node.args[0]
            if _dynamic(arg):
                segment = ast.get_source_segment(source, arg) or ""
                found.add((str(path.relative_to(REPO)), _squeezed(segment)))
    allowed = {(path, _squeezed(segment)) for path, segment in _DYNAMIC_SQL_ALLOWED}
    assert found <= allowed, found - allowed


def _http(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def test_http_port_serves_nothing_that_changes_state(engine, rabbit, start_relay):
    port = free_port()
    daemon = start_relay(
        "outbox",
        "--exchange",
        rabbit.exchange,
        "--http-port",
        str(port),
        env={"RELAY_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/"},
    )
    daemon.wait_for_log("outbox relay started", timeout=30)
    for method in (b"POST", b"PUT", b"DELETE", b"PATCH"):
        for path in (b"/healthz", b"/metrics", b"/retry", b"/"):
            reply = _http(
                port, method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
            )
            assert reply.startswith(b"HTTP/1.1 405"), (method, path, reply[:80])
    assert _http(port, b"GET /retry HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    metrics = _http(port, b"GET /metrics HTTP/1.1\r\n\r\n")
    assert b"relay_outbox_published_total" in metrics
    assert b"guest" not in metrics and b"postgres@" not in metrics
    assert daemon.proc.poll() is None


async def test_tables_live_where_the_search_path_in_the_url_puts_them(
    empty_database, rabbit, run_relay
):
    """Table names are fixed; their schema is the connection's search_path,
    which the database URL may set (`?options=-csearch_path%3Dapp`)."""
    queue = await rabbit.queue("sp.#")
    with psycopg.connect(empty_database.replace("+psycopg", "")) as conn:
        conn.execute("CREATE SCHEMA app")
    url = empty_database + "?options=-csearch_path%3Dapp"
    env = {"RELAY_DATABASE_URL": url}
    applied = run_relay("schema", "apply", env=env)
    assert applied.returncode == 0, applied.stderr
    with psycopg.connect(empty_database.replace("+psycopg", "")) as conn:
        assert conn.execute(
            "SELECT to_regclass('app.outbox') IS NOT NULL, to_regclass('public.outbox') IS NULL"
        ).fetchone() == (True, True)
        conn.execute("INSERT INTO app.outbox (topic, key, payload) VALUES ('sp.x', 'k', '1')")
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange, env=env)
    assert result.returncode == 0, result.stderr
    [message] = await rabbit.drain(queue, 1)
    assert message.body == b"1"
