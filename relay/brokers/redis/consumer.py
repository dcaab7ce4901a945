"""Redis Streams → inbox: a consumer group read with XREADGROUP, each
process a consumer of its own in it; XACK only behind committed rows; the
entries a dead consumer left pending claimed with XAUTOCLAIM after
--claim-idle.

Two tasks on the event loop feed the buffer that batches() hands out: the
reader (first this consumer's own pending entries, after a reconnect, then
new ones with a blocking XREADGROUP) and the claimer (every quarter of
--claim-idle, 5 s at most: XAUTOCLAIM of entries idle that long, and
XCLAIM of the entries this process holds, which keeps them its own while
their rows are stored slowly, as SQS's visibility extension in
relay.brokers.sqs does). Both stop
reading while the entries held (received, not acknowledged) reach
--prefetch or about `max_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import operator
import os
import secrets
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator, Coroutine, Sequence
from typing import Any, NamedTuple

import orjson
import redis.asyncio as aioredis
from redis import exceptions as rex

from relay.brokers import Incoming, buffered_batches
from relay.brokers.redis.client import FAILED, describe, make_client, where
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable, ConfigError

log = logging.getLogger("relay.brokers.redis")

# XREADGROUP's longest wait for new entries (below client.SOCKET_TIMEOUT).
BLOCK_MS = 2000
# Entries asked for at once, by XREADGROUP and XAUTOCLAIM.
READ_COUNT = 500
CLAIM_COUNT = 100
# Released entries (received, not stored, at a clean close) are given this
# idle time, so that the group's other consumers claim them at once.
RELEASED_IDLE_MS = 10**12
# The fields relay reads for the row itself; every other one is a header
# when the entry has a `payload` (without one, the fields are the body).
OWN_FIELDS = frozenset({"id", "message_id", "type", "key", "payload", "headers"})


# bytes -> str, invalid UTF-8 as surrogate escapes; a C-level call (map).
_text = operator.methodcaller("decode", "utf-8", "surrogateescape")


class Token(NamedTuple):
    """A received entry's stream and id (ack_token)."""

    stream: str
    entry_id: bytes

    @property
    def place(self) -> str:
        """STREAM:ENTRY-ID; `redis:` and it, an entry's dedup key without an id."""
        return f"{self.stream}:{self.entry_id.decode('ascii', 'replace')}"


def _fields_body(fields: dict[str, str]) -> bytes:
    """An entry without `payload`: its fields as a JSON object, byte for
    byte (a name or value that is not UTF-8 keeps its bytes: the row is
    then dead, its body kept as received)."""
    try:
        return orjson.dumps(fields)
    except orjson.JSONEncodeError:  # surrogate escapes: invalid UTF-8 as received
        text = json.dumps(fields, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "surrogateescape")


def to_incoming(token: Token, pairs: Sequence[bytes]) -> Incoming:
    """An entry (its fields as XREADGROUP gives them: name, value, …) as the
    inbox sees it: the contract's mapping. Names and values are decoded
    leniently (invalid UTF-8 as surrogate escapes, which relay.storable keeps
    in a dead row with the reason); a repeated name: its last value. The
    payload is the row's body as received, never decoded."""
    pairing = iter(pairs)
    raw = dict(zip(pairing, pairing, strict=False))  # an odd last name: no value, dropped
    payload = raw.pop(b"payload", None)
    fields = dict(zip(map(_text, raw), map(_text, raw.values()), strict=True))
    headers: dict[str, Any] = {}
    undecodable = None
    given = fields.get("headers")
    if given is not None:
        try:
            parsed = orjson.loads(raw[b"headers"])
        except orjson.JSONDecodeError as exc:
            parsed, why = None, f"it is not JSON ({exc})"
        else:
            why = f"it is a JSON {type(parsed).__name__}"
        if isinstance(parsed, dict):
            headers.update(parsed)
        else:
            undecodable = f"the field headers must be a JSON object: {why}"
            headers["headers"] = given
    if payload is not None:
        body = payload
        headers.update((n, v) for n, v in fields.items() if n not in OWN_FIELDS)
    else:
        body = _fields_body(fields)
    message_id = fields.get("id") or fields.get("message_id") or f"redis:{token.place}"

    def original() -> dict[str, Any]:
        """The entry's fields as received, but its payload (the row's body)."""
        return {
            "stream": token.stream,
            "entry_id": token.entry_id,
            "fields": [
                [pairs[i], pairs[i + 1]]
                for i in range(0, len(pairs) - 1, 2)
                if pairs[i] != b"payload"
            ],
        }

    return Incoming(
        message_id=message_id,
        topic=token.stream,
        key=fields.get("key"),
        type=fields.get("type") or token.stream,
        body=body,
        headers=headers,
        ack_token=token,
        original=original,
        undecodable=undecodable,
        content_type=fields.get("content-type"),
    )


