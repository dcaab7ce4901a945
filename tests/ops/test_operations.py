"""Operations: shutdown, supervision, probes, metrics, retention, logs, systemd
notify and `relay demo`, against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import orjson
import psycopg
import pytest
import sqlalchemy as sa

import relay
from relay.db import RETENTION_LOCK
from relay.lifecycle import EXIT_FAILURE, EXIT_OK, Daemon, Service
from tests.conftest import (
    HANDLERS,
    PG_HOST,
    PG_PORT,
    free_port,
    insert_outbox,
    left_in_the_queue,
    receiver_processes,
    rows,
    sync_hang_holds_its_transaction,
    wait_until,
)
from tests.proxy import amqp_proxy, pg_proxy  # noqa: F401 - fixtures

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def http_status(port: int, path: str, method: str = "GET") -> int | None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def scrape(port: int) -> dict[str, float]:
    """/metrics as {'name{labels}': value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


def metric_is(port: int, name: str, value: float) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return scrape(port).get(name) == value
        except OSError:  # not listening yet
            return False

    return check


def json_lines(log: str) -> list[dict]:
    return [orjson.loads(line) for line in log.splitlines() if line.strip()]


def status_counts(engine: sa.Engine, table: str) -> dict[str, int]:
    return dict(rows(engine, f"SELECT status, count(*) FROM {table} GROUP BY status"))


def through(url: str, proxy) -> str:
    """The test database URL, through a proxy."""
    return url.replace(f"@{PG_HOST}:{PG_PORT}/", f"@127.0.0.1:{proxy.port}/")


# --------------------------------------------------------------------------
# SIGTERM: stop taking work, finish or release the batch, exit 0 in time
# --------------------------------------------------------------------------


async def test_sigterm_under_load_outbox_exits_0_in_time_and_a_rerun_finds_no_row_half_done(
    engine, rabbit, start_relay, run_relay
):
    queue = await rabbit.queue("load.#")
    insert_outbox(engine, 20000, topic="load.x", keys=40)
    daemon = start_relay(
        "outbox", "--exchange", rabbit.exchange, "--batch-size", "200", "--shutdown-timeout", "10"
    )
    wait_until(lambda: status_counts(engine, "outbox").get("published", 0) > 0, timeout=30)
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log
    assert time.monotonic() - started < 10
    assert "outbox: stopped" in daemon.log
    # Every row is either published (with its time) or untouched pending; none is locked.
    half_done = rows(
        engine,
        """
        SELECT count(*) FROM outbox
        WHERE NOT ((status = 'published' AND published_at IS NOT NULL)
                OR (status = 'pending' AND published_at IS NULL AND attempts = 0
                    AND last_error IS NULL))""",
    )
    assert half_done == [(0,)]
    with engine.begin() as conn:
        pending = conn.scalar(sa.text("SELECT count(*) FROM outbox WHERE status = 'pending'"))
        claimable = conn.scalar(
            sa.text(
                "SELECT count(*) FROM (SELECT id FROM outbox WHERE status = 'pending' "
                "FOR UPDATE SKIP LOCKED) t"
            )
        )
    assert claimable == pending
    # A rerun publishes the rest: every row published, every id on the wire.
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange, timeout=120)
    assert result.returncode == 0, result.stderr
    assert status_counts(engine, "outbox") == {"published": 20000}
    declared = await queue.declare()
    assert declared.message_count >= 20000


async def test_sigterm_under_load_inbox_exits_0_in_time_and_a_rerun_finds_no_row_half_done(
    effects, rabbit, inbox, run_relay
):
    first = inbox("--batch-size", "50", "--shutdown-timeout", "10", bind="load.#")
    insert_outbox(effects, 3000, topic="load.x", keys=30, type="Effect")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(lambda: status_counts(effects, "inbox").get("processed", 0) > 100, timeout=60)
    started = time.monotonic()
    first.signal(signal.SIGTERM)
    assert first.wait(30) == 0, first.log
    assert time.monotonic() - started < 10
    # A handler's effect exists exactly when its row is processed.
    assert rows(
        effects,
        """
        SELECT count(*) FROM effects e JOIN inbox i USING (message_id)
        WHERE i.status <> 'processed'""",
    ) == [(0,)]
    assert rows(effects, "SELECT count(*), count(DISTINCT message_id) FROM effects") == [
        (status_counts(effects, "inbox")["processed"],) * 2
    ]
    assert rows(effects, "SELECT count(*) FROM inbox WHERE attempts > 0 OR status = 'dead'") == [
        (0,)
    ]
    inbox(bind="load.#")
    wait_until(lambda: status_counts(effects, "inbox") == {"processed": 3000}, timeout=120)
    assert rows(effects, "SELECT count(*), count(DISTINCT message_id) FROM effects") == [
        (3000, 3000)
    ]


