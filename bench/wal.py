"""`relay outbox --capture wal` beside polling, in the same run (issue 52).

On a cluster of the benchmark's own with `wal_level = logical`
(bench.pgserver), to RabbitMQ or (`--broker kafka`) to a Kafka topic of six
partitions on Tansu, started as bench.kafka starts it, for each mode in
turn (poll, wal; `--rounds` times, interleaved), each in a fresh database
(and a fresh exchange or topic):

- idle: the transactions the database commits in `--idle` seconds while the
  daemon waits with nothing to do (pg_stat_database.xact_commit, the
  metrics' jobs included, as the issue's idle target counts them);
- drain: `--rows` rows committed in transactions of `--txn` while the daemon
  runs, as fast as one producer commits them: the rate from the first
  commit to the last row published, and the cluster's CPU (its processes'
  utime + stime) less the producer's own, measured alone in the same run;
- backlog (`--backlog N`, after the drains): the daemon started once (with
  `--capture wal` its slot is made), stopped, N rows committed in
  transactions of `--txn` meanwhile, then the daemon again until all are
  published: the rate over the first fifth of the rows and over the last.

    python -m bench.wal                      # 100,000 rows in transactions of 1,000
    python -m bench.wal --rows 20000 --idle 30 --rounds 1   # a small run
    python -m bench.wal --broker kafka       # the same to Kafka
    python -m bench.wal --rows 0 --backlog 1000000   # the backlog alone (below)

The results are printed and written to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika
import psycopg

from bench.backlog import fifths, window_rate
from bench.common import (
    AMQP_URL,
    PAYLOAD_SQL,
    REPO,
    BenchError,
    Proc,
    Resources,
    apply_schema,
    batch_times,
    descendants,
    free_port,
    relay_command,
    relay_env,
)
from bench.cpu import TICK, cpu_seconds
from bench.harness import Report, Sizes, started_outbox, wait_metric
from bench.kafka import URL_PARAMS as KAFKA_URL_PARAMS
from bench.kafka import drop_topic, make_topic
from bench.pgserver import own_postgres
from bench.reference import offered_latency

RESULTS = REPO / "bench" / "results"
# The cluster's settings for WAL capture (the rest PostgreSQL's defaults).
WAL_SETTINGS = ("wal_level=logical", "max_replication_slots=10")


def cluster_cpu(postmaster: int) -> float:
    """CPU seconds of the postmaster and its live processes so far, and of
    the backends that ended (their CPU is the postmaster's cutime, cstime)."""
    return sum(cluster_cpu_by_kind(postmaster).values())


def postmaster_pid(data: Path) -> int:
    return int((data / "postmaster.pid").read_text().split()[0])


def cluster_cpu_by_kind(postmaster: int) -> dict[str, float]:
    """The cluster's CPU seconds so far by kind of process (walsender,
    autovacuum, checkpointer, ..., a client's backend: "backend"; the
    backends that ended: "ended")."""
    kinds: dict[str, float] = {}
    for pid in descendants(postmaster):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        title = title.split(":", 1)[-1]
        kind = next(
            (
                k
                for k in (
                    "walsender",
                    "autovacuum",
                    "checkpointer",
                    "background writer",
                    "walwriter",
                    "logical replication",
                    "stats",
                )
                if k in title
            ),
            "backend",
        )
        kinds[kind] = kinds.get(kind, 0.0) + cpu_seconds(pid)
    try:
        fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
        kinds["ended"] = (int(fields[13]) + int(fields[14])) / TICK
    except OSError:
        pass
    kinds["postmaster"] = cpu_seconds(postmaster)
    return kinds


def _less(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}


async def execute(url: str, sql: str, params: Any = None) -> Any:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cursor = await conn.execute(sql, params)
        return await cursor.fetchone() if cursor.description else None


async def make_database(server_url: str) -> str:
    name = f"bench_wal_{uuid.uuid4().hex[:8]}"
    await execute(f"{server_url}/postgres", f'CREATE DATABASE "{name}"')
    url = f"{server_url}/{name}"
    await apply_schema(url)
    return url


async def produce(url: str, rows: int, txn: int, topic: str = "bench.wal") -> float:
    """Commit `rows` in transactions of `txn` (to `topic`); the monotonic
    time of the first commit."""
    first = 0.0
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for start in range(0, rows, txn):
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO outbox (topic, type, payload) "
                    f"SELECT %s, 'Bench', {PAYLOAD_SQL} "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (topic, start + 1, min(start + txn, rows)),
                )
            if not first:
                first = time.monotonic()
    return first


