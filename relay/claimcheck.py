"""The claim check's format: Amazon's SQS Extended Client pointer, nothing else.

A message whose body is too big for the broker travels as a pointer to an
S3 object that holds the body: the body

    ["software.amazon.payloadoffloading.PayloadS3Pointer",
     {"s3BucketName": "BUCKET", "s3Key": "PREFIX/<id>"}]

and the size of the stored body in `ExtendedPayloadSize` (an SQS Number
attribute; an integer AMQP header). This is what Amazon's Extended Client
libraries (Java, Python, JavaScript) write and read; the older ones wrote
`SQSLargePayloadSize` and the class name `com.amazon.sqs.javamessaging.
MessageS3Pointer`, which the inbox reads too.

This module holds only the format (no boto3), so that the broker adapters
and the receiver's row building can use it; S3 itself is relay.s3.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson

from relay.brokers import Incoming

POINTER_CLASS = "software.amazon.payloadoffloading.PayloadS3Pointer"
LEGACY_POINTER_CLASS = "com.amazon.sqs.javamessaging.MessageS3Pointer"
SIZE_ATTRIBUTE = "ExtendedPayloadSize"
LEGACY_SIZE_ATTRIBUTE = "SQSLargePayloadSize"
SIZE_ATTRIBUTES = (SIZE_ATTRIBUTE, LEGACY_SIZE_ATTRIBUTE)
# A pointer body is small: a bucket name (63 bytes) and a key (1,024
# bytes, up to 3,072 once json.dumps has escaped it as Amazon's Python
# client does).
MAX_POINTER_BYTES = 8192


def pointer_body(bucket: str, key: str) -> str:
    """The pointer the outbox publishes in place of a large body (compact JSON)."""
    return orjson.dumps([POINTER_CLASS, {"s3BucketName": bucket, "s3Key": key}]).decode()


def read_pointer(body: bytes | str | None) -> tuple[str, str] | None:
    """(bucket, key) when `body` is a claim check pointer, else None.

    Cheap for every other body: only a short JSON array that names a
    pointer class is parsed."""
    if body is None or len(body) > MAX_POINTER_BYTES:
        return None
    raw = body.encode() if isinstance(body, str) else body
    if not raw.lstrip().startswith(b"[") or b"S3Pointer" not in raw:
        return None
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict)):
        return None
    if value[0] not in (POINTER_CLASS, LEGACY_POINTER_CLASS):
        return None
    bucket, key = value[1].get("s3BucketName"), value[1].get("s3Key")
    if not (isinstance(bucket, str) and isinstance(key, str) and bucket and key):
        return None
    return bucket, key


def has_size(headers: Mapping[str, Any]) -> bool:
    """Whether the message carries the claim check's size attribute (or header)."""
    return SIZE_ATTRIBUTE in headers or LEGACY_SIZE_ATTRIBUTE in headers


def without_size(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers less the claim check's size: what the sender's own were."""
    return {k: v for k, v in headers.items() if k not in SIZE_ATTRIBUTES}


def where(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


# (bucket, key) -> the object's bytes, or why it cannot be read (relay.s3).
Fetch = Callable[[str, str], Awaitable[bytes | str]]


async def resolve(
    batch: Sequence[Incoming], fetch: Fetch | None
) -> tuple[list[Incoming], int, int]:
    """The batch with each pointer's message carrying its object's bytes as
    its body (its size header dropped: the message as its sender sent it),
    or, when the object cannot be read or no --claim-check is given (fetch
    None), as received and marked `unfetched` with the reason (relay.storable
    makes that row dead). Also how many were fetched, and how many bytes.
    Whatever fetch raises (S3 unreachable) goes to the caller."""
    found = [
        (index, pointer)
        for index, message in enumerate(batch)
        if has_size(message.headers) and (pointer := read_pointer(message.body)) is not None
    ]
    if not found:
        return list(batch), 0, 0
    out = list(batch)
    if fetch is None:
        fetched: Sequence[bytes | str] = ["no --claim-check is configured"] * len(found)
    else:
        fetched = await asyncio.gather(*(fetch(*pointer) for _, pointer in found))
    count = size = 0
    for (index, pointer), data in zip(found, fetched, strict=True):
        message = batch[index]
        if isinstance(data, bytes):
            count += 1
            size += len(data)
            out[index] = dataclasses.replace(
                message, body=data, headers=without_size(message.headers)
            )
        else:
            out[index] = dataclasses.replace(
                message,
                unfetched=f"the message is a claim check pointer to {where(*pointer)}, whose "
                f"object could not be read: {data}; it is kept as received, and relay "
                "retry fetches it again",
            )
    return out, count, size


def is_pointer(message: Incoming) -> bool:
    return has_size(message.headers) and read_pointer(message.body) is not None


def declared_size(headers: Mapping[str, Any]) -> int:
    """The body's size as the pointer's attribute declares it (0 if unreadable)."""
    for name in SIZE_ATTRIBUTES:
        try:
            return max(0, int(headers[name]))
        except (KeyError, TypeError, ValueError):
            continue
    return 0


def parts(
    batch: Sequence[Incoming], pointers: int, max_bytes: int | None = None
) -> list[Sequence[Incoming]]:
    """The batch in consecutive parts of at most `pointers` claim check
    pointers each, whose declared sizes add up to at most `max_bytes` (but
    for one pointer larger than that, alone): the whole batch, as it is,
    when it holds that few."""
    out: list[Sequence[Incoming]] = []
    start = count = size = 0
    for index, message in enumerate(batch):
        if is_pointer(message):
            more = declared_size(message.headers)
            if count == pointers or (count and max_bytes is not None and size + more > max_bytes):
                out.append(batch[start:index])
                start, count, size = index, 0, 0
            count += 1
            size += more
    if start == 0:
        return [batch]
    out.append(batch[start:])
    return out


def fetch_from(objects: Any) -> Fetch:
    """The Fetch of `relay retry` over a relay.s3.ObjectStore, or over None
    (no --claim-check given: every object "cannot be read", saying why)."""

    async def fetch(bucket: str, key: str) -> bytes | str:
        from relay.s3 import fetch_object  # boto3, only once a pointer row is found

        return await fetch_object(objects, bucket, key)

    return fetch


__all__ = [
    "LEGACY_POINTER_CLASS",
    "LEGACY_SIZE_ATTRIBUTE",
    "POINTER_CLASS",
    "SIZE_ATTRIBUTE",
    "SIZE_ATTRIBUTES",
    "Fetch",
    "fetch_from",
    "has_size",
    "is_pointer",
    "parts",
    "pointer_body",
    "read_pointer",
    "resolve",
    "where",
    "without_size",
]
