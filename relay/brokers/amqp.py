"""RabbitMQ through aio-pika/aiormq: the outbox publisher and the inbox consumer.

The publisher uses publisher confirms with the whole batch in flight on one
channel (AMQP keeps a channel's publishes in order) and mandatory routing,
so a message no queue would take comes back (basic.return) and is counted
(by default published: pub/sub on a topic exchange; or a failed attempt)
instead of vanishing unseen. The consumer acknowledges with one
multiple-ack per stored batch.

A broker URL may list several nodes: each connection goes to the first node
that answers, starting after the node whose connection was lost.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import ssl
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from typing import Any, cast

import aio_pika
import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.decode import field_table as _field_table
from pamqp.header import ContentHeader

from relay.brokers import (
    ConsumerOptions,
    Incoming,
    Outcome,
    PublishResult,
    aiormq_internals,
    amqp_lenient,
    amqp_wire,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.brokers.aiormq_internals import ConfirmFrame, Returning
from relay.brokers.amqp_wire import publish_frames, shortstr
from relay.config import BrokerURL, redact_url
from relay.errors import BadMessage, BrokerUnavailable, ConfigError
from relay.rows import Failure, OutboxRow

log = logging.getLogger(__name__)

KEY_HEADER = "x-relay-key"
CONNECT_TIMEOUT = 10.0
CONFIRM_TIMEOUT = 60.0
# RabbitMQ's default max_message_size (128 MiB); a larger publish would make
# the broker close the channel, failing the whole batch.
MAX_MESSAGE_SIZE = 128 * 1024 * 1024
# How RabbitMQ says a publish was over its max_message_size (it then closes
# the channel): the publisher adopts the broker's limit from it.
_SIZE_REFUSED = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")

_DELIVER = spec.Basic.Deliver  # the only delivery a consumer's channel hands over

# What a broken connection or channel looks like from aiormq and the OS.
_CONNECTION_ERRORS = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPChannelError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
    RuntimeError,  # aiormq: "writer is None" / closed transport
)


def _unavailable(exc: BaseException, url: str) -> BrokerUnavailable:
    return BrokerUnavailable(f"RabbitMQ at {redact_url(url)}: {type(exc).__name__}: {exc}")


class _TLSRefused(BrokerUnavailable):
    """The node's certificate did not verify (CA or host name), or TLS
    could not be set up with the given files: no retry mends it at start."""


async def _connect_one(url: str) -> AbstractConnection:
    try:
        return await aio_pika.connect(url, timeout=CONNECT_TIMEOUT)
    except aiormq.exceptions.ProbableAuthenticationError as exc:
        raise BrokerUnavailable(f"RabbitMQ at {redact_url(url)} refused the login: {exc}") from exc
    except (ssl.SSLError, *_CONNECTION_ERRORS) as exc:
        refusal = _tls_error(exc)
        if refusal is not None:
            reason = getattr(refusal, "verify_message", None) or refusal.reason or str(refusal)
            raise _TLSRefused(
                f"RabbitMQ at {redact_url(url)}: TLS failed: {reason} (check ?cafile=, the "
                "server's certificate and the host name in the URL)"
            ) from exc
        raise _unavailable(exc, url) from exc


def _tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind `exc` (aiormq raises its own error from it)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _connect(
    nodes: Sequence[str], first: int, *, starting: bool = False
) -> tuple[AbstractConnection, int]:
    """A connection to the first node that answers, trying them in order from
    `first` round the list; and that node's index. BrokerUnavailable naming
    each node's failure when none answers; ConfigError when `starting` (no
    connection was made yet) and every node refused TLS: a certificate that
    does not verify is bad configuration."""
    failures: list[BrokerUnavailable] = []
    for step in range(len(nodes)):
        index = (first + step) % len(nodes)
        try:
            return await _connect_one(nodes[index]), index
        except BrokerUnavailable as exc:
            failures.append(exc)
    if starting and all(isinstance(exc, _TLSRefused) for exc in failures):
        raise ConfigError("; ".join(map(str, failures)))
    if len(failures) == 1:
        raise BrokerUnavailable(str(failures[0]))
    raise BrokerUnavailable("no RabbitMQ node answered: " + "; ".join(map(str, failures)))


async def _declare_exchange(channel: AbstractChannel, name: str) -> aio_pika.abc.AbstractExchange:
    try:
        return await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise ConfigError(
            f"exchange {name!r} exists with other settings than a durable topic exchange: {exc}"
        ) from None


class _Client:
    """A connection and a channel of aio-pika/aiormq, and whether both are open;
    the broker's nodes, and which one the connection goes (or last went) to."""

    _connection: AbstractConnection | None = None
    _channel: Any = None  # aiormq's channel for the publisher, aio-pika's for the consumer
    nodes: tuple[str, ...] = ()
    _node = 0  # index in nodes of the node connected to, or last connected to
    _was_connected = False

    def _init_nodes(self, url: str | Sequence[str]) -> None:
        self.nodes = (url,) if isinstance(url, str) else tuple(url)
        if not self.nodes:
            raise ConfigError("no RabbitMQ node given")

    @property
    def url(self) -> str:
        """The node connected to (or to try first)."""
        return self.nodes[self._node]

    async def _connect_node(self) -> AbstractConnection:
        """Connect to the first node that answers; after a lost connection,
        the nodes after the one lost come first."""
        first = (self._node + 1) % len(self.nodes) if self._was_connected else self._node
        connection, self._node = await _connect(self.nodes, first, starting=not self._was_connected)
        if self._was_connected and len(self.nodes) > 1:
            log.info(
                "RabbitMQ: now on node %d of %d (%s)",
                self._node + 1,
                len(self.nodes),
                redact_url(self.url),
            )
        self._was_connected = True
        return connection

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            try:
                await connection.close()
            except _CONNECTION_ERRORS:
                pass


