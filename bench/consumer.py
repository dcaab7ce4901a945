"""The latency scenario's consumer, in a process of its own so that it does
not share an event loop with the producer.

Consumes a queue and records `message_id -> time.time()` on receipt. Prints
"ready" once consuming. Reads the number of messages to expect from stdin;
once it has that many (or --timeout seconds after the number arrived) it
writes the receipts as JSON to --out and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import aio_pika
import orjson


async def consume(amqp_url: str, queue: str, out: str, timeout: float) -> None:
    received: dict[str, float] = {}
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2000)
        q = await channel.declare_queue(queue, passive=True)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received[message.message_id or ""] = time.time()

        await q.consume(on_message, no_ack=True)
        print("ready", flush=True)
        line = await asyncio.to_thread(sys.stdin.readline)
        expected = int(line.strip() or 0)
        deadline = time.monotonic() + timeout
        while len(received) < expected and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
    finally:
        with open(out, "wb") as f:
            f.write(orjson.dumps(received))
        await connection.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--amqp-url", required=True)
    parser.add_argument("--queue", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    asyncio.run(consume(args.amqp_url, args.queue, args.out, args.timeout))


if __name__ == "__main__":
    main()