@pytest.mark.parametrize("dispatch", ["received", "stored"])
async def test_sigterm_releases_a_sync_handler_that_overruns_the_shutdown_timeout(
    effects, rabbit, inbox, dispatch
):
    daemon = inbox("--shutdown-timeout", "3", "--handler-timeout", "60")
    await rabbit.publish("hang", b"{}", message_id="h-1", type="SyncHang")
    # The handler has written its effect and now blocks its thread.
    wait_until(lambda: sync_hang_holds_its_transaction(effects), timeout=30)
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log
    # Within the timeout, plus the interpreter's own start-to-exit slack.
    assert time.monotonic() - started < 3 + 1.5
    assert "releasing it" in daemon.log
    if dispatch == "received":
        await left_in_the_queue(effects, rabbit, daemon, "h-1")
        return
    # Released: rolled back, no attempt counted, claimable at once.
    wait_until(
        lambda: (
            rows(effects, "SELECT status, attempts FROM inbox FOR UPDATE SKIP LOCKED")
            == [("pending", 0)]
        )
    )
    assert rows(effects, "SELECT count(*) FROM effects") == [(0,)]


@pytest.mark.parametrize("dispatch", ["received", "stored"])
async def test_a_second_signal_exits_at_once_with_130(effects, rabbit, inbox, dispatch):
    daemon = inbox("--shutdown-timeout", "60", "--handler-timeout", "60")
    await rabbit.publish("hang", b"{}", message_id="h-2", type="SyncHang")
    wait_until(lambda: sync_hang_holds_its_transaction(effects), timeout=30)
    daemon.signal(signal.SIGTERM)
    daemon.wait_for_log("stopping")
    started = time.monotonic()
    daemon.signal(signal.SIGINT)
    assert daemon.wait(30) == 130
    assert time.monotonic() - started < 5
    if dispatch == "received":
        await left_in_the_queue(effects, rabbit, daemon, "h-2")
        return
    wait_until(
        lambda: (
            rows(effects, "SELECT status, attempts FROM inbox FOR UPDATE SKIP LOCKED")
            == [("pending", 0)]
        )
    )


# --------------------------------------------------------------------------
# Supervision
# --------------------------------------------------------------------------


def _service(main=None, stop=None, **kwargs) -> tuple[Service, asyncio.Event]:
    stopped = asyncio.Event()

    async def default_main(started) -> None:
        started()
        await stopped.wait()

    return Service(
        name="test", main=main or default_main, stop=stop or stopped.set, **kwargs
    ), stopped


async def test_a_background_task_that_dies_stops_the_daemon_with_exit_status_1():
    async def crash(stop: asyncio.Event) -> None:
        await asyncio.sleep(0.2)
        raise RuntimeError("listener lost its mind")

    service, stopped = _service(background={"listener": crash})
    daemon = Daemon("test", [service], shutdown_timeout=5)
    assert await asyncio.wait_for(daemon.run(), 10) == EXIT_FAILURE
    assert stopped.is_set()  # the main loop was asked to stop, and did
    assert not daemon.alive()


async def test_a_crashed_main_loop_exits_1_and_stops_the_background_tasks():
    background_cancelled = asyncio.Event()

    async def main(started) -> None:
        started()
        await asyncio.sleep(0.2)
        raise ValueError("bug")

    async def listener(stop: asyncio.Event) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            background_cancelled.set()

    service, _ = _service(main=main, background={"listener": listener})
    assert await asyncio.wait_for(Daemon("test", [service], 5).run(), 10) == EXIT_FAILURE
    assert background_cancelled.is_set()


