"""Commit-to-receipt latency of `relay outbox` directly and through PgBouncer.

    .venv/bin/python -m bench.pgbouncer [--rate 100] [--seconds 10]

For each setup, a fresh database and queue, a running `relay outbox` and the
latency scenario's producer (single-row transactions at --rate per second)
and consumer (bench.consumer): the latency is from each producer's COMMIT
to the consumer's receipt. Setups: PostgreSQL directly; PgBouncer (Debian's,
started here as tests/pgbouncer.py does) in session mode; in transaction
mode with a direct --listen-url; in transaction mode without one, where
relay warns and polls every --poll-interval (1 s by default).

--drain N: also `relay outbox --once` over a backlog of N rows, directly and
through PgBouncer in transaction mode (the claim is parsed and planned each
batch there: no prepared statements).
"""

from __future__ import annotations

import argparse
import asyncio

from bench.common import (
    AMQP_URL,
    PG_URL,
    BenchError,
    Resources,
    insert_backlog,
    percentile,
    relay_env,
)
from bench.harness import Report, outbox_once, produce
from tests.pgbouncer import PgBouncer

SETUPS = ("direct", "session", "transaction+listen-url", "transaction")


async def measure(setup: str, rate: int, seconds: float) -> dict[str, float]:
    res = Resources(f"pgb_{setup.split('+')[0]}")
    bouncer = None if setup == "direct" else PgBouncer(setup.split("+")[0])
    try:
        url = await res.database()
        exchange, queue = res.names()
        await res.bind_queue(exchange, queue)
        env = relay_env()
        relay_url = url
        if bouncer is not None:
            relay_url = bouncer.url(url)
            if setup.endswith("+listen-url"):
                env["RELAY_LISTEN_URL"] = url
        outbox = res.relay(
            "outbox",
            "outbox",
            "--database-url",
            relay_url,
            "--broker-url",
            AMQP_URL,
            "--exchange",
            exchange,
            env=env,
        )
        await outbox.wait_log("outbox relay started", timeout=60)
        await asyncio.sleep(6 if setup == "transaction" else 0.5)  # the LISTEN self-check
        consumer, receipts_file = await res.consumer("consumer", queue)
        commits, achieved, _ = await produce(url, "bench.latency", rate, seconds)
        receipts = await res.receipts(consumer, receipts_file, len(commits))
        latencies = sorted(
            (receipts[m] - committed) * 1000
            for m, (committed, offset) in commits.items()
            if offset >= 0.5 and m in receipts
        )
        if len(latencies) < len([c for c in commits.values() if c[1] >= 0.5]):
            raise BenchError(f"{setup}: messages never arrived")
        warned = "LISTEN/NOTIFY does not work" in outbox.log_path.read_text(errors="replace")
        return {
            "p50": percentile(latencies, 50),
            "p95": percentile(latencies, 95),
            "p99": percentile(latencies, 99),
            "achieved": achieved,
            "warned": float(warned),
        }
    finally:
        await res.close()
        if bouncer is not None:
            bouncer.stop()


async def drain(setup: str, count: int) -> float:
    """msgs/s of `relay outbox --once` over `count` rows (steady rate)."""
    res = Resources(f"pgbd_{setup}")
    bouncer = None if setup == "direct" else PgBouncer(setup)
    try:
        url = await res.database()
        exchange, queue = res.names()
        await res.bind_queue(exchange, queue)
        await insert_backlog(url, count, topic="bench.drain")
        report = Report()
        await outbox_once(
            res,
            report,
            "drain",
            url,
            count,
            [
                "--database-url",
                bouncer.url(url) if bouncer else url,
                "--broker-url",
                AMQP_URL,
                "--exchange",
                exchange,
            ],
        )
        return float(report.get("drain", "rate") or 0.0)
    finally:
        await res.close()
        if bouncer is not None:
            bouncer.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--drain", type=int, default=0)
    args = parser.parse_args()
    if args.seconds > 0:
        print(
            f"commit-to-receipt latency, {args.rate} msgs/s for {args.seconds:g} s each, "
            f"PostgreSQL at {PG_URL}"
        )
        print(
            f"{'setup':<24} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'msgs/s':>8}  LISTEN warning"
        )
    for setup in SETUPS if args.seconds > 0 else ():  # --seconds 0: the drains only
        r = await measure(setup, args.rate, args.seconds)
        print(
            f"{setup:<24} {r['p50']:>8.2f} {r['p95']:>8.2f} {r['p99']:>8.2f} "
            f"{r['achieved']:>8.1f}  {'yes' if r['warned'] else 'no'}",
            flush=True,
        )
    if args.drain:
        for setup in ("direct", "transaction", "direct", "transaction"):
            rate = await drain(setup, args.drain)
            print(f"drain of {args.drain} rows, {setup}: {rate:,.0f} msgs/s", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
