"""RabbitMQ through aio-pika/aiormq: the outbox publisher and the inbox consumer.

The publisher uses publisher confirms with the whole batch in flight on one
channel (AMQP keeps a channel's publishes in order) and mandatory routing,
so a message no queue would take comes back (basic.return) and is counted
(by default published: pub/sub on a topic exchange; or a failed attempt)
instead of vanishing unseen. The consumer acknowledges with one
multiple-ack per stored batch.

A broker URL may list several nodes: each connection goes to the first node
that answers, starting after the node whose connection was lost.

The package: `connection` (nodes, connecting, what a broken connection
looks like), `publishing` (the outbox's publisher), `consuming` (the
inbox's consumer), `wire` (relay's own encoding and decoding of the frames
it publishes and consumes), `lenient` (pamqp's decoding, made never to drop
a connection for one message) and `aiormq_internals` (where relay reaches
into aiormq).
"""

from __future__ import annotations

from relay.brokers import ConsumerOptions
from relay.brokers.amqp.consuming import AmqpConsumer
from relay.brokers.amqp.publishing import AmqpPublisher
from relay.config import BrokerURL

__all__ = ["AmqpConsumer", "AmqpPublisher", "consumer", "publisher"]


# The factory's entry points (relay.brokers.KINDS).


def publisher(
    broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str
) -> AmqpPublisher:
    return AmqpPublisher(broker.nodes or broker.url, exchange=exchange, on_unroutable=on_unroutable)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> AmqpConsumer:
    return AmqpConsumer(
        broker.nodes or broker.url,
        queue=options.queue,
        exchange=options.exchange,
        binds=options.binds,
        prefetch=options.prefetch,
        queue_type=options.queue_type,
        queue_args=options.queue_args,
        max_bytes=options.max_bytes,
    )
