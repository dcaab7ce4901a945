"""Issue 36: one `relay outbox` of many sources (schemas of one database).

    python -m bench.sources                      # 1, 10, 100 sources; the trickle of 100
    python -m bench.sources --counts 1 10 --trickle-seconds 10 --backlog 0

For each count: a PostgreSQL of the benchmark's own (bench.pgserver, with
max_connections raised: a source holds about six), that many schemas with
relay's tables, one `relay outbox --schema t1 … --schema tN`; once every
source has started and the daemon has idled `--settle` seconds, its memory
(RSS of the process) and the connections it holds (PostgreSQL's
pg_stat_activity, application_name relay).

Then, with the largest count (or `--trickle-sources`): every source
trickles (single-row transactions spread round the sources, `--rate` in
all; `--keyed`: each row with a key, eight keys a source) while, with
`--backlog N`, one more source drains N rows; the commit-to-receipt latency
of the trickle (each row's commit returned to its message read from
RabbitMQ, both clocks this process's), and the CPU of the relay and of the
PostgreSQL server (all its processes) over the trickle. With
`--backlog-after S` the backlog is committed S seconds into the trickle
(the relay running), so that the trickle overlaps the whole drain; its
drain rate (first to last `published_at`) is then set beside a relay of
that source alone draining as many rows in the same run (`--drain-alone`).
The result is printed and saved as JSON under bench/results/.

Issue 45's scenario (99 keyed trickles of 2 rows a second beside a
100,000-row backlog, 100 sources)::

    python -m bench.sources --issue45
    python -m bench.sources --issue45 --backlog-apart   # the backlog's source in a relay of its own
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
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
from bench.pgserver import OwnPostgres, own_postgres
from relay.db.schema import sql_script

# How long the trickle scenario waits for its backlog to drain after the
# trickle (then reports the rows left and the rate until then).
DRAIN_WAIT = 300.0
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


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name (field 3 on)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_seconds(server: OwnPostgres) -> float:
    """CPU time of a PostgreSQL server so far: the postmaster's, its ended
    children's (which it has reaped) and its running children's."""
    postmaster = int((server.data / "postmaster.pid").read_text().split()[0])
    fields = _stat(postmaster)
    total = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                child = _stat(int(entry))
            except OSError:
                continue  # ended meanwhile
            if int(child[1]) == postmaster:
                total += int(child[11]) + int(child[12])
    return total / os.sysconf("SC_CLK_TCK")


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


async def fill_backlog(url: str, schema: str, rows: int, topic: str) -> None:
    """`rows` keyless rows in `schema`'s outbox, committed in one transaction."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            f"INSERT INTO {schema}.outbox (topic, payload) "
            f"SELECT %s, {PAYLOAD_SQL} FROM generate_series(1, %s) i",
            (topic, rows),
        )
        await conn.execute(f"ANALYZE {schema}.outbox")


async def drained(url: str, schema: str) -> tuple[int, float | None, float | None]:
    """Pending rows of `schema`'s outbox, and its first and last published_at
    (epoch seconds)."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FILTER (WHERE status = 'pending'), "
            "extract(epoch FROM min(published_at)), extract(epoch FROM max(published_at)) "
            f"FROM {schema}.outbox"
        )
        row = await cur.fetchone()
        assert row is not None
        first, last = (None if v is None else float(v) for v in row[1:])
        return int(row[0]), first, last


async def sample_activity(url: str, stop: asyncio.Event, every: float = 0.1) -> dict[str, Any]:
    """relay's sessions in pg_stat_activity every `every` seconds until
    `stop`: the mean and the most of them in each state and wait, and what
    the sessions idle in a transaction ran last."""
    counts: dict[str, list[int]] = {}
    last_queries: dict[str, int] = {}
    samples = 0
    # (seconds into the sampling, sessions in a transaction) when over 20.
    bursts: list[tuple[float, int]] = []
    began = time.monotonic()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while not stop.is_set():
            # Counted by the server: hundreds of sessions, a few rows back
            # (the sampling's own cost is the machine's, beside the relay's).
            cur = await conn.execute(
                "SELECT state, coalesce(wait_event_type || ':' || wait_event, ''), count(*), "
                "array_agg(left(query, 60)) FILTER (WHERE state = 'idle in transaction') "
                "FROM pg_stat_activity WHERE application_name = 'relay' GROUP BY 1, 2"
            )
            seen: dict[str, int] = {}
            for state, wait, n, lasts in await cur.fetchall():
                name = f"{state} {wait}".strip()
                seen[name] = seen.get(name, 0) + n
                for last in lasts or ():
                    last_queries[last] = last_queries.get(last, 0) + 1
            open_now = sum(n for name, n in seen.items() if "in transaction" in name)
            if open_now > 20:
                bursts.append((round(time.monotonic() - began, 2), open_now))
            for name in seen.keys() | counts.keys():
                counts.setdefault(name, [0] * samples).append(seen.get(name, 0))
            samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
    return {
        "samples": samples,
        "sessions": {
            name: {"mean": round(sum(n) / max(1, samples), 1), "max": max(n)}
            for name, n in sorted(counts.items())
        },
        "idle_in_transaction_after": dict(sorted(last_queries.items(), key=lambda kv: -kv[1])[:5]),
        "over_20_in_transaction_at": bursts[:20],
    }


async def transactions(url: str) -> int:
    """Transactions committed and rolled back in `url`'s database so far."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database "
            "WHERE datname = current_database()"
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0


