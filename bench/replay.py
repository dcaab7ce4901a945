"""Replay of a large outbox (issue 35): how long `relay replay outbox` takes
over N published rows, and how long until they are all published again,
by `relay outbox --once` and by a running `relay outbox`.

    .venv/bin/python -m bench.replay [--rows 100000] [--keys 1000]

The rows are published once first (by `relay outbox --once`, timed as the
reference), on a topic exchange with one queue bound; the queue is purged
between rounds. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import (
    AMQP_URL,
    PAYLOAD_SQL,
    BenchError,
    Resources,
    connect,
    relay_command,
    scalar,
    settle,
)
from bench.common import relay_env as bench_env


async def run(rows: int, keys: int) -> dict[str, float]:
    res = Resources("replay")
    figures: dict[str, float] = {}
    try:
        url = await res.database()
        exchange, queue = res.names()
        await res.bind_queue(exchange, queue)
        async with await connect(url, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO outbox (topic, key, type, payload) "
                f"SELECT 'orders.placed', 'k' || (i %% %s), 'Bench', {PAYLOAD_SQL} "
                "FROM generate_series(1, %s) AS i",
                (keys, rows),
            )
            await conn.execute("ANALYZE outbox")
        env = bench_env(RELAY_DATABASE_URL=url, RELAY_BROKER_URL=AMQP_URL, RELAY_EXCHANGE=exchange)

        async def command(*args: str) -> tuple[float, str]:
            started = time.perf_counter()
            proc = await asyncio.create_subprocess_exec(
                *relay_command(),
                *args,
                env=env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            if proc.returncode != 0:
                raise BenchError(f"relay {' '.join(args)} exited {proc.returncode}: {err.decode()}")
            return time.perf_counter() - started, out.decode().strip()

        async def published_everything() -> None:
            depth = await res.queue_depth(queue)
            if depth != rows:
                raise BenchError(f"{depth} messages in the queue, not {rows}")
            channel = await (await res.amqp()).channel()
            await (await channel.declare_queue(queue, passive=True)).purge()
            await channel.close()

        await settle(url, timeout=30)
        figures["first publish (outbox --once) s"], _ = await command(
            "outbox", "--once", "--exchange", exchange
        )
        await published_everything()

        await settle(url, timeout=30)
        seconds, out = await command("replay", "outbox", "--topic", "orders.#", "--as", "bench")
        if out != f"replayed {rows} outbox rows":
            raise BenchError(f"relay replay said {out!r}")
        figures["relay replay s"] = seconds
        figures["published again (outbox --once) s"], _ = await command(
            "outbox", "--once", "--exchange", exchange
        )
        await published_everything()

        # With a daemon running: from the replay's start to the last row published.
        daemon = res.relay("outbox", "outbox", "--exchange", exchange, env=env)
        await daemon.wait_log("outbox relay started", timeout=30)
        await settle(url, timeout=30)
        figures["dry run s"], _ = await command("replay", "outbox", "--topic", "#", "--dry-run")
        started = time.perf_counter()
        seconds, out = await command("replay", "outbox", "--since", "1d", "--as", "bench")
        figures["relay replay, daemon running s"] = seconds
        while await scalar(url, "SELECT count(*) FROM outbox WHERE status = 'pending'"):
            await asyncio.sleep(0.05)
        figures["replay start to all published, daemon running s"] = time.perf_counter() - started
        await published_everything()
    finally:
        await res.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    figures = asyncio.run(run(args.rows, args.keys))
    print(f"replay of {args.rows:,} outbox rows over {args.keys:,} keys")
    for name, value in figures.items():
        print(f"  {name:<52} {value:8.2f}  ({args.rows / value:,.0f} rows/s)")


if __name__ == "__main__":
    main()