async def test_stop_releases_a_batch_that_overruns_the_shutdown_timeout():
    cancelled = asyncio.Event()

    async def main(started) -> None:
        started()
        try:
            await asyncio.sleep(3600)  # a batch that ignores the stop request
        except asyncio.CancelledError:
            cancelled.set()
            raise

    service, _ = _service(main=main, stop=lambda: None)
    daemon = Daemon("test", [service], shutdown_timeout=1)
    task = asyncio.ensure_future(daemon.run())
    await asyncio.wait_for(daemon.started_event.wait(), 5)
    began = time.monotonic()
    daemon.request_stop("test")
    assert await asyncio.wait_for(task, 10) == EXIT_OK
    assert time.monotonic() - began < 1.5
    assert cancelled.is_set() and daemon.released


@pytest.mark.parametrize("table", ["outbox", "inbox"])
async def test_a_main_loop_that_crashes_for_real_exits_1(
    table, effects, rabbit, inbox, start_relay
):
    if table == "outbox":
        daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--poll-interval", "0.2")
        daemon.wait_for_log("outbox relay started", timeout=30)
    else:
        daemon = inbox()
    # Not an outage: the table is gone, which no retry can fix.
    rows(effects, f"ALTER TABLE {table} RENAME TO {table}_gone")
    assert daemon.wait(60) == EXIT_FAILURE
    assert "main loop crashed" in daemon.log and "UndefinedTable" in daemon.log


# --------------------------------------------------------------------------
# Probes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["outbox", "inbox"])
async def test_probes_flip_when_the_database_or_broker_goes_away_and_come_back(
    kind, effects, database, rabbit, pg_proxy, amqp_proxy, start_relay
):
    port = free_port()
    queue = await rabbit.queue("probe.#")
    env = {
        "RELAY_DATABASE_URL": through(database, pg_proxy),
        "RELAY_BROKER_URL": f"amqp://guest:guest@127.0.0.1:{amqp_proxy.port}/",
    }
    args = ["--exchange", rabbit.exchange, "--http-port", str(port), "--poll-interval", "0.5"]
    if kind == "inbox":
        inbox_queue = f"{rabbit.exchange}.in"
        rabbit.queues.append(inbox_queue)
        args = ["--queue", inbox_queue, "--bind", "probe.#", "--handlers", HANDLERS, *args]
    daemon = start_relay(kind, *args, env=env)
    wait_until(lambda: http_status(port, "/readyz") == 200, timeout=30, message="ready")
    assert http_status(port, "/healthz") == 200
    for proxy in (pg_proxy, amqp_proxy):
        proxy.stop()
        wait_until(lambda: http_status(port, "/readyz") == 503, timeout=30, message="not ready")
        # Liveness does not depend on the servers: an outage must not restart relay.
        assert http_status(port, "/healthz") == 200
        proxy.start()
        wait_until(lambda: http_status(port, "/readyz") == 200, timeout=60, message="ready")
    # And it works again.
    if kind == "outbox":
        with effects.begin() as conn:
            relay.enqueue(conn, "probe.x", {"n": 1}, type="Effect")
        [message] = await rabbit.drain(queue, 1, timeout=30)
        assert message.body == b'{"n":1}'
    else:
        await rabbit.publish("probe.x", b'{"n": 2}', message_id="p-1", type="Effect")
        wait_until(
            lambda: rows(effects, "SELECT status FROM inbox") == [("processed",)], timeout=60
        )
    daemon.stop()
    assert daemon.proc.returncode == 0


async def test_healthz_turns_503_when_a_started_loop_stalls_while_its_servers_answer():
    port = free_port()
    clock = {"progress": time.monotonic(), "ready": True}

    async def ready() -> bool:
        return clock["ready"]

    service, _ = _service(ready=ready, progress=lambda: clock["progress"], stall_after=0.3)
    daemon = Daemon("test", [service], shutdown_timeout=5, http_port=port)
    task = asyncio.ensure_future(daemon.run())
    await asyncio.wait_for(daemon.started_event.wait(), 5)
    get = lambda path: asyncio.to_thread(http_status, port, path)  # noqa: E731
    assert await get("/healthz") == 200
    await asyncio.sleep(0.5)
    assert await get("/healthz") == 503  # stuck although the servers answer
    assert await get("/readyz") == 200
    clock["ready"] = False
    assert await get("/healthz") == 200  # waiting for a server is not stuck
    assert await get("/readyz") == 503
    clock["ready"] = True
    clock["progress"] = time.monotonic()
    assert await get("/healthz") == 200
    daemon.request_stop("test")
    assert await asyncio.wait_for(task, 10) == EXIT_OK


