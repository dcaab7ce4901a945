"""`relay outbox --capture wal` beside polling, in the same run (issue 52).

On a cluster of the benchmark's own with `wal_level = logical`
(bench.pgserver), to RabbitMQ, for each mode in turn (poll, wal; `--rounds`
times, interleaved), each in a fresh database:

- idle: the transactions the database commits in `--idle` seconds while the
  daemon waits with nothing to do (pg_stat_database.xact_commit, the
  metrics' jobs included, as the issue's idle target counts them);
- drain: `--rows` rows committed in transactions of `--txn` while the daemon
  runs, as fast as one producer commits them: the rate from the first
  commit to the last row published, and the cluster's CPU (its processes'
  utime + stime) less the producer's own, measured alone in the same run.

    python -m bench.wal                      # 100,000 rows in transactions of 1,000
    python -m bench.wal --rows 20000 --idle 30 --rounds 1   # a small run

The results are printed and written to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import psycopg

from bench.common import (
    AMQP_URL,
    PAYLOAD_SQL,
    REPO,
    Proc,
    apply_schema,
    descendants,
    relay_command,
    relay_env,
)
from bench.cpu import TICK, cpu_seconds
from bench.pgserver import own_postgres

RESULTS = REPO / "bench" / "results"


def cluster_cpu(postmaster: int) -> float:
    """CPU seconds of the postmaster and its live processes so far, and of
    the backends that ended (their CPU is the postmaster's cutime, cstime)."""
    live = sum(cpu_seconds(pid) for pid in [postmaster, *descendants(postmaster)])
    try:
        fields = Path(f"/proc/{postmaster}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return live
    return live + (int(fields[13]) + int(fields[14])) / TICK


def postmaster_pid(data: Path) -> int:
    return int((data / "postmaster.pid").read_text().split()[0])


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


async def produce(url: str, rows: int, txn: int) -> float:
    """Commit `rows` in transactions of `txn`; the monotonic time of the first commit."""
    first = 0.0
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for start in range(0, rows, txn):
            async with conn.transaction():
                await conn.execute(
                    "INSERT INTO outbox (topic, type, payload) "
                    f"SELECT 'bench.wal', 'Bench', {PAYLOAD_SQL} "
                    "FROM generate_series(%s::bigint, %s::bigint) AS i",
                    (start + 1, min(start + txn, rows)),
                )
            if not first:
                first = time.monotonic()
    return first


async def published(url: str) -> int:
    row = await execute(url, "SELECT count(*) FROM outbox WHERE status = 'published'")
    return int(row[0])


async def one(
    mode: str, server_url: str, postmaster: int, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    url = await make_database(server_url)
    exchange = f"bench_wal_{uuid.uuid4().hex[:8]}"
    amqp = await aio_pika.connect(AMQP_URL)
    channel = await amqp.channel()
    ex = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
    queue = await channel.declare_queue(f"{exchange}.q", durable=True)
    await queue.bind(ex, "#")
    slot = f"bench_{uuid.uuid4().hex[:8]}"
    daemon = Proc(
        f"outbox-{mode}",
        [
            *relay_command(),
            "outbox",
            "--capture",
            mode,
            "--slot",
            slot,
            "--exchange",
            exchange,
            "--poll-interval",
            str(args.poll_interval),
        ],
        relay_env(RELAY_DATABASE_URL=url, RELAY_BROKER_URL=AMQP_URL),
        workdir / f"outbox-{mode}-{slot}.log",
    )
    try:
        await daemon.wait_log("reading replication slot" if mode == "wal" else "relay started")
        await asyncio.sleep(3.0)
        before = int((await execute(url, _COMMITS))[0])
        await asyncio.sleep(args.idle)
        idle = int((await execute(url, _COMMITS))[0]) - before
        cpu = cluster_cpu(postmaster)
        started = time.monotonic()
        producing = asyncio.ensure_future(produce(url, args.rows, args.txn))
        while await published(url) < args.rows:
            await asyncio.sleep(0.1)
        done = time.monotonic()
        first = await producing
        cpu = cluster_cpu(postmaster) - cpu
        return {
            "mode": mode,
            "idle_commits": idle,
            "idle_seconds": args.idle,
            "drain_rate": args.rows / (done - first),
            "wall_seconds": done - started,
            "cluster_cpu_seconds": cpu,
            "loadavg": os.getloadavg(),
        }
    finally:
        await daemon.stop()
        await queue.delete(if_unused=False, if_empty=False)
        await ex.delete()
        await amqp.close()
        if mode == "wal":
            await execute(url, "SELECT pg_drop_replication_slot(%s)", (slot,))
        await execute(
            f"{server_url}/postgres", f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)'
        )


_COMMITS = "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"


async def producer_alone(server_url: str, postmaster: int, args: argparse.Namespace) -> float:
    url = await make_database(server_url)
    try:
        cpu = cluster_cpu(postmaster)
        await produce(url, args.rows, args.txn)
        return cluster_cpu(postmaster) - cpu
    finally:
        await execute(
            f"{server_url}/postgres", f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)'
        )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-wal-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True)
    async with own_postgres(["wal_level=logical", "max_replication_slots=10"]) as server:
        postmaster = postmaster_pid(server.data)
        alone = await producer_alone(server.url, postmaster, args)
        runs = []
        for _ in range(args.rounds):
            for mode in ("poll", "wal"):
                result = await one(mode, server.url, postmaster, args, workdir)
                result["relay_pg_cpu_seconds"] = result["cluster_cpu_seconds"] - alone
                runs.append(result)
                print(json.dumps(result), flush=True)
    return {"rows": args.rows, "txn": args.txn, "producer_alone_cpu_seconds": alone, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--txn", type=int, default=1_000)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args()
    report = asyncio.run(run(args))
    polls = [r for r in report["runs"] if r["mode"] == "poll"]
    wals = [r for r in report["runs"] if r["mode"] == "wal"]
    print(f"producer alone: {report['producer_alone_cpu_seconds']:.2f} s of PostgreSQL CPU")
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
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{time.strftime('%Y-%m-%dT%H%M')}-issue52-wal.json"
    path.write_text(json.dumps(report, indent=2))
    print(path)


if __name__ == "__main__":
    main()