_UNSETTLED = object()  # no ack or nack yet
_RETURNED = object()  # came back unroutable (mandatory), then acked


class _Confirms:
    """The publisher confirms of one batch, counted by delivery tag.

    aiormq keeps an asyncio future per publish in channel.confirmations and
    settles a multiple-ack tag by tag, each through call_soon: with the
    futures' own callbacks, a large share of the relay's CPU in a drain
    (docs/performance.md). Here
    every tag of a batch maps to this one object instead, the publisher's
    channel settles acks a range at a time (_settle_confirms), and the batch
    waits on one future. A returned message (basic.return) is taken from the
    connection's frames by _Returns, which notes its tag in `returned`, so
    that the broker's ack that follows settles it here as returned. Where
    relay cannot read the frames, a return goes through aiormq, which calls
    set_exception (or set_result) with it before the broker's ack, and puts
    a marker of its own (Returning) in the tag's place: the tag is noted in
    `returned` the same way."""

    __slots__ = ("first", "left", "outcomes", "returned", "settled", "tags")

    def __init__(
        self,
        settled: asyncio.Future[None],
        first: int,
        tags: dict[str, int],
        returned: dict[int, _Confirms],
    ) -> None:
        self.settled = settled  # the channel's: rejected if it closes
        self.first = first  # delivery tag of outcomes[0]
        self.outcomes: list[Any] = []  # None (acked), _RETURNED, a nack frame, _UNSETTLED
        self.left = 0
        self.tags = tags  # message id -> delivery tag, the channel's
        self.returned = returned  # delivery tag -> batch, of returns awaiting their ack

    def add(self) -> None:
        self.outcomes.append(_UNSETTLED)
        self.left += 1

    def settle(self, tag: int, outcome: Any) -> None:
        offset = tag - self.first
        if self.outcomes[offset] is not _UNSETTLED:
            return
        self.outcomes[offset] = outcome
        self.left -= 1
        if not self.left and not self.settled.done():
            self.settled.set_result(None)

    # What aiormq's channel calls with a returned message (_on_return_frame);
    # acks and nacks come through _settle_confirms.
    def set_exception(self, exc: BaseException) -> None:
        self.set_result(getattr(exc, "message", None))

    def set_result(self, message: Any) -> None:
        properties = getattr(getattr(message, "header", None), "properties", None)
        tag = self.tags.get(getattr(properties, "message_id", None) or "")
        if tag is not None:
            # Published only once confirmed: the broker's ack follows.
            self.returned[tag] = self


