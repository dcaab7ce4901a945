"""The reference relay, written the way the pattern's articles write it.

One row per transaction: claim it (`FOR UPDATE SKIP LOCKED LIMIT 1`),
publish it, wait for the broker's confirm, mark it published, commit,
repeat. Correct (at least once, the row lock is the claim), and the
baseline the relay is measured against.

    .venv/bin/python -m bench.naive --database-url URL --exchange NAME [--broker-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import aio_pika
import orjson

from bench.common import AMQP_URL, connect

CLAIM = """
SELECT id, topic, type, payload FROM outbox
WHERE status = 'pending' AND available_at <= now()
ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED
"""
MARK = "UPDATE outbox SET status = 'published', published_at = now() WHERE id = %s"


async def run_naive(
    database_url: str, amqp_url: str, exchange: str, *, seconds: float | None = None
) -> tuple[int, float]:
    """Publish until nothing is pending (or `seconds` have passed); (rows, seconds)."""
    db = await connect(database_url)
    broker = await aio_pika.connect(amqp_url)
    try:
        channel = await broker.channel(publisher_confirms=True)
        ex = await channel.get_exchange(exchange, ensure=False)
        done = 0
        started = time.perf_counter()
        deadline = started + seconds if seconds else None
        while deadline is None or time.perf_counter() < deadline:
            async with db.transaction():
                row = await (await db.execute(CLAIM)).fetchone()
                if row is None:
                    break
                row_id, topic, type_, body = row
                # publish() returns once the broker has confirmed the message.
                await ex.publish(
                    aio_pika.Message(
                        orjson.dumps(body),
                        content_type="application/json",
                        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                        message_id=str(row_id),
                        type=type_,
                    ),
                    routing_key=topic,
                )
                await db.execute(MARK, (row_id,))
            done += 1
        return done, time.perf_counter() - started
    finally:
        await broker.close()
        await db.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--broker-url", default=AMQP_URL)
    parser.add_argument("--exchange", required=True)
    parser.add_argument("--seconds", type=float, default=None)
    args = parser.parse_args()
    done, elapsed = asyncio.run(
        run_naive(args.database_url, args.broker_url, args.exchange, seconds=args.seconds)
    )
    print(f"published {done} rows in {elapsed:.2f}s: {done / elapsed:.0f} msgs/s")


if __name__ == "__main__":
    main()
