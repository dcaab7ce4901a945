"""NATS JetStream through nats-py (the NATS maintainers' asyncio client):
the outbox publisher (publishing.py) and the inbox consumer (consuming.py),
over connections opened as connection.py says. (The modules are not named
publisher and consumer: the factory's entry points below have those names.)

What relay sets, and the streams and consumers it expects, is docs/nats.md.
"""

from __future__ import annotations

from relay.brokers import ConsumerOptions
from relay.brokers.nats.connection import API_TIMEOUT, close, connect
from relay.brokers.nats.consuming import NatsConsumer
from relay.brokers.nats.publishing import NatsPublisher
from relay.config import BrokerURL


# The factory's entry points (relay.brokers.KINDS).
def publisher(
    broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str
) -> NatsPublisher:
    return NatsPublisher(broker)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> NatsConsumer:
    """The durable pull consumer `consumer_name` of the stream `queue`,
    holding at most `prefetch` messages and about `max_bytes` of their data."""
    return NatsConsumer(
        broker,
        stream=options.queue,
        durable=options.consumer_name or options.queue,
        prefetch=options.prefetch,
        max_bytes=options.max_bytes,
    )


async def demo_queue(broker: BrokerURL, queue: str, topic: str) -> None:
    """`relay demo`'s stream: `queue`, capturing the subject `topic`, made
    when missing (the daemons never make streams)."""
    from nats.js.errors import NotFoundError

    client = await connect(broker, "relay demo", lambda why: None)
    try:
        js = client.jetstream(timeout=API_TIMEOUT)
        try:
            await js.stream_info(queue)
        except NotFoundError:
            await js.add_stream(name=queue, subjects=[topic])
    finally:
        await close(client)


__all__ = ["NatsConsumer", "NatsPublisher", "consumer", "demo_queue", "publisher"]