def _settle_confirms(channel: aiormq.Channel, returned: dict[int, _Confirms]) -> None:
    """Settle the publisher's acks and nacks a range at a time (see _Confirms)."""

    def settle(tag: int, confirmation: Any, frame: ConfirmFrame) -> None:
        ack = isinstance(frame, spec.Basic.Ack)
        if isinstance(confirmation, _Confirms):
            if returned and returned.pop(tag, None) is not None and ack:
                confirmation.settle(tag, _RETURNED)
            else:
                confirmation.settle(tag, None if ack else frame)
        elif isinstance(confirmation, Returning):
            batch = returned.pop(tag, None)
            if batch is not None:
                batch.settle(tag, _RETURNED if ack else frame)
        elif not confirmation.done():
            if ack:  # a future of aiormq's own
                confirmation.set_result(frame)
            else:
                confirmation.set_exception(aiormq.exceptions.DeliveryError(None, frame))

    aiormq_internals.settle_confirms_with(channel, settle)


class _Returns:
    """The returned messages (basic.return: mandatory, and routed to no
    queue) of the publisher's channel, taken from the connection's frame
    reader (aiormq_internals.read_frames_with): each is matched to its batch
    by its message id, and its tag noted in `returned` before the broker's
    ack for it is read, so that the ack settles it as returned
    (_settle_confirms). aiormq would decode each return's properties and
    headers with pamqp and aio-pika make an IncomingMessage of it, which
    held a drain to a topic nobody is bound to at about 13,000 msgs/s
    against about 36,000 now (docs/rabbitmq.md). The channel's other frames
    go on to aiormq."""

    __slots__ = ("confirmations", "left", "number", "returned", "returning", "tags")

    def __init__(self, channel: aiormq.Channel, returned: dict[int, _Confirms]) -> None:
        self.number = channel.number
        self.tags = aiormq_internals.message_tags(channel)
        self.confirmations = aiormq_internals.confirmations(channel)
        self.returned = returned
        self.returning = False  # a return's method frame came: its header is next
        self.left = 0  # body bytes of the return still to come

    def __call__(self, frame_type: int, channel: int, payload: bytes) -> bool:
        if channel != self.number:
            return False
        if frame_type == 3 and self.left > 0:
            self.left -= len(payload)
            return True
        if frame_type == 1 and payload[:4] == amqp_wire.BASIC_RETURN:
            self.returning = True
            return True
        if frame_type == 2 and self.returning:
            self.returning = False
            try:
                self.left, message_id = amqp_wire.decode_returned(payload)
            except Exception:  # leave it to pamqp, leniently
                header = aiormq_internals.decode_header(payload)
                self.left, message_id = header.body_size or 0, header.properties.message_id
            # Delivery tags start at 1: 0 is no publish's.
            tag = self.tags.get(message_id, 0) if message_id is not None else 0
            batch = self.confirmations.get(tag)
            if isinstance(batch, _Confirms):
                self.returned[tag] = batch
            else:
                log.error("a returned message matches no publish of the channel: %r", message_id)
            return True
        return False


