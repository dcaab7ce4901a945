"""What the Kafka adapter's two clients share: relay's librdkafka
properties (what relay sets on each client, and why, is docs/kafka.md; the
URL's properties, relay.config.parse_kafka_url, come first and relay's own
settings last, so no property can undo them), the error codes by what
relay does with each, librdkafka's log lines and the timeouts."""

from __future__ import annotations

import logging
import re
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from relay.config import BrokerURL, redact_url
from relay.errors import ConfigError

log = logging.getLogger("relay.brokers.kafka")

# relay's own producer settings: what its guarantees rest on (the URL may
# repeat them, never change them: relay.config.KAFKA_FIXED).
PRODUCER = {
    "enable.idempotence": "true",
    "acks": "all",
    "partitioner": "murmur2_random",  # a key's partition is the one Java picks
    "allow.auto.create.topics": "false",
}
# Defaults the URL may change.
PRODUCER_DEFAULTS = {
    "linger.ms": "5",
    # A record not delivered in a minute is released (sent again later).
    "message.timeout.ms": "60000",
}
CONSUMER = {
    "enable.auto.commit": "false",
    "enable.auto.offset.store": "false",
    "auto.offset.reset": "earliest",
    "isolation.level": "read_committed",
    "allow.auto.create.topics": "false",
    # Eager: cooperative-sticky with manual commits is librdkafka #4059.
    "partition.assignment.strategy": "range,roundrobin",
}
CONSUMER_DEFAULTS: dict[str, str] = {}
# Properties that belong to one side only: left out of the other's config.
_CONSUMER_ONLY = set(CONSUMER) - {"allow.auto.create.topics"} | {
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "fetch.min.bytes",
    "fetch.wait.max.ms",
    "fetch.max.bytes",
    "max.partition.fetch.bytes",
    "queued.min.messages",
    "queued.max.messages.kbytes",
    "group.instance.id",
    "check.crcs",
    "enable.partition.eof",
}
_PRODUCER_ONLY = set(PRODUCER) - {"allow.auto.create.topics"} | {
    "linger.ms",
    "queue.buffering.max.ms",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "batch.num.messages",
    "batch.size",
    "compression.type",
    "compression.codec",
    "compression.level",
    "queue.buffering.max.messages",
    "queue.buffering.max.kbytes",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "retries",
    "message.send.max.retries",
    "retry.backoff.ms",
    "request.timeout.ms",
    "enable.gapless.guarantee",
    "sticky.partitioning.linger.ms",
    # The largest request the producer sends; a consumer would only raise
    # its fetch.max.bytes to it (librdkafka insists), past its budget
    # (budget_config): a record larger than a fetch comes alone anyway.
    "message.max.bytes",
}
CONNECT_TIMEOUT = 5.0
# The outbox's first metadata request: short enough for /readyz's probe
# (relay.lifecycle.PROBE_TIMEOUT, 2 s) to give the reason; a slower cluster
# is only asked again, with backoff.
PROBE_TIMEOUT = 1.5
DEFAULT_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's message.max.bytes
# Kafka topic names: letters, digits, . _ and -, at most 249.
_TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

_UNREACHABLE = {
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TRANSPORT,
    KafkaError._RESOLVE,
    KafkaError._TIMED_OUT,
    KafkaError._AUTHENTICATION,
    KafkaError.SASL_AUTHENTICATION_FAILED,
    KafkaError._SSL,
}
# Not written, or maybe written and not confirmed: pending again, no attempt.
_RELEASE = {
    KafkaError._MSG_TIMED_OUT,
    KafkaError._TIMED_OUT,
    KafkaError._TRANSPORT,
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.NETWORK_EXCEPTION,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError._DESTROY,
}
# The idempotent producer's own state refused (fenced, its epoch or sequence
# out of step with the cluster's): librdkafka raises a fatal error and that
# producer can produce no more. Not the row's fault: released, and a new
# producer made (KafkaPublisher._renew).
_UNUSABLE = {
    KafkaError._FATAL,
    KafkaError._FENCED,
    KafkaError.PRODUCER_FENCED,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
}
_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE}
_MISSING_TOPIC = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError._UNKNOWN_PARTITION,
}
_DENIED = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.CLUSTER_AUTHORIZATION_FAILED,
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
}


def client_config(
    broker: BrokerURL, own: dict[str, str], defaults: dict[str, str]
) -> dict[str, Any]:
    """The URL's properties over the defaults, relay's own over both; the
    other side's properties (a consumer's in a producer) left out."""
    other = _CONSUMER_ONLY if own is PRODUCER else _PRODUCER_ONLY
    given = {name: value for name, value in broker.kafka if name not in other}
    return {**defaults, **given, **own}


class _Librdkafka:
    """librdkafka's own log lines (a connection refused on every reconnect)
    at DEBUG: relay logs what they mean once (unreachable, back again)."""

    def log(self, level: int, msg: str, *args: Any, **kwargs: Any) -> None:
        log.debug(msg, *args)


LIBRDKAFKA_LOG = _Librdkafka()


def _where(broker: BrokerURL) -> str:
    return redact_url(broker.url)


def _describe(error: KafkaError) -> str:
    return f"{error.name()}: {error.str()}"


def _config_error(exc: KafkaException, broker: BrokerURL) -> ConfigError:
    return ConfigError(f"invalid broker URL {_where(broker)!r}: {exc.args[0].str()}")
