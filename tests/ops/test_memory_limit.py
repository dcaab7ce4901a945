"""The daemons inside a memory-limited cgroup, as the kernel runs a sidecar
under Kubernetes (issue 43): with default flags, a backlog of small rows
with a few dozen rows of several MiB among them drains with no OOM kill, in
key order, in 256 MiB for `relay outbox` and 384 MiB for `relay inbox` and
its receiver (a child process: it follows its parent into the group).
Through RabbitMQ, and through Kafka (issue 51: 200 records just under
Kafka's 1 MB default limit, 40 of 6 MiB).

The group is the cgroup v1 memory controller's (/sys/fs/cgroup/memory, as
root) or cgroup v2's (memory.max); the daemon enters it before it execs, so
all it allocates is charged there. The peak each run reached is printed
(pytest -s shows it) for docs/operations.md's table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import aio_pika
import pytest
import sqlalchemy as sa

from tests.conftest import (
    AMQP_URL,
    HANDLERS,
    REPO,
    free_port,
    rows,
    wait_until,
)
from tests.e2e.test_claim_check import s3  # noqa: F401 - the fixture
from tests.kafka_server import Kafka, KafkaServer
from tests.sqs_server import REGION, sqs_server  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)

MiB = 1 << 20
V1 = Path("/sys/fs/cgroup/memory")
V2 = Path("/sys/fs/cgroup")
SMALL = 400
LARGE = 40  # one in every SMALL // LARGE + 1 rows
KEYS = 7


class MemoryGroup:
    """A memory cgroup of its own with a limit (run_in starts a process in
    it, before it execs, so all it allocates is charged there). remove()
    kills what is left in it and removes it."""

    def __init__(self, limit: int) -> None:
        name = f"relay-test-{uuid.uuid4().hex[:10]}"
        if (V1 / "memory.limit_in_bytes").exists():
            self.v2 = False
            self.path = V1 / name
            self.path.mkdir()
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            swap = self.path / "memory.memsw.limit_in_bytes"
            if swap.exists():  # no swapping out of the limit: it is the container's
                swap.write_text(str(limit))
        else:
            self.v2 = True
            self.path = V2 / name
            self.path.mkdir()
            (self.path / "memory.max").write_text(str(limit))
            swap = self.path / "memory.swap.max"
            if swap.exists():
                swap.write_text("0")
        self.limit = limit

    def peak(self) -> int:
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        name = "memory.events" if self.v2 else "memory.oom_control"
        for line in (self.path / name).read_text().splitlines():
            field, _, value = line.partition(" ")
            if field == "oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        for _ in range(50):
            pids = [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:  # only this test's processes are in its group
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 9)
            time.sleep(0.1)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _can_limit() -> str | None:
    for base in (V1, V2):
        if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
            return None
    return "needs a writable memory cgroup (root, /sys/fs/cgroup/memory or cgroup v2)"


@pytest.fixture
def memory_group() -> Iterator[Callable[[int], MemoryGroup]]:
    problem = _can_limit()
    if problem is not None:
        if os.environ.get("RELAY_TEST_REQUIRE_CGROUP"):  # CI (.ci/run): a skip would hide it
            pytest.fail(problem)
        pytest.skip(problem)
    made: list[MemoryGroup] = []

    def make(limit: int) -> MemoryGroup:
        made.append(MemoryGroup(limit))
        return made[-1]

    yield make
    for group in made:
        group.remove()


def run_in(
    group: MemoryGroup, args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    """`relay ARGS` started inside the group: a shell enters it, then execs relay."""
    enter = 'echo $$ > "$0/cgroup.procs" && exec "$@"'
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["sh", "-c", enter, str(group.path), sys.executable, "-m", "relay.cli", *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )


def insert_backlog(
    engine: sa.Engine, topic: str, type_: str, large: int, count: int = LARGE
) -> list[tuple[str, int]]:
    """SMALL small rows and `count` rows of `large` bytes among them (every
    SMALL // count + 1-th row), over KEYS keys, in one transaction; the
    large payloads are random hex (incompressible to PostgreSQL's pglz, as
    most real payloads of that size are not: both are measured alike).
    Returns each row's (key, n) in order."""
    every = SMALL // count + 1
    total = SMALL + count
    insert = sa.text(
        "INSERT INTO outbox (topic, key, type, payload) "
        "VALUES (:topic, :key, :type, CAST(:payload AS jsonb))"
    )
    with engine.begin() as conn:
        for i in range(total):
            payload: dict[str, object] = {"n": i}
            if i % every == 0:  # as long as `large` bytes of md5 hex would be
                payload["blob"] = os.urandom(large // 32 * 16).hex()
            conn.execute(
                insert,
                {
                    "topic": topic,
                    "key": f"k{i % KEYS}",
                    "type": type_,
                    "payload": json.dumps(payload),
                },
            )
    return [(f"k{i % KEYS}", i) for i in range(total)]


@pytest.fixture
def exchange() -> Iterator[str]:
    """A test's own exchange and its queue `<exchange>.in` (declared as relay
    inbox declares it, bound to every topic), deleted afterwards. Not the
    `rabbit` fixture: its connection would sit unread on the test's loop
    while the daemons run for minutes, and RabbitMQ closes it for the
    missed heartbeats."""
    name = f"relay_test_{uuid.uuid4().hex[:10]}"

    async def setup(declare: bool) -> None:
        connection = await aio_pika.connect(AMQP_URL)
        try:
            channel = await connection.channel()
            if declare:
                ex = await channel.declare_exchange(name, "topic", durable=True)
                queue = await channel.declare_queue(
                    f"{name}.in", durable=True, arguments={"x-queue-type": "classic"}
                )
                await queue.bind(ex, "#")
            else:
                await channel.queue_delete(f"{name}.in")
                await channel.exchange_delete(name)
        finally:
            await connection.close()

    asyncio.run(setup(True))
    yield name
    asyncio.run(setup(False))


def in_key_order(sequence: list[tuple[str, int]]) -> bool:
    last: dict[str, int] = {}
    for key, n in sequence:
        if last.get(key, -1) >= n:
            return False
        last[key] = n
    return True


def report(what: str, group: MemoryGroup) -> None:
    print(f"\n{what}: peak {group.peak() / MiB:.0f} MiB of {group.limit // MiB} MiB")


CASES = {
    # label: (large rows' size, --handlers, by claim check)
    "6MiB-handler": (6 * MiB, HANDLERS, False),
    "6MiB-batch-handler": (6 * MiB, "tests.apps.handlers:batch_registry", False),
    "10MiB-claim-check": (10 * MiB, HANDLERS, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_large_rows_drain_within_the_memory_limits(
    effects: sa.Engine,
    relay_env: dict[str, str],
    tmp_path: Path,
    memory_group: Callable[[int], MemoryGroup],
    exchange: str,
    request: pytest.FixtureRequest,
    case: str,
) -> None:
    """With default flags: `relay outbox --once` in 256 MiB drains the
    backlog to a queue, then `relay inbox` in 384 MiB consumes it and its
    handlers see every row once, in key order; neither is OOM-killed."""
    large, handlers, claim_check = CASES[case]
    queue = f"{exchange}.in"
    expected = insert_backlog(effects, "t", "Effect", large)
    env, extra = dict(relay_env), []
    if claim_check:
        s3 = request.getfixturevalue("s3")
        extra = ["--claim-check", s3.url("large")]
        env.update(AWS_DEFAULT_REGION=REGION, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x")

    outbox = ["outbox", "--once", f"--exchange={exchange}", *extra]
    inbox = ["inbox", f"--queue={queue}", f"--exchange={exchange}", "--bind=#"]
    inbox += [f"--handlers={handlers}", *extra]
    drain_then_consume(case, effects, env, tmp_path, memory_group, outbox, inbox, expected)


KAFKA_CASES = {
    # label: (large records' size, how many, the URL's properties)
    # Just under Kafka's default largest record (1,000,000 bytes, with the
    # key and headers), and larger: the outbox's limit raised by the URL.
    "1MB-kafka": (990_000, 200, ""),
    "6MiB-kafka": (6 * MiB, LARGE, "message.max.bytes=8388608"),
}


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kafka]:
    """Tansu of its own, reached directly: the tests' proxy copies every
    byte in Python, which took a minute a case of the 400 MB."""
    server = KafkaServer(tmp_path_factory.mktemp("tansu") / "tansu.log", proxied=False)
    helper = Kafka(server)
    try:
        yield helper
    finally:
        helper.close()
        server.close()


@pytest.mark.parametrize("case", list(KAFKA_CASES))
def test_large_kafka_records_drain_within_the_memory_limits(
    effects: sa.Engine,
    relay_env: dict[str, str],
    tmp_path: Path,
    memory_group: Callable[[int], MemoryGroup],
    kafka: Kafka,
    case: str,
) -> None:
    """As above through Kafka (three partitions), with default flags: the
    inbox's receiver holds about --batch-bytes of records, librdkafka's
    prefetch included (issue 51: OOM-killed at 384 MiB before)."""
    large, count, properties = KAFKA_CASES[case]
    topic = kafka.topic("memory", 3)
    expected = insert_backlog(effects, topic, "Effect", large, count)
    env = {**relay_env, "RELAY_BROKER_URL": kafka.url(properties)}
    inbox = ["inbox", f"--queue={topic}", f"--handlers={HANDLERS}"]
    drain_then_consume(
        case, effects, env, tmp_path, memory_group, ["outbox", "--once"], inbox, expected
    )


def drain_then_consume(
    case: str,
    effects: sa.Engine,
    env: dict[str, str],
    tmp_path: Path,
    memory_group: Callable[[int], MemoryGroup],
    outbox_args: list[str],
    inbox_args: list[str],
    expected: list[tuple[str, int]],
) -> None:
    """`relay OUTBOX_ARGS` in 256 MiB drains the backlog; then `relay
    INBOX_ARGS` in 384 MiB consumes it and its handlers see every row once,
    in key order; neither is OOM-killed. Each one's peak is printed."""
    outbox_group = memory_group(256 * MiB)
    outbox = run_in(outbox_group, outbox_args, env, tmp_path / "outbox.log")
    code = outbox.wait(300)
    log = (tmp_path / "outbox.log").read_text(errors="replace")
    report(f"{case}: relay outbox --once", outbox_group)
    assert outbox_group.oom_kills() == 0, f"OOM-killed (exit {code}):\n{log[-3000:]}"
    assert code == 0, log[-3000:]
    assert rows(effects, "SELECT count(*) FROM outbox WHERE status <> 'published'")[0][0] == 0

    inbox_group = memory_group(384 * MiB)
    port = free_port()
    inbox = run_in(inbox_group, [*inbox_args, f"--http-port={port}"], env, tmp_path / "inbox.log")
    try:
        wait_until(
            lambda: (
                inbox.poll() is not None
                or rows(effects, "SELECT count(*) FROM effects")[0][0] >= len(expected)
            ),
            timeout=300,
            message="every message handled",
        )
        report(f"{case}: relay inbox + receiver", inbox_group)
        inbox_log = (tmp_path / "inbox.log").read_text(errors="replace")
        assert inbox_group.oom_kills() == 0, f"OOM-killed:\n{inbox_log[-3000:]}"
        assert inbox.poll() is None, inbox_log[-3000:]
        # Every batch done: the dispatchers hold nothing (the gauge is there).
        wait_until(lambda: metric(port, "relay_inbox_held_bytes") == 0, message="held 0")
    finally:
        if inbox.poll() is None:
            inbox.terminate()
            inbox.wait(30)
    handled = [(k, n) for k, n in rows(effects, "SELECT key, n FROM effects ORDER BY id")]
    assert sorted(handled) == sorted(expected)
    assert in_key_order(handled)
    assert rows(effects, "SELECT count(*) FROM inbox WHERE status <> 'processed'")[0][0] == 0


def metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None