class AmqpPublisher(_Client):
    """Publishes outbox rows to a durable topic exchange with publisher confirms."""

    def __init__(
        self, url: str | Sequence[str], *, exchange: str, on_unroutable: str = "publish"
    ) -> None:
        self._init_nodes(url)
        self.exchange = exchange
        # "publish": a returned (unroutable) message that the broker acked is
        # published (Outcome.UNROUTABLE, counted by the loop); "fail": a
        # failed attempt.
        self.on_unroutable = on_unroutable
        try:
            self._exchange_name = shortstr(exchange)
        except ValueError as exc:
            raise ConfigError(f"invalid --exchange: {exc}") from None
        self._connection: AbstractConnection | None = None
        self._channel: aiormq.Channel | None = None
        self._max_content_size = 0  # the channel's, for body frames (set on connect)
        self._connect_lock = asyncio.Lock()
        # Lowered to the broker's own limit when it refuses a message as too big.
        self.max_message_size = MAX_MESSAGE_SIZE
        self._returned: dict[int, _Confirms] = {}
        # While RabbitMQ blocks the connection (a memory or disk alarm): why.
        self._blocked: str | None = None
        self._unblocked = asyncio.Event()
        self._unblocked.set()
        self._blocks = 0  # connection.blocked notifications so far

    @property
    def blocked(self) -> str | None:
        """Why RabbitMQ blocks this connection (a resource alarm), or None."""
        return self._blocked if self.connected else None

    def _on_blocking(self, reason: str | None) -> None:
        if reason is not None:
            self._blocks += 1
            self._blocked = reason or "no reason given"
            self._unblocked.clear()
            log.warning(
                "RabbitMQ blocked the connection (%s): publishing waits until it unblocks it",
                self._blocked,
                extra={"action": "broker_blocked"},
            )
        else:
            if self._blocked is not None:
                log.info(
                    "RabbitMQ unblocked the connection: publishing resumes",
                    extra={"action": "broker_unblocked"},
                )
            self._blocked = None
            self._unblocked.set()

    async def wait_unblocked(self) -> None:
        """Return once the connection is not blocked (or is gone)."""
        while self._blocked is not None and self.connected:
            try:
                await asyncio.wait_for(self._unblocked.wait(), 1.0)
            except TimeoutError:
                pass

    async def connect(self) -> None:
        if self.connected:
            return
        # Both outbox workers may find the connection down at once: one
        # connects, the other waits for it instead of opening a second one.
        async with self._connect_lock:
            if not self.connected:
                await self._connect()

    async def _connect(self) -> None:
        aiormq_internals.check_versions()  # once per process
        await self.close()
        self._on_blocking(None)  # a new connection starts unblocked
        connection = await self._connect_node()
        try:
            aiormq_internals.watch_blocking(connection, self._on_blocking)
            channel = await connection.channel(publisher_confirms=True)
            await _declare_exchange(channel, self.exchange)
            self._channel = aiormq_internals.aiormq_channel(await channel.get_underlay_channel())
            self._max_content_size = aiormq_internals.max_content_size(self._channel)
            self._returned = {}
            _settle_confirms(self._channel, self._returned)
            aiormq_internals.read_frames_with(connection, _Returns(self._channel, self._returned))
        except _CONNECTION_ERRORS as exc:
            await connection.close()
            raise _unavailable(exc, self.url) from exc
        except BaseException:
            await connection.close()
            raise
        self._connection = connection
        log.info("connected to RabbitMQ at %s", redact_url(self.url))

    def _encode(self, channel: aiormq.Channel, row: OutboxRow) -> bytes:
        """The frames of one row's publish; BadMessage when no broker could carry it."""
        check_topic(row)
        headers = row_headers(row)
        if row.key is not None:
            headers[KEY_HEADER] = row.key
        table: Mapping[str, str | int] = headers
        if row.attributes:  # added above the broker (relay.rows.OutboxRow)
            table = {**headers, **dict(row.attributes)}
        # The copies of a body that stay, one row at a time: the compact body
        # (the payload is PostgreSQL's text of the jsonb, with spaces, and
        # the wire carries it compact, numbers exact), then its frames (cut
        # to the connection's frame size, with their heads: what the socket
        # is given); the body goes when this returns, the frames once written.
        body = row_body(row)
        if len(body) > self.max_message_size:
            raise BadMessage(
                f"payload is {len(body)} bytes, over RabbitMQ's message size limit "
                f"({self.max_message_size} bytes)"
            )
        try:
            return publish_frames(
                channel.number,
                self._exchange_name,
                row.topic,
                body,
                message_id=row.id,
                type=row.type,
                timestamp=row.created_at,
                headers=table,
                max_content_size=self._max_content_size,
            )
        except ValueError as exc:  # a topic, type or header name over 255 bytes
            raise BadMessage(str(exc)) from None

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        if self._blocked is not None:
            await self.wait_unblocked()
            await self.connect()
        channel = self._channel
        assert channel is not None
        results: list[PublishResult] = [None] * len(rows)
        frames: list[bytes] = []
        indexes: list[int] = []  # of the rows published, in delivery tag order
        message_ids = aiormq_internals.message_tags(channel)
        # The whole batch goes out as one buffer. Delivery tags are the
        # channel's publish sequence numbers, so they are taken under the
        # channel's lock, in the order the frames are written.
        async with aiormq_internals.lock(channel):
            batch = _Confirms(
                channel.create_future(),
                aiormq_internals.next_delivery_tag(channel),
                message_ids,
                self._returned,
            )
            held: set[str] = set()  # keys whose row failed here: their later rows wait
            for index, row in enumerate(rows):
                if row.key is not None and row.key in held:
                    results[index] = Outcome.RELEASE
                    continue
                try:
                    frames.append(self._encode(channel, row))
                except Exception as exc:  # whatever it is, it is this row's
                    results[index] = encode_failure(exc)
                    if row.key is not None:
                        held.add(row.key)
                    continue
                batch.add()
                indexes.append(index)
            if frames:
                # Tags in row order, each matched to its message id for returns.
                aiormq_internals.register_publishes(
                    channel, batch, [rows[index].id for index in indexes]
                )
                try:
                    for payload in _writes(frames):
                        await aiormq_internals.write(channel, payload)
                    # Not kept while the confirms come: the payloads' text
                    # (the rows') is all the batch holds of its bodies then.
                    frames.clear()
                except _CONNECTION_ERRORS as exc:
                    raise _unavailable(exc, self.url) from exc
        if not indexes:
            batch.settled.set_result(None)
            return results
        broken: BaseException | None = None
        try:
            while True:
                blocks = self._blocks
                try:
                    await asyncio.wait_for(asyncio.shield(batch.settled), CONFIRM_TIMEOUT)
                    break
                except TimeoutError:
                    # A blocked connection is read by nobody: its confirms
                    # come once the alarm clears, however long that takes.
                    if self._blocked is None and blocks == self._blocks:
                        raise
        except TimeoutError:
            broken = TimeoutError(f"no confirm within {CONFIRM_TIMEOUT:.0f}s")
        except asyncio.CancelledError:
            if not batch.settled.cancelled():
                raise  # our task's, not the channel's
            broken = asyncio.CancelledError()
        except Exception as exc:  # the channel or connection closed first
            broken = exc
        if self._returned:  # returns whose ack never came (the connection broke)
            for tag in range(batch.first, batch.first + len(indexes)):
                self._returned.pop(tag, None)
        for index, outcome in zip(indexes, batch.outcomes, strict=True):
            message_ids.pop(rows[index].id, None)
            if outcome is None:
                continue
            if outcome is _UNSETTLED:
                results[index] = Outcome.RELEASE
            elif outcome is _RETURNED:
                results[index] = self._unroutable(rows[index])
            else:
                nack = aiormq.exceptions.DeliveryError(None, outcome)
                results[index] = Failure(f"rejected by RabbitMQ (nack): {nack}")
        if broken is not None:
            if not self._size_refused(rows, results, broken):
                log.warning(
                    "RabbitMQ connection lost mid-batch: %s", _unavailable(broken, self.url)
                )
            await self.close()
        return results

    def _size_refused(
        self, rows: Sequence[OutboxRow], results: list[PublishResult], exc: BaseException
    ) -> bool:
        """If RabbitMQ closed the channel because a message was over its
        max_message_size: that row fails for good, the others of the batch
        stay released, and later batches are checked against the broker's
        limit before publishing. True if that was the reason."""
        match = _SIZE_REFUSED.search(str(exc))
        if not isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed) or match is None:
            return False
        refused, limit = int(match[1]), int(match[2])
        log.warning(
            "RabbitMQ refused a message of %d bytes: its max_message_size is %d bytes; "
            "larger payloads now fail before they are published",
            refused,
            limit,
        )
        self.max_message_size = min(self.max_message_size, limit)
        sizes = {
            index: len(row_body(rows[index]))
            for index, result in enumerate(results)
            if result is Outcome.RELEASE
        }
        too_big = [index for index, size in sizes.items() if size > limit]
        if not too_big and sizes:  # sized differently: the largest one it was
            too_big = [max(sizes, key=sizes.__getitem__)]
        for index in too_big:
            results[index] = Failure(
                f"payload is {sizes[index]} bytes, over RabbitMQ's message size limit "
                f"({limit} bytes): the broker refused it",
                permanent=True,
            )
        return True

    def _unroutable(self, row: OutboxRow) -> Failure | Outcome:
        if self.on_unroutable == "publish":
            return Outcome.UNROUTABLE
        return Failure(
            f"unroutable: no queue is bound to exchange {self.exchange!r} "
            f"for routing key {row.topic!r}"
        )


