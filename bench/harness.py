"""What every scenario of the benchmark shares: the sizes of a run, the
report the figures go into, reading a daemon's /metrics, the arguments and
tables the daemons are started with, a `relay outbox --once` drain and the
latency scenarios' producer.

The scenario modules (bench.backlog, bench.reference, bench.where,
bench.pgbouncer, bench.kafka) import these from here, and bench.run imports
the scenarios: the imports run one way (tests/ops/test_bench_imports.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
import uuid
from typing import Any

from bench.common import (
    AMQP_URL,
    BenchError,
    Proc,
    Resources,
    batch_times,
    connect,
    payload,
    percentile,
    scalar,
    steady_rate,
)
from bench.handlers import EFFECTS_DDL

# The source of the CloudEvents scenarios (bench.run, bench.kafka).
CLOUDEVENTS_SOURCE = "https://bench.example.com/relay"


@dataclasses.dataclass(frozen=True)
class Sizes:
    limit_pg: int
    limit_amqp: int
    naive: int
    naive_seconds: float
    drain: int
    latency_seconds: float
    inbox: int
    sqs: int
    memory: int
    scale_measured: int
    scale_pending: tuple[int, int]
    backlog: int = 1_000_000
    backlog_reference: int = 20_000
    retention_rows: int = 1_000_000
    retention_measured: int = 30_000
    # Rounds per table in retention, alternating empty and full: the median.
    retention_rounds: int = 3
    latency_rates: tuple[int, ...] = (100, 500, 2000)
    wire: int = 150_000
    wire_rounds: int = 2
    sqs_ref: int = 1_000  # moto's ReceiveMessage is quadratic in the queue's depth
    multi: int = 50_000
    redis: int = 100_000  # issue 53: `relay outbox --once` to Redis Streams
    # Seconds of a quiet machine that backlog and retention wait for before
    # each daemon starts (bench.common.settle); 0: no wait.
    quiet_for: int = 5

    def scaled(self, factor: float) -> Sizes:
        if factor == 1:
            return self
        counts = {
            f.name: max(100, int(getattr(self, f.name) * factor))
            for f in dataclasses.fields(self)
            if f.name
            not in (
                "naive_seconds",
                "latency_seconds",
                "scale_pending",
                "latency_rates",
                "wire_rounds",
                "quiet_for",
            )
        }
        small, large = self.scale_pending
        return dataclasses.replace(
            self, **counts, scale_pending=(small, max(small, int(large * factor)))
        )


FULL = Sizes(
    limit_pg=100_000,
    limit_amqp=100_000,
    naive=100_000,
    naive_seconds=20.0,
    drain=100_000,
    latency_seconds=10.0,
    inbox=100_000,
    sqs=1_000,
    memory=1_000_000,
    scale_measured=50_000,
    scale_pending=(1_000, 1_000_000),
)
QUICK = Sizes(
    limit_pg=20_000,
    limit_amqp=5_000,
    naive=3_000,
    naive_seconds=3.0,
    drain=5_000,
    latency_seconds=1.5,
    latency_rates=(500,),  # one rate: the run is a smoke test, its figures unjudged
    inbox=5_000,
    sqs=300,
    memory=3_000,
    scale_measured=5_000,
    scale_pending=(1_000, 10_000),
    backlog=5_000,
    backlog_reference=2_000,
    retention_rows=10_000,
    retention_measured=2_000,
    retention_rounds=1,
    wire=5_000,
    wire_rounds=1,
    sqs_ref=100,
    multi=5_000,
    redis=5_000,
    quiet_for=0,
)


class Report:
    def __init__(self) -> None:
        self.figures: list[dict[str, Any]] = []
        self.scenarios: dict[str, dict[str, Any]] = {}

    def add(self, scenario: str, name: str, value: float | None, unit: str, **extra: Any) -> None:
        if isinstance(value, float):
            value = round(value, 3)
        self.figures.append(
            {"scenario": scenario, "figure": name, "value": value, "unit": unit, **extra}
        )

    def get(self, scenario: str, name: str) -> float | None:
        for f in self.figures:
            if f["scenario"] == scenario and f["figure"] == name:
                return f["value"]
        return None


async def metrics(port: int) -> dict[str, float]:
    """The samples of a daemon's /metrics."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
    samples: dict[str, float] = {}
    body = data.split(b"\r\n\r\n", 1)[-1].decode()
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                samples[name] = float(value)
    return samples


