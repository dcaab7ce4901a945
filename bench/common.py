"""Plumbing shared by the scenarios: the servers, fresh databases, unique
broker names, relay subprocesses, RSS sampling and the rate arithmetic.

Everything a scenario creates is registered in its `Resources` and removed
by `Resources.close()`, which the runner calls in a `finally`.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aio_pika
import orjson
import psycopg

REPO = Path(__file__).resolve().parent.parent
# Server URLs without a database name; each scenario makes its own database.
PG_URL = os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432").rstrip("/")
AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")

# A 200-byte JSON object on the wire (compact, jsonb's key order: i, pad, kind).
PAD = 158
PAYLOAD_SQL = (
    f"jsonb_build_object('i', lpad(i::text, 10, '0'), 'pad', repeat('x', {PAD}), 'kind', 'bench')"
)


def payload(i: int) -> bytes:
    """The same 200-byte object PAYLOAD_SQL builds, for messages made in Python."""
    return orjson.dumps({"i": f"{i:010d}", "pad": "x" * PAD, "kind": "bench"})


assert len(payload(1)) == 200


class BenchError(RuntimeError):
    """The benchmark could not measure (lost messages, a daemon failed...)."""


def relay_command() -> list[str]:
    """The installed `relay` console script of this venv (BENCH_RELAY: another
    one, e.g. an older relay's, to measure before and after side by side)."""
    if os.environ.get("BENCH_RELAY"):
        return [os.environ["BENCH_RELAY"]]
    script = Path(sys.executable).parent / "relay"
    return [str(script)] if script.exists() else [sys.executable, "-m", "relay.cli"]


def db_url(name: str) -> str:
    return f"{PG_URL}/{name}"


@functools.cache
def _bench_only_path() -> str:
    """A directory holding only `bench` (a link to this checkout's): put on
    the daemons' PYTHONPATH, it makes bench.handlers importable without
    putting this checkout's `relay` ahead of the one BENCH_RELAY runs (the
    checkout itself on the path made an older relay import today's)."""
    where = Path(tempfile.mkdtemp(prefix="relay-bench-path-"))
    (where / "bench").symlink_to(REPO / "bench", target_is_directory=True)
    atexit.register(shutil.rmtree, where, ignore_errors=True)
    return str(where)


def relay_env(**extra: str) -> dict[str, str]:
    # The user's RELAY_ settings stay out, but RELAY_DISPATCH: the inbox's
    # two paths (docs/inbox.md) are compared as `RELAY_DISPATCH=stored
    # python -m bench.run ...` beside a run without it.
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("RELAY_") or k == "RELAY_DISPATCH"
    }
    env.update(
        {
            "PYTHONUNBUFFERED": "1",
            # bench.handlers must be importable by `relay inbox`.
            "PYTHONPATH": os.pathsep.join(
                filter(None, [_bench_only_path(), env.get("PYTHONPATH")])
            ),
            "RELAY_LOG_LEVEL": "INFO",
        }
    )
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def admin() -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(db_url("postgres"), autocommit=True)


async def connect(url: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(url, options="-c jit=off", **kwargs)


async def scalar(url: str, sql: str, params: Sequence[Any] | None = None) -> Any:
    async with await connect(url, autocommit=True) as conn:
        row = await (await conn.execute(sql, params)).fetchone()
        return row[0] if row else None


async def insert_backlog(
    url: str, count: int, *, topic: str, type: str | None = "Bench", first: int = 1
) -> float:
    """`count` pending outbox rows with 200-byte payloads, then ANALYZE; the seconds it took."""
    started = time.perf_counter()
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, type, payload) "
            f"SELECT %s, %s, {PAYLOAD_SQL} FROM generate_series(%s::bigint, %s::bigint) AS i",
            (topic, type, first, first + count - 1),
        )
        await conn.execute("ANALYZE outbox")
    return time.perf_counter() - started


async def batch_times(
    url: str, table: str, column: str | None = None, where: str = ""
) -> list[tuple[float, int]]:
    """(transaction start, rows) per transaction that wrote `column`
    (published_at, processed_at, received_at: all now(), the start of the
    batch's transaction), in time order."""
    default_column, status = {
        "outbox": ("published_at", "published"),
        "inbox": ("processed_at", "processed"),
    }[table]
    column = column or default_column
    async with await connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            f"SELECT extract(epoch FROM {column})::float8, count(*) FROM {table} "
            f"WHERE status = '{status}' {where} GROUP BY 1 ORDER BY 1"
        )
        return [(float(t), int(n)) for t, n in await cur.fetchall()]


