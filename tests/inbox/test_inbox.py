"""`relay inbox` against the real PostgreSQL and RabbitMQ: the daemon with
its receiver process, its signals, commands and handler loading, and the
paths from end to end.

The loop's own behaviours (handlers' savepoints, retries, dead rows, what
the receiver stores) run in this process on the memory broker:
tests/inbox/test_loop.py.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import orjson
import pytest

import relay
from relay.inbox import DISPATCHERS
from relay.pacing import PACE_BATCHES
from tests.conftest import (
    HANDLERS,
    effect_ids,
    inbox_rows,
    process_gone,
    receiver_processes,
    rows,
    wait_until,
)
from tests.waits import wait_while_progressing


async def publish(rabbit, routing_key="orders.placed", body=b'{"n": 1}', **props):
    await rabbit.publish(routing_key, body, **props)


async def test_message_is_stored_handled_and_marked_processed(effects, rabbit, inbox):
    daemon = inbox()
    await publish(
        rabbit,
        body=b'{"n": 5}',
        message_id="m-1",
        type="Effect",
        headers={"x-relay-key": "order-5", "traceparent": "00-aa-bb-01"},
    )
    wait_until(lambda: effect_ids(effects) == ["m-1"])
    wait_until(lambda: inbox_rows(effects)[0][1] == "processed")
    [(message_id, status, attempts, error, type_, key, topic)] = inbox_rows(effects)
    assert (message_id, status, attempts, error) == ("m-1", "processed", 0, None)
    assert (type_, key, topic) == ("Effect", "order-5", "orders.placed")
    [(payload, headers, processed_at)] = rows(
        effects, "SELECT payload, headers, processed_at FROM inbox"
    )
    assert payload == {"n": 5}
    assert headers["traceparent"] == "00-aa-bb-01"
    assert processed_at is not None
    assert rows(effects, "SELECT n, key, traceparent FROM effects") == [
        (5, "order-5", "00-aa-bb-01")
    ]
    daemon.stop()
    assert daemon.proc.returncode == 0


async def test_same_message_three_times_to_three_inboxes_gives_one_row_and_one_effect(
    effects, rabbit, inbox
):
    daemons = [inbox() for _ in range(3)]
    for _ in range(3):
        await asyncio.gather(
            *[
                publish(rabbit, message_id=f"dup-{i}", type="Effect", body=b'{"n": %d}' % i)
                for i in range(20)
            ]
        )
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM inbox WHERE status = 'processed'")) == 20)
    time.sleep(1)  # any second effect would have landed by now
    assert sorted(effect_ids(effects)) == sorted(f"dup-{i}" for i in range(20))
    assert len(rows(effects, "SELECT 1 FROM inbox")) == 20
    # Every copy was acknowledged: the queue is empty.
    probe = await rabbit.connection.channel()

    async def depth() -> int:
        declared = await probe.declare_queue(daemons[0].queue, passive=True)
        return declared.declaration_result.message_count

    deadline = time.monotonic() + 10
    while await depth() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert await depth() == 0


async def test_receiver_stores_at_most_two_batches_per_dispatcher_ahead_of_slow_handlers(
    effects, rabbit, inbox, dispatch
):
    # Batches of 5, each handler 50 ms: the backlog stays in the broker,
    # where another daemon could take it, instead of piling up in the table.
    # Here, not in test_loop.py: `relay inbox`'s receiver process waits on a
    # LeadGate the daemon's Pace keeps up to date (relay.pacing), a path a
    # receiver on the daemon's own loop does not take.
    limit = PACE_BATCHES * DISPATCHERS * 5
    assert limit < 100 / 2  # else the bound below would not show pacing
    inbox("--batch-size", "5")
    await asyncio.gather(
        *[
            publish(
                rabbit, message_id=f"s-{i}", type="Slow", body=b'{"n": %d, "seconds": 0.05}' % i
            )
            for i in range(100)
        ]
    )
    most_pending = 0
    while True:
        [(stored, pending)] = rows(
            effects, "SELECT count(*), count(*) FILTER (WHERE status = 'pending') FROM inbox"
        )
        most_pending = max(most_pending, pending)
        if stored == 100 and pending == 0:
            break
        time.sleep(0.05)
    if dispatch == "received":
        # Each row is stored as its handler runs: none waits in the table.
        assert most_pending == 0
    else:
        # The limit, plus the batch taken while a dispatcher finished one.
        assert 0 < most_pending <= limit + 5
    assert sorted(effect_ids(effects)) == sorted(f"s-{i}" for i in range(100))


async def test_per_key_dispatch_order_with_three_inboxes(effects, rabbit, inbox):
    for _ in range(3):
        inbox("--batch-size", "20")
    for n in range(600):
        await publish(
            rabbit,
            message_id=f"o-{n}",
            type="Effect",
            body=orjson.dumps({"n": n}),
            headers={"x-relay-key": f"k{n % 12}"},
        )
    wait_until(lambda: len(effect_ids(effects)) == 600, timeout=60)
    last: dict[str, int] = {}
    for key, n in rows(effects, "SELECT key, n FROM effects ORDER BY at, id"):
        assert n > last.get(key, -1), f"{key}: {n} handled after {last[key]}"
        last[key] = n


async def test_two_inboxes_racing_behind_slow_handlers_handle_each_key_in_seq_order(
    effects, rabbit, inbox
):
    """Two daemons on one queue each get a share of every key, and a slow
    handler holds a key's rows back in one of them while the other has more
    of the key in hand: per key, the handlers run in the inbox's order of
    arrival (`seq`), the order that the table, `relay status` and replay
    show (the fault suite's slow_handler round found the receiving path
    numbering a batch before it waited for its keys)."""
    for _ in range(2):
        inbox("--batch-size", "10", "--prefetch", "10")
    count = 160
    for n in range(count):
        slow = n % 13 == 0
        await publish(
            rabbit,
            message_id=f"s-{n}",
            type="Slow" if slow else "Effect",
            body=orjson.dumps({"n": n, "seconds": 0.2} if slow else {"n": n}),
            headers={"x-relay-key": f"k{n % 4}"},
        )
    wait_until(lambda: len(effect_ids(effects)) == count, timeout=90)
    last: dict[str, int] = {}
    handled = rows(
        effects,
        "SELECT e.key, i.seq, e.message_id FROM effects e JOIN inbox i USING (message_id) "
        "ORDER BY e.id",
    )
    assert len(handled) == count
    for key, seq, message_id in handled:
        assert seq > last.get(key, -1), f"{key}: {message_id} (seq {seq}) after seq {last[key]}"
        last[key] = seq


async def test_kill_9_of_the_inbox_takes_its_receiver_process_along(effects, rabbit, inbox):
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    daemon.signal(signal.SIGKILL)
    daemon.wait()
    wait_until(lambda: process_gone(receiver), timeout=5, message="receiver process gone")
    # Nothing is left consuming the queue: a message stays there for the next daemon.
    probe = await rabbit.connection.channel()
    for _ in range(100):
        declared = await probe.declare_queue(daemon.queue, passive=True)
        if declared.declaration_result.consumer_count == 0:
            break
        await asyncio.sleep(0.05)
    assert declared.declaration_result.consumer_count == 0
    await publish(rabbit, message_id="after-kill", type="Effect")
    await asyncio.sleep(0.5)
    declared = await probe.declare_queue(daemon.queue, passive=True)
    assert declared.declaration_result.message_count == 1
    inbox()
    wait_until(lambda: effect_ids(effects) == ["after-kill"])


async def test_a_receiver_process_that_dies_stops_the_inbox_with_status_1(effects, rabbit, inbox):
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    os.kill(receiver, signal.SIGKILL)
    assert daemon.wait(30) == 1
    assert "the receiver process exited with status -9" in daemon.log
    inbox()  # the supervisor's restart
    await publish(rabbit, message_id="after-restart", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["after-restart"])


async def test_ctrl_c_reaching_both_processes_still_stops_cleanly(effects, rabbit, inbox):
    # A terminal sends SIGINT to the whole process group: the receiver
    # process leaves stopping to the daemon, which stops it in order.
    daemon = inbox()
    [receiver] = wait_until(lambda: receiver_processes(daemon.proc.pid))
    await publish(rabbit, message_id="before-stop", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["before-stop"])
    os.kill(receiver, signal.SIGINT)
    daemon.signal(signal.SIGINT)
    assert daemon.wait(30) == 0, daemon.log
    assert process_gone(receiver)
    assert "Traceback" not in daemon.log and "exited with status" not in daemon.log


async def test_status_and_retry_commands(effects, rabbit, inbox, run_relay):
    inbox("--max-attempts", "1")
    await publish(rabbit, message_id="s-1", type="AlwaysFails")
    await publish(rabbit, message_id="s-2", type="Effect")
    wait_until(lambda: sorted(r[1] for r in inbox_rows(effects)) == ["dead", "processed"])
    with effects.begin() as conn:
        relay.enqueue(conn, "t", {})
    result = run_relay("status", "--json")
    assert result.returncode == 0, result.stderr
    report = orjson.loads(result.stdout)
    assert report["inbox"] == {
        "pending": 0,
        "processed": 1,
        "dead": 1,
        "oldest_pending_seconds": None,
    }
    assert report["outbox"]["pending"] == 1
    assert report["outbox"]["oldest_pending_seconds"] >= 0
    text = run_relay("status")
    assert "inbox: pending 0, processed 1, dead 1" in text.stdout

    result = run_relay("retry", "inbox", "--id", "s-1", "--consumer", "someone-else")
    assert result.stdout.strip() == "retried 0 inbox rows"
    result = run_relay("retry", "inbox", "--all-dead")
    assert result.returncode == 0 and result.stdout.strip() == "retried 1 inbox row"
    # Retried and woken at once: it fails again (max-attempts 1) and is dead again.
    wait_until(
        lambda: (
            rows(effects, "SELECT attempts, status FROM inbox WHERE message_id = 's-1'")
            == [(1, "dead")]
        )
    )
    assert run_relay("retry", "outbox").returncode == 2
    bad = run_relay("retry", "outbox", "--id", "not-a-uuid")
    assert bad.returncode == 2 and "not-a-uuid" in bad.stderr


async def test_handlers_module_is_found_in_the_working_directory(
    effects, rabbit, relay_env, tmp_path
):
    """`relay inbox --handlers app_handlers` run from the app's own checkout
    finds app_handlers.py there, as Celery and uvicorn find theirs."""
    (tmp_path / "cwd_handlers.py").write_text(
        "import relay\nimport sqlalchemy as sa\nregistry = relay.HandlerRegistry()\n"
        "@registry.handler('CwdEffect')\n"
        "def effect(message, conn):\n"
        "    conn.execute(sa.text('INSERT INTO effects (message_id) VALUES (:m)'), "
        "{'m': message.id})\n"
    )
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)
    log = tmp_path / "inbox.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            # The console script, as users run it (`python -m` would put the
            # working directory on sys.path by itself).
            [
                str(Path(sys.executable).parent / "relay"),
                "inbox",
                "--queue",
                queue,
                "--exchange",
                rabbit.exchange,
                "--bind",
                "#",
                "--handlers",
                "cwd_handlers",
            ],
            env=relay_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        wait_while_progressing(
            lambda: "inbox started" in log.read_text(),
            proc,
            quiet=30,
            what="'inbox started' logged",
            log=log.read_text,
        )
        assert proc.poll() is None, log.read_text()
        await rabbit.publish("t", b"{}", message_id="cwd-1", type="CwdEffect")
        wait_until(lambda: effect_ids(effects) == ["cwd-1"])
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0


def test_handler_loading_errors_exit_2(run_relay):
    base = ["inbox", "--queue", "q"]
    cases = {
        "tests.apps.broken_handlers": "cannot import handler module 'tests.apps.broken_handlers'",
        "tests.apps.nope": "cannot import handler module 'tests.apps.nope'",
        "tests.apps.other_handlers:missing": "has no attribute 'missing'",
        "tests.apps.other_handlers:not_a_registry": "not a relay.HandlerRegistry",
    }
    for spec, expected in cases.items():
        result = run_relay(*base, "--handlers", spec)
        assert result.returncode == 2, (spec, result.stderr)
        assert expected in result.stderr, (spec, result.stderr)
        assert "Traceback" not in result.stderr
    clash = run_relay(*base, "--handlers", HANDLERS, "--handlers", "tests.apps.other_handlers")
    assert clash.returncode == 2
    assert "two handlers for message type 'Effect'" in clash.stderr
    assert "tests.apps.handlers.effect" in clash.stderr
    assert "tests.apps.other_handlers.clashing_effect" in clash.stderr


async def test_entry_point_registries_load_when_no_handlers_flag(
    effects, rabbit, inbox, tmp_path, relay_env
):
    dist = tmp_path / "orders_app-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: orders-app\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[relay.handlers]\norders = tests.apps.handlers:registry\n"
    )
    relay_env["PYTHONPATH"] = str(tmp_path)
    inbox(handlers=None)
    await publish(rabbit, message_id="ep-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["ep-1"])


async def test_outbox_to_inbox_end_to_end_carries_id_key_and_traceparent(
    effects, rabbit, inbox, run_relay
):
    inbox(bind="orders.#")
    with effects.begin() as conn:
        ids = [
            relay.enqueue(
                conn,
                "orders.placed",
                {"n": n},
                key="order-1",
                type="Effect",
                headers={"traceparent": f"00-{n:032x}-{n:016x}-01"},
            )
            for n in range(5)
        ]
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(lambda: len(effect_ids(effects)) == 5)
    got = rows(effects, "SELECT message_id, key, n, traceparent FROM effects ORDER BY id")
    assert [g[0] for g in got] == [str(i) for i in ids]
    assert [g[2] for g in got] == [0, 1, 2, 3, 4]
    assert all(g[1] == "order-1" and g[3].startswith("00-") for g in got)


def test_relay_message_is_importable_and_registry_rejects_bad_types():
    registry = relay.HandlerRegistry()
    with pytest.raises(ValueError):
        registry.handler("")
    assert (
        relay.Message(id=str(uuid.uuid4()), type="T", topic=None, key=None, payload={}).attempts
        == 0
    )


async def test_consumes_a_queue_declared_with_arguments_of_its_own(effects, rabbit, start_relay):
    queue_name = f"{rabbit.exchange}.quorum"
    rabbit.queues.append(queue_name)
    channel = await rabbit.connection.channel()
    await channel.declare_queue(queue_name, durable=True, arguments={"x-queue-type": "quorum"})
    await channel.close()
    daemon = start_relay(
        "inbox",
        "--queue",
        queue_name,
        "--exchange",
        rabbit.exchange,
        "--bind",
        "#",
        "--handlers",
        HANDLERS,
    )
    daemon.wait_for_log("inbox started")
    await publish(rabbit, message_id="q-1", type="Effect")
    wait_until(lambda: effect_ids(effects) == ["q-1"])
