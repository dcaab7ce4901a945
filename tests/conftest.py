"""Fixtures: a fresh database per test (cloned from a template made once per
run), unique RabbitMQ names per test, and helpers to run `relay` as a
subprocess, the way users and the acceptance suite do.

The servers are real. Without them a run on a laptop skips the tests that
need them; under CI (CI=true) an unreachable server fails the run instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest
import sqlalchemy as sa

from tests.waits import wait_while_progressing

PG_HOST = os.environ.get("RELAY_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("RELAY_TEST_PG_PORT", "5432"))
PG_USER = os.environ.get("RELAY_TEST_PG_USER", "postgres")
AMQP_URL = os.environ.get("RELAY_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
RELAY = [sys.executable, "-m", "relay.cli"]
REPO = Path(__file__).resolve().parent.parent


def pg_url(dbname: str, driver: str = "postgresql+psycopg") -> str:
    return f"{driver}://{PG_USER}@{PG_HOST}:{PG_PORT}/{dbname}"


def _reachable(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=2):
        return True
    return False


def _require(host: str, port: int, what: str) -> None:
    if _reachable(host, port):
        return
    message = f"{what} is not reachable at {host}:{port}"
    if os.environ.get("CI"):
        pytest.fail(message + " (CI must provide it)")
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests that ask for more than the default time-out go first: run
    in parallel (pytest-xdist, pyproject.toml), each starts on a worker of
    its own at once, rather than one of them last while the others idle."""

    def timeout(item: pytest.Item) -> float:
        marker = item.get_closest_marker("timeout")
        return float(marker.args[0]) if marker is not None and marker.args else 0.0

    items.sort(key=timeout, reverse=True)  # stable: the rest keep their order


# --------------------------------------------------------------------------
# PostgreSQL: one template per run, one clone per test
# --------------------------------------------------------------------------


def _admin() -> psycopg.Connection:
    return psycopg.connect(
        host=PG_HOST, port=PG_PORT, user=PG_USER, dbname="postgres", autocommit=True
    )