async def wait_metric(
    proc: Proc,
    port: int,
    name: str,
    target: float,
    timeout: float,
    interval: float = 0.1,
    fail_on: str | None = None,
) -> float:
    """Poll /metrics until `name` reaches `target`; the monotonic time it did."""
    deadline = time.monotonic() + timeout
    last = 0.0
    while True:
        if proc.popen.poll() is not None:
            raise BenchError(f"{proc.name} exited {proc.popen.returncode}:\n{proc.tail()}")
        with contextlib.suppress(OSError):
            samples = await metrics(port)
            last = samples.get(name, 0.0)
            if fail_on and samples.get(fail_on, 0.0) > 0:
                raise BenchError(f"{proc.name}: {fail_on} = {samples[fail_on]:.0f}:\n{proc.tail()}")
            if last >= target:
                return time.monotonic()
        if time.monotonic() > deadline:
            raise BenchError(
                f"{proc.name}: {name} at {last:.0f} of {target:.0f} after "
                f"{timeout:.0f}s:\n{proc.tail()}"
            )
        await asyncio.sleep(interval)


async def wait_handled(proc: Proc, port: int, count: int, interval: float) -> float:
    """When `relay inbox` (`proc`, its /metrics on `port`, scraped every
    `interval` seconds) had processed `count` messages: a BenchError as soon
    as one failed, or if that takes too long."""
    return await wait_metric(
        proc,
        port,
        "relay_inbox_processed_total",
        count,
        timeout=max(300.0, count / 150),
        interval=interval,
        fail_on="relay_inbox_failed_total",
    )


async def handle_all(proc: Proc, port: int, count: int) -> None:
    """Wait until `relay inbox` (`proc`, its /metrics on `port`) has processed
    `count` messages (none failed; scraped every second past 100,000, as a
    backlog's drain takes minutes), then stop it: a BenchError unless it
    exits 0 on SIGTERM."""
    await wait_handled(proc, port, count, 1.0 if count > 100_000 else 0.1)
    code = await proc.stop()
    if code != 0:
        raise BenchError(f"relay inbox exited {code} on SIGTERM:\n{proc.tail()}")


def daemon_args(url: str, exchange: str, broker: str = AMQP_URL) -> list[str]:
    return ["--database-url", url, "--broker-url", broker, "--exchange", exchange]


async def create_effects(url: str) -> None:
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(EFFECTS_DDL)


def rss_figures(
    report: Report,
    scenario: str,
    who: str,
    proc: Proc,
    start: float | None = None,
    end: float | None = None,
) -> dict[str, Any]:
    """Peak RSS of the daemon's processes; with a window, also the RSS at 10,
    50 and 90 % of it."""
    summary = proc.rss.summary(start, end)
    report.add(
        scenario,
        f"{who}_peak_rss",
        summary["peak_mb"],
        "MB",
        process_peaks_mb=summary["process_peaks_mb"],
    )
    if start is not None:
        for pct in (10, 50, 90):
            if f"rss_{pct}pct_mb" in summary:
                report.add(scenario, f"{who}_rss_at_{pct}pct", summary[f"rss_{pct}pct_mb"], "MB")
    return summary


async def expect(url: str, sql: str, expected: int, what: str) -> None:
    got = await scalar(url, sql)
    if got != expected:
        raise BenchError(f"{what}: {got}, expected {expected}")


async def outbox_once(
    res: Resources,
    report: Report,
    scenario: str,
    url: str,
    count: int,
    args: list[str],
    env: dict[str, str] | None = None,
    min_rate: float = 300,
) -> None:
    """Run `relay outbox --once` over a backlog of `count` rows and report its rates.

    It fails if the drain takes longer than at `min_rate` msgs/s (or 2 min)."""
    proc = res.relay("outbox", "outbox", "--once", *args, env=env)
    ready = await proc.wait_log("outbox relay started", timeout=60)
    code = await proc.wait_exit(timeout=max(120.0, count / min_rate))
    ended, ended_wall = time.monotonic(), time.time()
    if code != 0:
        raise BenchError(f"relay outbox --once exited {code}:\n{proc.tail()}")
    await expect(
        url, "SELECT count(*) FROM outbox WHERE status = 'published'", count, "published rows"
    )
    points = await batch_times(url, "outbox")
    report.add(scenario, "rate", steady_rate(points), "msgs/s", messages=count, batches=len(points))
    report.add(scenario, "rate_wall", count / (ended - ready), "msgs/s")
    report.add(scenario, "startup", ready - proc.started, "s")
    # From the start of the last batch to the exit: the last batch plus shutdown.
    report.add(scenario, "last_batch_to_exit", ended_wall - points[-1][0], "s")
    rss_figures(report, scenario, "outbox", proc)


INSERT_ONE = "INSERT INTO outbox (id, topic, type, payload) VALUES (%s, %s, 'Bench', %s::jsonb)"


