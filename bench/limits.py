"""The two halves of the relay's work, each alone, as fast as a plain loop goes.

- limit_pg: claim-and-mark only, no broker: batched `FOR UPDATE SKIP LOCKED`
  update loops (a connection per worker, as many as the relay's), returning
  the columns the relay reads.
- limit_amqp: publish only, no database: a plain aio-pika loop with a window
  of publishes in flight, persistent, with publisher confirms.

The relay does both on the same two cores, so the most it could do is
1 / (1/limit_pg + 1/limit_amqp).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import aio_pika

from bench.common import BenchError, connect, payload

CLAIM_AND_MARK = """
UPDATE outbox SET status = 'published', published_at = now()
WHERE id IN (SELECT id FROM outbox WHERE status = 'pending'
             ORDER BY seq LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
RETURNING id, seq, topic, key, type, payload::text, headers::text, created_at, attempts
"""


async def limit_pg(url: str, *, batch: int = 500, workers: int = 2) -> tuple[int, float]:
    """Claim-and-mark every pending row; (rows, seconds)."""
    done = 0

    async def worker() -> None:
        nonlocal done
        async with await connect(url) as conn:
            while True:
                async with conn.transaction():
                    cur = await conn.execute(CLAIM_AND_MARK, {"limit": batch})
                    rows = await cur.fetchall()
                if not rows:
                    return
                done += len(rows)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return done, time.perf_counter() - started


def bench_message(i: int, type: str = "Bench") -> aio_pika.Message:
    """A message as the relay sends it: persistent JSON with a message id and a type."""
    return aio_pika.Message(
        payload(i),
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(uuid.uuid4()),
        type=type,
    )


async def publish_window(
    amqp_url: str,
    exchange: str,
    routing_key: str,
    count: int,
    *,
    window: int = 1000,
    make: Callable[[int], aio_pika.Message] = bench_message,
) -> float:
    """Publish `count` messages with up to `window` awaiting their confirm; the seconds it took."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        ex = await channel.get_exchange(exchange, ensure=False)
        slots = asyncio.Semaphore(window)
        failures: list[BaseException] = []
        in_flight: set[asyncio.Task[None]] = set()

        async def one(message: aio_pika.Message) -> None:
            try:
                await ex.publish(message, routing_key=routing_key)
            except BaseException as exc:
                failures.append(exc)
            finally:
                slots.release()

        started = time.perf_counter()
        for i in range(count):
            await slots.acquire()
            if failures:
                break
            task = asyncio.create_task(one(make(i)))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        await asyncio.gather(*in_flight)
        elapsed = time.perf_counter() - started
        if failures:
            raise BenchError(f"{len(failures)} publishes failed: {failures[0]!r}")
        return elapsed
    finally:
        await connection.close()


async def limit_amqp(
    amqp_url: str, exchange: str, routing_key: str, count: int, *, window: int = 1000
) -> tuple[int, float]:
    """Publish `count` 200-byte messages; (messages, seconds)."""
    return count, await publish_window(amqp_url, exchange, routing_key, count, window=window)
