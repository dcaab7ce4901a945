"""Redis Streams through redis-py's asyncio client: the outbox publisher
(publisher.py: one pipeline of XADDs a batch) and the inbox consumer
(consumer.py: XREADGROUP in a consumer group, XACK behind committed rows,
XAUTOCLAIM of a dead consumer's entries). client.py holds what both share:
the client made from the URL and the errors that mean "unreachable".

What relay sets, the streams and groups it expects and the choices where
the contract is silent are docs/redis.md.
"""

from __future__ import annotations

from relay.brokers import ConsumerOptions
from relay.brokers.redis.consumer import RedisConsumer
from relay.brokers.redis.publisher import RedisPublisher
from relay.config import BrokerURL


# The factory's entry points (relay.brokers.KINDS). A stream has no
# exchange, bindings or queue arguments (relay.config refuses them).
def publisher(
    broker: BrokerURL,
    *,
    exchange: str,
    workers: int,
    on_unroutable: str,
    stream_maxlen: int | None = None,
) -> RedisPublisher:
    return RedisPublisher(broker, maxlen=stream_maxlen)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> RedisConsumer:
    """The group `consumer_name` reading the streams --queue lists; it holds
    at most `prefetch` entries and about `max_bytes` of them unacknowledged."""
    return RedisConsumer(
        broker,
        streams=options.queue.split(","),
        group=options.consumer_name,
        prefetch=options.prefetch,
        max_bytes=options.max_bytes,
        claim_idle=options.claim_idle,
    )


__all__ = ["RedisConsumer", "RedisPublisher", "consumer", "publisher"]
