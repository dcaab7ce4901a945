"""Issue 53's Redis Streams scenario: relay on a redis-server of its own
beside references measured in the same run.

    .venv/bin/python -m bench.run --only redis           # 100,000 rows; --quick: 5,000

- `pg`: the database's own claim-and-mark (bench.limits.limit_pg) over N rows;
- `redis`: redis-benchmark sending relay's fields (`XADD` with `id`,
  `payload` of 200 bytes, `type`, `key`) down one connection, pipelined
  512 deep: what Redis takes from one client, the broker side alone;
- `floor`: the serial floor 1 / (1/pg + 1/redis);
- `outbox`: `relay outbox --once` over N rows of 100 keys to one stream,
  its steady rate from the batches' timestamps, and over the floor;
- `inbox_batch`: `relay inbox` with a batch handler (bench.handlers:batch)
  over the N entries the outbox wrote, as a consumer group, its steady rate
  and over the outbox's (the Redis drain);
- `*_relay_us_per_msg`, `*_pg_us_per_msg`: the CPU a message of relay's
  processes and of the database's backends (bench.kafka.Spent).

The server is reached directly (no test proxy): the proxy copies every
byte in Python, a bound of its own.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import uuid

from bench import limits
from bench.backlog import KEYS, MEASURED_TOPIC, preload_outbox
from bench.common import BenchError, Resources, payload, steady_rate
from bench.harness import Report, Sizes
from bench.kafka import run_inbox, run_outbox
from relay.outbox import WORKERS

PIPELINE = 512


def limit_redis(port: int, count: int) -> float:
    """XADDs a second redis-benchmark sends with relay's fields, one
    connection, PIPELINE deep (its -q line: "…: N requests per second")."""
    benchmark = shutil.which("redis-benchmark")
    if benchmark is None:
        raise BenchError("redis-benchmark is not installed")
    done = subprocess.run(
        [
            benchmark,
            "-p",
            str(port),
            "-c",
            "1",
            "-P",
            str(PIPELINE),
            "-n",
            str(count),
            "-q",
            "XADD",
            "bench.bare",
            "*",
            "id",
            str(uuid.uuid4()),
            "payload",
            payload(0).decode(),
            "type",
            "Bench",
            "key",
            f"k{KEYS - 1}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    rates = re.findall(r"([0-9.]+) requests per second", done.stdout)
    if not rates:
        raise BenchError(f"redis-benchmark said nothing of XADD: {done.stdout[-500:]}")
    return float(rates[-1])


async def scenario_redis(res: Resources, sz: Sizes, report: Report) -> None:
    from tests.redis_server import RedisServer

    count = sz.redis
    workdir = res.workdir / "redis"
    workdir.mkdir(exist_ok=True)
    server = await asyncio.to_thread(RedisServer, workdir)
    try:
        url = await res.database("redispg")
        await preload_outbox(url, count)
        rows, seconds = await limits.limit_pg(url, batch=500, workers=WORKERS)
        if rows != count:
            raise BenchError(f"claimed {rows} of {count} rows")
        pg = rows / seconds
        await res.drop_database(url)
        redis = await asyncio.to_thread(limit_redis, server.port, count)
        floor = 1 / (1 / pg + 1 / redis)
        report.add("redis", "pg", pg, "rows/s", messages=count)
        report.add("redis", "redis", redis, "msgs/s", pipeline=PIPELINE)
        report.add("redis", "floor", floor, "msgs/s", formula="1 / (1/pg + 1/redis)")

        broker = server.url(direct=True)
        url = await res.database("redis")
        outbox_points, outbox_cpu = await run_outbox(res, url, broker, count)
        outbox = steady_rate(outbox_points)
        if outbox is None:
            raise BenchError("too few outbox batches for a steady rate: use more messages")
        report.add("redis", "outbox", outbox, "msgs/s", messages=count)
        report.add("redis", "outbox_over_floor", outbox / floor, "x")

        inbox_points, inbox_cpu = await run_inbox(res, url, broker, MEASURED_TOPIC, count)
        handled = steady_rate(inbox_points)
        if handled is None:
            raise BenchError("too few inbox batches for a steady rate: use more messages")
        report.add("redis", "inbox_batch", handled, "msgs/s", messages=count)
        report.add("redis", "inbox_batch_over_drain", handled / outbox, "x")
        await res.drop_database(url)
        outbox_cpu.report(report, "redis", "outbox", count)
        inbox_cpu.report(report, "redis", "inbox", count)
    finally:
        await asyncio.to_thread(server.close)
