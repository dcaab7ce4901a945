"""Encoding Basic.Publish frames for a whole batch at once.

aiormq builds each publish through pamqp's generic, reflective encoder and
sends it from a coroutine of its own: over a hundred microseconds of Python
per message. The outbox publishes one shape of message only, so this module
encodes it directly with struct, producing the same bytes pamqp would (a
test compares them), and the publisher hands aiormq's connection one
buffer per batch. aiormq still owns the socket, the channel state and the
confirms; this is only the encoder.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

# The header that carries the row's key (the contract's `x-relay-key`).
KEY_HEADER = "x-relay-key"

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_END = b"\xce"
BASIC_CLASS = 60
BASIC_PUBLISH = 40

# Property flag bits (AMQP 0-9-1, Basic class), most significant first.
FLAG_CONTENT_TYPE = 1 << 15
FLAG_HEADERS = 1 << 13
FLAG_DELIVERY_MODE = 1 << 12
FLAG_MESSAGE_ID = 1 << 7
FLAG_TIMESTAMP = 1 << 6
FLAG_TYPE = 1 << 5

_frame_head = struct.Struct(">BHI").pack
_publish_head = struct.Struct(">HHH").pack(BASIC_CLASS, BASIC_PUBLISH, 0)
_header_head = struct.Struct(">HHQH").pack
_u32 = struct.Struct(">I").pack
_u64 = struct.Struct(">Q").pack
_i64 = struct.Struct(">q").pack
_CONTENT_TYPE = b"\x10application/json"  # shortstr


def shortstr(value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > 255:
        raise ValueError(f"{value[:40]!r}... is longer than 255 bytes, the AMQP limit for it")
    return bytes((len(raw),)) + raw


# Header names encoded once: most messages repeat a few (x-relay-key, the
# CloudEvents attributes, traceparent).
_names: dict[str, bytes] = {}
_NAMES_KEPT = 1024


def _name(name: str) -> bytes:
    encoded = _names.get(name)
    if encoded is None:
        encoded = shortstr(name)
        if len(_names) < _NAMES_KEPT:
            _names[name] = encoded
    return encoded


def string_table(table: Mapping[str, str | int]) -> bytes:
    """An AMQP field table whose values are long strings ('S'), or 64-bit
    integers ('l': the claim check's ExtendedPayloadSize)."""
    parts = []
    for name, value in table.items():
        if isinstance(value, int):
            parts.append(_name(name) + b"l" + _i64(value))
            continue
        raw = value.encode("utf-8")
        parts.append(_name(name) + b"S" + _u32(len(raw)) + raw)
    body = b"".join(parts)
    return _u32(len(body)) + body


def publish_frames(
    channel: int,
    exchange: bytes,
    routing_key: str,
    body: bytes,
    *,
    message_id: str,
    type: str | None,
    timestamp: datetime,
    headers: Mapping[str, str | int],
    max_content_size: int,
    mandatory: bool = True,
) -> bytes:
    """Method, header and body frames of one persistent JSON publish.

    `exchange` is the exchange name already encoded as a shortstr."""
    method = _publish_head + exchange + shortstr(routing_key) + (b"\x01" if mandatory else b"\x00")

    flags = FLAG_CONTENT_TYPE | FLAG_DELIVERY_MODE | FLAG_MESSAGE_ID | FLAG_TIMESTAMP
    props = [_CONTENT_TYPE]
    if headers:
        flags |= FLAG_HEADERS
        props.append(string_table(headers))
    props.append(b"\x02")  # delivery_mode 2: persistent
    props.append(shortstr(message_id))
    props.append(_u64(int(timestamp.timestamp())))
    if type is not None:
        flags |= FLAG_TYPE
        props.append(shortstr(type))
    header = _header_head(BASIC_CLASS, 0, len(body), flags) + b"".join(props)

    out = [
        _frame_head(FRAME_METHOD, channel, len(method)),
        method,
        FRAME_END,
        _frame_head(FRAME_HEADER, channel, len(header)),
        header,
        FRAME_END,
    ]
    for start in range(0, len(body), max_content_size):
        chunk = body[start : start + max_content_size]
        out += [_frame_head(FRAME_BODY, channel, len(chunk)), chunk, FRAME_END]
    return b"".join(out)


# --- decoding deliveries ----------------------------------------------------
#
# The inbox's receiver reads deliveries the same way: aiormq's frame reader
# and pamqp's generic decoders cost over half of the receiver's CPU per
# message (docs/performance.md). A delivery's Basic.Deliver method and its
# content header are decoded here with struct, for the fields relay reads;
# anything unusual raises, and the frame is decoded by pamqp instead (with
# relay's lenient fallbacks, lenient.py), so both ways give the same values.

BASIC_DELIVER = struct.pack(">HH", BASIC_CLASS, 60)
BASIC_RETURN = struct.pack(">HH", BASIC_CLASS, 50)
_u64_at = struct.Struct(">Q").unpack_from
_u32_at = struct.Struct(">I").unpack_from
_header_at = struct.Struct(">HHQH").unpack_from


class Unusual(ValueError):
    """A frame the fast decoders leave to pamqp."""


def _shortstr_at(data: bytes, at: int) -> tuple[str, int]:
    end = at + 1 + data[at]
    if end > len(data):
        raise Unusual("short string past the frame's end")
    return data[at + 1 : end].decode("utf-8"), end


def decode_deliver(payload: bytes) -> tuple[int, str, str]:
    """A Basic.Deliver method frame's payload -> (delivery tag, exchange,
    routing key). The payload starts with class and method ids (60, 60)."""
    at = 5 + payload[4]  # past the consumer tag
    (tag,) = _u64_at(payload, at)
    exchange, at = _shortstr_at(payload, at + 9)  # past the tag and the redelivered bit
    routing_key, at = _shortstr_at(payload, at)
    if at != len(payload):
        raise Unusual("Basic.Deliver longer than its fields")
    return tag, exchange, routing_key


# Property flags of the Basic class, in the order of their values.
FLAG_CONTENT_ENCODING = 1 << 14
_OCTETS = (1 << 12, 1 << 11)  # delivery mode, priority
_SKIPPED_AFTER_OCTETS = (1 << 10, 1 << 9, 1 << 8)  # correlation id, reply to, expiration
_SKIPPED_LAST = (1 << 4, 1 << 3, 1 << 2)  # user id, app id, cluster id


def _past_octets_to_message_id(payload: bytes, at: int, flags: int) -> int:
    """Where the message id would start, from where the delivery mode would."""
    for flag in _OCTETS:
        if flags & flag:
            at += 1
    for flag in _SKIPPED_AFTER_OCTETS:
        if flags & flag:
            at += 1 + payload[at]
    return at


def decode_header(
    payload: bytes, field_table: Callable[[bytes], tuple[int, dict[str, Any]]]
) -> tuple[int, str | None, str | None, dict[str, Any], str | None]:
    """A content header frame's payload -> (body size, message id, type,
    headers, content type), as pamqp would decode them. `field_table` is
    pamqp's decoder of the headers table (its values come out exactly as
    pamqp's)."""
    class_id, _weight, body_size, flags = _header_at(payload, 0)
    if class_id != BASIC_CLASS or flags & 1:
        raise Unusual("not the Basic class, or more property flags than one word")
    at = 14
    content_type = None
    if flags & FLAG_CONTENT_TYPE:
        content_type, at = _shortstr_at(payload, at)
    if flags & FLAG_CONTENT_ENCODING:
        at += 1 + payload[at]
    headers: dict[str, Any] = {}
    if flags & FLAG_HEADERS:
        used, headers = field_table(payload[at:])
        at += used
    at = _past_octets_to_message_id(payload, at, flags)
    message_id = type_ = None
    if flags & FLAG_MESSAGE_ID:
        message_id, at = _shortstr_at(payload, at)
    if flags & FLAG_TIMESTAMP:
        at += 8
    if flags & FLAG_TYPE:
        type_, at = _shortstr_at(payload, at)
    for flag in _SKIPPED_LAST:
        if flags & flag:
            at += 1 + payload[at]
    if at != len(payload):
        raise Unusual("content header longer or shorter than its properties")
    return body_size, message_id, type_, headers, content_type


def decode_returned(payload: bytes) -> tuple[int, str | None]:
    """A returned message's content header payload -> (body size, message
    id): the one property that matches a basic.return to its publish. The
    headers table is skipped by its length, not decoded."""
    class_id, _weight, body_size, flags = _header_at(payload, 0)
    if class_id != BASIC_CLASS or flags & 1:
        raise Unusual("not the Basic class, or more property flags than one word")
    at = 14
    for flag in (FLAG_CONTENT_TYPE, FLAG_CONTENT_ENCODING):
        if flags & flag:
            at += 1 + payload[at]
    if flags & FLAG_HEADERS:
        at += 4 + _u32_at(payload, at)[0]
    at = _past_octets_to_message_id(payload, at, flags)
    if not flags & FLAG_MESSAGE_ID:
        return body_size, None
    message_id, _ = _shortstr_at(payload, at)
    return body_size, message_id