async def published(url: str) -> int:
    row = await execute(url, "SELECT count(*) FROM outbox WHERE status = 'published'")
    return int(row[0])


@contextlib.asynccontextmanager
async def target(
    mode: str, server_url: str, args: argparse.Namespace, workdir: Path, kafka: Any
) -> AsyncIterator[Target]:
    """A fresh database and exchange (or Kafka topic) for one mode's run,
    and the daemon's command for them; all dropped after (the slot too)."""
    url = await make_database(server_url)
    name = f"bench_wal_{uuid.uuid4().hex[:8]}"
    amqp: Any = None
    if kafka is None:
        topic = "bench.wal"
        amqp = await aio_pika.connect(AMQP_URL)
        channel = await amqp.channel()
        ex = await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
        queue = await channel.declare_queue(f"{name}.q", durable=True)
        await queue.bind(ex, "#")
        broker = AMQP_URL
    else:
        topic = name
        await asyncio.to_thread(make_topic, kafka.bootstrap, topic)
        broker = f"kafka://{kafka.bootstrap}?{KAFKA_URL_PARAMS}"
    slot = f"bench_{uuid.uuid4().hex[:8]}"
    port = free_port()
    made = Target(
        url=url,
        topic=topic,
        port=port,
        argv=[
            *relay_command(),
            "outbox",
            *("--capture", mode, "--slot", slot),
            *(["--exchange", name] if kafka is None else []),
            *("--poll-interval", str(args.poll_interval), "--http-port", str(port)),
        ],
        env=relay_env(RELAY_DATABASE_URL=url, RELAY_BROKER_URL=broker),
        log=workdir / f"outbox-{mode}-{slot}",
        ready="reading replication slot" if mode == "wal" else "relay started",
    )
    try:
        yield made
    finally:
        for daemon in made.daemons:
            await daemon.stop()
        if kafka is None:
            await queue.delete(if_unused=False, if_empty=False)
            await ex.delete()
            await amqp.close()
        else:
            await asyncio.to_thread(drop_topic, kafka.bootstrap, topic)
        await drop_slot(url, slot)
        await execute(
            f"{server_url}/postgres", f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)'
        )


@dataclasses.dataclass
class Target:
    url: str
    topic: str
    port: int
    argv: list[str]
    env: dict[str, str]
    log: Path
    ready: str
    daemons: list[Proc] = dataclasses.field(default_factory=list)

    async def start(self) -> Proc:
        """The daemon, started and reading (its slot, or the table)."""
        daemon = Proc(
            "outbox", self.argv, self.env, self.log.with_suffix(f".{len(self.daemons)}.log")
        )
        self.daemons.append(daemon)
        await daemon.wait_log(self.ready)
        return daemon


async def one(
    mode: str,
    server_url: str,
    postmaster: int,
    args: argparse.Namespace,
    workdir: Path,
    kafka: Any = None,
) -> dict[str, Any]:
    async with target(mode, server_url, args, workdir, kafka) as made:
        url = made.url
        daemon = await made.start()
        await asyncio.sleep(3.0)
        before = int((await execute(url, _COMMITS))[0])
        await asyncio.sleep(args.idle)
        idle = int((await execute(url, _COMMITS))[0]) - before
        kinds = cluster_cpu_by_kind(postmaster)
        started = time.monotonic()
        producing = asyncio.ensure_future(produce(url, args.rows, args.txn, made.topic))
        # Watched on the daemon's /metrics: the bench's own questions to the
        # database would count as relay's CPU.
        done = await wait_metric(
            daemon, made.port, "relay_outbox_published_total", args.rows, timeout=900, interval=0.05
        )
        first = await producing
        after = cluster_cpu_by_kind(postmaster)
        cpu = sum(after.values()) - sum(kinds.values())
        kinds = _less(after, kinds)
        if await published(url) < args.rows:
            raise BenchError("relay_outbox_published_total counted rows that are not published")
        return {
            "cpu_by_kind": kinds,
            "mode": mode,
            "broker": "rabbitmq" if kafka is None else "kafka",
            "idle_commits": idle,
            "idle_seconds": args.idle,
            "drain_rate": args.rows / (done - first),
            "wall_seconds": done - started,
            "cluster_cpu_seconds": cpu,
            "loadavg": os.getloadavg(),
        }


