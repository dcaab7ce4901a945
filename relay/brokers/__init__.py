"""The ports the loops talk to, and the factory that picks an adapter by URL.

The outbox loop sees a Publisher; the inbox loop sees a Consumer. Neither
knows which broker is behind it: RabbitMQ (`amqp.py`) and SQS (`sqs.py`)
each implement both.
"""

from __future__ import annotations

import enum
import re
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from relay.config import DEFAULT_CLAIM_CHECK_OVER, BrokerURL, ClaimCheckURL
from relay.errors import BadMessage
from relay.limits import MAX_JSON_DEPTH, json_depth
from relay.rows import Failure, OutboxRow


class Outcome(enum.Enum):
    """A publish result other than a plain confirm or a failure."""

    RELEASE = "release"  # unknown (the connection broke first): pending, no attempt counted
    # RabbitMQ confirmed it but no queue was bound for it (returned,
    # mandatory): published, and counted as unroutable.
    UNROUTABLE = "unroutable"


PublishResult = None | Failure | Outcome  # None: confirmed by the broker


class Publisher(Protocol):
    """Sends claimed outbox rows to the broker and reports each one's fate."""

    @property
    def connected(self) -> bool: ...

    @property
    def blocked(self) -> str | None:
        """Why the broker blocks publishing now (a resource alarm), or None."""

    async def wait_unblocked(self) -> None:
        """Return once the broker no longer blocks publishing."""

    async def connect(self) -> None:
        """Connect (or reconnect); raises BrokerUnavailable."""

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        """Publish rows in order; one result per row. Raises BrokerUnavailable
        only when nothing was sent."""

    async def close(self) -> None: ...


@dataclass(slots=True)
class Incoming:
    """A message received from the broker, not yet in the inbox table."""

    message_id: str | None  # the producer's id, if it sent one
    topic: str | None
    key: str | None
    type: str | None
    body: bytes
    # As decoded: AMQP table values of any type, strings that may hold NUL
    # characters or (decoded leniently) invalid UTF-8 as surrogate escapes.
    # relay.storable turns them into what the inbox table can hold.
    headers: dict[str, Any] = field(default_factory=dict)
    ack_token: object = None  # adapter-specific (delivery tag, receipt handle)
    # The adapter's lossless account of the properties, asked for only when
    # the row cannot hold them as given: a JSON-able dict (bytes allowed).
    original: Callable[[], dict[str, Any]] | None = None
    # Why the adapter could not decode the properties at all, if so.
    undecodable: str | None = None
    # A claim check pointer whose object could not be read: why (relay.claimcheck).
    unfetched: str | None = None
    # The message's content type where its broker carries one (the AMQP
    # content_type property, the SQS attribute or Kafka header
    # `content-type`), for the layers above the adapters to read.
    content_type: str | None = None


class Consumer(Protocol):
    """Receives messages in batches; acknowledges them after they are stored."""

    @property
    def connected(self) -> bool: ...

    async def connect(self) -> None:
        """Connect and declare what is needed; raises BrokerUnavailable."""

    def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        """Batches of received messages, in delivery order."""

    async def ack(self, batch: Sequence[Incoming]) -> None:
        """Acknowledge every message of a batch (after its rows are committed)."""

    async def close(self) -> None: ...


def row_headers(row: OutboxRow) -> dict[str, str]:
    """The row's headers as a str→str dict, or BadMessage saying what is wrong."""
    try:
        headers = orjson.loads(row.headers) if row.headers else {}
    except orjson.JSONDecodeError as exc:
        raise BadMessage(f"headers are not valid JSON: {exc}") from None
    if not isinstance(headers, dict):
        raise BadMessage(f"headers must be a JSON object, not {type(headers).__name__}")
    for name, value in headers.items():
        if not isinstance(value, str):
            raise BadMessage(
                f"header {name!r} has a {type(value).__name__} value; headers must be strings"
            )
    return headers


