"""RabbitMQ, broker to inbox: a durable queue bound to the exchange,
consumed with a prefetch window and a bound on the bytes held, the
deliveries decoded by relay (wire) and acknowledged with one multiple-ack
per stored batch."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncGenerator, Sequence
from typing import Any, cast

import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.decode import field_table as _field_table
from pamqp.header import ContentHeader

from relay.brokers import (
    Incoming,
)
from relay.brokers.amqp import aiormq_internals, lenient, wire
from relay.brokers.amqp.connection import (
    CONNECTION_ERRORS,
    Client,
    declare_exchange,
    unavailable,
)
from relay.brokers.amqp.wire import KEY_HEADER
from relay.config import redact_url
from relay.errors import BrokerUnavailable, ConfigError

log = logging.getLogger("relay.brokers.amqp")  # the name its log lines have always had

_DELIVER = spec.Basic.Deliver  # the only delivery a consumer's channel hands over


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
    (these two set by lenient), and the content type."""
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


class _Deliveries:
    """The deliveries of the consumer's channel, taken from the connection's
    frame reader (aiormq_internals.read_frames_with) and decoded by
    wire; a frame it cannot decode is decoded by pamqp, leniently
    (lenient), with the same outcome. Each delivery goes to `deliver`
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
        if frame_type == 1 and payload[:4] == wire.BASIC_DELIVER:
            if self.method is not None:
                raise aiormq.exceptions.InvalidFrameError("a delivery inside another's content")
            try:
                self.method = wire.decode_deliver(payload)
            except Exception:  # leave it to pamqp, leniently
                deliver = aiormq_internals.decode_method(payload)
                assert isinstance(deliver, _DELIVER) and deliver.delivery_tag is not None
                self.method = (deliver.delivery_tag, deliver.exchange, deliver.routing_key)
            return True
        if frame_type == 2 and self.method is not None and self.header is None:
            undecodable = None
            try:
                size, message_id, type_, headers, content_type = wire.decode_header(
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


class AmqpConsumer(Client):
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
        lenient.install()  # no delivery can drop the connection

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
            exchange = await declare_exchange(channel, self.exchange)
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
                exchange = await declare_exchange(channel, self.exchange)
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
        except CONNECTION_ERRORS as exc:
            await connection.close()
            raise unavailable(exc, self.url) from exc
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
            if not isinstance(exc, CONNECTION_ERRORS) and self.connected:
                raise
            # The rows are committed; the broker will redeliver and the
            # inbox will count them as duplicates.
            await self.close()
            raise unavailable(exc, self.url) from exc
