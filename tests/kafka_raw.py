"""Records as any producer may write them: a Produce request (v3, one
record batch of magic 2) built byte by byte, so that a test can send what
confluent-kafka's producer never would (a header name that is not UTF-8).
Kafka's protocol guide: https://kafka.apache.org/protocol#The_Messages_Produce
and the record batch format of KIP-98."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

RawRecord = tuple[bytes | None, bytes | None, Sequence[tuple[bytes, bytes | None]]]


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        crc = n
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)  # zigzag
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def _sized(data: bytes | None) -> bytes:
    return _varint(-1) if data is None else _varint(len(data)) + data


def record_batch(records: Sequence[RawRecord], timestamp_ms: int) -> bytes:
    body = bytearray()
    for delta, (key, value, headers) in enumerate(records):
        record = (
            b"\x00"  # attributes
            + _varint(0)  # timestamp delta
            + _varint(delta)  # offset delta
            + _sized(key)
            + _sized(value)
            + _varint(len(headers))
            + b"".join(_sized(name) + _sized(v) for name, v in headers)
        )
        body += _varint(len(record)) + record
    # attributes, last offset delta, first and max timestamp, producer id,
    # epoch and base sequence (none: not idempotent), the record count
    after_crc = (
        struct.pack(">hiqqqhi", 0, len(records) - 1, timestamp_ms, timestamp_ms, -1, -1, -1)
        + struct.pack(">i", len(records))
        + bytes(body)
    )
    after_length = struct.pack(">ibI", -1, 2, crc32c(after_crc)) + after_crc
    return struct.pack(">qi", 0, len(after_length)) + after_length


def _string(text: str) -> bytes:
    data = text.encode()
    return struct.pack(">h", len(data)) + data


def produce(bootstrap: str, topic: str, records: Sequence[RawRecord], partition: int = 0) -> int:
    """Send the records to the partition (its leader: Tansu's one node) with
    acks=-1; the base offset the broker gave them, or AssertionError with
    its error code."""
    batch = record_batch(records, int(time.time() * 1000))
    body = (
        struct.pack(">hhi", 0, 3, 1)  # Produce v3, correlation id 1
        + _string("relay-tests-raw")
        + struct.pack(">hhi", -1, -1, 30_000)  # no transactional id, acks=all, timeout
        + struct.pack(">i", 1)
        + _string(topic)
        + struct.pack(">i", 1)
        + struct.pack(">ii", partition, len(batch))
        + batch
    )
    host, port = bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(struct.pack(">i", len(body)) + body)
        size = struct.unpack(">i", _read(conn, 4))[0]
        answer = _read(conn, size)
    # correlation id, [topic [partition error_code base_offset log_append_time]], throttle
    at = 4 + 4
    name_length = struct.unpack_from(">h", answer, at)[0]
    at += 2 + name_length + 4  # the name, then the partitions' count
    _index, error, base_offset = struct.unpack_from(">ihq", answer, at)
    assert error == 0, f"Produce refused with error code {error}"
    return int(base_offset)


def _read(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        data += chunk
    return bytes(data)
