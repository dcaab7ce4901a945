"""One inbox dispatcher alone (issue 33): N pending inbox rows, claimed and
handled by relay's Dispatcher in this process, one thread, on the sync
engine, with no broker and no receiver; prints the CPU per message.

    .venv/bin/python -m bench.dispatch --messages 40000 --batch-size 170
    .venv/bin/python -m bench.dispatch --handlers bench.handlers:batch --profile

Rows are copied in first, shaped as the receiver stores a relay-sent
message (a key among 1,000, a small JSON payload, headers with a
traceparent), in a database of the benchmark's own, dropped after. With
--batch-size as small as the daemon's batches (bench.where prints their
mean) this is the dispatchers' process without its other threads; run it
with PYTHONPATH=<another checkout> to compare two versions of relay.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import pstats
import time
import uuid

import orjson
import psycopg
import sqlalchemy as sa

import bench.handlers
from bench.common import PG_URL
from relay.config import InboxSettings
from relay.db import Store
from relay.db.schema import apply
from relay.metrics import InboxMetrics
from relay.wiring import inbox_dispatcher

CONSUMER = "bench"
HEADERS = orjson.dumps(
    {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "content_type": "application/json",
        "delivery_mode": 2,
    }
).decode()


def fill(url: str, messages: int) -> None:
    engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.begin() as conn:
            apply(conn)
            conn.exec_driver_sql(bench.handlers.EFFECTS_DDL)
    finally:
        engine.dispose()
    with psycopg.connect(url, autocommit=True) as conn:
        columns = "consumer, message_id, topic, key, type, payload, headers"
        copy_sql = f"COPY inbox ({columns}) FROM STDIN"
        with conn.cursor().copy(copy_sql) as copy:
            for i in range(messages):
                payload = orjson.dumps({"i": i}).decode()
                row = (CONSUMER, str(uuid.uuid4()), "bench.t", f"k{i % 1000}", "Bench", payload)
                copy.write_row((*row, HEADERS))
        conn.execute("VACUUM ANALYZE inbox")


async def dispatch(url: str, args: argparse.Namespace) -> None:
    module, _, name = args.handlers.partition(":")
    registry = getattr(importlib.import_module(module), name or "registry")
    settings = InboxSettings(
        database_url=url, queue=CONSUMER, consumer_name=CONSUMER, batch_size=args.batch_size
    )
    store = Store(url, sync=True)
    try:
        dispatcher = inbox_dispatcher(settings, store, registry, InboxMetrics())
        await dispatcher.dispatch_batch()  # connections and prepared statements
        profile = cProfile.Profile() if args.profile else None
        done = 0
        cpu, wall = time.process_time(), time.perf_counter()
        if profile is not None:
            profile.enable()
        while n := (await dispatcher.dispatch_batch())[0]:
            done += n
        if profile is not None:
            profile.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        print(
            f"{args.handlers}: {done:,} messages in batches of {args.batch_size}, "
            f"CPU {1e6 * cpu / done:.1f} µs a message, wall {1e6 * wall / done:.1f} µs"
        )
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--batch-size", type=int, default=170)
    parser.add_argument("--handlers", default="bench.handlers:noop")
    parser.add_argument("--profile", action="store_true", help="cProfile (wall time included)")
    args = parser.parse_args()
    database = f"bench_dispatch_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(f"{PG_URL}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {database}")
    try:
        url = f"{PG_URL}/{database}"
        fill(url, args.messages + args.batch_size)
        asyncio.run(dispatch(url, args))
    finally:
        with psycopg.connect(f"{PG_URL}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE {database} WITH (FORCE)")


if __name__ == "__main__":
    main()
