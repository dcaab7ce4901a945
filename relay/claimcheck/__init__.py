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

The claim check is one place above the brokers, which wiring puts around
whichever adapter was chosen; no adapter names S3 or the claim check (the
size travels as an OutboxRow attribute, which each adapter writes as its
native header or attribute):

- this module: the format only (no boto3);
- `s3`: the S3 store (boto3 in threads) and what its failures mean;
- `publisher`: `ClaimCheckPublisher`, the wrapper around a broker's
  Publisher that stores large bodies first and publishes their pointers;
- `inbound`: the receiver's stage over a consumer's incoming messages
  (pointers found, their objects fetched, the batch stored in parts);
- `retry`: a dead inbox row kept as a pointer, fetched again on retry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

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


__all__ = [
    "LEGACY_POINTER_CLASS",
    "LEGACY_SIZE_ATTRIBUTE",
    "POINTER_CLASS",
    "SIZE_ATTRIBUTE",
    "SIZE_ATTRIBUTES",
    "has_size",
    "pointer_body",
    "read_pointer",
    "where",
    "without_size",
]