async def backlog(
    mode: str, server_url: str, args: argparse.Namespace, workdir: Path, kafka: Any = None
) -> dict[str, Any]:
    """The issue's backlog: the daemon started once (its slot made), stopped,
    `--backlog` rows committed in transactions of `--txn` meanwhile, then the
    daemon again until all are published: the rate over the first fifth of
    the rows and over the last, from the marks' transactions."""
    async with target(mode, server_url, args, workdir, kafka) as made:
        once = await made.start()
        await once.stop()
        made.daemons.remove(once)
        await produce(made.url, args.backlog, args.txn, made.topic)
        await execute(made.url, "CHECKPOINT")
        daemon = await made.start()
        await wait_metric(
            daemon,
            made.port,
            "relay_outbox_published_total",
            args.backlog,
            timeout=3600,
            interval=0.5,
        )
        points = await batch_times(made.url, "outbox")
        first, last = fifths(points)
        return {
            "mode": mode,
            "broker": "rabbitmq" if kafka is None else "kafka",
            "backlog": args.backlog,
            "first_fifth": first,
            "last_fifth": last,
            "last_over_first": last / first if first and last else None,
            "fifths": [window_rate(points, i / 5, (i + 1) / 5) for i in range(5)],
            "whole": window_rate(points, 0.0, 1.0),
            "loadavg": os.getloadavg(),
        }


async def scenario_wal_latency(res: Resources, sz: Sizes, report: Report) -> None:
    """Issue 52's latency: single-row transactions offered at 2,000 msgs/s
    by bench.reference's producer processes (as `latency_offered` offers
    them: one process alone does not keep that rate here), through
    `relay outbox` polling and then with `--capture wal`, on one cluster
    with `wal_level = logical` (bench.run starts it, WAL_SETTINGS): the
    commit-to-receipt percentiles of each, `poll_p50`, `wal_p50`, ..."""
    for mode in ("poll", "wal"):
        slot = f"bench_{uuid.uuid4().hex[:8]}"
        url, queue, relay = await started_outbox(
            res,
            *("--capture", mode, "--slot", slot),
            tag=f"wal_{mode}",
            ready="reading replication slot" if mode == "wal" else "outbox relay started",
        )
        try:
            await offered_latency(
                res, report, "wal_latency", url, queue, sz.latency_seconds, f"{mode}_"
            )
            if relay.popen.poll() is not None:
                raise BenchError(f"relay outbox exited {relay.popen.returncode}:\n{relay.tail()}")
        finally:
            await relay.stop()
            if mode == "wal":  # a database with a slot cannot be dropped
                await drop_slot(url, slot)
    poll, wal = report.get("wal_latency", "poll_p99"), report.get("wal_latency", "wal_p99")
    if poll and wal:
        report.add("wal_latency", "wal_over_poll_p99", wal / poll, "x")


async def drop_slot(url: str, slot: str) -> None:
    """The replication slot `slot` of the database at `url`, if there is one."""
    await execute(
        url,
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    )


_COMMITS = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"