def _original(
    exchange: str, routing_key: str | None, content_header: bytes | None
) -> dict[str, Any]:
    """A delivery's properties exactly as they came: the content header
    frame's bytes (AMQP 0-9-1, class 60) and the routing key."""
    return {"exchange": exchange, "routing_key": routing_key, "content_header": content_header}


def _incoming(
    channel: aiormq.abc.AbstractChannel,
    tag: int,
    exchange: str,
    routing_key: str | None,
    message_id: str | None,
    type_: str | None,
    headers: dict[str, Any],
    body: bytes,
    raw_header: bytes | None,
    undecodable: str | None = None,
    content_type: str | None = None,
) -> Incoming:
    """A delivery as the inbox sees it: values as decoded (relay.storable
    makes them storable, or the row dead), nothing here can fail."""
    key = headers.get(KEY_HEADER)
    if isinstance(key, (bytes, bytearray)):
        key = bytes(key).decode("utf-8", "surrogateescape")
    return Incoming(
        message_id=message_id or None,
        topic=routing_key,
        key=key if key is None or isinstance(key, str) else str(key),
        type=type_ or routing_key or None,  # the contract's fallback
        body=body,
        headers=headers,
        ack_token=(channel, tag),
        original=functools.partial(_original, exchange, routing_key, raw_header),
        undecodable=undecodable,
        content_type=content_type,
    )


