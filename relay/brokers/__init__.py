"""The ports the loops talk to, and the factory that picks an adapter by URL.

The outbox loop sees a Publisher; the inbox loop sees a Consumer. Neither
knows which broker is behind it: RabbitMQ (`amqp/`), SQS (`sqs.py`) and
Kafka (`kafka.py`) each implement both, SNS (`sns.py`) only the publisher
(what SQS and SNS share is `aws.py`). KINDS is the factory's table, from a URL's kind
(relay.config.BrokerURL.kind) to its adapter's module and what the layers
above need to know of that broker; a new broker is its adapter module and
one line there. Nothing here, nor in an adapter, imports a module above the
brokers (the claim check, wiring, the loops): wiring wraps what the factory
makes.
"""

from __future__ import annotations

import asyncio
import enum
import importlib
import logging
import re
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import orjson

from relay.config import BrokerURL
from relay.errors import BadMessage, BrokerUnavailable
from relay.limits import MAX_JSON_DEPTH, json_depth
from relay.rows import Failure, OutboxRow

_log = logging.getLogger("relay.brokers")


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


class PublisherWrapper:
    """A layer put around a broker's Publisher (the claim check,
    CloudEvents): everything but publish goes to `inner` as it is."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner

    @property
    def connected(self) -> bool:
        return self.inner.connected

    @property
    def blocked(self) -> str | None:
        return self.inner.blocked

    async def wait_unblocked(self) -> None:
        await self.inner.wait_unblocked()

    async def connect(self) -> None:
        await self.inner.connect()

    async def close(self) -> None:
        await self.inner.close()


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
    # Why a layer above the adapters keeps the message dead as received
    # (relay.cloudevents: an event that breaks the specification).
    rejected: str | None = None
    # The message's content type where its broker carries one (the AMQP
    # content_type property, the SQS attribute or Kafka header
    # `content-type`), for the layers above the adapters to read.
    content_type: str | None = None


@dataclass(frozen=True, slots=True)
class Reading:
    """A figure a consumer measures on its broker, for /metrics: a gauge
    (relay_inbox_kafka_lag by topic and partition, say) or a counter (its
    name without `_total`, which /metrics adds; the value counted since
    the consumer was made). A consumer that has any has `async def
    readings(self) -> list[Reading]`; the layers above show them as they
    are, knowing no broker."""

    name: str
    help: str
    labels: tuple[str, ...]
    values: tuple[tuple[tuple[str, ...], float], ...]
    kind: str = "gauge"  # or "counter"


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


async def take_batch(
    buffer: deque[Incoming],
    arrived: asyncio.Event,
    failed: Callable[[], bool],
    max_size: int,
    max_wait: float,
) -> list[Incoming]:
    """Up to `max_size` messages from `buffer`, which a receiving thread or
    task fills, setting `arrived`: waiting for the first as long as it takes,
    then at most `max_wait` for the rest. Empty once `failed()`: the adapter
    says why. The adapter changes `buffer` in place, never rebinds it: the
    batch being gathered holds this deque."""
    loop = asyncio.get_running_loop()
    batch: list[Incoming] = []
    deadline = 0.0
    while len(batch) < max_size and not failed():
        if buffer:
            if not batch:
                deadline = loop.time() + max_wait
            batch.append(buffer.popleft())
            continue
        timeout = None
        if batch:
            timeout = deadline - loop.time()
            if timeout <= 0:
                break
        arrived.clear()
        try:
            await asyncio.wait_for(arrived.wait(), timeout)
        except TimeoutError:
            break
    return batch


class Buffered(Protocol):
    """A consumer whose receiving thread or task fills `_buffer` (setting
    `_arrived`) and records in `_failure` why it stopped."""

    _buffer: deque[Incoming]
    _arrived: asyncio.Event
    _failure: BaseException | None

    async def connect(self) -> None: ...

    async def close(self) -> None: ...


async def buffered_batches(
    consumer: Buffered, what: str, max_size: int, max_wait: float
) -> AsyncGenerator[list[Incoming], None]:
    """A buffered consumer's `batches`: (re)connect, yield what `take_batch`
    gathers; once the receiving side failed, close and raise BrokerUnavailable
    (the failure itself, or one saying `what` stopped and why)."""

    def failed() -> bool:
        return consumer._failure is not None

    while True:
        await consumer.connect()
        batch = await take_batch(consumer._buffer, consumer._arrived, failed, max_size, max_wait)
        if batch:
            yield batch  # any failure shows on the next round
            continue
        failure = consumer._failure
        await consumer.close()
        if isinstance(failure, BrokerUnavailable):
            raise failure
        raise BrokerUnavailable(f"{what} stopped: {failure!r}") from failure


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


def warn_out_of_order(
    rows: Sequence[OutboxRow], results: Sequence[PublishResult], broker: str
) -> None:
    """Log each row of a key that the broker took after an earlier row of
    its key in the same batch failed: sent together (a pipeline, a
    producer's queue), the later one could not be held back."""
    failed: set[str] = set()
    for row, result in zip(rows, results, strict=True):
        if row.key is None:
            continue
        if row.key in failed and result is None:
            _log.warning(
                "a row of key %r reached %s after an earlier row of its key failed",
                row.key,
                broker,
            )
        if result is not None:
            failed.add(row.key)


def check_topic(row: OutboxRow) -> None:
    if not row.topic:
        raise BadMessage("topic is empty")


@dataclass(frozen=True, slots=True)
class ConsumerOptions:
    """What `relay inbox` asks of a consumer, whatever the broker; each
    adapter reads the options its broker has (SQS and Kafka: no exchange,
    no bindings, no queue type)."""

    queue: str  # RabbitMQ's queue, SQS's queue name, Kafka's TOPIC[,TOPIC…]
    exchange: str
    binds: Sequence[str]
    prefetch: int
    queue_type: str | None = None
    queue_args: Sequence[tuple[str, str | int]] = ()
    consumer_name: str = ""  # Kafka's and Redis's consumer group
    # About the most bytes of bodies received and not yet acknowledged.
    max_bytes: int | None = None
    # Seconds a message delivered to another consumer stays unacknowledged
    # before this one takes it over (Redis's pending entries: XAUTOCLAIM).
    claim_idle: float = 30.0


class Adapter(Protocol):
    """What an adapter module (relay/brokers/<kind>.py) offers the factory."""

    def publisher(
        self, broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str, **only: Any
    ) -> Publisher:
        """`only`: the options of one broker kind alone (Redis's
        stream_maxlen), passed only when given: relay.config refuses them
        for the others."""

    def consumer(self, broker: BrokerURL, options: ConsumerOptions) -> Consumer: ...


@dataclass(frozen=True)
class Kind:
    """One broker kind as the layers above the brokers see it."""

    module: str  # the adapter, imported only when used (a process loads aio-pika or boto3)
    system: str  # OpenTelemetry's messaging.system
    # The publisher's topic names the queue a consumer reads (SQS): no
    # exchange, no bindings. Else the topic is routed by an exchange.
    topic_is_queue: bool
    # CloudEvents' binary mode on this broker: the attributes' header
    # prefixes (the first one written); none: structured mode (relay.cloudevents).
    cloudevents: tuple[str, ...] = ()
    # Binary mode: the header for datacontenttype, when the adapter's own
    # content type header is not it.
    cloudevents_content_type: str | None = None


# The factory's table: URL kind -> adapter. A new broker adds its line here,
# its module beside this one, and its URL to relay.config.BrokerURL.
KINDS: dict[str, Kind] = {
    "amqp": Kind(
        "relay.brokers.amqp",
        system="rabbitmq",
        topic_is_queue=False,
        cloudevents=("cloudEvents_", "cloudEvents:"),
    ),
    "sqs": Kind("relay.brokers.sqs", system="aws_sqs", topic_is_queue=True),
    "kafka": Kind("relay.brokers.kafka", system="kafka", topic_is_queue=True, cloudevents=("ce_",)),
    "nats": Kind(
        "relay.brokers.nats",
        system="nats",
        topic_is_queue=True,
        cloudevents=("ce_", "ce-"),
        cloudevents_content_type="content-type",
    ),
    "sns": Kind("relay.brokers.sns", system="aws.sns", topic_is_queue=True),
    "redis": Kind("relay.brokers.redis", system="redis", topic_is_queue=True),
}


def kind_of(broker: BrokerURL) -> Kind:
    return KINDS[broker.kind]


def _adapter(broker: BrokerURL) -> Adapter:
    return cast(Adapter, importlib.import_module(kind_of(broker).module))


async def prepare_demo(broker: BrokerURL, queue: str, topic: str) -> None:
    """What `relay demo` needs of the broker before its daemons start, made
    when missing (a NATS stream for its topic) by the adapter's `demo_queue`,
    if it has one; the daemons themselves never make it."""
    made = getattr(_adapter(broker), "demo_queue", None)
    if made is not None:
        await made(broker, queue, topic)


def make_publisher(
    broker: BrokerURL,
    *,
    exchange: str,
    workers: int,
    on_unroutable: str = "publish",
    stream_maxlen: int | None = None,
) -> Publisher:
    """The publisher for `broker`, shared by `workers` outbox workers."""
    only: dict[str, Any] = {}
    if stream_maxlen is not None:
        only["stream_maxlen"] = stream_maxlen
    return _adapter(broker).publisher(
        broker, exchange=exchange, workers=workers, on_unroutable=on_unroutable, **only
    )


def make_consumer(
    broker: BrokerURL,
    *,
    queue: str,
    exchange: str,
    binds: Sequence[str],
    prefetch: int,
    queue_type: str | None = None,
    queue_args: Sequence[tuple[str, str | int]] = (),
    consumer_name: str = "",
    max_bytes: int | None = None,
    claim_idle: float = 30.0,
) -> Consumer:
    """The consumer of `queue` on `broker`; RabbitMQ's, Kafka's, NATS's and
    Redis's hold at most about `max_bytes` of bodies received and not yet
    acknowledged (Kafka's with librdkafka's prefetch; SQS's, at most 100
    messages, relay.brokers.sqs.MAX_HELD, of SQS's 1 MiB at most each)."""
    return _adapter(broker).consumer(
        broker,
        ConsumerOptions(
            queue=queue,
            exchange=exchange,
            binds=binds,
            prefetch=prefetch,
            queue_type=queue_type,
            queue_args=queue_args,
            consumer_name=consumer_name,
            max_bytes=max_bytes,
            claim_idle=claim_idle,
        ),
    )
