"""Outbox → Redis Streams: each row an XADD to the stream named by its
topic, a batch one pipeline (one round trip), each reply read on its own:
an error on one entry fails that row alone."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis import exceptions as rex

from relay.brokers import (
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
    warn_out_of_order,
)
from relay.brokers.redis.client import FAILED, UNREACHABLE, describe, make_client, not_now, where
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable
from relay.rows import Failure, OutboxRow

try:  # C: redis-py's asyncio connection packs commands in Python
    from hiredis import pack_command
except ImportError:  # pragma: no cover - the redis extra brings it
    pack_command = None  # type: ignore[assignment]

log = logging.getLogger("relay.brokers.redis")

# The fields relay writes (the contract's wire format); a layer's attribute
# (CloudEvents' content-type, the claim check's size) never replaces one.
OWN_FIELDS = frozenset({"id", "payload", "type", "key", "headers"})


def entry_fields(row: OutboxRow) -> list[bytes | str]:
    """The row's XADD fields as a flat list (name, value, …), or BadMessage
    (relay.brokers.row_body, row_headers) saying why no entry can carry it."""
    check_topic(row)
    fields: list[bytes | str] = ["id", row.id, "payload", row_body(row)]
    if row.type is not None:
        fields += ["type", row.type]
    if row.key is not None:
        fields += ["key", row.key]
    headers = row_headers(row)
    if headers:
        fields += ["headers", orjson.dumps(headers)]
    for name, value in row.attributes:
        if name not in OWN_FIELDS:
            fields += [name, value if type(value) is str else str(value)]
    return fields


class RedisPublisher:
    """XADDs outbox rows to the streams named by their topic."""

    def __init__(self, broker: BrokerURL, *, maxlen: int | None = None) -> None:
        self.broker = broker
        self.maxlen = maxlen
        # XADD's arguments before the fields: `MAXLEN ~ N` when asked, then
        # `*` (Redis gives the entry's id).
        self._head: tuple[Any, ...] = ("MAXLEN", "~", maxlen, "*") if maxlen else ("*",)
        self._client: aioredis.Redis | None = None
        self._down: str | None = "not connected yet"  # why Redis is unreachable

    @property
    def connected(self) -> bool:
        return self._client is not None and self._down is None

    @property
    def reason(self) -> str | None:
        """Why Redis is unreachable now, or None."""
        return self._down

    @staticmethod
    async def _pipeline(client: aioredis.Redis, commands: list[tuple[Any, ...]]) -> list[Any]:
        """The commands down one connection in one write, then each reply
        read in turn: an error reply is that command's, in its place.
        redis-py's own pipeline, less its per-command packing in Python
        (hiredis packs a batch in C: two thirds of the outbox's CPU)."""
        pool = client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            if pack_command is not None:
                packed: Any = b"".join([pack_command(command) for command in commands])
            else:
                packed = conn.pack_commands(commands)
            await conn.send_packed_command(packed, check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except rex.ResponseError as exc:
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect()  # half read: never used again
            raise
        finally:
            await pool.release(conn)

    blocked: str | None = None  # Redis refuses a write (OOM); it never blocks one

    async def wait_unblocked(self) -> None:
        return

    def _unavailable(self, exc: BaseException) -> BrokerUnavailable:
        first = self._down in (None, "not connected yet")
        self._down = describe(exc)
        if first:
            log.warning("Redis at %s is unreachable: %s", where(self.broker), self._down)
        return BrokerUnavailable(f"Redis at {where(self.broker)}: {self._down}")

    async def connect(self) -> None:
        if self._client is None:
            self._client = make_client(self.broker, "relay-outbox")
        if self._down is None:
            return
        try:
            await self._client.ping()
        except FAILED as exc:
            raise self._unavailable(exc) from None
        if self._down != "not connected yet":
            log.info("Redis at %s is reachable again", where(self.broker))
        else:
            log.info("connected to Redis at %s", where(self.broker))
        self._down = None

    async def close(self) -> None:
        client, self._client = self._client, None
        self._down = "closed"
        if client is not None:
            try:
                await client.aclose()
            except Exception as exc:  # noqa: BLE001 - closing: nothing more to do
                log.debug("closing the Redis client: %s", describe(exc))

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        client = self._client
        assert client is not None
        results: list[PublishResult] = [None] * len(rows)
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        sent: list[int] = []
        commands: list[tuple[Any, ...]] = []
        for index, row in enumerate(rows):
            if row.key is not None and row.key in held:
                results[index] = Outcome.RELEASE
                continue
            try:
                fields = entry_fields(row)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's
                results[index] = encode_failure(exc)
                if row.key is not None:
                    held.add(row.key)
                continue
            commands.append(("XADD", row.topic, *self._head, *fields))
            sent.append(index)
        if not sent:
            return results
        try:
            replies = await self._pipeline(client, commands)
        except UNREACHABLE as exc:
            # Maybe written, maybe not: pending again, no attempt (a
            # republish is a duplicate the inbox drops by its id).
            self._unavailable(exc)
            for index in sent:
                results[index] = Outcome.RELEASE
            return results
        refused_now = 0
        for index, reply in zip(sent, replies, strict=True):
            if not isinstance(reply, Exception):
                continue
            if isinstance(reply, UNREACHABLE) or not_now(reply):
                results[index] = Outcome.RELEASE
                refused_now += 1
            else:
                results[index] = Failure(
                    f"Redis refused the entry for stream {rows[index].topic[:200]!r}: "
                    f"{describe(reply)}"
                )
        if refused_now == len(sent) and refused_now:
            # Nothing written: Redis cannot take writes now (OOM, a replica,
            # loading): wait it out as an unreachable server.
            reply = next(r for r in replies if isinstance(r, Exception))
            raise self._unavailable(reply)
        warn_out_of_order(rows, results, "Redis")
        return results