async def producer_alone(
    server_url: str, postmaster: int, args: argparse.Namespace
) -> tuple[float, float]:
    """The producer alone, no daemon: the cluster's CPU seconds it cost, and
    its rate of rows committed (a bound on any drain measured while it
    commits)."""
    url = await make_database(server_url)
    try:
        cpu = cluster_cpu(postmaster)
        started = time.monotonic()
        await produce(url, args.rows, args.txn)
        seconds = time.monotonic() - started
        return cluster_cpu(postmaster) - cpu, args.rows / seconds if seconds else 0.0
    finally:
        await execute(
            f"{server_url}/postgres", f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)'
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-wal-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    kafka = None
    if args.broker == "kafka":
        from tests.kafka_server import KafkaServer

        kafka = await asyncio.to_thread(
            functools.partial(KafkaServer, workdir / "tansu.log", proxied=False)
        )
    try:
        async with own_postgres(WAL_SETTINGS) as server:
            postmaster = postmaster_pid(server.data)
            alone, alone_rate = await producer_alone(server.url, postmaster, args)
            runs = []
            for _ in range(args.rounds if args.rows else 0):
                for mode in ("poll", "wal"):
                    result = await one(mode, server.url, postmaster, args, workdir, kafka)
                    result["relay_pg_cpu_seconds"] = result["cluster_cpu_seconds"] - alone
                    runs.append(result)
                    print(json.dumps(result), flush=True)
            backlogs = []
            for _ in range(args.rounds if args.backlog else 0):
                for mode in ("poll", "wal"):
                    result = await backlog(mode, server.url, args, workdir, kafka)
                    backlogs.append(result)
                    print(json.dumps(result), flush=True)
    finally:
        if kafka is not None:
            await asyncio.to_thread(kafka.close)
    return {
        "rows": args.rows,
        "txn": args.txn,
        "broker": args.broker,
        "producer_alone_cpu_seconds": alone,
        "producer_alone_rows_per_s": alone_rate,
        "runs": runs,
        "backlogs": backlogs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--txn", type=int, default=1_000)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--broker", choices=("rabbitmq", "kafka"), default="rabbitmq")
    parser.add_argument(
        "--backlog",
        type=int,
        default=0,
        help="then this many rows committed while the daemon is stopped, then drained, "
        "each mode --rounds times (the issue's 1,000,000; 0: not run)",
    )
    parser.add_argument("--out", type=Path, help="the report's file (default: bench/results/)")
    args = parser.parse_args()
    report = asyncio.run(run(args))
    polls = [r for r in report["runs"] if r["mode"] == "poll"]
    wals = [r for r in report["runs"] if r["mode"] == "wal"]
    print(
        f"producer alone: {report['producer_alone_cpu_seconds']:.2f} s of PostgreSQL CPU, "
        f"{report['producer_alone_rows_per_s']:,.0f} rows/s committed"
    )
    print("mode  idle commits  drain msgs/s  relay's PostgreSQL CPU s")
    for r in report["runs"]:
        print(
            f"{r['mode']:<5} {r['idle_commits']:>12}  {r['drain_rate']:>12,.0f}  "
            f"{r['relay_pg_cpu_seconds']:>10.2f}"
        )
    if polls and wals:
        for p, w in zip(polls, wals, strict=True):
            cpu = w["relay_pg_cpu_seconds"] / max(p["relay_pg_cpu_seconds"], 1e-9)
            print(
                f"wal / poll: drain {w['drain_rate'] / p['drain_rate']:.2f} x, "
                f"PostgreSQL CPU {cpu:.2f} x, "
                f"idle commits {w['idle_commits'] / max(p['idle_commits'], 1):.2f} x"
            )
    for b in report["backlogs"]:
        print(
            f"backlog {b['backlog']:,} {b['mode']:<5} first fifth {b['first_fifth'] or 0:,.0f}, "
            f"last {b['last_fifth'] or 0:,.0f} msgs/s: {b['last_over_first'] or 0:.2f} x"
        )
    RESULTS.mkdir(exist_ok=True)
    path = args.out or RESULTS / f"{time.strftime('%Y-%m-%dT%H%M')}-issue52-wal-{args.broker}.json"
    path.write_text(json.dumps(report, indent=2))
    print(path)


if __name__ == "__main__":
    main()