# Fewer batches than this have no steady part: two workers' claims may
# start within a millisecond of each other (a 1,000-row SQS drain gave
# "134,770 msgs/s" that way), so the rate is left to rate_wall.
MIN_BATCHES = 5


def steady_rate(
    points: Sequence[tuple[float, int]], lo: float = 0.1, hi: float = 0.9
) -> float | None:
    """Rows per second between the batch that crosses `lo` of the rows and the
    one that crosses `hi`: start-up and the tail are left out. With too few
    batches for that, from the first batch to the last; None for fewer than
    MIN_BATCHES batches."""
    if len(points) < MIN_BATCHES:
        return None
    total = sum(n for _, n in points)
    done = 0
    start: tuple[float, int] | None = None
    for t, n in points:
        if start is None and done >= lo * total:
            start = (t, done)
        if start is not None and done >= hi * total and t > start[0]:
            return (done - start[1]) / (t - start[0])
        done += n
    if points[-1][0] > points[0][0]:
        return (total - points[-1][1]) / (points[-1][0] - points[0][0])
    return None


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot; waiting on the disk
    counts as busy (a server still writing slows the next run's fsyncs)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3]  # iowait (fields[4]) stays in busy
    return sum(fields) - idle, sum(fields)


async def settle(
    url: str | None = None, *, busy: float = 0.15, quiet_for: int = 5, timeout: float = 180.0
) -> dict[str, float | bool | None]:
    """Let the work before a measurement finish before it starts: CHECKPOINT
    the server of `url` (the preload's dirty pages are written now, not in
    the measurement's first seconds), then wait until the machine's CPUs
    were busy under `busy` (a fraction of all of them) for `quiet_for`
    seconds in a row, or `timeout` passed.

    A long scenario is judged by comparing its own stretches (a backlog's
    first fifth with its last): work left over from before it (a broker
    deleting the previous scenario's messages, a server writing out a
    preload) must not land in one of them. Returns the seconds waited,
    whether the machine became quiet, and the last second's busy
    fraction, for the result file."""
    started = time.monotonic()
    if url is not None:
        async with await connect(url, autocommit=True) as conn:
            await conn.execute("CHECKPOINT")
    calm, last = 0, _cpu_times()
    fraction: float | None = None
    while calm < quiet_for and time.monotonic() - started < timeout:
        await asyncio.sleep(1.0)
        now = _cpu_times()
        fraction = (now[0] - last[0]) / max(1, now[1] - last[1])
        last = now
        calm = calm + 1 if fraction < busy else 0
    return {
        "settle_s": round(time.monotonic() - started, 1),
        "settled": calm >= quiet_for,
        "busy_before": None if fraction is None else round(fraction, 3),
    }


# --------------------------------------------------------------------------
# Processes and their memory
# --------------------------------------------------------------------------


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process, in kB ({} once it is gone)."""
    values: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name, value = line.split(":", 1)
                    values[name] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError, ValueError):
        pass
    return values


def descendants(pid: int) -> list[int]:
    """The live processes started by `pid`, their children, and so on.

    Read from /proc/PID/task/TID/children: a handful of small files, where
    scanning all of /proc every few milliseconds took a fifth of a core
    from the daemon being measured."""
    found, frontier = [], [pid]
    while frontier:
        children = []
        for parent in frontier:
            with contextlib.suppress(OSError):
                for task in os.listdir(f"/proc/{parent}/task"):
                    with open(f"/proc/{parent}/task/{task}/children") as f:
                        children += [int(child) for child in f.read().split()]
        found += children
        frontier = children
    return found


class RssSampler:
    """Samples the RSS of a process and its descendants (relay inbox's
    receiver process) every `interval` seconds while it runs. The peak is
    the sum of each process's own peak (VmHWM): exact when they peak
    together, above the true peak otherwise."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, int]] = []  # (monotonic, kB of the whole tree)
        self.hwm_by_pid: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None

    @property
    def hwm_kb(self) -> int:
        return sum(self.hwm_by_pid.values())

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def sample(self) -> None:
        total = 0
        for pid in [self.pid, *descendants(self.pid)]:
            values = read_status(pid)
            total += values.get("VmRSS", 0)
            self.hwm_by_pid[pid] = max(self.hwm_by_pid.get(pid, 0), values.get("VmHWM", 0))
        if total:
            self.samples.append((time.monotonic(), total))

    async def _run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def at(self, t: float) -> int | None:
        """RSS (kB) of the last sample taken at or before monotonic time t."""
        best = None
        for ts, kb in self.samples:
            if ts > t:
                break
            best = kb
        return best if best is not None else (self.samples[0][1] if self.samples else None)

    def summary(self, start: float | None = None, end: float | None = None) -> dict[str, Any]:
        """Peak (VmHWM) and the RSS at 10, 50 and 90 % of [start, end], in MB."""

        def mb(kb: int | None) -> float | None:
            return round(kb / 1024, 1) if kb is not None else None

        result: dict[str, Any] = {
            "peak_mb": mb(self.hwm_kb or None),
            "samples": len(self.samples),
            "process_peaks_mb": [mb(kb) for kb in self.hwm_by_pid.values()],
        }
        if self.samples:
            start = self.samples[0][0] if start is None else start
            end = self.samples[-1][0] if end is None else end
            for pct in (10, 50, 90):
                result[f"rss_{pct}pct_mb"] = mb(self.at(start + (end - start) * pct / 100))
        return result


class Proc:
    """A subprocess (a relay daemon, moto, the latency consumer) with its
    output in a log file and its RSS sampled."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log_path: Path,
        *,
        stdin: bool = False,
        stdout_pipe: bool = False,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            argv,
            env=env,
            cwd=REPO,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
        )
        self.started = time.monotonic()
        self.rss = RssSampler(self.popen.pid)
        self.rss.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    async def wait_log(self, text: str, timeout: float = 30.0) -> float:
        """Monotonic time at which `text` was first seen in the log (polled every 10 ms)."""
        deadline = time.monotonic() + timeout
        while True:
            if text in self.log():
                return time.monotonic()
            if self.popen.poll() is not None:
                raise BenchError(
                    f"{self.name} exited {self.popen.returncode} before logging "
                    f"{text!r}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} did not log {text!r} in {timeout}s:\n{self.tail()}")
            await asyncio.sleep(0.01)

    async def wait_exit(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} still running after {timeout}s:\n{self.tail()}")
            await asyncio.sleep(0.01)
        return self.popen.returncode

    async def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; the exit code (None if killed by us)."""
        code: int | None
        if self.popen.poll() is None:
            self.rss.sample()
            self.popen.send_signal(signal.SIGTERM)
            try:
                code = await self.wait_exit(timeout)
            except BenchError:
                self.popen.kill()
                self.popen.wait()
                code = None
        else:
            code = self.popen.returncode
        await self.rss.stop()
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self._log.close()
        return code


# --------------------------------------------------------------------------
# What a scenario creates
# --------------------------------------------------------------------------


async def apply_schema(url: str) -> None:
    """`relay schema apply` on the database at `url`; BenchError if it fails."""
    proc = await asyncio.create_subprocess_exec(
        *relay_command(),
        "schema",
        "apply",
        "--database-url",
        url,
        env=relay_env(),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise BenchError(f"relay schema apply failed ({proc.returncode}): {out.decode()}")


class Resources:
    """Databases, exchanges, queues and processes of one scenario; close()
    removes them all, whatever happened."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.workdir = Path(tempfile.mkdtemp(prefix=f"bench_{label}_"))
        self.databases: list[str] = []
        self.exchanges: list[str] = []
        self.queues: list[str] = []
        self.procs: list[Proc] = []
        self._amqp: aio_pika.abc.AbstractConnection | None = None
        self.failed = False

    # -- PostgreSQL -----------------------------------------------------------

    async def database(self, tag: str | None = None) -> str:
        """A fresh database with `relay schema apply` done; its URL."""
        name = f"bench_{tag or self.label}_{uuid.uuid4().hex[:8]}"
        async with await admin() as conn:
            await conn.execute(f'CREATE DATABASE "{name}"')
        self.databases.append(name)
        url = db_url(name)
        await apply_schema(url)
        return url

    async def drop_database(self, url: str) -> None:
        name = url.rsplit("/", 1)[1]
        async with await admin() as conn:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if name in self.databases:
            self.databases.remove(name)

    # -- RabbitMQ -------------------------------------------------------------

    async def amqp(self) -> aio_pika.abc.AbstractConnection:
        if self._amqp is None or self._amqp.is_closed:
            self._amqp = await aio_pika.connect(AMQP_URL)
        return self._amqp

    def names(self, tag: str | None = None) -> tuple[str, str]:
        """A unique exchange name and queue name, deleted in close()."""
        exchange = f"bench_{tag or self.label}_{uuid.uuid4().hex[:8]}"
        queue = f"{exchange}.q"
        self.exchanges.append(exchange)
        self.queues.append(queue)
        return exchange, queue

    async def bind_queue(
        self,
        exchange: str,
        queue: str,
        pattern: str = "#",
        arguments: dict[str, Any] | None = None,
    ) -> None:
        """Declare the durable topic exchange and a durable queue (with these
        arguments) bound to it."""
        channel = await (await self.amqp()).channel()
        try:
            ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
            q = await channel.declare_queue(queue, durable=True, arguments=arguments)
            await q.bind(ex, pattern)
        finally:
            await channel.close()

    async def queue_depth(self, queue: str) -> int:
        channel = await (await self.amqp()).channel()
        try:
            q = await channel.declare_queue(queue, passive=True)
            return int(q.declaration_result.message_count)
        finally:
            await channel.close()

    # -- processes --------------------------------------------------------------

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, **kwargs: Any
    ) -> Proc:
        log = self.workdir / f"{name}.{len(self.procs)}.log"
        proc = Proc(name, argv, env or relay_env(), log, **kwargs)
        self.procs.append(proc)
        return proc

    def relay(self, name: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        return self.spawn(name, [*relay_command(), *args], env)

    async def consumer(self, name: str, queue: str) -> tuple[Proc, Path]:
        """bench.consumer on `queue`, connected and ready; it writes every
        message's receipt time to the returned file once it is told on stdin
        how many messages to wait for."""
        receipts = self.workdir / f"{name}-receipts.json"
        argv = [sys.executable, "-m", "bench.consumer", "--amqp-url", AMQP_URL, "--queue", queue]
        proc = self.spawn(
            name, [*argv, "--out", str(receipts)], relay_env(), stdin=True, stdout_pipe=True
        )
        assert proc.popen.stdout is not None and proc.popen.stdin is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.popen.stdout.readline), 30)
        if line.strip() != b"ready":
            raise BenchError(f"{name} did not start:\n{proc.tail()}")
        return proc, receipts

    @staticmethod
    async def receipts(consumer: Proc, receipts: Path, count: int) -> dict[str, float]:
        """Tell a consumer from consumer() to wait for `count` messages; once it
        has exited, their receipt times by message id."""
        assert consumer.popen.stdin is not None
        consumer.popen.stdin.write(f"{count}\n".encode())
        consumer.popen.stdin.flush()
        code = await consumer.wait_exit(60)
        if code != 0:
            raise BenchError(f"{consumer.name} exited {code}:\n{consumer.tail()}")
        found: dict[str, float] = orjson.loads(receipts.read_bytes())
        return found

    # -- cleanup ----------------------------------------------------------------

    async def close(self) -> list[str]:
        """Remove everything; returns what could not be removed."""
        problems: list[str] = []
        for proc in reversed(self.procs):
            try:
                await proc.stop()
            except Exception as exc:  # keep cleaning up
                problems.append(f"stop {proc.name}: {exc}")
        if self.exchanges or self.queues:
            try:
                connection = await self.amqp()
                # A channel per delete: a broker error closes the channel it happens on.
                for kind, name in [
                    *(("queue", q) for q in self.queues),
                    *(("exchange", e) for e in self.exchanges),
                ]:
                    channel = await connection.channel()
                    try:
                        if kind == "queue":
                            await channel.queue_delete(name)
                        else:
                            await channel.exchange_delete(name)
                    except Exception as exc:
                        problems.append(f"delete {kind} {name}: {exc}")
                    finally:
                        with contextlib.suppress(Exception):
                            await channel.close()
            except Exception as exc:
                problems.append(f"RabbitMQ cleanup: {exc}")
        if self._amqp is not None:
            with contextlib.suppress(Exception):
                await self._amqp.close()
        for name in list(self.databases):
            try:
                await self.drop_database(db_url(name))
            except Exception as exc:
                problems.append(f"drop database {name}: {exc}")
        if not self.failed:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return problems
