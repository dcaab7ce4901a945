"""NATS JetStream → inbox: a durable pull consumer of one stream.

`relay inbox --queue STREAM --consumer-name NAME` reads the stream through
the durable consumer NAME (made when missing: explicit acknowledgement,
from the stream's first message). Pull requests ask for what the memory
bound leaves room for (a count and, with --batch-bytes, bytes: the pull
request's max_bytes); the messages come to one subscription of the
connection's. A message is acknowledged (+ACK) only after its inbox row is
committed; while it waits longer than a third of the consumer's AckWait it
is told to be in progress (+WPI), and what is held at close is given back
(-NAK) for redelivery at once. Several processes with one consumer name
share the stream's messages as competing consumers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from relay.brokers import Incoming, buffered_batches
from relay.brokers.nats.connection import (
    API_TIMEOUT,
    Client,
    RawHeaders,
    connect,
    describe,
    where,
)
from relay.brokers.nats.connection import close as close_client
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable, ConfigError

log = logging.getLogger("relay.brokers.nats")

# Stream and consumer names: no white space, dots, wildcards or path separators.
_NAME = re.compile(r"^[^\s.*>/\\]{1,255}$")
# A pull request waits this long for messages, with heartbeats this often;
# a request that hears neither for HEARTBEAT_LOST is taken as a lost
# connection. Short: close() waits for the last request to end, and a
# process killed leaves its request on the server that long (a message
# that reaches it meanwhile waits for the consumer's AckWait).
EXPIRES = 2.0
HEARTBEAT = 0.5
HEARTBEAT_LOST = 5.0
# At most this many messages a pull request asks for.
PULL_BATCH = 500
# How often the progress of held messages is looked at (+WPI).
PROGRESS_EVERY = 1.0
NANOS = 1_000_000_000


@dataclass(slots=True)
class Token:
    """A received message's acknowledgement subject and place (ack_token)."""

    reply: str
    stream: str
    sequence: int
    size: int
    since: float  # monotonic, when received or last told in progress


def place(reply: str) -> tuple[str, int]:
    """The stream and stream sequence of a JetStream acknowledgement subject:
    `$JS.ACK.STREAM.CONSUMER.DELIVERED.SSEQ.CSEQ.TS.PENDING`, or the form
    with a domain and account hash after `$JS.ACK` (11 or 12 tokens)."""
    tokens = reply.split(".")
    if len(tokens) >= 11:
        return tokens[4], int(tokens[7])
    if len(tokens) == 9:
        return tokens[2], int(tokens[5])
    raise ValueError(f"not a JetStream acknowledgement subject: {reply[:200]!r}")


def header_pairs(raw: bytes) -> tuple[str | None, list[tuple[str, str]]]:
    """A header block as received: its status (`NATS/1.0 404 …`) and its
    `Name: Value` pairs in order, decoded leniently (bytes that are not
    UTF-8 as surrogate escapes, which relay.storable keeps in a dead row)."""
    lines = raw.split(b"\r\n")
    first = lines[0][len(b"NATS/1.0") :].strip()
    status = first.split(b" ", 1)[0].decode("ascii", "replace") if first else None
    pairs = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name.strip():
            continue
        pairs.append(
            (
                name.strip().decode("utf-8", "surrogateescape"),
                value.strip().decode("utf-8", "surrogateescape"),
            )
        )
    return status, pairs


def _as_received(
    token: Token, subject: str, pairs: list[tuple[str, str]] | None
) -> Callable[[], dict[str, Any]]:
    def original() -> dict[str, Any]:
        out: dict[str, Any] = {
            "stream": token.stream,
            "sequence": token.sequence,
            "subject": subject.encode("utf-8", "surrogateescape"),
        }
        if pairs is not None:
            out["headers"] = [
                [n.encode("utf-8", "surrogateescape"), v.encode("utf-8", "surrogateescape")]
                for n, v in pairs
            ]
        return out

    return original


def to_incoming(msg: Msg, token: Token, pairs: list[tuple[str, str]]) -> Incoming:
    """A message as the inbox sees it (the contract's mapping). A repeated
    header: its first value, as the server and nats.go's Header.Get read it."""
    headers: dict[str, str] = {}
    for name, value in pairs:
        headers.setdefault(name, value)
    message_id = headers.get("Nats-Msg-Id") or headers.get("message_id")
    content_type = headers.get("Content-Type") or headers.get("content-type")
    return Incoming(
        message_id=message_id or f"nats:{token.stream}:{token.sequence}",
        topic=msg.subject,
        key=headers.get("key"),
        type=headers.get("type") or msg.subject,
        body=msg.data,
        headers=headers,
        ack_token=token,
        original=_as_received(token, msg.subject, pairs),
        content_type=content_type,
    )