async def produce(
    url: str, topic: str, rate: int, seconds: float
) -> tuple[dict[str, tuple[float, float]], float, list[float]]:
    """Commit single-row transactions at `rate` per second for `seconds`.

    Returns {message id: (time.time() right after the commit, scheduled
    offset in seconds)}, the rate achieved and each INSERT+COMMIT's duration
    (ms). Several connections share the schedule so that one slow commit
    does not hold up the next."""
    total = int(rate * seconds)
    lanes = min(16, max(1, math.ceil(rate / 100)))
    conns = [await connect(url) for _ in range(lanes)]
    commits: dict[str, tuple[float, float]] = {}
    durations: list[float] = []
    try:
        start = time.perf_counter() + 0.05

        async def lane(first: int, conn: Any) -> None:
            for i in range(first, total, lanes):
                due = start + i / rate
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                message_id = str(uuid.uuid4())
                began = time.perf_counter()
                await conn.execute(INSERT_ONE, (message_id, topic, payload(i).decode()))
                await conn.commit()
                commits[message_id] = (time.time(), i / rate)
                durations.append((time.perf_counter() - began) * 1000)

        await asyncio.gather(*(lane(j, c) for j, c in enumerate(conns)))
        achieved = total / (time.perf_counter() - start)
    finally:
        for conn in conns:
            await conn.close()
    return commits, achieved, durations


async def started_outbox(
    res: Resources, *extra: str, tag: str | None = None, ready: str = "outbox relay started"
) -> tuple[str, str, Proc]:
    """A fresh database, an exchange and its queue, and `relay outbox` on
    them (with `extra` arguments), started and listening: the database's
    URL, the queue, the daemon."""
    url = await res.database(tag)
    exchange, queue = res.names(tag)
    await res.bind_queue(exchange, queue)
    relay = res.relay(
        f"outbox{'-' + tag if tag else ''}", "outbox", *daemon_args(url, exchange), *extra
    )
    await relay.wait_log(ready, timeout=60)
    await asyncio.sleep(0.5)  # the LISTEN connection comes up next to the workers
    return url, queue, relay


def commit_to_receipt(
    commits: dict[str, tuple[float, float]], receipts: dict[str, float], seconds: float
) -> tuple[list[float], float]:
    """Each message's latency (ms) from its commit to its receipt, sorted,
    those of the warm-up left out, and the warm-up (s); every committed
    message must have arrived."""
    missing = [m for m in commits if m not in receipts]
    if missing:
        raise BenchError(
            f"{len(missing)} of {len(commits)} messages never arrived (e.g. {missing[0]})"
        )
    warmup = min(0.5, seconds / 4)
    latencies = sorted(
        (receipts[m] - committed) * 1000
        for m, (committed, offset) in commits.items()
        if offset >= warmup
    )
    return latencies, warmup


async def latency_at(
    res: Resources,
    report: Report,
    scenario: str,
    url: str,
    queue: str,
    rate: int,
    seconds: float,
    prefix: str = "",
) -> None:
    """Single-row transactions committed at `rate` a second for `seconds`
    into `url`, whose running `relay outbox` publishes to `queue`: the
    commit-to-receipt latency's percentiles (`{prefix}p50@{rate}`, ...), as
    bench.consumer receives them."""
    consumer, receipts_file = await res.consumer(f"consumer{prefix}{rate}", queue)
    commits, achieved, durations = await produce(url, "bench.latency", rate, seconds)
    receipts = await res.receipts(consumer, receipts_file, len(commits))
    latencies, warmup = commit_to_receipt(commits, receipts, seconds)
    report_latency(
        report, scenario, latencies, durations, achieved, rate, warmup, prefix, f"@{rate}"
    )


def report_latency(
    report: Report,
    scenario: str,
    latencies: list[float],
    durations: list[float],
    achieved: float,
    offered: float,
    warmup: float,
    prefix: str = "",
    suffix: str = "",
    **extra: Any,
) -> None:
    """The figures of a latency run: `{prefix}p50{suffix}`, p95, p99 and max
    of `latencies` (sorted, ms), the rate achieved against `offered`, and
    the producer's own INSERT+COMMIT (`durations`, ms) at p50 and p99."""
    extra = {
        "offered": offered,
        "achieved": round(achieved, 1),
        "messages": len(latencies),
        "warmup_s": warmup,
        **extra,
    }
    for q in (50, 95, 99):
        report.add(scenario, f"{prefix}p{q}{suffix}", percentile(latencies, q), "ms", **extra)
    report.add(scenario, f"{prefix}max{suffix}", latencies[-1], "ms")
    report.add(
        scenario,
        f"{prefix}achieved{suffix}",
        achieved,
        "msgs/s",
        note="offered rate not kept" if achieved < offered * 0.95 else None,
    )
    # The producer's own INSERT+COMMIT: a slow disk or a busy machine shows here.
    durations.sort()
    report.add(scenario, f"{prefix}commit_p50{suffix}", percentile(durations, 50), "ms")
    report.add(scenario, f"{prefix}commit_p99{suffix}", percentile(durations, 99), "ms")