async def test_http_serves_get_and_head_on_three_paths_and_nothing_else():
    port = free_port()

    async def main(started) -> None:
        started()
        await stopped.wait()

    stopped = asyncio.Event()
    service = Service(
        name="test",
        main=main,
        stop=stopped.set,
        metrics=lambda: b"m 1.0\n",
        ready=lambda: asyncio.sleep(0, True),
    )
    daemon = Daemon("test", [service], shutdown_timeout=5, http_port=port)
    task = asyncio.ensure_future(daemon.run())
    await asyncio.wait_for(daemon.started_event.wait(), 5)
    status = lambda *args: asyncio.to_thread(http_status, port, *args)  # noqa: E731
    for path in ("/healthz", "/readyz", "/metrics"):
        assert await status(path) == 200
        assert await status(path, "HEAD") == 200
        for method in ("POST", "PUT", "DELETE"):
            assert await status(path, method) == 405
    assert await status("/") == 404
    assert await status("/admin") == 404
    daemon.request_stop("test")
    assert await asyncio.wait_for(task, 10) == EXIT_OK
    assert await status("/healthz") is None  # closed with the daemon


# --------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------


async def test_outbox_metrics_after_a_known_workload(engine, rabbit, start_relay):
    await rabbit.queue("m.#")
    insert_outbox(engine, 50, topic="m.x", keys=5)
    with engine.begin() as conn:  # a row no broker can carry: failed once, dead at once
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, payload, headers) VALUES ('m.x', '{}', '{\"n\": 1}')"
            )
        )
    port = free_port()
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--http-port", str(port))
    wait_until(metric_is(port, "relay_outbox_published_total", 50.0), timeout=30)
    # The backlog gauges refresh every 5 s.
    wait_until(metric_is(port, "relay_outbox_pending", 0.0), timeout=30)
    metrics = scrape(port)
    assert metrics["relay_outbox_failed_total"] == 1.0
    assert metrics["relay_outbox_dead_total"] == 1.0
    assert metrics["relay_outbox_oldest_pending_seconds"] == 0.0
    assert metrics["relay_outbox_deleted_total"] == 0.0
    assert metrics["relay_outbox_broker_blocked"] == 0.0
    assert metrics["relay_ready"] == 1.0  # /readyz's answer (monitoring/alerts.yml)
    assert metrics["relay_outbox_publish_seconds_count"] >= 1
    assert (
        metrics['relay_outbox_publish_seconds_bucket{le="+Inf"}']
        == (metrics["relay_outbox_publish_seconds_count"])
    )
    text = scrape_text(port)
    assert "# TYPE relay_outbox_publish_seconds histogram" in text
    assert "# TYPE relay_outbox_published_total counter" in text
    assert "# TYPE relay_outbox_pending gauge" in text
    # Every batch done: no claimed row's bytes held (issue 43's gauge).
    assert "# TYPE relay_outbox_claimed_bytes gauge" in text
    assert metrics["relay_outbox_claimed_bytes"] == 0.0
    # A backlog shows up in the gauges: rows not due yet stay pending.
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, payload, created_at, available_at) "
                "SELECT 'm.x', '{}', now() - interval '1 minute', now() + interval '1 hour' "
                "FROM generate_series(1, 3)"
            )
        )
    wait_until(metric_is(port, "relay_outbox_pending", 3.0), timeout=30)
    assert scrape(port)["relay_outbox_oldest_pending_seconds"] >= 60
    daemon.stop()


async def test_inbox_metrics_after_a_known_workload(effects, rabbit, inbox):
    port = free_port()
    inbox("--http-port", str(port), "--max-attempts", "2")
    for n in range(10):
        await rabbit.publish("m.x", orjson.dumps({"n": n}), message_id=f"m-{n}", type="Effect")
    for n in (3, 7):  # duplicates: the broker delivers, the inbox drops
        await rabbit.publish("m.x", orjson.dumps({"n": n}), message_id=f"m-{n}", type="Effect")
    await rabbit.publish("m.x", b"{}", message_id="f-1", type="AlwaysFails")
    wait_until(metric_is(port, "relay_inbox_processed_total", 10.0), timeout=30)
    wait_until(metric_is(port, "relay_inbox_dead_total", 1.0), timeout=30)
    wait_until(metric_is(port, "relay_inbox_pending", 0.0), timeout=30)
    metrics = scrape(port)
    assert metrics["relay_inbox_received_total"] == 13.0
    assert metrics["relay_inbox_duplicates_total"] == 2.0
    assert metrics["relay_inbox_failed_total"] == 2.0  # two runs of AlwaysFails
    # Every handler run: 10 + 2 failed, and any rolled back with its batch
    # when AlwaysFails failed after them (to run again).
    assert metrics["relay_inbox_handler_seconds_count"] == (
        12.0 + metrics["relay_inbox_handler_reruns_total"]
    )
    assert metrics["relay_inbox_oldest_pending_seconds"] == 0.0
    assert "# TYPE relay_inbox_handler_seconds histogram" in scrape_text(port)
    assert metrics["relay_ready"] == 1.0
    assert rows(
        effects, "SELECT count(DISTINCT message_id) FROM effects WHERE message_id LIKE 'm-%'"
    ) == [(10,)]


