"""AMQP publishes written byte by byte, for what client libraries refuse to encode.

pamqp (and so aio-pika) will not write a short string of invalid UTF-8 or a
timestamp past year 9999, but other clients and a broker pass such bytes
on. Values are given typed, as AMQP field tables carry them: ("S", b"..."),
("x", b"..."), ("F", {name: typed}), ("A", [typed, ...]), ("I", int),
("l", int), ("t", bool), ("d", float), ("T", int), ("V", None). Names and
short strings may be str or raw bytes.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

from aiormq.abc import ChannelFrame

Typed = tuple[str, Any]

_FLAGS = {  # Basic properties in wire order, with their flag bits
    "content_type": 1 << 15,
    "content_encoding": 1 << 14,
    "headers": 1 << 13,
    "delivery_mode": 1 << 12,
    "priority": 1 << 11,
    "correlation_id": 1 << 10,
    "reply_to": 1 << 9,
    "expiration": 1 << 8,
    "message_id": 1 << 7,
    "timestamp": 1 << 6,
    "type": 1 << 5,
    "user_id": 1 << 4,
    "app_id": 1 << 3,
}
_SHORTSTRS = {
    "content_type",
    "content_encoding",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "type",
    "user_id",
    "app_id",
}


def _raw(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8", "surrogateescape")


def shortstr(value: str | bytes) -> bytes:
    raw = _raw(value)
    assert len(raw) <= 255, len(raw)
    return bytes((len(raw),)) + raw


def longstr(value: str | bytes) -> bytes:
    raw = _raw(value)
    return struct.pack(">I", len(raw)) + raw


def field_value(typed: Typed | Encoded) -> bytes:
    if isinstance(typed, Encoded):
        return typed.raw
    kind, value = typed
    code = kind.encode()
    if kind in ("S", "x"):
        return code + longstr(value)
    if kind == "F":
        return code + table(value)
    if kind == "A":
        items = b"".join(field_value(item) for item in value)
        return code + struct.pack(">I", len(items)) + items
    if kind == "t":
        return code + (b"\x01" if value else b"\x00")
    if kind == "V":
        return code
    formats = {
        "b": ">b",
        "B": ">B",
        "s": ">h",
        "u": ">H",
        "I": ">i",
        "i": ">I",
        "l": ">q",
        "f": ">f",
        "d": ">d",
        "T": ">Q",
    }
    if kind == "D":
        places, number = value
        return code + struct.pack(">Bi", places, number)
    return code + struct.pack(formats[kind], value)


def table(entries: dict[str | bytes, Typed | Encoded]) -> bytes:
    body = b"".join(shortstr(name) + field_value(typed) for name, typed in entries.items())
    return struct.pack(">I", len(body)) + body


def content_header(body_size: int, **properties: Any) -> bytes:
    """The payload of a content header frame (class 60) with these properties:
    short strings as str or bytes, `headers` a dict of typed values,
    `delivery_mode`/`priority` ints, `timestamp` an int."""
    flags, parts = 0, []
    for name, bit in _FLAGS.items():
        value = properties.pop(name, None)
        if value is None:
            continue
        flags |= bit
        if name in _SHORTSTRS:
            parts.append(shortstr(value))
        elif name == "headers":
            parts.append(table(value))
        elif name in ("delivery_mode", "priority"):
            parts.append(bytes((value,)))
        elif name == "timestamp":
            parts.append(struct.pack(">Q", value))
    assert not properties, f"unknown properties {sorted(properties)}"
    return struct.pack(">HHQH", 60, 0, body_size, flags) + b"".join(parts)


def frame(kind: int, channel: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", kind, channel, len(payload)) + payload + b"\xce"


async def publish(
    channel: Any, exchange: str, routing_key: str | bytes, body: bytes, **properties: Any
) -> None:
    """Write one publish on an aiormq channel (no confirms): method, header
    and body frames, exactly these bytes."""
    method = struct.pack(">HHH", 60, 40, 0) + shortstr(exchange) + shortstr(routing_key) + b"\x00"
    frames = [
        frame(1, channel.number, method),
        frame(2, channel.number, content_header(len(body), **properties)),
    ]
    for start in range(0, len(body), 100_000):
        frames.append(frame(3, channel.number, body[start : start + 100_000]))
    done = asyncio.get_running_loop().create_future()
    await channel.write_queue.put(
        ChannelFrame(payload=b"".join(frames), should_close=False, drain_future=done)
    )
    await done


class Encoded:
    """A field value already encoded (for nesting deeper than recursion allows)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw


def deep_table_value(depth: int) -> Encoded:
    """A table nested `depth` levels ({"n": {"n": ... "bottom"}}), built iteratively."""
    raw = field_value(("S", "bottom"))
    for _ in range(depth):
        entry = shortstr("n") + raw
        raw = b"F" + struct.pack(">I", len(entry)) + entry
    return Encoded(raw)