_HeaderFields = tuple[str | None, str | None, dict[str, Any], bytes | None, str | None, str | None]


def _header_fields(header: ContentHeader) -> _HeaderFields:
    """What the inbox reads of a content header decoded by pamqp: message
    id, type, headers, the frame's bytes and why it did not decode, if so
    (these two set by amqp_lenient), and the content type."""
    properties = header.properties
    return (
        properties.message_id,
        properties.message_type,
        properties.headers or {},
        getattr(header, "relay_raw", None),
        getattr(header, "relay_undecodable", None),
        properties.content_type,
    )


def _from_pamqp(message: DeliveredMessage) -> Incoming:
    """A delivery that came the way of aiormq (pamqp's decoding)."""
    # Consumed, never fetched (basic.get): always a Deliver. Narrowed by
    # annotation, not isinstance, which would cost every delivery a call.
    delivery: spec.Basic.Deliver = message.delivery  # type: ignore[assignment]
    assert delivery.delivery_tag is not None  # RabbitMQ tags every delivery
    message_id, type_, headers, raw, undecodable, content_type = _header_fields(message.header)
    return _incoming(
        message.channel,
        delivery.delivery_tag,
        delivery.exchange,
        delivery.routing_key,
        message_id,
        type_,
        headers,
        message.body,
        raw,
        undecodable,
        content_type,
    )


# Frames at least this large are written as they are, not joined with the
# others of their batch (the joined copy of a batch of large messages was a
# copy of all their bodies at once); smaller ones are joined into writes of
# about this size, so that a batch of small messages is still one write.
JOIN_UNDER = 1 << 20


def _writes(frames: list[bytes]) -> Iterator[bytes]:
    """A batch's encoded publishes as the writes that carry them, in order."""
    group: list[bytes] = []
    size = 0
    for frame in frames:
        if len(frame) >= JOIN_UNDER:
            if group:
                yield b"".join(group)
                group, size = [], 0
            yield frame
            continue
        group.append(frame)
        size += len(frame)
        if size >= JOIN_UNDER:
            yield b"".join(group)
            group, size = [], 0
    if group:
        yield b"".join(group)