# --------------------------------------------------------------------------
# Retention
# --------------------------------------------------------------------------


def _outbox_ages(engine: sa.Engine) -> None:
    """1500 old published rows (deleted), and rows that must stay."""
    insert_outbox(engine, 1500, topic="old")
    rows(
        engine,
        "UPDATE outbox SET status = 'published', "
        "published_at = now() - interval '2 hours' WHERE topic = 'old'",
    )
    for topic, status, age in [
        ("young", "published", "10 minutes"),
        ("waiting", "pending", None),
        ("dead", "dead", None),
    ]:
        insert_outbox(engine, 2, topic=topic)
        rows(
            engine,
            "UPDATE outbox SET status = :status, created_at = now() - interval '3 hours', "
            "available_at = now() + interval '1 day', "
            "published_at = now() - CAST(:age AS interval) WHERE topic = :topic",
            status=status,
            age=age or "3 hours",
            topic=topic,
        )


async def test_outbox_retention_deletes_old_published_rows_and_nothing_more(
    engine, rabbit, start_relay
):
    _outbox_ages(engine)
    port = free_port()
    daemon = start_relay(
        "outbox", "--exchange", rabbit.exchange, "--retention", "1h", "--http-port", str(port)
    )
    wait_until(
        lambda: rows(engine, "SELECT count(*) FROM outbox WHERE topic = 'old'") == [(0,)],
        timeout=60,
        message="old published rows deleted",
    )
    assert rows(engine, "SELECT topic, status, count(*) FROM outbox GROUP BY 1, 2 ORDER BY 1") == [
        ("dead", "dead", 2),
        ("waiting", "pending", 2),
        ("young", "published", 2),
    ]
    daemon.wait_for_log("retention deleted 1500 outbox rows older than 3600s")
    assert scrape(port)["relay_outbox_deleted_total"] == 1500.0
    daemon.stop()


async def test_inbox_retention_deletes_old_processed_rows_and_nothing_more(effects, inbox):
    rows(
        effects,
        """
        INSERT INTO inbox (consumer, message_id, topic, payload, status, processed_at,
                           received_at, available_at)
        SELECT 'c', t || '-' || i, t, '{}', s, now() - CAST(a AS interval),
               now() - interval '3 hours', now() + interval '1 day'
        FROM (VALUES ('old', 'processed', '8 days', 1200), ('young', 'processed', '1 hour', 2),
                     ('waiting', 'pending', '9 days', 2), ('dead', 'dead', '9 days', 2))
             AS v(t, s, a, n), generate_series(1, v.n) AS i""",
    )
    daemon = inbox("--retention", "7d")
    wait_until(
        lambda: rows(effects, "SELECT count(*) FROM inbox WHERE topic = 'old'") == [(0,)],
        timeout=60,
        message="old processed rows deleted",
    )
    assert rows(effects, "SELECT topic, status, count(*) FROM inbox GROUP BY 1, 2 ORDER BY 1") == [
        ("dead", "dead", 2),
        ("waiting", "pending", 2),
        ("young", "processed", 2),
    ]
    daemon.wait_for_log("retention deleted 1200 inbox rows")


async def test_retention_skips_while_another_replica_holds_the_lock(
    engine, database, rabbit, start_relay
):
    _outbox_ages(engine)
    with psycopg.connect(database.replace("+psycopg", ""), autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (RETENTION_LOCK["outbox"],))
        daemon = start_relay(
            "outbox", "--exchange", rabbit.exchange, "--retention", "1h", "--log-level", "DEBUG"
        )
        daemon.wait_for_log("another replica is deleting outbox rows", timeout=60)
        assert rows(engine, "SELECT count(*) FROM outbox WHERE topic = 'old'") == [(1500,)]
    daemon.stop()