def latency_figures(latencies: list[float]) -> dict[str, float]:
    latencies = sorted(latencies)
    if not latencies:
        return {}
    return {
        "rows": len(latencies),
        "p50_ms": round(percentile(latencies, 50), 2),
        "p95_ms": round(percentile(latencies, 95), 2),
        "p99_ms": round(percentile(latencies, 99), 2),
        "max_ms": round(latencies[-1], 2),
    }


async def trickle(
    server: OwnPostgres,
    count: int,
    rate: float,
    seconds: float,
    backlog: int,
    exchange: str,
    logs: Path,
    poll: float,
    settle: float,
    *,
    keyed: bool = False,
    backlog_after: float | None = None,
    apart: bool = False,
) -> dict[str, Any]:
    """Commit-to-receipt latency of `count` trickling sources, beside a backlog
    (committed before the relay starts, or `backlog_after` seconds into the
    trickle), and the CPU of the relay and of PostgreSQL meanwhile. `apart`:
    the backlog's source in a `relay outbox` of its own (what sources spread
    over processes could at best give; the relay CPU is then the trickles')."""
    url = f"{server.url}/postgres"
    schemas = [f"tr_{i}" for i in range(count)]
    busy = "tr_backlog"
    await make_schemas(url, [*schemas, busy])
    if backlog and backlog_after is None:
        await fill_backlog(url, busy, backlog, "bench.backlog")
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
    if apart:
        proc = await start_outbox(url, schemas, exchange, logs, free_port(), poll)
        backlog_proc = await start_outbox(url, [busy], exchange, logs, port, poll)
    else:
        proc = backlog_proc = await start_outbox(url, [*schemas, busy], exchange, logs, port, poll)
    committed: dict[str, float] = {}
    backlog_task: asyncio.Task[None] | None = None
    wall = time.time() - time.monotonic()  # monotonic + wall: the epoch
    try:
        await asyncio.sleep(settle)
        cpu = {"relay": cpu_seconds(proc.pid), "postgresql": server_cpu_seconds(server)}
        load = loadavg()
        xacts = await transactions(url)
        sampling = asyncio.Event()
        sampler = asyncio.create_task(sample_activity(url, sampling))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            interval, n = 1 / rate, 0
            start = time.monotonic()
            while time.monotonic() - start < seconds:
                late = backlog_after is not None and time.monotonic() - start >= backlog_after
                if backlog and late and backlog_task is None:
                    backlog_task = asyncio.create_task(
                        fill_backlog(url, busy, backlog, "bench.backlog")
                    )
                schema = schemas[n % count]
                message_id = str(uuid.uuid4())
                key = f"k{n // count % 8}" if keyed else None
                await conn.execute(
                    f"INSERT INTO {schema}.outbox (id, topic, key, payload) "
                    "VALUES (%s, 'bench.trickle', %s, '{\"n\": 1}')",
                    (message_id, key),
                )
                committed[message_id] = time.monotonic()
                n += 1
                await asyncio.sleep(max(0.0, start + n * interval - time.monotonic()))
            elapsed = time.monotonic() - start
        sampling.set()
        activity = await sampler
        # Every transaction in the database meanwhile (the relay's claims,
        # empty or not, its jobs', the producers' and the backlog's own).
        activity["transactions_per_trickle_row"] = round(
            (await transactions(url) - xacts) / max(1, len(committed)), 2
        )
        cpu = {
            name: round((now - cpu[name]) / elapsed * 100, 1)
            for name, now in (
                ("relay", cpu_seconds(proc.pid)),
                ("postgresql", server_cpu_seconds(server)),
            )
        }
        if backlog_task is not None:
            await backlog_task
        # Late rows and an undrained backlog are reported, not fatal: a
        # relay that falls behind on a busy machine still gives figures.
        deadline = time.monotonic() + 60
        while len(received.keys() & committed.keys()) < len(committed):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        deadline = time.monotonic() + DRAIN_WAIT
        while backlog and (left := (await drained(url, busy))[0]):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        samples = await metrics(port)
        published = samples.get(f'relay_outbox_published_total{{source="postgres/{busy}"}}', 0.0)
    finally:
        await proc.stop()
        if backlog_proc is not proc:
            await backlog_proc.stop()
        await broker.close()
    figure: dict[str, Any] = {
        "backlog_apart": apart,
        "sources": count + 1 if backlog else count,
        "trickling": count,
        "keyed": keyed,
        "rate": rate,
        "seconds": seconds,
        "load_before": load,
        "load_after": loadavg(),
        "backlog": backlog,
        # As many as the trickle's seconds held (fewer when commits ran late).
        "committed": len(committed),
        **latency_figures(
            [(received[i] - t) * 1000 for i, t in committed.items() if i in received]
        ),
        "not_arrived_in_60s": len(committed.keys() - received.keys()),
        # When (seconds into the trickle) rows took over 50 ms, the first 20.
        "over_50ms_at": sorted(
            round(t - start, 2)
            for i, t in committed.items()
            if i in received and received[i] - t > 0.05
        )[:20],
        "cpu_pct": cpu,
        "rss_peak_mb": round(proc.rss.hwm_kb / 1024, 1),
        "activity": activity,
    }
    if backlog and backlog_after is None:
        figure["backlog_published_meanwhile"] = int(published)
    elif backlog:
        left, first, last = await drained(url, busy)
        assert first is not None and last is not None
        # The trickle's rows committed while the backlog drained.
        during = [
            (received[i] - t) * 1000
            for i, t in committed.items()
            if i in received and first <= t + wall <= last
        ]
        figure["during_drain"] = latency_figures(during)
        figure["backlog_left_undrained"] = left
        figure["backlog_msgs_s"] = round((backlog - left) / (last - first))
    return figure