def unreadable(token: Token, why: str) -> Incoming:
    """An entry whose fields could not be read: a dead row under its place."""
    return Incoming(
        message_id=f"redis:{token.place}",
        topic=token.stream,
        key=None,
        type=token.stream,
        body=b"",
        ack_token=token,
        undecodable=f"Redis entry {token.place}: {why}",
    )


def _size(pairs: Sequence[bytes]) -> int:
    return sum(map(len, pairs))


def _raw(response: Any, **options: Any) -> Any:
    """The reply as Redis sent it (redis-py's parsers change between versions)."""
    return response


class RedisConsumer:
    """Reads streams as a consumer group; acknowledges only stored entries."""

    def __init__(
        self,
        broker: BrokerURL,
        *,
        streams: Sequence[str],
        group: str,
        prefetch: int,
        max_bytes: int | None,
        claim_idle: float,
    ) -> None:
        names = list(dict.fromkeys(s.strip() for s in streams if s.strip()))
        if not names:
            raise ConfigError("no Redis stream: set --queue STREAM[,STREAM…]")
        self.broker = broker
        self.streams = names
        self._by_name = {name.encode(): name for name in names}
        self.group = group or names[0]
        # Unique to this process: a restarted one is a new consumer, and
        # what the old one held is claimed after claim_idle.
        self.name = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.max_held = max(1, prefetch)
        self.max_bytes = max_bytes
        self.claim_idle = claim_idle
        self._client: aioredis.Redis | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: deque[Incoming] = deque()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        # Received and not acknowledged: token -> [size, when last claimed (monotonic)]
        self._held: dict[Token, list[float]] = {}
        self._held_bytes = 0
        # The entries' size so far (a moving average), for how many to ask for.
        self._each: float | None = None
        self._failure: BaseException | None = None

    @property
    def connected(self) -> bool:
        return self._client is not None and self._failure is None

    # -- connecting ------------------------------------------------------------

    async def connect(self) -> None:
        if self.connected:
            return
        await self.close()
        self._failure = None
        client = make_client(self.broker, "relay-inbox")
        for command in ("XREADGROUP", "XAUTOCLAIM", "XCLAIM"):
            client.set_response_callback(command, _raw)
        try:
            await client.ping()
            for stream in self.streams:
                await self._create_group(client, stream)
        except FAILED as exc:
            with contextlib.suppress(Exception):
                await client.aclose()
            raise BrokerUnavailable(f"Redis at {where(self.broker)}: {describe(exc)}") from None
        self._client = client
        self._update_room()
        self._tasks = [
            asyncio.create_task(self._run(self._read(client)), name="redis-read"),
            asyncio.create_task(self._run(self._claim(client)), name="redis-claim"),
        ]
        log.info(
            "consuming Redis streams %s as group %r, consumer %r, at %s",
            ", ".join(self.streams),
            self.group,
            self.name,
            where(self.broker),
        )

    async def _create_group(self, client: aioredis.Redis, stream: str) -> None:
        """The group at the stream's first entry (the stream made when missing)."""
        try:
            await client.xgroup_create(stream, self.group, id="0", mkstream=True)
        except rex.ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):
                raise
        else:
            log.info("created Redis consumer group %r of stream %r", self.group, stream)

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        client, self._client = self._client, None
        held = list(self._held)
        self._held.clear()
        self._held_bytes = 0
        self._buffer.clear()
        if client is None:
            return
        try:
            if self._failure is None:  # else the connection is gone: they stay
                async with asyncio.timeout(5):  # pending, this process's own
                    await self._let_go(client, held)
        except Exception as exc:  # noqa: BLE001 - closing: they are claimed after claim_idle
            log.debug("closing the Redis consumer: %s", describe(exc))
        with contextlib.suppress(Exception):
            await client.aclose()

    async def _let_go(self, client: aioredis.Redis, held: list[Token]) -> None:
        """Entries received and not stored: claimable by the group's other
        consumers at once (their idle time set long past any claim_idle).
        A consumer that holds nothing more leaves the group."""
        by_stream: dict[str, list[Any]] = {}
        for token in held:
            by_stream.setdefault(token.stream, []).append(token.entry_id)
        for stream, ids in by_stream.items():
            await client.xclaim(
                stream, self.group, self.name, 0, ids, idle=RELEASED_IDLE_MS, justid=True
            )
        if not held:
            for stream in self.streams:
                if await client.xpending_range(stream, self.group, "-", "+", 1, self.name):
                    return
            for stream in self.streams:
                await client.xgroup_delconsumer(stream, self.group, self.name)

    # -- the tasks ---------------------------------------------------------------

    async def _run(self, work: Coroutine[Any, Any, None]) -> None:
        """A task's body: whatever ends it reaches batches() as a failure
        (the receiver reconnects), never a silent stall."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except FAILED as exc:
            self._fail(BrokerUnavailable(f"Redis at {where(self.broker)}: {describe(exc)}"))
        except Exception as exc:
            log.exception("the Redis consumer failed")
            self._fail(BrokerUnavailable(f"Redis consumer of {', '.join(self.streams)}: {exc!r}"))

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            log.warning("%s", exc)
        self._arrived.set()

    def _count(self, most: int) -> int:
        """How many entries to ask for: the room left, by count and by bytes
        at the size entries had so far (one, before any was seen)."""
        room = self.max_held - len(self._held)
        if self.max_bytes is not None:
            if self._each is None:
                return 1
            room = min(room, int((self.max_bytes - self._held_bytes) // self._each))
        return max(1, min(most, room))

    def _update_room(self) -> None:
        full = len(self._held) >= self.max_held or (
            self.max_bytes is not None and self._held_bytes >= self.max_bytes
        )
        if full:
            self._room.clear()
        else:
            self._room.set()

    def _take(self, stream: str, entries: Any, gone: list[Token]) -> int:
        """Entries (id, [name, value, …]) into the buffer; one already held is
        skipped, one deleted since it was delivered (no fields) is `gone`.
        How many were taken."""
        now = time.monotonic()
        taken = 0
        for entry in entries or ():
            if entry is None:  # Redis 6.2's XAUTOCLAIM: deleted, its id not given
                continue
            entry_id, pairs = entry[0], entry[1]
            token = Token(stream, entry_id)
            if token in self._held:
                continue
            if not pairs:
                gone.append(token)
                continue
            size = _size(pairs)
            self._each = size if self._each is None else 0.8 * self._each + 0.2 * size
            self._held[token] = [size, now]
            self._held_bytes += size
            try:
                message = to_incoming(token, pairs)
            except Exception as exc:  # noqa: BLE001 - one entry never stops the consumer
                message = unreadable(token, f"{type(exc).__name__}: {exc}")
            self._buffer.append(message)
            taken += 1
        self._update_room()
        if self._buffer:
            self._arrived.set()
        return taken

    async def _forget(self, client: aioredis.Redis, gone: list[Token]) -> None:
        """Acknowledge entries deleted (trimmed) before they were stored:
        nothing is left of them to store."""
        for token in gone:
            log.warning(
                "Redis entry %s was deleted from its stream before relay stored it", token.place
            )
            await client.xack(token.stream, self.group, token.entry_id)

    async def _read(self, client: aioredis.Redis) -> None:
        # This consumer's own pending entries first (after a reconnect: what
        # it was given and did not acknowledge), then new ones.
        for stream in self.streams:
            after = b"0"
            while True:
                await self._room.wait()
                reply = await client.xreadgroup(
                    self.group, self.name, {stream: after}, count=self._count(READ_COUNT)
                )
                entries = _entries(reply)
                if not entries or not entries[0][1]:
                    break
                gone: list[Token] = []
                self._take(stream, entries[0][1], gone)
                await self._forget(client, gone)
                after = entries[0][1][-1][0]
        new: dict[Any, Any] = dict.fromkeys(self.streams, ">")
        while True:
            await self._room.wait()
            try:
                reply = await client.xreadgroup(
                    self.group, self.name, new, count=self._count(READ_COUNT), block=BLOCK_MS
                )
            except rex.ResponseError as exc:
                if not str(exc).startswith("NOGROUP"):
                    raise
                # The stream or the group was deleted meanwhile: made again.
                log.warning("Redis: %s; creating the group again", exc)
                for stream in self.streams:
                    await self._create_group(client, stream)
                continue
            for name, entries in _entries(reply):
                self._take(self._by_name.get(name, _text(name)), entries, [])

    async def _claim(self, client: aioredis.Redis) -> None:
        # What this process holds is claimed again (_keep) once held this
        # long, so never idle more than half claim_idle.
        every = max(0.05, min(self.claim_idle / 4, 5.0))
        idle_ms = max(1, int(self.claim_idle * 1000))
        while True:
            await self._keep(client, every)  # even while full: what is held stays
            for stream in self.streams:
                cursor: Any = b"0-0"
                while self._room.is_set():  # full: claimed on a later round
                    reply = await client.xautoclaim(
                        stream,
                        self.group,
                        self.name,
                        idle_ms,
                        start_id=cursor,
                        count=self._count(CLAIM_COUNT),
                    )
                    cursor, entries = reply[0], reply[1]
                    gone: list[Token] = []
                    taken = self._take(stream, entries, gone)
                    await self._forget(client, gone)
                    if taken:
                        log.info(
                            "claimed %d entries of Redis stream %r idle over %gs",
                            taken,
                            stream,
                            self.claim_idle,
                        )
                    if cursor in (b"0-0", "0-0"):
                        break
            await asyncio.sleep(every)

    async def _keep(self, client: aioredis.Redis, after: float) -> None:
        """The entries held `after` seconds or more claimed again by this
        consumer (their idle time starts over, their delivery count stays):
        no other consumer takes them while their rows are being stored."""
        now = time.monotonic()
        due: dict[str, list[Any]] = {}
        for token, state in list(self._held.items()):
            if now - state[1] >= after:
                due.setdefault(token.stream, []).append(token.entry_id)
                state[1] = now
        for stream, ids in due.items():
            for start in range(0, len(ids), CLAIM_COUNT):
                await client.xclaim(
                    stream, self.group, self.name, 0, ids[start : start + CLAIM_COUNT], justid=True
                )

    # -- the receiver's side -------------------------------------------------------

    def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        return buffered_batches(self, "Redis consumer", max_size, max_wait)

    async def ack(self, batch: Sequence[Incoming]) -> None:
        """XACK the batch's entries (their rows are committed)."""
        if not batch:
            return
        by_stream: dict[str, list[Any]] = {}
        for message in batch:
            token = message.ack_token
            assert isinstance(token, Token)
            by_stream.setdefault(token.stream, []).append(token.entry_id)
            state = self._held.pop(token, None)
            if state is not None:
                self._held_bytes -= int(state[0])
        self._update_room()
        client = self._client
        if client is None:
            raise BrokerUnavailable("Redis consumer closed before the batch was committed")
        try:
            pipe = client.pipeline(transaction=False)
            for stream, ids in by_stream.items():
                pipe.xack(stream, self.group, *ids)
            await pipe.execute()
        except FAILED as exc:
            # The rows are committed; the entries stay pending and come back
            # (this consumer's own after a reconnect, else claimed by another):
            # duplicates the inbox drops.
            error = BrokerUnavailable(
                f"Redis at {where(self.broker)}: acknowledging entries: {describe(exc)}"
            )
            self._fail(error)
            raise error from None


def _entries(reply: Any) -> list[tuple[bytes, Any]]:
    """XREADGROUP's reply as (stream, entries) pairs, RESP2's list or RESP3's map."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return list(reply.items())
    return [(item[0], item[1]) for item in reply]
