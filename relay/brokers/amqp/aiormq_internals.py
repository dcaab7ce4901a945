"""The one place relay reaches into aiormq's and pamqp's private state.

relay's AMQP adapter (`relay/brokers/amqp/`) runs on aio-pika/aiormq, but on its two hot
paths it does not go through their public API:

- Publishing: aiormq builds each publish through pamqp's generic encoder
  and sends it from a coroutine of its own, and settles a multiple-ack tag
  by tag, each future through call_soon. relay encodes a whole batch itself
  (`wire`), so it takes the channel's delivery tags under the channel's
  lock, registers the batch in the channel's confirmation table, writes the
  batch to the connection's write queue as one buffer, and replaces the
  channel's confirm handler to settle a multiple-ack a range at a time.
  Returned (unroutable) messages are taken from the connection's frames
  (read_frames_with, below) and matched to their batch by relay.
- Consuming: relay replaces the get_frame of the connection's FrameReceiver
  (found in aiormq's reader task) with a reader of its own that offers each
  frame to the consumer before pamqp decodes it, so that deliveries are
  decoded by relay (wire) and never reach aiormq; where that reader is
  not found, the channel's deliver handler is replaced instead, to hand each
  delivery over from the channel's reader, in order (aiormq makes a task of
  every delivery to call the consumer's callback).
- Blocking: aiormq handles connection.blocked/unblocked (it holds back new
  writes while blocked) but tells nobody; relay wraps both handlers to
  learn of a resource alarm.
- Lenient decoding (`lenient`): pamqp's method and content header
  frame decoders are wrapped, and a frame that fails is decoded again with
  lenient value decoders swapped into pamqp's decoder tables.

None of this is aiormq's or pamqp's public API, so it may change in any
release: relay is tested with the versions in TESTED (and pins aiormq to
that range in pyproject.toml). check_versions() logs one warning when
another version is installed; it does not refuse to run.

Each function here is called once per channel, connection or batch, so the
adapter binds what it needs there; the handlers installed run per frame, as
aiormq's own did, and add no lookup to the per-message paths.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.metadata
import logging
import struct
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractAsyncContextManager, contextmanager
from typing import Any, cast

import aiormq
import aiormq.abc
import aiormq.connection
import aiormq.exceptions
from aio_pika.abc import AbstractConnection
from aiormq.abc import ChannelFrame, DeliveredMessage
from aiormq.channel import Returning
from pamqp import commands as spec
from pamqp import decode as pamqp_decode
from pamqp import frame as pamqp_frame
from pamqp.base import Frame
from pamqp.body import ContentBody
from pamqp.exceptions import PAMQPException
from pamqp.header import ContentHeader

log = logging.getLogger("relay.brokers.aiormq_internals")  # the name its log lines have always had

__all__ = [
    "TESTED",
    "ConfirmFrame",
    "Returning",
    "aiormq_channel",
    "check_versions",
    "confirmations",
    "decode_header",
    "decode_method",
    "deliver_directly",
    "lock",
    "max_content_size",
    "message_tags",
    "next_delivery_tag",
    "pamqp_decoders_replaced",
    "read_frames_with",
    "register_publishes",
    "settle_confirms_with",
    "watch_blocking",
    "wrap_pamqp_decoders",
    "write",
]

# Distribution -> (lowest tested version, first version not tested).
TESTED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "aiormq": ((7, 2, 4), (7, 3)),
    "pamqp": ((4, 0, 1), (4, 1)),
}

ConfirmFrame = spec.Basic.Ack | spec.Basic.Nack
# Called for each delivery tag a confirm frame settles, in tag order: the tag,
# what the channel held for it (whatever register_publishes put there, a
# Returning, or a future of aiormq's own) and the frame.
Settle = Callable[[int, Any, ConfirmFrame], None]


def _version(text: str) -> tuple[int, ...]:
    """The leading numbers of a version: "7.2.4" -> (7, 2, 4), "7.3.0rc1" -> (7, 3, 0)."""
    parts = []
    for part in text.split("."):
        number = ""
        for char in part:
            if not char.isdigit():
                break
            number += char
        if not number:
            break
        parts.append(int(number))
    return tuple(parts)


@functools.cache
def check_versions() -> None:
    """Warn once per process if aiormq or pamqp is a version relay was not
    tested with (its private state may differ)."""
    for name, (low, high) in TESTED.items():
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if not low <= _version(installed) < high:
            log.warning(
                "%s %s is installed; relay's AMQP adapter uses its private state and was "
                "tested with %s >=%s,<%s only: if publishing or consuming misbehaves, "
                "install a tested version",
                name,
                installed,
                name,
                ".".join(map(str, low)),
                ".".join(map(str, high)),
            )


# --- publishing -------------------------------------------------------------


def aiormq_channel(channel: aiormq.abc.AbstractChannel) -> aiormq.Channel:
    """aiormq's own channel class, which the functions below rely on."""
    if not isinstance(channel, aiormq.Channel):
        raise TypeError(f"not an aiormq.Channel: {type(channel).__name__}")
    return channel


