"""The claim check around a broker's publisher: large bodies to S3, their pointers to the broker.

`ClaimCheckPublisher` wraps whichever adapter's Publisher wiring chose. A
row whose body would be over --claim-check-over is stored as the object
PREFIX/<id> (relay.claimcheck.s3), then the broker gets the pointer
(relay.claimcheck) in its place, with the stored size as the row's
ExtendedPayloadSize attribute, which every adapter writes as its native
header or attribute (relay.rows.OutboxRow.attributes).

Memory: bodies are built, sent and dropped one upload at a time per slot
(UPLOADS), so a batch of large rows holds at most that many bodies beside
the rows themselves.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

from relay.brokers import (
    Outcome,
    Publisher,
    PublisherWrapper,
    PublishResult,
    encode_failure,
    row_body,
)
from relay.claimcheck import SIZE_ATTRIBUTE, pointer_body, where
from relay.claimcheck.s3 import UPLOADS, ObjectStore, S3Refused, S3Unavailable
from relay.config import ClaimCheckURL
from relay.rows import Failure, OutboxRow

log = logging.getLogger("relay.s3")  # the name its log lines have always had


class ClaimCheckPublisher(PublisherWrapper):
    """A Publisher that stores large bodies in S3 and publishes their pointers
    through the broker's Publisher; every other row goes through as it is."""

    def __init__(
        self,
        inner: Publisher,
        url: ClaimCheckURL,
        over: int,
        on_sent: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.url = url
        self.over = over
        self.store = ObjectStore(url, UPLOADS)
        self.on_sent = on_sent  # (messages published by claim check, bytes uploaded)
        self._s3_ok = False
        self._slots = asyncio.Semaphore(UPLOADS)

    @property
    def connected(self) -> bool:
        return self.inner.connected and self._s3_ok

    async def connect(self) -> None:
        await self.inner.connect()
        if not self._s3_ok:
            await self.store.probe()
            self._s3_ok = True
            log.info(
                "claim check: bodies over %d bytes go to s3://%s/%s (%s)",
                self.over,
                self.url.bucket,
                self.url.prefix,
                self.store.endpoint,
            )

    async def close(self) -> None:
        self._s3_ok = False
        await self.store.close()
        await self.inner.close()

    def _maybe_large(self, row: OutboxRow) -> bool:
        # A row's compact body is no longer than PostgreSQL's rendering of
        # it, which is at most 4 bytes a character: rows under that need
        # no look at their body here.
        return len(row.payload) * 4 > self.over

    async def _offload(self, row: OutboxRow, gone: list[bool]) -> int | Failure | Outcome | None:
        """Store the row's body if it is over the threshold: its size, None
        (small: published as it is), or what to report instead. Once one
        upload of the batch found S3 unreachable (`gone`), the others do not
        try: each would wait out the time-outs and retries again."""
        key = self.url.key(row.id)

        def body() -> bytes | None:
            data = row_body(row)
            return data if len(data) > self.over else None

        async with self._slots:
            if gone[0]:
                return Outcome.RELEASE
            try:
                size = await self.store.put_body(key, body)
                self._s3_ok = True  # back, if it was away
                return size
            except S3Unavailable as exc:
                gone[0] = True
                if self._s3_ok:
                    log.warning("claim check: %s", exc)
                self._s3_ok = False
                return Outcome.RELEASE
            except S3Refused as exc:
                return Failure(
                    f"claim check: S3 refused to store the body as "
                    f"{where(self.url.bucket, key)}: {exc}"
                )
            except Exception as exc:  # noqa: BLE001 - the row's own (an encoding failure)
                return encode_failure(exc)

    def _pointer(self, row: OutboxRow, size: int) -> OutboxRow:
        """The row as published once its body is in S3: the pointer, and the size."""
        pointer = pointer_body(self.url.bucket, self.url.key(row.id))
        return dataclasses.replace(
            row, payload=pointer, attributes=(*row.attributes, (SIZE_ATTRIBUTE, size))
        )

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        large = [index for index, row in enumerate(rows) if self._maybe_large(row)]
        if not large:
            return await self.inner.publish(rows)
        gone = [False]
        offloaded = dict(
            zip(
                large,
                await asyncio.gather(*(self._offload(rows[i], gone) for i in large)),
                strict=True,
            )
        )
        results: list[PublishResult] = [None] * len(rows)
        forward: list[tuple[int, OutboxRow]] = []
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        uploaded = 0
        for index, row in enumerate(rows):
            if row.key is not None and row.key in held:
                results[index] = Outcome.RELEASE
                continue
            outcome = offloaded.get(index)
            if isinstance(outcome, (Failure, Outcome)):
                results[index] = outcome
                if row.key is not None:
                    held.add(row.key)
                continue
            if isinstance(outcome, int):
                uploaded += outcome
                forward.append((index, self._pointer(row, outcome)))
            else:
                forward.append((index, row))
        sent = await self.inner.publish([row for _, row in forward]) if forward else []
        claimed = 0
        for (index, _row), result in zip(forward, sent, strict=True):
            results[index] = result
            if isinstance(offloaded.get(index), int) and result in (None, Outcome.UNROUTABLE):
                claimed += 1
        if self.on_sent is not None:
            self.on_sent(claimed, uploaded)
        return results


__all__ = ["ClaimCheckPublisher"]
