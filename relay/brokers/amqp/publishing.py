"""RabbitMQ, outbox to broker: publisher confirms with the whole batch in
flight on one channel (AMQP keeps a channel's publishes in order), and
mandatory routing, so that a message no queue would take comes back
(basic.return) and is counted instead of vanishing unseen."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from pamqp import commands as spec

from relay.brokers import (
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.brokers.amqp import aiormq_internals, wire
from relay.brokers.amqp.aiormq_internals import ConfirmFrame, Returning
from relay.brokers.amqp.connection import (
    CONNECTION_ERRORS,
    Client,
    declare_exchange,
    unavailable,
)
from relay.brokers.amqp.wire import KEY_HEADER, publish_frames, shortstr
from relay.config import redact_url
from relay.errors import BadMessage, ConfigError
from relay.rows import Failure, OutboxRow

log = logging.getLogger("relay.brokers.amqp")  # the name its log lines have always had

CONFIRM_TIMEOUT = 60.0
# RabbitMQ's default max_message_size (128 MiB); a larger publish would make
# the broker close the channel, failing the whole batch.
MAX_MESSAGE_SIZE = 128 * 1024 * 1024
# How RabbitMQ says a publish was over its max_message_size (it then closes
# the channel): the publisher adopts the broker's limit from it.
_SIZE_REFUSED = re.compile(r"message size (\d+) is larger than (?:configured )?max size (\d+)")


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
        if frame_type == 1 and payload[:4] == wire.BASIC_RETURN:
            self.returning = True
            return True
        if frame_type == 2 and self.returning:
            self.returning = False
            try:
                self.left, message_id = wire.decode_returned(payload)
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


class AmqpPublisher(Client):
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
            await declare_exchange(channel, self.exchange)
            self._channel = aiormq_internals.aiormq_channel(await channel.get_underlay_channel())
            self._max_content_size = aiormq_internals.max_content_size(self._channel)
            self._returned = {}
            _settle_confirms(self._channel, self._returned)
            aiormq_internals.read_frames_with(connection, _Returns(self._channel, self._returned))
        except CONNECTION_ERRORS as exc:
            await connection.close()
            raise unavailable(exc, self.url) from exc
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
                except CONNECTION_ERRORS as exc:
                    raise unavailable(exc, self.url) from exc
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
                log.warning("RabbitMQ connection lost mid-batch: %s", unavailable(broken, self.url))
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