def lock(channel: aiormq.Channel) -> AbstractAsyncContextManager[None]:
    """The channel's lock, under which aiormq takes delivery tags; rejects
    the caller if the channel is closed."""
    return cast(AbstractAsyncContextManager[None], channel.lock)


def max_content_size(channel: aiormq.Channel) -> int:
    """The largest body frame the connection takes (its frame_max less framing)."""
    return channel.max_content_size


def message_tags(channel: aiormq.Channel) -> dict[str, int]:
    """The channel's message id -> delivery tag map, by which aiormq matches
    a returned message (basic.return) to its publish."""
    return channel.message_id_delivery_tag


def confirmations(channel: aiormq.Channel) -> dict[int, object]:
    """The channel's delivery tag -> what awaits its confirm."""
    return cast(dict[int, object], channel.confirmations)


def next_delivery_tag(channel: aiormq.Channel) -> int:
    """The delivery tag the channel's next publish gets (under lock())."""
    return channel.delivery_tag + 1


def register_publishes(
    channel: aiormq.Channel, confirmation: object, message_ids: Iterable[str]
) -> None:
    """Take the next delivery tags for publishes of these message ids (under
    lock(), before they are written), each awaiting `confirmation` in the
    channel's confirmation table and matched to its id for returns."""
    confirmations = cast(dict[int, object], channel.confirmations)
    tags = channel.message_id_delivery_tag
    tag = channel.delivery_tag
    for message_id in message_ids:
        tag += 1
        confirmations[tag] = confirmation
        tags[message_id] = tag
    channel.delivery_tag = tag


def write(channel: aiormq.Channel, payload: bytes) -> Awaitable[None]:
    """Queue encoded frames on the channel's connection, as one write."""
    return cast(
        Awaitable[None],
        channel.write_queue.put(ChannelFrame(payload=payload, should_close=False)),
    )


def settle_confirms_with(channel: aiormq.Channel, settle: Settle) -> None:
    """Replace the channel's handler of basic.ack/basic.nack: `settle` is
    called for each delivery tag the frame settles, in tag order, taken out
    of the channel's confirmation table (kept in tag order but for returns,
    which aiormq moves to its end)."""
    confirmations = cast("OrderedDict[int, Any]", channel.confirmations)

    async def on_confirm_frame(frame: ConfirmFrame) -> None:
        last = frame.delivery_tag
        if not frame.multiple:
            if last in confirmations:
                settle(last, confirmations.pop(last), frame)
            return
        while confirmations:
            tag, confirmation = confirmations.popitem(last=False)
            if tag > last:
                confirmations[tag] = confirmation
                confirmations.move_to_end(tag, last=False)
                return
            settle(tag, confirmation, frame)

    channel._on_confirm_frame = on_confirm_frame  # type: ignore[method-assign,assignment]