async def drain_rate(
    url: str, rows: int, others: int, exchange: str, logs: Path, poll: float, *, vacuum: bool = True
) -> float:
    """Rows/s of one source's drain of `rows` rows (first to last published_at),
    by a relay of its own (others 0) or beside `others` idle sources."""
    busy = "dr_busy"
    idle = [f"dr_idle_{i}" for i in range(others)]
    await make_schemas(url, [busy, *idle])
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(f"TRUNCATE {busy}.outbox")
    await fill_backlog(url, busy, rows, "bench.drain")
    if vacuum:
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(f"VACUUM ANALYZE {busy}.outbox")
    proc = await start_outbox(url, [busy, *idle], exchange, logs, free_port(), poll)
    try:
        deadline = time.monotonic() + 600
        while True:
            pending, first, last = await drained(url, busy)
            if not pending and first is not None and last is not None:
                return rows / (last - first)
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
                server,
                args.trickle_sources or max(args.counts),
                args.rate,
                args.trickle_seconds,
                args.backlog,
                exchange,
                logs,
                args.poll_interval,
                args.settle,
                keyed=args.keyed,
                backlog_after=args.backlog_after,
                apart=args.backlog_apart,
            )
            if args.drain_alone and args.backlog:
                # The same rows drained by a relay of that source alone: as
                # in the trickle, committed just before (no VACUUM).
                alone_rate = await drain_rate(
                    url, args.backlog, 0, exchange, logs, args.poll_interval, vacuum=False
                )
                figure["backlog_alone_msgs_s"] = round(alone_rate)
                if "backlog_msgs_s" in figure:
                    figure["backlog_ratio"] = round(figure["backlog_msgs_s"] / alone_rate, 3)
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
    parser.add_argument("--trickle-sources", type=int, help="default: the largest of --counts")
    parser.add_argument("--keyed", action="store_true", help="trickle rows with keys")
    parser.add_argument(
        "--backlog-after",
        type=float,
        help="commit the backlog this many seconds into the trickle (default: before)",
    )
    parser.add_argument(
        "--drain-alone",
        action="store_true",
        help="then drain --backlog rows by a relay of that source alone",
    )
    parser.add_argument(
        "--backlog-apart",
        action="store_true",
        help="the backlog's source in a relay of its own, beside the trickles' relay",
    )
    parser.add_argument(
        "--issue45",
        action="store_true",
        help="issue 45's scenario: 99 keyed trickles of 2 rows/s, a 100,000-row backlog "
        "committed 5 s in, the drain alone after; no footprint",
    )
    args = parser.parse_args()
    if args.issue45:
        args.counts, args.trickle_sources, args.keyed = [], 99, True
        args.rate, args.backlog, args.backlog_after = 198.0, 100_000, 5.0
        args.drain, args.drain_alone = 0, True
    EXTRA.extend(arg for given in args.relay_arg for arg in given.split())
    results = asyncio.run(run(args))
    out = REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%dT%H%M')}-sources.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"saved {out.relative_to(REPO)}")
    trickled = results.get("trickle", {})
    if trickled.get("not_arrived_in_60s") or trickled.get("backlog_left_undrained"):
        sys.exit("rows were lost or left: see not_arrived_in_60s, backlog_left_undrained")


if __name__ == "__main__":
    main()