# orjson reads integers over 64 bits (and decimals longer than a double) as
# floats, which would change the number. A payload with a run of 16 or more
# digits is compacted as text instead: PostgreSQL renders jsonb with ", "
# and ": " between items and no other whitespace outside strings.
_LONG_DIGITS = re.compile(r"[0-9]{16,}")
# Strings in the unrolled form, as relay.limits' _STRINGS (one engine step per
# run of plain characters, not one per character).
_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^"]+')


def row_body(row: OutboxRow) -> bytes:
    """The payload as compact UTF-8 JSON, every number exactly as stored;
    BadMessage for one nested deeper than relay carries (MAX_JSON_DEPTH)."""
    if not _LONG_DIGITS.search(row.payload):
        try:
            return orjson.dumps(orjson.loads(row.payload))
        except (orjson.JSONDecodeError, orjson.JSONEncodeError, TypeError):
            pass  # nested past orjson's limits (254 levels written, 1,024 read)
    depth = json_depth(row.payload)
    if depth > MAX_JSON_DEPTH:
        raise BadMessage(
            f"payload is JSON nested {depth} levels deep, over relay's limit "
            f"of {MAX_JSON_DEPTH} levels"
        )
    return "".join(
        token if token[0] == '"' else token.replace(" ", "")
        for token in _JSON_TOKENS.findall(row.payload)
    ).encode()


def encode_failure(exc: Exception) -> Failure:
    """A row no broker can carry, whatever the encoder raised: dead at once."""
    if isinstance(exc, BadMessage):
        return Failure(str(exc), permanent=True)
    return Failure(
        f"the row cannot be encoded for the broker: {type(exc).__name__}: {exc}", permanent=True
    )


def check_topic(row: OutboxRow) -> None:
    if not row.topic:
        raise BadMessage("topic is empty")


def make_publisher(
    broker: BrokerURL,
    *,
    exchange: str,
    workers: int,
    on_unroutable: str = "publish",
    claim_check: ClaimCheckURL | None = None,
    claim_check_over: int = DEFAULT_CLAIM_CHECK_OVER,
    on_claim_check: Callable[[int, int], None] | None = None,
) -> Publisher:
    """The publisher for `broker`, shared by `workers` outbox workers; with
    `claim_check`, behind relay.s3's claim check (large bodies go to S3)."""
    publisher: Publisher
    if broker.kind == "amqp":
        from relay.brokers.amqp import AmqpPublisher

        publisher = AmqpPublisher(
            broker.nodes or broker.url, exchange=exchange, on_unroutable=on_unroutable
        )
    else:
        from relay.brokers.sqs import SqsPublisher

        publisher = SqsPublisher(broker, workers=workers)
    if claim_check is None:
        return publisher
    from relay.s3 import ClaimCheckPublisher  # boto3, only when asked for

    return ClaimCheckPublisher(publisher, claim_check, claim_check_over, on_claim_check)


def make_consumer(
    broker: BrokerURL,
    *,
    queue: str,
    exchange: str,
    binds: Sequence[str],
    prefetch: int,
    queue_type: str | None = None,
    queue_args: Sequence[tuple[str, str | int]] = (),
    max_bytes: int | None = None,
) -> Consumer:
    """The queue's consumer; RabbitMQ's holds at most about `max_bytes` of
    bodies received and not yet acknowledged (SQS's, at most 100 messages,
    relay.brokers.sqs.MAX_HELD, of SQS's 1 MiB at most each)."""
    if broker.kind == "amqp":
        from relay.brokers.amqp import AmqpConsumer

        return AmqpConsumer(
            broker.nodes or broker.url,
            queue=queue,
            exchange=exchange,
            binds=binds,
            prefetch=prefetch,
            queue_type=queue_type,
            queue_args=queue_args,
            max_bytes=max_bytes,
        )
    from relay.brokers.sqs import SqsConsumer

    return SqsConsumer(broker, queue=queue)