# --- consuming --------------------------------------------------------------


def deliver_directly(
    channel: aiormq.abc.AbstractChannel, deliver: Callable[[DeliveredMessage], None]
) -> None:
    """Hand each delivery of the channel (one consumer) to `deliver` from the
    channel's frame reader, in order. aiormq makes a task of every delivery
    to call the consumer's callback, which cost the receiver much of its CPU
    (docs/performance.md)."""
    underlay = aiormq_channel(channel)
    get_frame = underlay._get_frame

    async def on_deliver_frame(frame: spec.Basic.Deliver) -> None:
        header = await get_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"unexpected frame {header!r} instead of a content header")
        parts, left = [], header.body_size or 0
        while left > 0:
            content = await get_frame()
            if not isinstance(content, ContentBody):
                raise ValueError(f"unexpected frame {content!r} instead of a content body")
            parts.append(content.value)
            left -= len(content.value)
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        deliver(DeliveredMessage(delivery=frame, header=header, body=body, channel=underlay))

    underlay._on_deliver_frame = on_deliver_frame  # type: ignore[method-assign]


# Called with each frame of the connection (its type, channel and payload,
# the frame end left off) before pamqp decodes it; True when it took the
# frame, which then never reaches aiormq.
Intercept = Callable[[int, int, bytes], bool]
_FRAME_HEAD = struct.Struct(">BHI").unpack


def read_frames_with(
    connection: AbstractConnection, intercept: Intercept, room: asyncio.Event | None = None
) -> bool:
    """Read the connection's frames with relay's reader, which offers each
    frame to `intercept` first; the frames it does not take are decoded by
    pamqp and go to aiormq as before. False (and nothing changed) where
    aiormq's reader is not found.

    aiormq's FrameReceiver reads a frame in three awaits into a BytesIO
    under a lock and decodes every frame with pamqp; for the inbox's
    deliveries that was most of the receiver's CPU. Its reader task iterates
    one FrameReceiver (`async for`, which calls `self.get_frame()`), found
    here in the suspended task's frame; the instance's get_frame is
    replaced, so the frame read now is the last one read the old way.

    With `room`, no frame is read while it is clear: the socket is left
    unread, TCP's window closes and RabbitMQ holds the deliveries (the
    consumer's bound on the bytes it holds, whatever the prefetch). aiormq
    then sees no frame either: a pause must stay well under its heartbeat
    grace (three heartbeat timeouts, 183 s by default)."""
    underlay = getattr(getattr(connection, "transport", None), "connection", None)
    task = getattr(underlay, "_reader_task", None)
    frame = task.get_coro().cr_frame if task is not None and not task.done() else None
    receiver = frame.f_locals.get("frame_receiver") if frame is not None else None
    if not isinstance(receiver, aiormq.connection.FrameReceiver):
        log.debug("aiormq's frame reader not found: deliveries are decoded by pamqp")
        return False
    reader = receiver.reader
    readexactly = reader.readexactly
    head_of = _FRAME_HEAD
    invalid = aiormq.exceptions.InvalidFrameError

    async def get_frame() -> tuple[int, int, Any]:
        while True:
            if room is not None and not room.is_set():
                await room.wait()
            if reader.at_eof():
                raise StopAsyncIteration
            try:
                head = await readexactly(7)
                frame_type, channel, size = head_of(head)
                rest = await readexactly(size + 1)
            except asyncio.IncompleteReadError as exc:
                raise aiormq.exceptions.AMQPConnectionError(
                    "Server connection unexpectedly closed. Read "
                    f"{len(exc.partial)} bytes but {exc.expected} bytes expected"
                ) from exc
            except OSError as exc:  # ConnectionError's kinds included
                raise aiormq.exceptions.AMQPConnectionError(
                    f"Server communication error: {exc!r}"
                ) from exc
            if rest[-1] != 0xCE:
                raise invalid(f"frame of type {frame_type} does not end with 0xCE")
            if intercept(frame_type, channel, rest[:-1]):
                continue
            try:
                return pamqp_frame.unmarshal(head + rest)
            except PAMQPException as exc:
                raise invalid(str(exc)) from exc

    receiver.get_frame = get_frame  # type: ignore[method-assign]
    return True