# --------------------------------------------------------------------------
# Logs and secrets
# --------------------------------------------------------------------------


async def test_json_logs_carry_ids_topic_action_and_the_handlers_own_lines_the_traceparent(
    effects, rabbit, inbox, run_relay
):
    daemon = inbox("--log-format", "json", "--max-attempts", "1", bind="logs.#")
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with effects.begin() as conn:
        message_id = relay.enqueue(
            conn, "logs.x", {"n": 1}, type="Logs", headers={"traceparent": traceparent}
        )
        failing_id = relay.enqueue(conn, "logs.y", {}, type="AlwaysFails")
        unroutable_id = relay.enqueue(conn, "nowhere", {})
    outbox = run_relay(
        "outbox",
        "--once",
        "--exchange",
        rabbit.exchange,
        "--log-format",
        "json",
        "--max-attempts",
        "1",
        "--on-unroutable",
        "fail",
    )
    assert outbox.returncode == 0, outbox.stderr
    outbox_lines = json_lines(outbox.stderr)
    [failed] = [line for line in outbox_lines if line.get("action") == "publish_failed"]
    assert failed["message_id"] == str(unroutable_id) and failed["topic"] == "nowhere"
    assert {"time", "level", "logger", "message"} <= set(failed)
    assert any(line.get("action") == "started" for line in outbox_lines)

    wait_until(lambda: "handler_failed" in daemon.log and "handling" in daemon.log, timeout=30)
    inbox_lines = json_lines(daemon.log)  # every line is one JSON object
    runs = [line for line in inbox_lines if line["message"] == "handling"]
    # Twice if AlwaysFails failed after it in one batch (rolled back, run again).
    assert len(runs) in (1, 2)
    for handling in runs:
        assert handling["logger"] == "tests.apps"
        assert handling["traceparent"] == traceparent  # from the outbox row, via the headers
        assert handling["message_id"] == str(message_id)
        assert handling["type"] == "Logs" and handling["topic"] == "logs.x"
    [failure] = [line for line in inbox_lines if line.get("action") == "handler_failed"]
    assert failure["message_id"] == str(failing_id) and failure["topic"] == "logs.y"
    # Outside a handler, no message fields leak into unrelated lines.
    assert all(
        "traceparent" not in line
        for line in inbox_lines
        if line.get("action") in ("started", "stopping")
    )


async def test_no_password_in_any_log_line_or_metric(
    database, engine, rabbit, start_relay, run_relay
):
    secret = "Hunter2-S3cret:p@ss/wd"
    quoted = urllib.parse.quote(secret, safe="")
    db = database.replace("//postgres@", f"//postgres:{quoted}@")
    assert db != database
    await rabbit.queue("s.#")
    with engine.begin() as conn:
        relay.enqueue(conn, "s.x", {"n": 1}, type="AlwaysFails")
        relay.enqueue(conn, "unbound", {"n": 2})
    env = {"RELAY_DATABASE_URL": db, "RELAY_LOG_LEVEL": "DEBUG"}
    outbox_port, inbox_port = free_port(), free_port()
    logs = []
    for fmt in ("json", "text"):
        result = run_relay(
            "outbox", "--once", "--exchange", rabbit.exchange, "--log-format", fmt, env=env
        )
        assert result.returncode == 0, result.stderr
        logs.append(result.stderr)
    outbox = start_relay(
        "outbox", "--exchange", rabbit.exchange, "--http-port", str(outbox_port), env=env
    )
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)
    daemon = start_relay(
        "inbox",
        "--queue",
        queue,
        "--exchange",
        rabbit.exchange,
        "--bind",
        "s.#",
        "--handlers",
        HANDLERS,
        "--http-port",
        str(inbox_port),
        "--max-attempts",
        "1",
        env=env,
    )
    daemon.wait_for_log("inbox started", timeout=30)
    await rabbit.publish("s.x", b'{"n": 3}', message_id="s-1", type="AlwaysFails")
    wait_until(lambda: "handler_failed" in daemon.log, timeout=30)
    for port in (outbox_port, inbox_port):
        wait_until(lambda: http_status(port, "/metrics") == 200, timeout=30)  # noqa: B023
    metrics = scrape_text(outbox_port) + scrape_text(inbox_port)
    # The receiver process gets the settings over a socket, not its command line.
    [receiver] = receiver_processes(daemon.proc.pid)
    cmdline = Path(f"/proc/{receiver}/cmdline").read_bytes().decode()
    assert "relay.receiver_process" in cmdline
    assert "S3cret" not in cmdline and "postgres" not in cmdline
    # The broker goes away: reconnect warnings carry the URL, masked.
    unreachable = start_relay(
        "outbox", env={**env, "RELAY_BROKER_URL": f"amqp://relay:{quoted}@127.0.0.1:1/"}
    )
    unreachable.wait_for_log("retrying in", timeout=30)
    for proc in (outbox, daemon, unreachable):
        proc.stop()
        logs.append(proc.log)
    text = "\n".join(logs) + metrics
    assert "Traceback" in text  # the failing handler's traceback was logged at DEBUG/WARNING
    for form in (secret, quoted, "S3cret", "guest:guest@"):
        assert form not in text, form
    assert "***" in text


