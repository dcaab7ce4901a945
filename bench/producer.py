"""One process of the latency scenario's producer (issue 21): several of
these together offer 2,000 single-row transactions a second, which one
Python process could not (it reached 1,430-1,822 here).

    python -m bench.producer --database-url URL --topic T --rate R --seconds S
        --out FILE [--lanes N] [--offset K --stride P]

Connects, prints "ready", then reads the epoch of message 0 from stdin
(the processes share one schedule, whatever their start-up took). Runs
--nice (5) levels below its parent: the relay it loads goes first.

Commits message i (i = offset, offset + stride, ...) at `start + i / (rate *
stride)`: P processes with offsets 0..P-1 interleave one schedule of
rate x P msgs/s. Each commit is one INSERT and a COMMIT on one of `lanes`
connections, so one slow commit does not hold up the next. Writes
{"commits": {id: [time.time() after the commit, scheduled offset s]},
"durations_ms": [...], "first": t, "last": t} to FILE.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from typing import Any

import orjson
import psycopg

from bench.common import payload

INSERT_ONE = "INSERT INTO outbox (id, topic, type, payload) VALUES (%s, %s, 'Bench', %s::jsonb)"


async def produce(args: argparse.Namespace) -> dict[str, Any]:
    total_rate = args.rate * args.stride
    total = int(total_rate * args.seconds)
    mine = list(range(args.offset, total, args.stride))
    conns = [
        await psycopg.AsyncConnection.connect(args.database_url, options="-c jit=off")
        for _ in range(args.lanes)
    ]
    commits: dict[str, tuple[float, float]] = {}
    durations: list[float] = []
    print("ready", flush=True)
    start = float(await asyncio.to_thread(sys.stdin.readline))
    # time.time() is the schedule's clock, shared by the processes.
    perf_at_start = time.perf_counter() + (start - time.time())

    async def lane(n: int, conn: Any) -> None:
        for i in mine[n :: args.lanes]:
            delay = perf_at_start + i / total_rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            message_id = str(uuid.uuid4())
            began = time.perf_counter()
            await conn.execute(INSERT_ONE, (message_id, args.topic, payload(i).decode()))
            await conn.commit()
            commits[message_id] = (time.time(), i / total_rate)
            durations.append((time.perf_counter() - began) * 1000)

    try:
        await asyncio.gather(*(lane(n, c) for n, c in enumerate(conns)))
    finally:
        for conn in conns:
            await conn.close()
    stamps = [t for t, _ in commits.values()]
    return {
        "commits": commits,
        "durations_ms": durations,
        "first": min(stamps, default=0.0),
        "last": max(stamps, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--rate", type=float, required=True, help="this process's msgs/s")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lanes", type=int, default=8)
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument(
        "--nice",
        type=int,
        default=5,
        help="lower this process's priority by N (the relay measured goes first)",
    )
    args = parser.parse_args()
    if args.nice:
        os.nice(args.nice)
    result = asyncio.run(produce(args))
    with open(args.out, "wb") as f:
        f.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
