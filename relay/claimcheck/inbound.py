"""The claim check on the receiver's side: received pointers become their objects' bytes.

The receiver (relay.receiving) is given an `Inbound` stage by wiring,
whichever broker the messages came from: it splits each received batch
into parts of at most FETCHED_AT_ONCE pointers (so that no more large
bodies than that are in memory at once) and resolves each part before its
rows are built. Without --claim-check a pointer is kept as received and
marked `unfetched` (relay.storable makes that row dead, saying why).

No boto3 here: S3 (relay.claimcheck.s3) is loaded once --claim-check is given.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from relay.brokers import Incoming
from relay.claimcheck import SIZE_ATTRIBUTES, has_size, read_pointer, where, without_size
from relay.config import ClaimCheckURL

# Claim check bodies fetched and held at once (a batch is stored in parts).
FETCHED_AT_ONCE = 4

# (bucket, key) -> the object's bytes, or why it cannot be read (relay.claimcheck.s3).
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


class Inbound:
    """The receiver's claim check stage (relay.receiving.Stage): `parts` and
    `resolve` above, fetching from S3 with `url` (--claim-check), or with
    None marking every pointer unfetched; a part's pointers declare at most
    `max_bytes` together (wiring gives a share of --batch-bytes, relay.budget)."""

    def __init__(
        self,
        url: ClaimCheckURL | None,
        at_once: int = FETCHED_AT_ONCE,
        *,
        max_bytes: int | None = None,
    ) -> None:
        self.at_once = at_once
        self.max_bytes = max_bytes
        self._reader: Any = None
        self.fetch: Fetch | None = None
        if url is not None:
            from relay.claimcheck.s3 import ClaimCheckReader  # boto3, only when asked for

            self._reader = ClaimCheckReader(url)
            self.fetch = self._reader.fetch

    def parts(self, batch: Sequence[Incoming]) -> list[Sequence[Incoming]]:
        return parts(batch, self.at_once, self.max_bytes)

    async def resolve(self, part: Sequence[Incoming]) -> tuple[list[Incoming], int, int]:
        return await resolve(part, self.fetch)

    async def close(self) -> None:
        if self._reader is not None:
            await self._reader.close()


__all__ = [
    "FETCHED_AT_ONCE",
    "Fetch",
    "Inbound",
    "declared_size",
    "is_pointer",
    "parts",
    "resolve",
]