class _Deliveries:
    """The deliveries of the consumer's channel, taken from the connection's
    frame reader (aiormq_internals.read_frames_with) and decoded by
    amqp_wire; a frame it cannot decode is decoded by pamqp, leniently
    (amqp_lenient), with the same outcome. Each delivery goes to `deliver`
    as an Incoming, in order; the channel's other frames go on to aiormq."""

    def __init__(self, channel: aiormq.abc.AbstractChannel, deliver: Any) -> None:
        self.channel = channel
        self.number = channel.number
        self.deliver = deliver
        # The delivery being put together: its method's fields, then its
        # header's, then the body's parts.
        self.method: tuple[int, str, str | None] | None = None
        self.header: _HeaderFields | None = None
        self.parts: list[bytes] = []
        self.left = 0

    def __call__(self, frame_type: int, channel: int, payload: bytes) -> bool:
        if channel != self.number:
            return False
        if frame_type == 3 and self.header is not None:
            self.parts.append(payload)
            self.left -= len(payload)
            if self.left <= 0:
                self._done()
            return True
        if frame_type == 1 and payload[:4] == amqp_wire.BASIC_DELIVER:
            if self.method is not None:
                raise aiormq.exceptions.InvalidFrameError("a delivery inside another's content")
            try:
                self.method = amqp_wire.decode_deliver(payload)
            except Exception:  # leave it to pamqp, leniently
                deliver = aiormq_internals.decode_method(payload)
                assert isinstance(deliver, _DELIVER) and deliver.delivery_tag is not None
                self.method = (deliver.delivery_tag, deliver.exchange, deliver.routing_key)
            return True
        if frame_type == 2 and self.method is not None and self.header is None:
            undecodable = None
            try:
                size, message_id, type_, headers, content_type = amqp_wire.decode_header(
                    payload, _field_table
                )
            except Exception:  # leave it to pamqp, leniently
                header = aiormq_internals.decode_header(payload)
                size = header.body_size or 0
                message_id, type_, headers, _, undecodable, content_type = _header_fields(header)
            self.header = (message_id, type_, headers, payload, undecodable, content_type)
            self.left = size
            if size <= 0:
                self._done()
            return True
        return False

    def _done(self) -> None:
        method, header, parts = self.method, self.header, self.parts
        assert method is not None and header is not None
        self.method = self.header = None
        self.parts = []
        # One bytes object for the body (the frames' parts joined: the copy
        # that stays, as the inbox row's payload is made from one text).
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.deliver(_incoming(self.channel, *method, *header[:3], body, *header[3:]))


