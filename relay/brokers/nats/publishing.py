"""Outbox → NATS JetStream: each row a message on the subject `topic`,
published only once the stream that captures it has acknowledged it.

Acknowledgements are pipelined: every message of a batch that may go is
sent at once on the connection, each with a reply subject of its own, and
the stream's acknowledgements come back on one subscription. The rows of a
key go one after another (the next once the stream has the one before), so
that a failure of an earlier one never leaves a later one published before
it; rows of different keys, and rows without a key, are all in flight
together.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from relay.brokers import (
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.brokers.nats.connection import API_TIMEOUT, Client, connect, describe, where
from relay.brokers.nats.connection import close as close_client
from relay.config import BrokerURL
from relay.errors import BadMessage, BrokerUnavailable
from relay.rows import Failure, OutboxRow

log = logging.getLogger("relay.brokers.nats")

MSG_ID = "Nats-Msg-Id"  # JetStream's duplicate window is keyed by it
# A message whose acknowledgement has not come in this long is released
# (pending again, no attempt): it may be stored, and its republish is then
# a duplicate the stream's window drops.
ACK_TIMEOUT = 10.0
# JetStream's error codes (err_code) of a message the stream will never take.
_TOO_LARGE = {10054}  # JSStreamMessageExceedsMaximumErr
# A header line is `Name: Value\r\n`; the block starts `NATS/1.0\r\n`, ends `\r\n`;
# a name is a token (RFC 7230, as nats-py checks it).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_SUBJECT_SPACE = re.compile(r"[\s\x00-\x1f\x7f]")


_NO_RESPONDERS = Failure("no responders")


@dataclass(slots=True)
class Message:
    """One row as a JetStream message (the contract's wire format)."""

    subject: str
    data: bytes
    headers: dict[str, str]
    header: bytes  # the header block as sent: `NATS/1.0`, `Name: Value` lines

    @property
    def size(self) -> int:
        """Data and header block, as the server counts them against max_payload."""
        return len(self.data) + len(self.header)


@functools.lru_cache(maxsize=4096)  # a few topics, each checked once (a bad one raises again)
def _check_subject(topic: str) -> None:
    if _SUBJECT_SPACE.search(topic) or any(token in ("", "*", ">") for token in topic.split(".")):
        raise BadMessage(
            f"topic {topic[:300]!r} is not a NATS subject to publish to (tokens separated by "
            "dots, none empty, no wildcard, no white space or control character)"
        )


def _check_name(name: str) -> None:
    if not _HEADER_NAME.fullmatch(name):
        raise BadMessage(
            f"header name {name[:100]!r} cannot be a NATS header (letters, digits and "
            "!#$%&'*+-.^_`|~ only)"
        )


def _check_value(name: str, value: str) -> None:
    if "\r" in value or "\n" in value or value != value.strip():
        raise BadMessage(
            f"header {name!r}: a NATS header value cannot hold a line break or begin or "
            "end with white space"
        )


def build_message(row: OutboxRow) -> Message:
    """The message for a row, or BadMessage saying why none can be."""
    check_topic(row)
    _check_subject(row.topic)
    own: dict[str, str] = {MSG_ID: row.id}
    if row.type:
        _check_value("type", row.type)
        own["type"] = row.type
    if row.key is not None:
        _check_value("key", row.key)
        own["key"] = row.key
    own["Content-Type"] = "application/json"
    for name, value in row.attributes:
        text = value if type(value) is str else str(value)
        _check_name(name)
        _check_value(name, text)
        own[name] = text
    headers = own
    given = row_headers(row)
    if given:
        # relay's own headers win over the row's of the same name (a second
        # Nats-Msg-Id would change what the stream's duplicate window sees).
        for name, value in given.items():
            _check_name(name)
            _check_value(name, value)
        headers = {**{n: v for n, v in given.items() if n not in own}, **own}
    block = b"NATS/1.0\r\n" + b"".join(
        b"%s: %s\r\n" % (name.encode(), value.encode()) for name, value in headers.items()
    )
    return Message(row.topic, row_body(row), headers, block + b"\r\n")


@dataclass(slots=True)
class _Batch:
    """One publish() call in flight: its results, and what waits for them."""

    results: list[PublishResult]
    sizes: dict[int, int] = field(default_factory=dict)
    outstanding: int = 0
    ready: deque[int] = field(default_factory=deque)  # sendable now, in seq order
    following: dict[str, deque[int]] = field(default_factory=dict)  # a key's later rows
    keys: dict[int, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    unanswered: dict[int, str] = field(default_factory=dict)  # no responders: row -> subject


class NatsPublisher:
    """Publishes outbox rows to JetStream, each confirmed by its stream."""

    def __init__(self, broker: BrokerURL) -> None:
        self.broker = broker
        self._client: Client | None = None
        self._subscription: Subscription | None = None
        self._prefix = ""
        self._tokens = itertools.count()
        self._waiting: dict[str, tuple[_Batch, int, str]] = {}  # reply token -> row
        self._lost: str | None = "not connected yet"
        self._connecting = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._client is not None and self._lost is None

    blocked: str | None = None  # NATS never blocks a publisher

    async def wait_unblocked(self) -> None:
        return

    async def connect(self) -> None:
        async with self._connecting:
            if self.connected:
                return
            await self._drop()
            was = self._lost
            client = await connect(
                self.broker, "relay outbox", self._on_lost, starting=was == "not connected yet"
            )
            self._client = client
            try:
                await client.jetstream(timeout=API_TIMEOUT).account_info()
                self._prefix = client.new_inbox()
                self._subscription = await client.subscribe(
                    self._prefix + ".*", cb=self._acknowledged
                )
            except Exception as exc:  # noqa: BLE001 - whatever it is, the server cannot take rows
                await self._drop()
                raise BrokerUnavailable(
                    f"NATS at {where(self.broker)}: no JetStream ({describe(exc)}); "
                    "start nats-server with JetStream enabled (-js)"
                ) from None
            self._lost = None
            if was == "not connected yet":
                log.info("connected to NATS at %s", where(self.broker))
            else:
                log.info("NATS at %s is reachable again", where(self.broker))

    def _on_lost(self, why: str) -> None:
        if self._lost is None:
            log.warning("lost the connection to NATS at %s: %s", where(self.broker), why)
            self._lost = why
        self._release_waiting()

    def _release_waiting(self) -> None:
        """Every row whose acknowledgement cannot come any more: released."""
        waiting, self._waiting = self._waiting, {}
        for batch, index, _ in waiting.values():
            batch.results[index] = Outcome.RELEASE
            batch.outstanding -= 1
            self._hold_key(batch, index)
            batch.changed.set()

    async def _drop(self) -> None:
        client, self._client = self._client, None
        self._subscription = None
        if client is not None:
            if self._lost is None:
                self._lost = "closed"
            await close_client(client)
        self._release_waiting()

    async def close(self) -> None:
        await self._drop()
        self._lost = "closed"

    # -- publishing -------------------------------------------------------------

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        client = self._client
        assert client is not None
        batch = _Batch(results=[None] * len(rows))
        messages: dict[int, Message] = {}
        held: set[str] = set()  # keys whose row cannot go: their later rows wait
        for index, row in enumerate(rows):
            key = row.key
            if key is not None and key in held:
                batch.results[index] = Outcome.RELEASE
                continue
            try:
                message = build_message(row)
                if message.size > client.max_payload:
                    raise BadMessage(
                        f"message is {message.size} bytes (data and headers), over the NATS "
                        f"server's max_payload of {client.max_payload} bytes"
                    )
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's
                batch.results[index] = encode_failure(exc)
                if key is not None:
                    held.add(key)
                continue
            messages[index] = message
            batch.sizes[index] = message.size
            if key is None:
                batch.ready.append(index)
            elif key in batch.following:
                batch.following[key].append(index)
                batch.keys[index] = key
            else:
                batch.following[key] = deque()
                batch.keys[index] = key
                batch.ready.append(index)
        await self._send(client, batch, messages)
        if batch.unanswered:
            await self._check_unanswered(client, batch)
        return batch.results

    async def _check_unanswered(self, client: Client, batch: _Batch) -> None:
        """ "No responders" is a failed attempt only when JetStream says that
        no stream captures the subject. When one does, the stream did not
        answer (a server still recovering its streams after a restart, a
        stream's leader being elected): the row is released, no attempt."""
        js = client.jetstream(timeout=API_TIMEOUT)
        captured: dict[str, bool] = {}
        for subject in set(batch.unanswered.values()):
            try:
                await js.find_stream_name_by_subject(subject)
                captured[subject] = True
            except NotFoundError:
                captured[subject] = False
            except Exception as exc:  # noqa: BLE001 - JetStream not answering either
                log.debug("NATS: no stream lookup for %r: %s", subject, describe(exc))
                captured[subject] = True
        for index, subject in batch.unanswered.items():
            if captured[subject]:
                batch.results[index] = Outcome.RELEASE
        waiting = [subject for subject, found in captured.items() if found]
        if waiting:
            log.warning(
                "NATS: the stream capturing %s did not answer (starting?): sent again later",
                ", ".join(map(repr, sorted(waiting))),
            )

    async def _send(self, client: Client, batch: _Batch, messages: dict[int, Message]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ACK_TIMEOUT
        while batch.ready or batch.outstanding:
            while batch.ready:
                index = batch.ready.popleft()
                message = messages[index]
                token = str(next(self._tokens))
                if self._lost is not None or self._client is not client:
                    batch.results[index] = Outcome.RELEASE
                    self._hold_key(batch, index)
                    continue
                self._waiting[token] = (batch, index, message.subject)
                batch.outstanding += 1
                try:
                    await client.publish_block(
                        message.subject, f"{self._prefix}.{token}", message.header, message.data
                    )
                except Exception as exc:  # noqa: BLE001 - the connection, not the row
                    if self._waiting.pop(token, None) is not None:
                        batch.outstanding -= 1
                        batch.results[index] = Outcome.RELEASE
                        self._hold_key(batch, index)
                    self._on_lost(describe(exc))
                deadline = loop.time() + ACK_TIMEOUT
            if not batch.outstanding:
                break
            batch.changed.clear()
            try:
                async with asyncio.timeout(deadline - loop.time()):
                    await batch.changed.wait()
            except TimeoutError:
                self._expire(batch)
        released = all(r is Outcome.RELEASE for r in batch.results)
        if self._lost is not None and batch.results and released:
            raise BrokerUnavailable(f"NATS at {where(self.broker)}: {self._lost}")

    def _expire(self, batch: _Batch) -> None:
        late = [token for token, (b, _, _) in self._waiting.items() if b is batch]
        if late:
            log.warning(
                "%d NATS acknowledgements did not come in %gs: released, sent again later",
                len(late),
                ACK_TIMEOUT,
            )
        for token in late:
            _, index, _ = self._waiting.pop(token)
            batch.results[index] = Outcome.RELEASE
            batch.outstanding -= 1
            self._hold_key(batch, index)

    @staticmethod
    def _hold_key(batch: _Batch, index: int) -> None:
        """Row `index` is not published: its key's later rows wait (released)."""
        key = batch.keys.get(index)
        if key is None:
            return
        for later in batch.following.pop(key, ()):
            batch.results[later] = Outcome.RELEASE

    async def _acknowledged(self, msg: Msg) -> None:
        """A stream's answer to one message (the subscription's callback)."""
        token = msg.subject[len(self._prefix) + 1 :]
        found = self._waiting.pop(token, None)
        if found is None:
            return  # released already (timed out, or its connection was lost)
        batch, index, subject = found
        batch.outstanding -= 1
        result = self._result(msg, subject, batch.sizes.get(index, 0))
        if result is _NO_RESPONDERS:
            batch.unanswered[index] = subject
            result = Failure(
                f"no NATS stream captures subject {subject!r} (no responders); relay never "
                "creates streams: add the subject to a stream"
            )
        batch.results[index] = result
        key = batch.keys.get(index)
        if result is not None:
            self._hold_key(batch, index)
        elif key is not None:
            following = batch.following.get(key)
            if following:
                batch.ready.append(following.popleft())
        batch.changed.set()

    def _result(self, msg: Msg, subject: str, size: int) -> PublishResult:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status == "503":
            return _NO_RESPONDERS  # made a Failure by the caller, checked after the batch
        if status:
            return Failure(f"NATS answered status {status} {headers.get('Description', '')}")
        try:
            answer = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            return Failure(f"NATS answered {msg.data[:200]!r}, not a JetStream acknowledgement")
        error = answer.get("error") if isinstance(answer, dict) else None
        if error is None:
            if isinstance(answer, dict) and "stream" in answer:
                return None
            return Failure(f"NATS answered {msg.data[:200]!r}, not a JetStream acknowledgement")
        code, err_code = error.get("code"), error.get("err_code")
        description = error.get("description", "")
        if err_code in _TOO_LARGE:
            return Failure(
                f"message is {size} bytes (data and headers), refused by the stream as too "
                f"large ({description}): over the stream's max_msg_size",
                permanent=True,
            )
        if code == 503:  # JetStream not ready (a leader election): pending again
            return Outcome.RELEASE
        return Failure(
            f"NATS JetStream refused the message: {description} (code {code}, err_code {err_code})"
        )