def drop_database(name: str) -> None:
    with _admin() as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def template_db() -> Iterator[str]:
    _require(PG_HOST, PG_PORT, "PostgreSQL")
    name = f"relay_tpl_{os.getpid()}"
    drop_database(name)
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    result = subprocess.run(
        [*RELAY, "schema", "apply", "--database-url", pg_url(name, "postgresql")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    yield name
    drop_database(name)


@pytest.fixture
def database(template_db: str) -> Iterator[str]:
    """A database with the relay schema applied, only for this test; its URL."""
    name = f"relay_t_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield pg_url(name)
    drop_database(name)


@pytest.fixture
def empty_database() -> Iterator[str]:
    """A database without the relay schema; its URL."""
    _require(PG_HOST, PG_PORT, "PostgreSQL")
    name = f"relay_e_{uuid.uuid4().hex[:12]}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    yield pg_url(name)
    drop_database(name)


@pytest.fixture
def loop_urls(database: str) -> dict[str, str]:
    """The database settings (database_url, listen_url) of a loop run in the
    test's process (tests/inbox/test_loop.py): the test's database;
    tests/db/test_pgbouncer.py puts PgBouncer in between."""
    return {"database_url": database}


@pytest.fixture
def engine(database: str) -> Iterator[sa.Engine]:
    eng = sa.create_engine(database)
    yield eng
    eng.dispose()


def rows(engine: sa.Engine, sql: str, **params: Any) -> list[sa.Row[Any]]:
    """Run one statement in its own transaction; its rows (none for a plain write)."""
    with engine.begin() as conn:
        result = conn.execute(sa.text(sql), params)
        return list(result) if result.returns_rows else []


def keys_by_share(engine: sa.Engine, shares: int) -> dict[int, list[str]]:
    """Keys 'key-1' … 'key-1000' by the share of `shares` workers (outbox) or
    dispatchers (inbox) that claims them, hashed as the claims hash them."""
    by_share: dict[int, list[str]] = {}
    for key, hashed in rows(
        engine,
        "SELECT k, hashtext(k) & 2147483647 "
        "FROM (SELECT 'key-' || i AS k "
        "FROM generate_series(1, 1000) i) c",
    ):
        # Share w takes the hashes in [(w << 31) // shares, ((w + 1) << 31) // shares).
        share = next(w for w in range(shares) if hashed < ((w + 1) << 31) // shares)
        by_share.setdefault(share, []).append(key)
    return by_share


def insert_outbox(
    engine: sa.Engine, count: int, *, topic: str, keys: int = 0, type: str | None = "Test"
) -> None:
    """`count` rows in one transaction; keys > 0 spreads them over that many keys."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO outbox (topic, key, type, payload) "
                "SELECT :topic, CASE WHEN :keys > 0 THEN 'k' || (i % :keys) END, :type, "
                "jsonb_build_object('i', i) FROM generate_series(1, :n) AS i"
            ),
            {"topic": topic, "keys": keys, "type": type, "n": count},
        )


# --------------------------------------------------------------------------
# RabbitMQ: unique exchange and queue names per test, deleted afterwards
# --------------------------------------------------------------------------


@dataclass
class Received:
    """A message read back from the broker, the same shape for every broker
    (tests/brokers, tests/e2e/test_brokers.py); `raw`: the client's own object."""

    body: bytes
    message_id: str | None
    type: str | None
    key: str | None
    headers: dict[str, Any]
    raw: Any = field(repr=False, default=None)


class Rabbit:
    """A test's own exchange, with helpers to bind queues and read them."""

    def __init__(self, connection: aio_pika.abc.AbstractConnection, exchange: str) -> None:
        self.connection = connection
        self.exchange = exchange
        self.queues: list[str] = []

    async def queue(self, *patterns: str, name: str | None = None) -> aio_pika.abc.AbstractQueue:
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(self.exchange, "topic", durable=True)
        queue = await channel.declare_queue(
            name or f"{self.exchange}.q{len(self.queues)}", durable=True
        )
        self.queues.append(queue.name)
        for pattern in patterns:
            await queue.bind(exchange, pattern)
        return queue

    async def publish(self, routing_key: str, body: bytes, **properties: Any) -> None:
        channel = await self.connection.channel()
        exchange = await channel.declare_exchange(self.exchange, "topic", durable=True)
        await exchange.publish(aio_pika.Message(body, **properties), routing_key=routing_key)
        await channel.close()

    async def publish_without_message_id(
        self, routing_key: str, body: bytes, **properties: Any
    ) -> None:
        """Publish with no message_id property at all.

        aiormq fills in a random message_id when none is given, so this
        writes the three frames itself; other AMQP clients send such
        messages, and the inbox must handle them."""
        from aiormq.abc import ChannelFrame
        from pamqp import commands as spec
        from pamqp.body import ContentBody
        from pamqp.header import ContentHeader

        channel = await self.connection.channel(publisher_confirms=False)
        await channel.declare_exchange(self.exchange, "topic", durable=True)
        underlay = await channel.get_underlay_channel()
        done = asyncio.get_running_loop().create_future()
        frames = [
            spec.Basic.Publish(exchange=self.exchange, routing_key=routing_key),
            ContentHeader(properties=spec.Basic.Properties(**properties), body_size=len(body)),
            ContentBody(body),
        ]
        await underlay.write_queue.put(
            ChannelFrame.marshall(frames=frames, channel_number=underlay.number, drain_future=done)
        )
        await done
        await channel.close()

    async def drain(
        self, queue: aio_pika.abc.AbstractQueue, count: int, timeout: float = 15.0
    ) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Exactly `count` messages (acked), or fail after `timeout` seconds."""
        got: list[aio_pika.abc.AbstractIncomingMessage] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            message = await queue.get(no_ack=True, fail=False)
            if message is None:
                if time.monotonic() > deadline:
                    raise AssertionError(f"got {len(got)} of {count} messages in {timeout}s")
                await asyncio.sleep(0.02)
                continue
            got.append(message)
        return got


@pytest.fixture
async def rabbit() -> AsyncIterator[Rabbit]:
    _require("127.0.0.1", 5672, "RabbitMQ")
    connection = await aio_pika.connect(AMQP_URL)
    helper = Rabbit(connection, f"relay_test_{uuid.uuid4().hex[:10]}")
    yield helper
    channel = await connection.channel()
    for name in helper.queues:
        with contextlib.suppress(Exception):
            await channel.queue_delete(name)
    with contextlib.suppress(Exception):
        await channel.exchange_delete(helper.exchange)
    await connection.close()


# --------------------------------------------------------------------------
# Running relay
# --------------------------------------------------------------------------


class RelayProcess:
    """`relay ...` as a subprocess with its stderr in a file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed when the process is stopped
        self.proc = subprocess.Popen(
            [*RELAY, *args], env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 15.0) -> None:
        """Until the process has logged `text`; `timeout` is how long it may
        go without progress (wait_while_progressing): a daemon starting on a
        busy machine takes longer, using CPU and logging on the way."""
        wait_while_progressing(
            lambda: text in self.log,
            self.proc,
            quiet=timeout,
            what=f"{text!r} logged",
            log=lambda: self.log,
        )

    def wait_until_logged(self, text: str, count: int = 1, timeout: float = 15.0) -> None:
        """wait_for_log until `text` has been logged `count` times."""
        wait_while_progressing(
            lambda: self.log.count(text) >= count,
            self.proc,
            quiet=timeout,
            what=f"{text!r} logged {count} times",
            log=lambda: self.log,
        )

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def relay_env(database: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
    env.update(
        {
            "RELAY_DATABASE_URL": database,
            "RELAY_BROKER_URL": AMQP_URL,
            "RELAY_LOG_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


@pytest.fixture
def start_relay(relay_env: dict[str, str], tmp_path: Path) -> Iterator[Callable[..., RelayProcess]]:
    started: list[RelayProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> RelayProcess:
        proc = RelayProcess(
            list(args), {**relay_env, **(env or {})}, tmp_path / f"relay{len(started)}.log"
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def run_relay(relay_env: dict[str, str]) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(
        *args: str, env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*RELAY, *args],
            env={**relay_env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )

    return run


def receiver_processes(parent: int) -> list[int]:
    """The live receiver processes (`python -m relay.receiver_process`) of a `relay inbox`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == parent and stat[0] != "Z" and b"relay.receiver_process" in cmdline:
            found.append(int(entry.name))
    return found


def process_gone(pid: int) -> bool:
    """True once `pid` has exited (gone, or a zombie not yet reaped)."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) == "Z"
    except OSError:
        return True


def _deadline(timeout: float, message: str) -> Callable[[Any], None]:
    """The time-out of a polling loop (wait_until, until): a check that fails
    the test, with the predicate's last value, once `timeout` has passed."""
    deadline = time.monotonic() + timeout

    def check(value: Any) -> None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{message} not reached in {timeout}s (last: {value!r})")

    return check


def wait_until(
    predicate: Callable[[], Any],
    timeout: float = 15.0,
    interval: float = 0.05,
    message: str = "condition",
) -> Any:
    check = _deadline(timeout, message)
    while not (value := predicate()):
        check(value)
        time.sleep(interval)
    return value


async def until(
    predicate: Callable[[], Any],
    timeout: float = 15.0,
    interval: float = 0.02,
    message: str = "condition",
) -> Any:
    """wait_until on the test's event loop: the code under test runs between
    the checks."""
    check = _deadline(timeout, message)
    while not (value := predicate()):
        check(value)
        await asyncio.sleep(interval)
    return value


# --------------------------------------------------------------------------
# The inbox with the test handlers (tests/apps/handlers.py)
# --------------------------------------------------------------------------

HANDLERS = "tests.apps.handlers:registry"  # sync handlers: psycopg's blocking connection
MIXED_HANDLERS = "tests.apps.handlers:mixed_registry"  # with async ones: the async engine


def run_bench(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """`python -m MODULE ARGS` in the repository, which must exit 0 within
    `timeout` seconds; what it printed."""
    result = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def quick_bench(tmp_path: Path, *scenarios: str) -> dict[str, set[str]]:
    """`python -m bench.run --quick --only SCENARIOS`, which must exit 0 with
    no scenario in error: the figures' names it recorded, by scenario."""
    out = tmp_path / "bench.json"
    only = ",".join(scenarios)
    run_bench("bench.run", "--quick", "--only", only, "--out", str(out), timeout=400)
    report = json.loads(out.read_text())
    figures: dict[str, set[str]] = {name: set() for name in scenarios}
    for name in scenarios:
        assert "error" not in report["scenarios"][name], report["scenarios"][name]
    for figure in report["figures"]:
        figures.setdefault(figure["scenario"], set()).add(figure["figure"])
    return figures


# `relay inbox` polling and backing off fast, for the tests' daemons.
FAST = ("--poll-interval", "0.5", "--backoff-min", "0.2", "--backoff-max", "0.5")


def inbox_args(queue: str, *extra: str) -> list[str]:
    """`relay inbox` on `queue` with the test handlers, polling and backing
    off fast (the broker's URL comes from the environment)."""
    return ["inbox", "--queue", queue, "--handlers", HANDLERS, *FAST, *extra]


def sync_hang_holds_its_transaction(engine: sa.Engine) -> bool:
    """The SyncHang handler has written its effect and blocks its thread,
    its transaction open."""
    return rows(
        engine,
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND application_name = 'relay' "
        "AND state = 'idle in transaction' AND query LIKE 'INSERT INTO effects%'",
    ) == [(1,)]


async def left_in_the_queue(
    engine: sa.Engine, rabbit: Rabbit, daemon: RelayProcess, message_id: str
) -> None:
    """--dispatch received: a handler released by a stop ran in the
    transaction that stores its row; it left no row, and its message waits
    in the queue (the `inbox` fixture's)."""
    assert rows(engine, "SELECT count(*) FROM inbox") == [(0,)]
    channel = await rabbit.connection.channel()
    queue = await channel.get_queue(daemon.queue)  # type: ignore[attr-defined]
    [message] = await rabbit.drain(queue, 1)
    assert message.message_id == message_id


@pytest.fixture
def effects(engine: sa.Engine) -> sa.Engine:
    """The test database with the handlers' `effects` table."""
    from tests.apps.handlers import EFFECTS_DDL

    rows(engine, EFFECTS_DDL)
    return engine


def effect_ids(engine: sa.Engine) -> list[str]:
    """The message ids the handlers wrote to `effects`, in the order written."""
    return [r[0] for r in rows(engine, "SELECT message_id FROM effects ORDER BY id")]


def inbox_rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    """Every inbox row, in arrival order: (message_id, status, attempts,
    last_error, type, key, topic)."""
    return rows(
        engine,
        "SELECT message_id, status, attempts, last_error, type, key, topic FROM inbox ORDER BY seq",
    )


@pytest.fixture
def dispatch() -> str:
    """The inbox's --dispatch for the `inbox` fixture: its default here;
    tests/inbox runs each test under both (its conftest)."""
    return "received"


@pytest.fixture
def inbox(
    rabbit: Rabbit, start_relay: Callable[..., RelayProcess], dispatch: str
) -> Callable[..., RelayProcess]:
    """Start `relay inbox` on a fresh queue bound to the test's exchange
    (with --dispatch as the `dispatch` fixture says, unless given)."""
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)

    def start(
        *extra: str,
        handlers: str | None = HANDLERS,
        bind: str = "#",
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> RelayProcess:
        args = [
            "inbox",
            "--queue",
            queue,
            "--exchange",
            rabbit.exchange,
            "--bind",
            bind,
            *FAST,
        ]
        if handlers:
            args += ["--handlers", handlers]
        if "--dispatch" not in extra:
            args += ["--dispatch", dispatch]
        proc = start_relay(*args, *extra, env=env)
        proc.queue = queue  # type: ignore[attr-defined]
        if wait:
            proc.wait_for_log("inbox started", timeout=30)
        return proc

    return start