class AmqpConsumer(_Client):
    """Consumes a durable queue bound to the exchange, with a prefetch window."""

    def __init__(
        self,
        url: str | Sequence[str],
        *,
        queue: str,
        exchange: str,
        binds: Sequence[str],
        prefetch: int,
        queue_type: str | None = None,
        queue_args: Sequence[tuple[str, str | int]] = (),
        max_bytes: int | None = None,
    ) -> None:
        self._init_nodes(url)
        self.queue = queue
        # The bytes of the bodies received and not yet acknowledged: past
        # max_bytes the frames are left unread until an ack brings them
        # under it (RabbitMQ bounds deliveries by count only: the prefetch).
        self.max_bytes = max_bytes
        self._held = 0
        self._underlay: object = None  # the channel whose deliveries are counted
        self._room = asyncio.Event()
        self._room.set()
        self.exchange = exchange
        self.binds = tuple(binds)
        self.prefetch = prefetch
        # Asked for (by --queue-type or --queue-arg): a queue declared
        # otherwise is an error. Not asked for: it is used as it is.
        self.strict = queue_type is not None or bool(queue_args)
        self.arguments: dict[str, Any] = dict(queue_args)
        if queue_type == "quorum":
            self.arguments["x-queue-type"] = "quorum"
        elif queue_type == "classic" and queue_args:
            self.arguments.setdefault("x-queue-type", "classic")
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._received: asyncio.Queue[Incoming | BaseException] = asyncio.Queue()
        self.frames_read_by_relay = False  # see connect()
        amqp_lenient.install()  # no delivery can drop the connection

    async def connect(self) -> None:
        if self.connected:
            return
        aiormq_internals.check_versions()  # once per process
        await self.close()
        # Deliveries of the old channel can no longer be acked: drop them,
        # the broker redelivers them.
        self._received = asyncio.Queue()
        self._hold(-self._held)
        connection = await self._connect_node()
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=self.prefetch)
            exchange = await _declare_exchange(channel, self.exchange)
            try:
                queue = await channel.declare_queue(
                    self.queue, durable=True, arguments=self.arguments or None
                )
            except aiormq.exceptions.ChannelPreconditionFailed as exc:
                if self.strict:
                    raise self._refused(exc) from None
                # Declared by its owner with arguments of its own (a quorum
                # queue, x-max-length...): use it as it is. The failed
                # declare closed the channel, so start over on a new one.
                channel = await connection.channel()
                await channel.set_qos(prefetch_count=self.prefetch)
                exchange = await _declare_exchange(channel, self.exchange)
                queue = await channel.declare_queue(self.queue, passive=True)
            for pattern in self.binds:
                await queue.bind(exchange, routing_key=pattern)
            received = self._received

            def put(message: Incoming) -> None:
                self._hold(len(message.body))
                received.put_nowait(message)

            async def on_message(message: DeliveredMessage) -> None:
                put(_from_pamqp(message))

            # Consumed on aiormq's channel: aio-pika would wrap each delivery
            # in an IncomingMessage and a task of its own, a share of the
            # receiver's CPU worth saving, for fields read once here. The
            # deliveries are taken from the connection's frames and decoded
            # by relay (_Deliveries, set before consuming so that all take
            # one path, in order); where aiormq's reader is not found, they
            # are handed over from the channel's reader, without aiormq's
            # task per delivery (deliver_directly). on_message is aiormq's
            # own path, kept as the callback basic_consume wants.
            underlay = self._underlay = await channel.get_underlay_channel()
            aiormq_internals.deliver_directly(underlay, lambda message: put(_from_pamqp(message)))
            self.frames_read_by_relay = aiormq_internals.read_frames_with(
                connection,
                _Deliveries(underlay, put),
                self._room if self.max_bytes is not None else None,
            )
            await underlay.basic_consume(queue.name, on_message)
            # Bound to this connection's queue: the old channel of a lost
            # connection may report its close late, when a new connection
            # (maybe to another node) is already consuming.
            channel.close_callbacks.add(functools.partial(self._on_close, received))
        except _CONNECTION_ERRORS as exc:
            await connection.close()
            raise _unavailable(exc, self.url) from exc
        except BaseException:
            await connection.close()
            raise
        self._connection, self._channel = connection, channel
        log.info(
            "consuming queue %r from RabbitMQ at %s (bindings: %s)",
            self.queue,
            redact_url(self.url),
            ", ".join(self.binds) or "none",
        )

    def _hold(self, change: int) -> None:
        """Count bodies received (+) or acknowledged (-); open or close the room."""
        self._held += change
        if self.max_bytes is None or self._held < self.max_bytes:
            self._room.set()
        else:
            self._room.clear()

    def _refused(self, exc: BaseException) -> ConfigError:
        """RabbitMQ refused to declare the queue as --queue-type/--queue-arg ask."""
        text = str(exc.args[0] if exc.args else exc)
        asked = ", ".join(f"{k}={v}" for k, v in self.arguments.items()) or "no arguments"
        if "inequivalent" in text:
            return ConfigError(
                f"queue {self.queue!r} exists with other arguments than relay was asked to "
                f"declare it with ({asked}): {text}. Delete the queue (losing its messages) "
                "or give the arguments it has; a queue's type and arguments cannot change"
            )
        return ConfigError(f"RabbitMQ refused to declare queue {self.queue!r} with {asked}: {text}")

    def _on_close(
        self,
        received: asyncio.Queue[Incoming | BaseException],
        _channel: object,
        exc: BaseException | None = None,
    ) -> None:
        received.put_nowait(BrokerUnavailable(f"RabbitMQ channel closed: {exc}"))

    async def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        while True:
            await self.connect()
            received = self._received
            first = await received.get()
            batch: list[Incoming] = []
            item: Incoming | BaseException = first
            loop = asyncio.get_running_loop()
            deadline = loop.time() + max_wait
            while True:
                if isinstance(item, BaseException):
                    if batch:
                        break  # store what we have; the error shows next time
                    await self.close()
                    raise BrokerUnavailable(str(item))
                batch.append(item)
                if len(batch) >= max_size:
                    break
                try:
                    item = received.get_nowait()
                except asyncio.QueueEmpty:
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        break
                    try:
                        item = await asyncio.wait_for(received.get(), timeout)
                    except TimeoutError:
                        break
            yield batch

    async def ack(self, batch: Sequence[Incoming]) -> None:
        if not batch:
            return
        channel, tag = cast(tuple[aiormq.abc.AbstractChannel, int], batch[-1].ack_token)
        try:
            # Deliveries arrive and are stored in order, so one multiple-ack
            # on the last delivery tag acknowledges the whole batch.
            await channel.basic_ack(tag, multiple=True)
            if channel is self._underlay:  # not a channel of a lost connection
                self._hold(-sum(len(message.body) for message in batch))
        except Exception as exc:
            # aiormq rejects pending operations with a bare Exception when a
            # channel closes without a reason: judge by the channel's state.
            if not isinstance(exc, _CONNECTION_ERRORS) and self.connected:
                raise
            # The rows are committed; the broker will redeliver and the
            # inbox will count them as duplicates.
            await self.close()
            raise _unavailable(exc, self.url) from exc


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