class NatsConsumer:
    """Pulls a stream's messages through a durable consumer; acks behind stored rows."""

    def __init__(
        self,
        broker: BrokerURL,
        *,
        stream: str,
        durable: str,
        prefetch: int,
        max_bytes: int | None,
    ) -> None:
        for what, name in (("--queue (the NATS stream)", stream), ("--consumer-name", durable)):
            if not _NAME.match(name):
                raise ConfigError(
                    f"invalid {what} {name[:80]!r} for NATS: a name without white space, "
                    ". * > / or \\, at most 255 characters"
                )
        self.broker = broker
        self.stream = stream
        self.durable = durable
        self.max_held = max(1, prefetch)
        self.max_bytes = max_bytes
        self._client: Client | None = None
        self._subscription: Subscription | None = None
        self._inbox = ""
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: deque[Incoming] = deque()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._pull_done = asyncio.Event()  # no pull request waits on the server
        self._pull_done.set()
        self._failure: BaseException | None = None
        self._held: dict[str, Token] = {}  # reply -> token, received and not acknowledged
        self._held_bytes = 0
        self._pull_left = 0
        self._heard = 0.0  # monotonic: the last message or heartbeat of a pull
        self._oversize = False  # the next message is over the room max_bytes leaves
        self.ack_wait = 30.0
        self._ever_connected = False

    @property
    def connected(self) -> bool:
        return self._client is not None and self._failure is None

    async def connect(self) -> None:
        if self.connected:
            return
        await self.close()
        self._failure = None
        client = await connect(
            self.broker, "relay inbox", self._on_lost, starting=not self._ever_connected
        )
        self._ever_connected = True
        try:
            await self._ensure_consumer(client)
            self._inbox = client.new_inbox()
            self._subscription = await client.subscribe(self._inbox, cb=self._received)
        except BaseException:
            await close_client(client)
            raise
        self._client = client
        self._tasks = [
            asyncio.ensure_future(self._watched(self._pull(client))),
            asyncio.ensure_future(self._watched(self._progress(client))),
        ]
        log.info(
            "consuming NATS stream %r as durable consumer %r at %s",
            self.stream,
            self.durable,
            where(self.broker),
        )

    async def _ensure_consumer(self, client: Client) -> None:
        js = client.jetstream(timeout=API_TIMEOUT)
        try:
            await js.stream_info(self.stream)
        except NotFoundError:
            raise BrokerUnavailable(
                f"NATS stream {self.stream!r} does not exist at {where(self.broker)}; relay "
                "does not create streams: create it"
            ) from None
        except Exception as exc:  # noqa: BLE001 - no JetStream, a timeout, a broken connection
            raise BrokerUnavailable(f"NATS at {where(self.broker)}: {describe(exc)}") from None
        try:
            try:
                info = await js.consumer_info(self.stream, self.durable)
            except NotFoundError:
                # Several processes may make it at once: the same config is
                # no error, and the one made is the one used.
                info = await js.add_consumer(
                    self.stream,
                    ConsumerConfig(
                        durable_name=self.durable,
                        ack_policy=AckPolicy.EXPLICIT,
                        deliver_policy=DeliverPolicy.ALL,
                    ),
                )
                log.info("made the NATS consumer %r of stream %r", self.durable, self.stream)
        except Exception as exc:  # noqa: BLE001
            raise BrokerUnavailable(
                f"NATS consumer {self.durable!r} of stream {self.stream!r}: {describe(exc)}"
            ) from None
        config = info.config
        if config.deliver_subject:
            raise ConfigError(
                f"NATS consumer {self.durable!r} of stream {self.stream!r} is a push consumer; "
                "relay pulls: give another --consumer-name"
            )
        if config.ack_policy not in (None, AckPolicy.EXPLICIT):
            raise ConfigError(
                f"NATS consumer {self.durable!r} of stream {self.stream!r} has AckPolicy "
                f"{config.ack_policy}; relay acknowledges each message once stored "
                "(explicit): give another --consumer-name"
            )
        self.ack_wait = float(config.ack_wait or 30.0)

    def _on_lost(self, why: str) -> None:
        if self._client is None:
            return  # closed by relay, or not connected yet (connect() says why)
        self._fail(BrokerUnavailable(f"NATS at {where(self.broker)}: {why}"))

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            log.warning("%s", exc)
        self._arrived.set()
        self._room.set()
        self._pull_done.set()

    async def _watched(self, work: Any) -> None:
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any end of the pulls reaches the receiver
            self._fail(BrokerUnavailable(f"NATS consumer of {self.stream!r}: {describe(exc)}"))

    # -- pulling ------------------------------------------------------------------

    async def _pull(self, client: Client) -> None:
        """One pull request at a time, for what the bound leaves room for."""
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        loop = asyncio.get_running_loop()
        while self._failure is None:
            room = self.max_held - len(self._held)
            room_bytes = None if self.max_bytes is None else self.max_bytes - self._held_bytes
            if room <= 0 or (room_bytes is not None and room_bytes <= 0 and self._held):
                self._room.clear()
                await self._room.wait()
                continue
            request: dict[str, int] = {
                "batch": min(room, PULL_BATCH),
                "expires": int(EXPIRES * NANOS),
                "idle_heartbeat": int(HEARTBEAT * NANOS),
            }
            if room_bytes is not None and not (self._oversize and not self._held):
                request["max_bytes"] = max(room_bytes, 1)
            elif self._oversize:  # one message larger than the bound: taken alone
                request["batch"] = 1
            self._oversize = False
            self._pull_left = request["batch"]
            self._pull_done.clear()
            self._heard = loop.time()
            await client.publish(subject, orjson.dumps(request), reply=self._inbox)
            while not self._pull_done.is_set():
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can
                # swallow a cancellation that comes as the event is set, and
                # this loop would then outlive close().
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(HEARTBEAT):
                        await self._pull_done.wait()
                if loop.time() - self._heard > HEARTBEAT_LOST and not self._pull_done.is_set():
                    raise BrokerUnavailable(
                        f"NATS at {where(self.broker)}: no message or heartbeat for "
                        f"{HEARTBEAT_LOST:g}s"
                    )

    async def _received(self, msg: Msg) -> None:
        """A message or status of a pull request (the subscription's callback)."""
        self._heard = asyncio.get_running_loop().time()
        raw = msg.headers.raw if isinstance(msg.headers, RawHeaders) else b""
        status, pairs = header_pairs(raw) if raw else (None, [])
        if status:
            self._status(status, msg)
            return
        try:
            stream, sequence = place(msg.reply)
        except ValueError:
            log.warning("a NATS message without an acknowledgement subject: ignored")
            return
        token = Token(msg.reply, stream, sequence, len(msg.data), time.monotonic())
        if msg.reply not in self._held:
            self._held[msg.reply] = token
            self._held_bytes += token.size
        try:
            incoming = to_incoming(msg, token, pairs)
        except Exception as exc:  # noqa: BLE001 - one message never stops the consumer
            incoming = Incoming(
                message_id=f"nats:{stream}:{sequence}",
                topic=msg.subject,
                key=None,
                type=msg.subject,
                body=msg.data,
                ack_token=token,
                original=_as_received(token, msg.subject, None),
                undecodable=f"NATS message {stream}:{sequence}: {describe(exc)}",
            )
        self._buffer.append(incoming)
        self._arrived.set()
        self._pull_left -= 1
        if self._pull_left <= 0:
            self._pull_done.set()

    def _status(self, status: str, msg: Msg) -> None:
        headers = msg.headers or {}
        description = str(headers.get("Description", ""))
        if status == "100":  # an idle heartbeat (or flow control, not asked for)
            return
        if status == "409" and "MaxBytes" in description:
            self._oversize = True
        elif status == "409" and "Deleted" in description:
            self._fail(
                BrokerUnavailable(
                    f"NATS consumer {self.durable!r} of stream {self.stream!r} was deleted"
                )
            )
        elif status not in ("404", "408", "409"):
            log.warning("NATS pull request of %r: status %s %s", self.stream, status, description)
        self._pull_done.set()

    async def _progress(self, client: Client) -> None:
        """Held messages older than a third of AckWait: told in progress (+WPI)."""
        while self._failure is None:
            await asyncio.sleep(min(PROGRESS_EVERY, self.ack_wait / 3))
            now = time.monotonic()
            due = now - self.ack_wait / 3
            for token in list(self._held.values()):
                if token.since < due:
                    token.since = now
                    await client.publish(token.reply, b"+WPI")

    # -- the receiver's side ------------------------------------------------------

    def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        return buffered_batches(self, "NATS consumer", max_size, max_wait)

    async def ack(self, batch: Sequence[Incoming]) -> None:
        """The batch's rows are committed: each message acknowledged (+ACK)."""
        if not batch:
            return
        client = self._client
        if client is None or client.is_closed:
            raise BrokerUnavailable("NATS consumer closed before the batch was committed")
        for message in batch:
            token = message.ack_token
            assert isinstance(token, Token)
            if self._held.pop(token.reply, None) is not None:
                self._held_bytes -= token.size
            await client.publish(token.reply, b"+ACK")
        self._room.set()

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        client = self._client
        if client is not None and client.is_connected and self._failure is None and self._held:
            # What was received and not stored is given back (-NAK) for
            # redelivery at once, but only once this connection's pull
            # request has ended: the server would hand it to that request
            # again, and nobody would read it (nats-server 2.9 does not
            # drop a request whose reply subject lost its subscriber).
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._pull_done.wait(), EXPIRES + 1)
            with contextlib.suppress(Exception):
                for token in self._held.values():
                    await client.publish(token.reply, b"-NAK")
                await asyncio.wait_for(client.flush(), 2)
        self._client = None
        self._subscription = None
        self._held = {}
        self._held_bytes = 0
        self._buffer.clear()
        await close_client(client)
