"""A broker in memory: the reference behaviour of the ports, and a test double.

`MemoryBroker` is one broker in this process, a topic exchange with queues
bound to it by AMQP patterns (`*` one word, `#` any number). Its
`publisher()` and `consumer()` implement `Publisher` and `Consumer`
completely, with what the port promises and no more:

- publish: rows in order, one result per row; each confirmed message is in
  every queue bound to its topic (at once, even while a confirm is slow);
  a row no broker can carry is a permanent Failure; once a row of a key
  fails, the later rows of that key in the batch are released, not sent;
  a topic no queue is bound to comes back (Outcome.UNROUTABLE, or a Failure
  with on_unroutable="fail"), as RabbitMQ's mandatory returns do.
- consume: batches in delivery order, at most `prefetch` unacknowledged
  messages; ack after the rows are stored; what a consumer received and did
  not acknowledge goes back to the head of its queue when it closes or its
  connection breaks, and is delivered again.
- the broker going away: BrokerUnavailable, as the real adapters raise it.

Faults are injected on the broker, for every client at once:

- `nack_when(when)`: the broker rejects the messages `when(row)` is true for
  (Failure "rejected by the memory broker (nack)"); `nack_when(None)` stops.
- `return_when(when)`: the messages `when(row)` is true for come back
  unroutable although a queue is bound; `return_when(None)` stops.
- `slow_confirms(seconds)`: every publish waits this long for its confirms.
- `disconnect(after=0)`: the connections break now (after=0) or once `after`
  more messages were confirmed, mid-batch: the rest of that batch is
  Outcome.RELEASE and the publisher is no longer connected. Consumers raise
  BrokerUnavailable from batches() and ack(); their unacked messages go back.
  A client connects again on its next call.
- `go_down()` / `come_back()`: while down, every connection breaks and
  connect() raises BrokerUnavailable.
- `block(reason)` / `unblock()`: a resource alarm (Publisher.blocked).

No `memory://` URL: `make_publisher` and `make_consumer` build adapters for
brokers another process can reach, and a broker in memory is only shared
inside one process, so a daemon started with it would talk to itself. Tests
build a `MemoryBroker` and hand its publisher or consumer to the loops
(`OutboxRelay`, `Receiver`, or the whole inbox: `wiring.inbox_service`)
directly.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from relay.brokers import (
    Incoming,
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.errors import BrokerUnavailable
from relay.rows import Failure, OutboxRow

RowTest = Callable[[OutboxRow], bool]


@dataclass(frozen=True, slots=True)
class Message:
    """A message as the broker holds it (what the wire would carry)."""

    topic: str
    body: bytes
    message_id: str | None = None
    type: str | None = None
    key: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Delivery:
    message: Message
    queue: str
    tag: int
    redelivered: bool = False


def matches(binding: str, topic: str) -> bool:
    """Whether an AMQP topic binding (`*` one word, `#` zero or more) takes a routing key."""

    def match(pattern: Sequence[str], words: Sequence[str]) -> bool:
        if not pattern:
            return not words
        if pattern[0] == "#":
            return any(match(pattern[1:], words[n:]) for n in range(len(words) + 1))
        return bool(words) and pattern[0] in ("*", words[0]) and match(pattern[1:], words[1:])

    return match(binding.split("."), topic.split("."))


class MemoryBroker:
    """One broker in memory: queues, bindings, the faults to inject, and what
    was published (`published`, confirmed messages in confirm order)."""

    def __init__(self) -> None:
        self.queues: dict[str, deque[_Delivery]] = {}
        self._bindings: list[tuple[str, str]] = []  # (pattern, queue)
        self.published: list[Message] = []
        self._tags = itertools.count(1)
        self._generation = 0  # bumped when every connection breaks
        self._break_after: int | None = None
        self._down = False
        self._nack: RowTest | None = None
        self._return: RowTest | None = None
        self.confirm_delay = 0.0
        self.blocked: str | None = None
        self._unblocked: asyncio.Event | None = None
        self._consumers: list[MemoryConsumer] = []

    # -- what the tests set up and read ---------------------------------

    def bind(self, queue: str, *patterns: str) -> None:
        """Declare `queue` (if new) and bind it to the topics matching `patterns`."""
        self.queues.setdefault(queue, deque())
        self._bindings += [(pattern, queue) for pattern in patterns]

    def send(
        self,
        topic: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> int:
        """Publish a message as any other producer would (no confirm awaited);
        how many queues took it."""
        return self._route(Message(topic, body, message_id, type, key, dict(headers or {})))

    def take(self, queue: str) -> list[Message]:
        """Remove and return every message ready in `queue` (as with no_ack)."""
        ready = self.queues[queue]
        messages = [d.message for d in ready]
        ready.clear()
        return messages

    def publisher(self, *, on_unroutable: str = "publish") -> MemoryPublisher:
        return MemoryPublisher(self, on_unroutable=on_unroutable)

    def consumer(
        self, queue: str, *, binds: Sequence[str] = (), prefetch: int = 100
    ) -> MemoryConsumer:
        return MemoryConsumer(self, queue=queue, binds=binds, prefetch=prefetch)

    # -- faults ---------------------------------------------------------

    def nack_when(self, when: RowTest | None) -> None:
        """Reject (nack) the rows `when` is true for, until nack_when(None)."""
        self._nack = when

    def return_when(self, when: RowTest | None) -> None:
        """Return (unroutable) the rows `when` is true for, until return_when(None)."""
        self._return = when

    def slow_confirms(self, seconds: float) -> None:
        """Confirm every publish `seconds` after its messages arrive."""
        self.confirm_delay = seconds

    def disconnect(self, after: int = 0) -> None:
        """Break every connection now, or once `after` more messages are confirmed."""
        if after:
            self._break_after = after
        else:
            self._break()

    def go_down(self) -> None:
        """Break every connection; connect() fails until come_back()."""
        self._down = True
        self._break()

    def come_back(self) -> None:
        self._down = False

    def block(self, reason: str) -> None:
        """A resource alarm: publishers wait until unblock()."""
        self.blocked = reason
        self._event().clear()

    def unblock(self) -> None:
        self.blocked = None
        self._event().set()

    # -- the broker's side of the clients --------------------------------

    def _event(self) -> asyncio.Event:
        if self._unblocked is None:
            self._unblocked = asyncio.Event()
            self._unblocked.set()
        return self._unblocked

    def _connect(self) -> int:
        if self._down:
            raise BrokerUnavailable("memory broker: down (connection refused)")
        return self._generation

    def _break(self) -> None:
        self._generation += 1
        self._break_after = None
        for consumer in self._consumers:
            consumer._lost()
        self._consumers.clear()
        self._notify()

    def _routes(self, topic: str) -> list[str]:
        return list(dict.fromkeys(q for pattern, q in self._bindings if matches(pattern, topic)))

    def _route(self, message: Message) -> int:
        queues = self._routes(message.topic)
        for name in queues:
            self.queues[name].append(_Delivery(message, name, next(self._tags)))
        self._notify()
        return len(queues)

    def _notify(self) -> None:
        for consumer in self._consumers:
            consumer._arrived.set()


class MemoryPublisher:
    """`Publisher` on a MemoryBroker."""

    def __init__(self, broker: MemoryBroker, *, on_unroutable: str = "publish") -> None:
        self.broker = broker
        self.on_unroutable = on_unroutable
        self._generation: int | None = None

    @property
    def connected(self) -> bool:
        return self._generation == self.broker._generation and not self.broker._down

    @property
    def blocked(self) -> str | None:
        """Why the broker blocks publishing (a resource alarm), or None."""
        return self.broker.blocked if self.connected else None

    async def wait_unblocked(self) -> None:
        """Return once the broker no longer blocks publishing (or the connection broke)."""
        while self.blocked is not None:
            try:
                await asyncio.wait_for(self.broker._event().wait(), 0.05)
            except TimeoutError:
                pass

    async def connect(self) -> None:
        if not self.connected:
            self._generation = self.broker._connect()

    async def close(self) -> None:
        self._generation = None

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        if self.blocked is not None:
            await self.wait_unblocked()
            await self.connect()
        broker = self.broker
        generation = self._generation
        results: list[PublishResult] = []
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        sent: list[int] = []  # indexes of the rows that reached the broker
        for row in rows:
            if row.key is not None and row.key in held:
                results.append(Outcome.RELEASE)
                continue
            if broker._generation != generation:  # broke mid-batch
                results.append(Outcome.RELEASE)
                continue
            result = self._publish_one(row)
            results.append(result)
            if isinstance(result, Failure) and row.key is not None:
                held.add(row.key)
            if not isinstance(result, Failure) or not result.permanent:
                sent.append(len(results) - 1)
            if broker._break_after is not None and result is None:
                broker._break_after -= 1
                if broker._break_after <= 0:
                    broker._break()
        if broker.confirm_delay and sent:
            await asyncio.sleep(broker.confirm_delay)
            if broker._generation != generation:  # the confirms never came
                for index in sent:
                    results[index] = Outcome.RELEASE
        return results

    def _publish_one(self, row: OutboxRow) -> PublishResult:
        broker = self.broker
        try:
            check_topic(row)
            headers = row_headers(row)
            body = row_body(row)
        except Exception as exc:  # whatever it is, it is this row's
            return encode_failure(exc)
        if broker._nack is not None and broker._nack(row):
            return Failure("rejected by the memory broker (nack)")
        message = Message(row.topic, body, row.id, row.type, row.key, headers)
        returned = broker._return is not None and broker._return(row)
        if returned or not broker._route(message):
            if self.on_unroutable != "publish":
                return Failure(f"unroutable: no queue is bound for routing key {row.topic!r}")
            broker.published.append(message)
            return Outcome.UNROUTABLE
        broker.published.append(message)
        return None


class MemoryConsumer:
    """`Consumer` on a MemoryBroker: one queue, declared and bound on connect."""

    def __init__(
        self, broker: MemoryBroker, *, queue: str, binds: Sequence[str] = (), prefetch: int = 100
    ) -> None:
        self.broker = broker
        self.queue = queue
        self.binds = tuple(binds)
        self.prefetch = prefetch
        self._unacked: dict[int, _Delivery] = {}
        self._open = False
        self._broken = False
        self._arrived = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._open and not self._broken

    async def connect(self) -> None:
        if self.connected:
            return
        self.broker._connect()
        if self.queue not in self.broker.queues or self.binds:
            self.broker.bind(self.queue, *self.binds)
        self._broken = False
        self._open = True
        self.broker._consumers.append(self)

    def _lost(self) -> None:
        """The connection broke: unacked messages go back to the queue's head."""
        self._broken = True
        self._requeue()
        self._arrived.set()

    def _requeue(self) -> None:
        ready = self.broker.queues[self.queue]
        for delivery in sorted(self._unacked.values(), key=lambda d: d.tag, reverse=True):
            delivery.redelivered = True
            ready.appendleft(delivery)
        self._unacked.clear()

    async def close(self) -> None:
        if self._open and not self._broken:
            self._requeue()
            self.broker._consumers.remove(self)
        self._open = False
        self.broker._notify()

    def _get(self) -> _Delivery | None:
        ready = self.broker.queues[self.queue]
        if not ready or len(self._unacked) >= self.prefetch:
            return None
        delivery = ready.popleft()
        self._unacked[delivery.tag] = delivery
        return delivery

    async def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        loop = asyncio.get_running_loop()
        while True:
            await self.connect()
            batch: list[Incoming] = []
            deadline = 0.0
            while len(batch) < max_size and not self._broken:
                delivery = self._get()
                if delivery is not None:
                    if not batch:
                        deadline = loop.time() + max_wait
                    batch.append(_incoming(delivery))
                    continue
                timeout = deadline - loop.time() if batch else None
                if timeout is not None and timeout <= 0:
                    break
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), timeout)
                except TimeoutError:
                    break
            if batch and not self._broken:
                yield batch
                continue
            self._open = False
            raise BrokerUnavailable(f"memory broker: connection of queue {self.queue!r} lost")

    async def ack(self, batch: Sequence[Incoming]) -> None:
        if not batch:
            return
        if not self.connected:
            self._open = False
            raise BrokerUnavailable(
                f"memory broker: connection of queue {self.queue!r} lost before the ack"
            )
        for incoming in batch:
            assert isinstance(incoming.ack_token, _Delivery)
            self._unacked.pop(incoming.ack_token.tag, None)
        self.broker._notify()


def _incoming(delivery: _Delivery) -> Incoming:
    message = delivery.message
    return Incoming(
        message_id=message.message_id,
        topic=message.topic,
        key=message.key,
        type=message.type or message.topic,  # the contract's fallback: the routing key
        body=message.body,
        headers=dict(message.headers),
        ack_token=delivery,
        original=lambda: {"routing_key": message.topic},
    )
