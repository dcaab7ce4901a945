"""Frames that pamqp cannot decode, decoded anyway: no delivery drops the consumer.

pamqp decodes AMQP short strings and table keys as strict UTF-8 and
timestamps as datetimes. Any client can send a `message_id`, `type` or
header name of invalid UTF-8, or a timestamp past year 9999; pamqp then
raises from aiormq's frame reader, the connection closes, and relay would
reconnect forever to the same first message. install() wraps pamqp's
method and content header decoding (for the whole process; the inbox's
receiver runs in a process of its own):

- a frame that decodes strictly is used as it is (the common case costs
  one try block);
- else it is decoded again leniently: invalid UTF-8 kept as surrogate
  escapes (lossless: relay.storable turns them back into bytes), a
  timestamp that is no date kept as its integer;
- a content header that still does not decode (a table of an unknown
  field type, nesting past Python's recursion limit) becomes an empty one
  of the same body size, marked `relay_undecodable`.

Every content header also carries its frame's bytes (`relay_raw`), which a
row that cannot store its properties as given keeps in raw_properties.
pamqp's private decoders are reached through `aiormq_internals` only.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from pamqp import common, decode
from pamqp.base import Frame
from pamqp.header import ContentHeader

from relay.brokers.amqp import aiormq_internals

_installed = False


def _short_str(value: bytes) -> tuple[int, str]:
    try:
        length = common.Struct.byte.unpack(value[0:1])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack short string value") from err
    return length + 1, value[1 : length + 1].decode("utf-8", "surrogateescape")


def _timestamp(value: bytes) -> tuple[int, Any]:
    try:
        return decode.timestamp(value)
    except (ValueError, OverflowError, OSError):
        return decode.long_long_int(value)


def _field_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """pamqp's field_table, with table keys decoded leniently."""
    try:
        length = common.Struct.integer.unpack(value[0:4])[0]
    except (struct.error, TypeError) as err:
        raise ValueError("Could not unpack data") from err
    offset, data, end = 4, {}, 4 + length
    if end > len(value):
        raise ValueError("Field table length exceeds available data")
    while offset < end:
        key_length = value[offset]
        offset += 1
        if offset + key_length > end:
            raise ValueError("Field table key length exceeds data")
        key = value[offset : offset + key_length].decode("utf-8", "surrogateescape")
        offset += key_length
        consumed, result = decode.embedded_value(value[offset:])
        offset += consumed
        data[key] = result
    return end, data


_LENIENT_BY_TYPE: dict[str, Callable[[bytes], tuple[int, Any]]] = {
    "shortstr": _short_str,
    "table": _field_table,
    "timestamp": _timestamp,
}
_LENIENT_BY_TABLE_CODE: dict[bytes, Callable[[bytes], tuple[int, Any]]] = {
    b"F": _field_table,
    b"T": _timestamp,
}


def _leniently() -> AbstractContextManager[None]:
    """pamqp's decoders swapped for the lenient ones (synchronous code only:
    nothing else runs on this thread meanwhile)."""
    return aiormq_internals.pamqp_decoders_replaced(_LENIENT_BY_TYPE, _LENIENT_BY_TABLE_CODE)


def _wrap_header(strict: Callable[[bytes], ContentHeader]) -> Callable[[bytes], ContentHeader]:
    def unmarshal_header(frame_data: bytes) -> ContentHeader:
        try:
            header = strict(frame_data)
        except Exception as first:  # any failure is this frame's
            header = ContentHeader()
            try:
                with _leniently():
                    header.unmarshal(frame_data)
            except Exception as exc:
                if len(frame_data) < 12:
                    raise first from None  # no body size: nothing to recover
                _class_id, weight, body_size = struct.unpack(">HHQ", frame_data[:12])
                header = ContentHeader(weight=weight, body_size=body_size)
                header.relay_undecodable = f"{type(exc).__name__}: {exc}"[:500]  # type: ignore[attr-defined]
        header.relay_raw = frame_data  # type: ignore[attr-defined]
        return header

    return unmarshal_header


def _wrap_method(strict: Callable[[bytes], Frame]) -> Callable[[bytes], Frame]:
    def unmarshal_method(frame_data: bytes) -> Frame:
        try:
            return strict(frame_data)
        except Exception:  # a routing key of invalid UTF-8, say
            with _leniently():
                return strict(frame_data)

    return unmarshal_method


def install() -> None:
    """Wrap pamqp's frame decoding (once per process)."""
    global _installed
    if _installed:
        return
    aiormq_internals.wrap_pamqp_decoders(_wrap_header, _wrap_method)
    _installed = True
