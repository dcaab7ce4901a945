"""The inbox receiver's broker side alone (issue 33): consume and acknowledge
N messages with relay's AmqpConsumer, no database, and print the CPU per
message, with relay's own frame reader or with aiormq's and pamqp's.

    .venv/bin/python -m bench.receive relay --messages 40000
    .venv/bin/python -m bench.receive pamqp --messages 40000 [--prefetch 600]

The queue is the benchmark's own, filled first with messages as
`relay outbox` sends them (bench.backlog.keyed_message), and deleted after.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
import uuid

import aio_pika

from bench.backlog import keyed_message
from bench.common import AMQP_URL
from relay.brokers import make_consumer
from relay.brokers.amqp import aiormq_internals
from relay.config import BrokerURL


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main(args: argparse.Namespace) -> None:
    name = f"bench_receive_{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=False)
        exchange = await channel.declare_exchange(name, "topic", durable=True)
        queue = await channel.declare_queue(name, durable=True)
        await queue.bind(exchange, "#")
        for i in range(args.messages):
            await exchange.publish(keyed_message(i), routing_key="bench.receive")
        while (await channel.declare_queue(name, passive=True)).declaration_result.message_count < (
            args.messages
        ):
            await asyncio.sleep(0.2)
        if args.reader == "pamqp":  # aiormq's reader, pamqp's decoding, as before issue 33
            aiormq_internals.read_frames_with = lambda *_: False  # type: ignore[assignment]
        consumer = make_consumer(
            BrokerURL.parse(AMQP_URL),
            queue=name,
            exchange=name,
            binds=["#"],
            prefetch=args.prefetch,
        )
        batches = consumer.batches(500, 0.05)
        got = len(first := await anext(batches))
        await consumer.ack(first)
        start, began, counted = cpu(), time.perf_counter(), got  # the first batch left out
        while got < args.messages:
            batch = await anext(batches)
            await consumer.ack(batch)
            got += len(batch)
        used, took, n = cpu() - start, time.perf_counter() - began, got - counted
        await batches.aclose()
        await consumer.close()
        print(
            f"{args.reader}: {n:,} messages, {used / n * 1e6:.1f} µs of CPU a message, "
            f"{n / took:,.0f} msgs/s (relay's reader: {consumer.frames_read_by_relay})"
        )
        await queue.delete(if_unused=False, if_empty=False)
        await exchange.delete()
    finally:
        await connection.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reader", choices=["relay", "pamqp"])
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--prefetch", type=int, default=1_000)
    asyncio.run(main(parser.parse_args()))