# --------------------------------------------------------------------------
# systemd notify
# --------------------------------------------------------------------------


def _receive(sock: socket.socket, seconds: float) -> list[str]:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
    return got


async def test_systemd_notify_ready_once_connected_then_watchdog_pings(
    database, rabbit, pg_proxy, start_relay
):
    directory = tempfile.mkdtemp(prefix="relay-n", dir="/tmp")  # short: AF_UNIX paths
    path = os.path.join(directory, "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    try:
        pg_proxy.stop()  # the database is away at start-up
        daemon = start_relay(
            "outbox",
            "--exchange",
            rabbit.exchange,
            env={
                "RELAY_DATABASE_URL": through(database, pg_proxy),
                "NOTIFY_SOCKET": path,
                "WATCHDOG_USEC": "1000000",
            },
        )
        daemon.wait_for_log("retrying in", timeout=30)
        assert "READY=1" not in _receive(sock, 1.5)
        pg_proxy.start()
        got: list[str] = []
        wait_until(
            lambda: got.extend(_receive(sock, 0.5)) or "READY=1" in got,
            timeout=60,
            message="READY=1",
        )
        # READY=1 goes out just before the line is written.
        daemon.wait_for_log("outbox relay started", timeout=10)
        later = _receive(sock, 2.5)
        assert later.count("WATCHDOG=1") >= 2  # every 0.5 s: half of WATCHDOG_USEC
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
        assert "STOPPING=1" in _receive(sock, 0.5) + later
    finally:
        sock.close()
        os.unlink(path)
        os.rmdir(directory)


# --------------------------------------------------------------------------
# relay demo
# --------------------------------------------------------------------------


async def test_relay_demo_runs_its_duration_showing_messages_flowing(engine, rabbit, run_relay):
    queue = f"{rabbit.exchange}.demo"
    rabbit.queues.append(queue)
    result = run_relay(
        "demo",
        "--duration",
        "5",
        "--rate",
        "50",
        "--exchange",
        rabbit.exchange,
        "--queue",
        queue,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if re.search(r"produced +\d+/s", line)]
    assert len(lines) >= 3, result.stdout
    assert all(
        "published" in line and "handled" in line and "backlog: outbox" in line for line in lines
    )
    assert any(re.search(r"handled +[1-9]\d*/s", line) for line in lines), result.stdout
    [(handled, consumers, traced)] = rows(
        engine,
        "SELECT count(*), count(DISTINCT consumer), count(traceparent) FROM relay_demo_events",
    )
    assert handled > 0 and consumers == 1 and traced == handled
    assert rows(engine, "SELECT DISTINCT consumer FROM relay_demo_events") == [(queue,)]
    assert "relay demo: produced" in result.stdout


def test_relay_demo_producer_only_needs_no_broker(engine, run_relay):
    result = run_relay(
        "demo", "--producer-only", "--duration", "2", "--rate", "20", env={"RELAY_BROKER_URL": ""}
    )
    assert result.returncode == 0, result.stderr
    assert "produced" in result.stdout
    [(count, types)] = rows(engine, "SELECT count(*), array_agg(DISTINCT type) FROM outbox")
    assert count > 0 and types == ["DemoEvent"]
