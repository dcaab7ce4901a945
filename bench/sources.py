"""Issue 36: one `relay outbox` of many sources (schemas of one database).

    python -m bench.sources                      # 1, 10, 100 sources; the trickle of 100
    python -m bench.sources --counts 1 10 --trickle-seconds 10 --backlog 0

For each count: a PostgreSQL of the benchmark's own (bench.pgserver, with
max_connections raised: a source holds about six), that many schemas with
relay's tables, one `relay outbox --schema t1 … --schema tN`; once every
source has started and the daemon has idled `--settle` seconds, its memory
(RSS of the process) and the connections it holds (PostgreSQL's
pg_stat_activity, application_name relay).

Then, with the largest count: every source trickles (single-row
transactions spread round the sources, `--rate` in all) while, with
`--backlog N`, one more source drains N rows; the commit-to-receipt latency
of the trickle (each row's commit returned to its message read from
RabbitMQ, both clocks this process's). The result is printed and saved as
JSON under bench/results/.
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
    BenchError,
    Proc,
    free_port,
    loadavg,
    percentile,
    relay_command,
    relay_env,
)
from bench.harness import metrics
from bench.pgserver import own_postgres
from relay.db.schema import sql_script

# More `relay outbox` flags for every daemon here (--relay-arg).
EXTRA: list[str] = []


async def make_schemas(url: str, names: list[str]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        for name in names:
            await conn.execute(sql_script(name).encode())


async def relay_connections(url: str) -> int:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'relay'"
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def start_outbox(
    url: str, schemas: list[str], exchange: str, logs: Path, port: int, poll: float
) -> Proc:
    argv = [
        *relay_command(),
        "outbox",
        "--database-url",
        url,
        "--broker-url",
        AMQP_URL,
        "--exchange",
        exchange,
        "--http-port",
        str(port),
        "--poll-interval",
        str(poll),
        *EXTRA,
        *[arg for name in schemas for arg in ("--schema", name)],
    ]
    proc = Proc(f"outbox-{len(schemas)}", argv, relay_env(), logs / f"outbox-{len(schemas)}.log")
    deadline = time.monotonic() + 120
    while proc.log().count("outbox relay started") < len(schemas):
        if proc.popen.poll() is not None or time.monotonic() > deadline:
            raise BenchError(f"the outbox did not start its {len(schemas)} sources:\n{proc.tail()}")
        await asyncio.sleep(0.1)
    return proc


async def footprint(
    url: str, count: int, settle: float, exchange: str, logs: Path, poll: float
) -> dict[str, Any]:
    """Memory, connections and CPU of an idle outbox of `count` sources."""
    schemas = [f"s{count}_{i}" for i in range(count)]
    await make_schemas(url, schemas)
    proc = await start_outbox(url, schemas, exchange, logs, free_port(), poll)
    try:
        await asyncio.sleep(3)
        cpu, started = cpu_seconds(proc.pid), time.monotonic()
        await asyncio.sleep(settle)
        idle_cpu = (cpu_seconds(proc.pid) - cpu) / (time.monotonic() - started)
        proc.rss.sample()
        rss = [kb for _, kb in proc.rss.samples[-max(1, int(settle)) :]]
        return {
            "sources": count,
            "rss_mb": round(sum(rss) / len(rss) / 1024, 1),
            "peak_mb": round(proc.rss.hwm_kb / 1024, 1),
            "pg_connections": await relay_connections(url),
            "idle_cpu_pct": round(idle_cpu * 100, 1),
            "poll_interval": poll,
        }
    finally:
        await proc.stop()


async def trickle(
    url: str,
    count: int,
    rate: float,
    seconds: float,
    backlog: int,
    exchange: str,
    logs: Path,
    poll: float,
    settle: float,
) -> dict[str, Any]:
    """Commit-to-receipt latency of `count` trickling sources, beside a backlog."""
    schemas = [f"tr_{i}" for i in range(count)]
    busy = "tr_backlog"
    await make_schemas(url, [*schemas, busy])
    if backlog:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(
                f"INSERT INTO {busy}.outbox (topic, payload) "
                f"SELECT 'bench.backlog', {PAYLOAD_SQL} FROM generate_series(1, %s) i",
                (backlog,),
            )
            await conn.execute(f"ANALYZE {busy}.outbox")
    broker = await aio_pika.connect(AMQP_URL)
    channel = await broker.channel()
    ex = await channel.declare_exchange(exchange, "topic", durable=True)
    queue = await channel.declare_queue(f"{exchange}.trickle", exclusive=True)
    await queue.bind(ex, "bench.trickle")
    received: dict[str, float] = {}

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        received[str(message.message_id)] = time.monotonic()
        await message.ack()

    await queue.consume(on_message)
    port = free_port()
    proc = await start_outbox(url, [*schemas, busy], exchange, logs, port, poll)
    committed: dict[str, float] = {}
    try:
        await asyncio.sleep(settle)
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            interval, n = 1 / rate, 0
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                schema = schemas[n % count]
                message_id = str(uuid.uuid4())
                await conn.execute(
                    f"INSERT INTO {schema}.outbox (id, topic, payload) "
                    "VALUES (%s, 'bench.trickle', '{\"n\": 1}')",
                    (message_id,),
                )
                committed[message_id] = time.monotonic()
                n += 1
                await asyncio.sleep(max(0.0, start + n * interval - time.monotonic()))
        deadline = time.monotonic() + 30
        while len(received.keys() & committed.keys()) < len(committed):
            if time.monotonic() > deadline:
                raise BenchError(f"{len(committed) - len(received)} trickle rows never arrived")
            await asyncio.sleep(0.1)
        samples = await metrics(port)
        drained = samples.get(f'relay_outbox_published_total{{source="postgres/{busy}"}}', 0.0)
    finally:
        await proc.stop()
        await broker.close()
    latencies = sorted((received[i] - t) * 1000 for i, t in committed.items())
    return {
        "sources": count,
        "rows": len(latencies),
        "rate": rate,
        "backlog": backlog,
        "backlog_published_meanwhile": int(drained),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p95_ms": round(percentile(latencies, 95), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(latencies[-1], 2),
        "rss_peak_mb": round(proc.rss.hwm_kb / 1024, 1),
    }


async def drain_rate(
    url: str, rows: int, others: int, exchange: str, logs: Path, poll: float
) -> float:
    """Rows/s of one source's drain of `rows` rows (first to last published_at),
    by a relay of its own (others 0) or beside `others` idle sources."""
    busy = "dr_busy"
    idle = [f"dr_idle_{i}" for i in range(others)]
    await make_schemas(url, [busy, *idle])
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f"TRUNCATE {busy}.outbox")
        await conn.execute(
            f"INSERT INTO {busy}.outbox (topic, payload) "
            f"SELECT 'bench.drain', {PAYLOAD_SQL} FROM generate_series(1, %s) i",
            (rows,),
        )
        await conn.execute(f"VACUUM ANALYZE {busy}.outbox")
    proc = await start_outbox(url, [busy, *idle], exchange, logs, free_port(), poll)
    try:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            deadline = time.monotonic() + 600
            while True:
                cur = await conn.execute(
                    f"SELECT count(*) FILTER (WHERE status = 'pending'), "
                    "extract(epoch FROM max(published_at) - min(published_at)) "
                    f"FROM {busy}.outbox"
                )
                row = await cur.fetchone()
                assert row is not None
                if row[0] == 0:
                    return rows / float(row[1])
                if time.monotonic() > deadline:
                    raise BenchError(f"the drain did not finish:\n{proc.tail()}")
                await asyncio.sleep(0.5)
    finally:
        await proc.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "load": loadavg()}
    logs = REPO / "bench" / "results" / "sources-logs"
    logs.mkdir(parents=True, exist_ok=True)
    exchange = f"bench_sources_{uuid.uuid4().hex[:8]}"
    async with own_postgres(["max_connections=1000", "shared_buffers=256MB"]) as server:
        url = f"{server.url}/postgres"
        results["footprint"] = []
        for count in args.counts:
            figure = await footprint(url, count, args.settle, exchange, logs, args.poll_interval)
            print(json.dumps(figure), flush=True)
            results["footprint"].append(figure)
        if args.trickle_seconds:
            figure = await trickle(
                url,
                max(args.counts),
                args.rate,
                args.trickle_seconds,
                args.backlog,
                exchange,
                logs,
                args.poll_interval,
                args.settle,
            )
            print(json.dumps(figure), flush=True)
            results["trickle"] = figure
        if args.drain:
            alone, inside = [], []
            for _ in range(args.drain_rounds):
                alone.append(
                    await drain_rate(url, args.drain, 0, exchange, logs, args.poll_interval)
                )
                inside.append(
                    await drain_rate(url, args.drain, 9, exchange, logs, args.poll_interval)
                )
            figure = {
                "rows": args.drain,
                "alone_msgs_s": [round(r) for r in alone],
                "beside_9_idle_msgs_s": [round(r) for r in inside],
                "ratio": round(sum(inside) / sum(alone), 3),
            }
            print(json.dumps(figure), flush=True)
            results["drain"] = figure
    results["load_after"] = loadavg()
    broker = await aio_pika.connect(AMQP_URL)
    try:
        channel = await broker.channel()
        await channel.exchange_delete(exchange)  # declared by the daemons
    finally:
        await broker.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=200.0, help="trickle rows/s, all sources")
    parser.add_argument("--trickle-seconds", type=float, default=30.0)
    parser.add_argument("--backlog", type=int, default=200_000)
    parser.add_argument("--poll-interval", type=float, default=1.0)
    parser.add_argument("--drain", type=int, default=100_000, help="rows; 0: no drain")
    parser.add_argument("--drain-rounds", type=int, default=2)
    parser.add_argument(
        "--relay-arg", action="append", default=[], help="a flag for relay outbox (repeatable)"
    )
    args = parser.parse_args()
    EXTRA.extend(arg for given in args.relay_arg for arg in given.split())
    results = asyncio.run(run(args))
    out = REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%dT%H%M')}-sources.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
