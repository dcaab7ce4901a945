"""Apache Kafka through librdkafka (confluent-kafka): the outbox publisher
and the inbox consumer.

confluent-kafka's Producer and Consumer are synchronous handles on
librdkafka's own threads. The publisher produces from the event loop (a
produce() only queues the record) and polls for the delivery reports there
too (a task while idle, every millisecond while a batch waits), which
resolve one future per publish() call, as faststream's polling task does.
The consumer runs librdkafka's consume loop in a thread of its own and
hands batches to the event loop; offsets are committed by hand, only
behind records whose rows are committed.

What relay sets on each client, and why, is docs/kafka.md; the URL's
properties (relay.config.parse_kafka_url) come first and relay's own
settings last, so no property can undo them.
"""

from __future__ import annotations

from relay.brokers import ConsumerOptions
from relay.brokers.kafka.common import (
    CONSUMER,
    CONSUMER_DEFAULTS,
    PRODUCER,
    PRODUCER_DEFAULTS,
    client_config,
)
from relay.brokers.kafka.consuming import (
    KafkaConsumer,
    Token,
    budget_config,
    to_incoming,
    unreadable,
)
from relay.brokers.kafka.producing import KafkaPublisher, Record, build_record
from relay.config import BrokerURL

__all__ = [
    "CONSUMER",
    "CONSUMER_DEFAULTS",
    "PRODUCER",
    "PRODUCER_DEFAULTS",
    "KafkaConsumer",
    "KafkaPublisher",
    "Record",
    "Token",
    "budget_config",
    "build_record",
    "client_config",
    "consumer",
    "publisher",
    "to_incoming",
    "unreadable",
]


# The factory's entry points (relay.brokers.KINDS).
def publisher(
    broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str
) -> KafkaPublisher:
    return KafkaPublisher(broker)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> KafkaConsumer:
    """Holds at most max(MAX_HELD, prefetch) records and about `max_bytes`
    of their bodies, librdkafka's prefetch included (budget_config)."""
    return KafkaConsumer(
        broker,
        topics=options.queue.split(","),
        group=options.consumer_name,
        prefetch=options.prefetch,
        max_bytes=options.max_bytes,
    )