def decode_method(payload: bytes) -> Frame:
    """A method frame's payload decoded by pamqp (and relay's lenient
    fallback, where lenient is installed)."""
    return pamqp_frame._unmarshal_method_frame(payload)


def decode_header(payload: bytes) -> ContentHeader:
    """A content header frame's payload decoded by pamqp (and relay's
    lenient fallbacks, where lenient is installed)."""
    return pamqp_frame._unmarshal_header_frame(payload)


# --- connection -------------------------------------------------------------


def watch_blocking(connection: AbstractConnection, on_change: Callable[[str | None], None]) -> None:
    """Tell on_change the reason of each connection.blocked and None on each
    connection.unblocked, by wrapping aiormq's two (name-mangled) handlers.
    Without them (another aiormq) nothing is told, as before."""
    transport = getattr(connection, "transport", None)
    underlay = getattr(transport, "connection", None)
    if underlay is None:
        return
    names = ("_Connection__handle_connection_blocked", "_Connection__handle_connection_unblocked")
    blocked, unblocked = (getattr(underlay, name, None) for name in names)
    if blocked is None or unblocked is None:
        log.debug("aiormq has no connection.blocked handler to watch")
        return

    async def on_blocked(frame: spec.Connection.Blocked) -> None:
        on_change(frame.reason or "")
        await blocked(frame)

    async def on_unblocked(frame: spec.Connection.Unblocked) -> None:
        on_change(None)
        await unblocked(frame)

    setattr(underlay, names[0], on_blocked)
    setattr(underlay, names[1], on_unblocked)


# --- pamqp ------------------------------------------------------------------

HeaderDecoder = Callable[[bytes], ContentHeader]
MethodDecoder = Callable[[bytes], Frame]


def wrap_pamqp_decoders(
    wrap_header: Callable[[HeaderDecoder], HeaderDecoder],
    wrap_method: Callable[[MethodDecoder], MethodDecoder],
) -> None:
    """Replace pamqp's content header and method frame decoders (for the
    whole process) with wrappers of them. pamqp.frame.unmarshal looks both
    up as module globals on every frame, so the replacements take effect at
    once, for aiormq's frame reader too."""
    # mypy sees module functions, which it does not let a callable replace.
    pamqp_frame._unmarshal_header_frame = wrap_header(  # type: ignore[assignment]
        pamqp_frame._unmarshal_header_frame
    )
    pamqp_frame._unmarshal_method_frame = wrap_method(  # type: ignore[assignment]
        pamqp_frame._unmarshal_method_frame
    )


@contextmanager
def pamqp_decoders_replaced(
    by_type: Mapping[str, Callable[[bytes], tuple[int, Any]]],
    by_table_code: Mapping[bytes, Callable[[bytes], tuple[int, Any]]],
) -> Iterator[None]:
    """pamqp's value decoders swapped, for the block, in its two tables:
    method fields by type name ("shortstr", "table"...) and field table
    values by type code (b"F", b"T"...). Synchronous code only: nothing
    else may decode on this thread meanwhile."""
    tables: list[tuple[dict[Any, Any], Mapping[Any, Callable[[bytes], tuple[int, Any]]]]] = [
        (pamqp_decode.METHODS, by_type),
        (pamqp_decode.TABLE_MAPPING, by_table_code),
    ]
    saved = [(table, name, table[name]) for table, new in tables for name in new]
    for table, new in tables:
        table.update(new)
    try:
        yield
    finally:
        for table, name, old in saved:
            table[name] = old
