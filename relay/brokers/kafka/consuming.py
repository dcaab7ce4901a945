"""Kafka → inbox: a consumer group whose consume loop runs in a thread of
its own and hands batches to the event loop; offsets are committed by
hand, only behind records whose rows are committed; held records bounded
by count and bytes; the lag and the rebalances as readings (docs/kafka.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import operator
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from confluent_kafka import Consumer as RdConsumer
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from relay.brokers import (
    Incoming,
    Reading,
    take_batch,
)
from relay.brokers.kafka.common import (
    _MISSING_TOPIC,
    _TOPIC_NAME,
    CONNECT_TIMEOUT,
    CONSUMER,
    CONSUMER_DEFAULTS,
    DEFAULT_MESSAGE_MAX_BYTES,
    LIBRDKAFKA_LOG,
    PROBE_TIMEOUT,
    _config_error,
    _describe,
    _where,
    client_config,
    log,
)
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable, ConfigError

# Records received and not yet acknowledged beyond which fetching pauses.
MAX_HELD = 5000
# A consume() asks for up to CONSUME_COUNT records and returns once it has
# them all or its wait is over: CONSUME_IDLE after one that found nothing,
# CONSUME_BUSY after one that found some. librdkafka hands fetched records
# on by the fetch, so a wait of 0.1 s for a full count held every batch of a
# backlog back (the Kafka inbox: 13,700 msgs/s, 19,200 with 0.01 s), while
# idle the thread wakes ten times a second only.
CONSUME_COUNT = 500
CONSUME_IDLE = 0.1
CONSUME_BUSY = 0.01
# How long the consume thread waits, over MAX_HELD (or its bytes), before it
# pauses its partitions (a rebalance waits that long at most meanwhile).
PAUSE_AFTER = 1.0
# librdkafka reports an idle connection closed, or a bootstrap connection
# let go of, as _ALL_BROKERS_DOWN too, and reconnects by itself: the
# consumer then asks the cluster for its metadata every PROBE_EVERY seconds
# (PROBE_TIMEOUT each) until it answers, not connected (/readyz) while it
# does not. It keeps its consumer (librdkafka rejoins the group itself; a
# new member each time cost the whole group a rebalance, tests/kafka/
# test_faults.py); only a cluster silent for UNREACHABLE_AFTER seconds (or
# the group's session timeout, if longer) gets a new one.
PROBE_EVERY = 1.0
UNREACHABLE_AFTER = 60.0
DEFAULT_SESSION_TIMEOUT_MS = 45000  # librdkafka's session.timeout.ms
# The lag metric is measured at most once in this many seconds (the
# receiver process asks every 5 s: relay.receiver_process); sooner, the last
# measure stands. A measure asks the cluster for the group's committed
# offsets and each partition's end, on a client of its own in a worker
# thread. It was the consume thread's (confluent-kafka serializes a
# consumer's calls), where one committed() waiting on the group coordinator
# held consumption for 2.4 s of every 5: the inbox from Kafka ran at half
# its rate (bench.where inbox --broker kafka: 7,700 -> 15,000-17,300 msgs/s).
LAG_MAX_AGE = 1.0


def _text(value: str | bytes | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.decode("utf-8", "surrogateescape")


class Token(NamedTuple):
    """A received record's place, and the assignment it came in (ack_token)."""

    topic: str
    partition: int
    offset: int
    epoch: int

    @property
    def place(self) -> str:
        """TOPIC:PARTITION:OFFSET; `kafka:` and it, a record's dedup key without an id."""
        return f"{self.topic}:{self.partition}:{self.offset}"


def _as_received(
    token: Token, raw_key: bytes | None, pairs: list[tuple[str, Any]] | None = None
) -> Callable[[], dict[str, Any]]:
    """The record's lossless account, asked for only when its row cannot
    hold it as given (Incoming.original); its headers when they were read."""

    def original() -> dict[str, Any]:
        out: dict[str, Any] = {
            "topic": token.topic,
            "partition": token.partition,
            "offset": token.offset,
            "key": raw_key,
        }
        if pairs is not None:
            out["headers"] = [list(pair) for pair in pairs]
        return out

    return original


# Message.headers() through a C-level call, never a plain `message.headers()`:
# for a header name that is not UTF-8, confluent-kafka returns a list holding
# a NULL with the UnicodeDecodeError still set. A C-level call checks the
# result and raises SystemError; CPython 3.11's specialized bytecode for a
# hot `message.headers()` does not, and the next touch of that list crashed
# the receiver process (SIGSEGV), found by the generated records of
# tests/kafka/test_daemons.py.
_headers_of = operator.methodcaller("headers")


def to_incoming(message: Message, token: Token) -> Incoming:
    """A record as the inbox sees it (the contract's mapping). Headers are
    decoded leniently: invalid UTF-8 as surrogate escapes, which
    relay.storable keeps in a dead row with the reason."""
    topic = token.topic
    given = _headers_of(message) or []  # raises for a header name not UTF-8: see _take
    pairs: list[tuple[str, Any]] = list(given.items() if isinstance(given, dict) else given)
    headers: dict[str, Any] = {}
    for name, value in pairs:  # a repeated name: the last, as Java's lastHeader()
        headers[name] = _text(value)
    message_id = headers.get("id") or headers.get("message_id") or None
    raw_key = message.key()
    return Incoming(
        message_id=message_id if isinstance(message_id, str) else f"kafka:{token.place}",
        topic=topic,
        key=_text(raw_key) if raw_key is not None else None,
        type=headers.get("type") or topic,
        body=message.value() or b"",
        headers=headers,
        ack_token=token,
        original=_as_received(token, raw_key, pairs),
        content_type=headers.get("content-type"),
    )


def _unreadable_why(exc: Exception) -> str:
    behind = exc.__cause__ or exc.__context__
    for error in (exc, behind):
        if isinstance(error, UnicodeDecodeError):
            return f"a header name is not valid UTF-8 ({error})"
    return f"{type(exc).__name__}: {exc}"


def unreadable(message: Message, token: Token, why: str) -> Incoming:
    """A record whose properties cannot be decoded: kept in a dead row with
    the reason (its value as received), under its own place in the log."""
    return Incoming(
        message_id=f"kafka:{token.place}",
        topic=token.topic,
        key=None,
        type=token.topic,
        body=message.value() or b"",
        ack_token=token,
        original=_as_received(token, message.key()),
        undecodable=f"Kafka record {token.place}: {why}",
    )


@dataclass(slots=True)
class _Partition:
    """One assigned partition: the records handed out, in offset order."""

    epoch: int
    handed: deque[list[int]] = field(default_factory=deque)  # [offset, done, bytes]
    committable: int | None = None  # the offset to commit next (last done + 1)
    committed: int | None = None


def budget_config(max_bytes: int | None) -> dict[str, str]:
    """librdkafka's prefetch under `max_bytes` (the receiver's share of
    --batch-bytes, relay.budget): a quarter for its queue of fetched
    records, a quarter for one fetch on its way (never under the consumer's
    message.max.bytes, its default, which librdkafka insists on), a
    partition's part of a fetch no more than either. A record larger than
    a fetch still comes, alone (the broker answers a fetch with at least
    one record batch). The records handed to the receiver hold the other
    half (KafkaConsumer.max_held_bytes). Defaults: the URL may set each."""
    if max_bytes is None:
        return {}
    quarter = max(max_bytes // 4, 1024)
    return {
        "queued.max.messages.kbytes": str(quarter // 1024),
        "fetch.max.bytes": str(max(quarter, DEFAULT_MESSAGE_MAX_BYTES)),
        "max.partition.fetch.bytes": str(min(quarter, 1 << 20)),
    }


class KafkaConsumer:
    """Consumes topics as a consumer group; commits only behind stored records."""

    def __init__(
        self,
        broker: BrokerURL,
        *,
        topics: Sequence[str],
        group: str,
        prefetch: int,
        max_bytes: int | None = None,
    ) -> None:
        names = [t.strip() for t in topics if t.strip()]
        if not names:
            raise ConfigError("no Kafka topic: set --queue TOPIC[,TOPIC…]")
        for name in names:
            if not _TOPIC_NAME.match(name):
                raise ConfigError(
                    f"invalid --queue {name[:80]!r} for Kafka: topic names are 1-249 letters, "
                    "digits, . _ and -"
                )
        self.broker = broker
        self.topics = names
        self.group = group or names[0]
        self.config = client_config(
            broker, CONSUMER, {**CONSUMER_DEFAULTS, **budget_config(max_bytes)}
        )
        self.config["group.id"] = self.group
        self.max_held = max(MAX_HELD, prefetch)
        # The bytes of the records handed to the receiver and not yet
        # acknowledged beyond which fetching pauses (half of `max_bytes`:
        # librdkafka's prefetch has the other, budget_config).
        self.max_held_bytes = max_bytes // 2 if max_bytes is not None else None
        self._held_bytes = 0
        # Rebalances this process took part in (each assignment of the
        # group's partitions to it, its first included), for /metrics.
        self.rebalances = 0
        # Since when (monotonic) librdkafka has said every broker is down,
        # not yet contradicted by an answer (PROBE_EVERY); when to ask next;
        # why the last question went unanswered.
        self._down_since: float | None = None
        self._probe_at = 0.0
        self._unreachable: str | None = None
        session_ms = int(self.config.get("session.timeout.ms", DEFAULT_SESSION_TIMEOUT_MS))
        self.unreachable_after = max(UNREACHABLE_AFTER, session_ms / 1000)
        self._consumer: RdConsumer | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the partitions' state, between the threads
        self._partitions: dict[tuple[str, int], _Partition] = {}
        self._epoch = 0
        self._held = 0
        self._buffer: deque[Incoming] = deque()
        # Records a consume() brought and not yet handed out (the consume
        # thread's: _take hands them out under the bounds, _revoked drops
        # a revoked partition's). A consume() takes all librdkafka has
        # fetched, whose limits a broker's answer may pass: Tansu's brought
        # 86 records of 50 MiB in one, which, handed out as one batch, cost
        # the receiver and the daemon several copies each (an OOM kill in
        # 384 MiB, tests/ops/test_memory_limit.py).
        self._unhanded: deque[Message] = deque()
        self._record_bytes = 0.0  # the mean size of the last records handed out
        self._arrived = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failure: BaseException | None = None
        self._revoking = threading.Event()
        self._acked = threading.Condition(self._lock)
        # confluent-kafka serializes a consumer's calls: a commit from the
        # event loop waits for the consume thread's consume() to return. So
        # every call after subscribe() is the consume thread's (a commit when
        # asked for, by ack), and the lag is measured by a client of its own.
        self._commit_due = threading.Event()
        self.lag: dict[tuple[str, int], int] = {}
        self._lag_at = -float("inf")  # when (monotonic) `lag` was measured
        self._lag_client: RdConsumer | None = None
        self._lag_unusable = False  # the lag client hit a fatal error
        self._lag_lock = asyncio.Lock()

    @property
    def connected(self) -> bool:
        """Consuming, and the cluster answers (/readyz)."""
        return self._alive and self._unreachable is None

    @property
    def _alive(self) -> bool:
        """The consumer runs (maybe waiting for the cluster to answer again)."""
        return self._consumer is not None and self._failure is None

    # -- connecting ----------------------------------------------------------

    async def connect(self) -> None:
        if self._alive:
            return
        await self.close()
        self._failure = None
        self._down_since, self._unreachable = None, None
        self._loop = asyncio.get_running_loop()
        try:
            consumer = RdConsumer(
                {**self.config, "error_cb": self._error, "logger": LIBRDKAFKA_LOG}
            )
        except KafkaException as exc:
            raise _config_error(exc, self.broker) from None
        try:
            metadata = await asyncio.to_thread(consumer.list_topics, None, CONNECT_TIMEOUT)
        except KafkaException as exc:
            await asyncio.to_thread(consumer.close)
            raise BrokerUnavailable(
                f"Kafka at {_where(self.broker)}: {_describe(exc.args[0])}"
            ) from None
        missing = [t for t in self.topics if t not in metadata.topics]
        if missing:
            await asyncio.to_thread(consumer.close)
            raise BrokerUnavailable(
                f"Kafka topic {missing[0]!r} does not exist at {_where(self.broker)}; relay "
                "does not create topics: create it"
            )
        consumer.subscribe(self.topics, on_assign=self._assigned, on_revoke=self._revoked)
        self._consumer = consumer
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._consume_or_fail, name="relay-kafka-consume", daemon=True
        )
        self._thread.start()
        log.info(
            "consuming Kafka topics %s as group %r at %s",
            ", ".join(self.topics),
            self.group,
            _where(self.broker),
        )

    async def close(self) -> None:
        consumer, thread = self._consumer, self._thread
        self._consumer, self._thread = None, None
        self._stop.set()
        with self._lock:
            self._acked.notify_all()
        if thread is not None:
            await asyncio.to_thread(thread.join, 10.0)
        self._buffer.clear()
        if consumer is not None:
            await asyncio.to_thread(self._close, consumer)
        lag_client, self._lag_client = self._lag_client, None
        if lag_client is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                await asyncio.to_thread(lag_client.close)

    def _close(self, consumer: RdConsumer) -> None:
        with contextlib.suppress(KafkaException, RuntimeError):
            self._commit(consumer, asynchronous=False)
        with contextlib.suppress(KafkaException, RuntimeError):
            consumer.close()
        with self._lock:
            self._partitions.clear()
            self._held = 0
            self._held_bytes = 0

    # -- librdkafka's callbacks, in the consume thread -----------------------

    def _error(self, error: KafkaError) -> None:
        if error.fatal():  # librdkafka: this consumer can be used no more
            self._fail(
                BrokerUnavailable(
                    f"the Kafka consumer at {_where(self.broker)} hit a fatal error "
                    f"({_describe(error)}): a new one replaces it"
                )
            )
        elif error.code() == KafkaError._ALL_BROKERS_DOWN:
            # Maybe only idle connections closed: the consume thread asks.
            if self._down_since is None:
                self._down_since = self._probe_at = time.monotonic()
            log.debug("Kafka consumer: %s", _describe(error))
        else:
            log.debug("Kafka consumer: %s", _describe(error))

    def _probe(self, consumer: RdConsumer) -> None:
        """After librdkafka said every broker is down (in the consume
        thread): ask the cluster for the topic's metadata. An answer ends
        it (an idle disconnect, or an outage over); none makes the cluster
        unreachable (the batches end, the consumer kept), and none for
        `unreachable_after` fails the consumer (the receiver makes a new one)."""
        down_since = self._down_since
        now = time.monotonic()
        if down_since is None or now < self._probe_at:
            return
        self._probe_at = now + PROBE_EVERY
        try:
            consumer.list_topics(self.topics[0], PROBE_TIMEOUT)
        except KafkaException as exc:
            first, self._unreachable = self._unreachable is None, _describe(exc.args[0])
            if first:
                log.warning(
                    "Kafka at %s is unreachable: %s", _where(self.broker), self._unreachable
                )
                self._loop_call(self._arrived.set)  # the batches end: see batches()
            if time.monotonic() - down_since >= self.unreachable_after:
                self._fail(
                    BrokerUnavailable(
                        f"Kafka at {_where(self.broker)} unreachable for "
                        f"{time.monotonic() - down_since:.0f}s: {self._unreachable}"
                    )
                )
            return
        if self._down_since == down_since:
            self._down_since = None
        if self._unreachable is not None:
            self._unreachable = None
            log.info("Kafka at %s is reachable again", _where(self.broker))
        else:  # librdkafka reconnected at once: an idle connection was closed, say
            log.debug("Kafka answers (%.1fs after all brokers were said down)", now - down_since)

    def _assigned(self, consumer: RdConsumer, partitions: list[TopicPartition]) -> None:
        with self._lock:
            self.rebalances += 1
            self._epoch += 1
            for tp in partitions:
                self._partitions[(tp.topic, tp.partition)] = _Partition(self._epoch)
        log.info(
            "Kafka group %r assigned %s",
            self.group,
            ", ".join(f"{tp.topic}[{tp.partition}]" for tp in partitions) or "nothing",
        )

    def _revoked(self, consumer: RdConsumer, partitions: list[TopicPartition]) -> None:
        """Finish the work in hand (the records handed out are stored and
        acknowledged, for a while at most), commit it, then let go."""
        gone = {(tp.topic, tp.partition) for tp in partitions}
        self._unhanded = deque(m for m in self._unhanded if (m.topic(), m.partition()) not in gone)
        # Records buffered and not handed to the receiver yet are let go of
        # first (their new owner reads them again), then the rest is waited for.
        forgotten = threading.Event()
        self._loop_call(self._forget, gone, forgotten)
        forgotten.wait(5)
        deadline = time.monotonic() + 30
        with self._lock:
            while (
                any(self._partitions[p].handed for p in gone if p in self._partitions)
                and not self._stop.is_set()
                and time.monotonic() < deadline
            ):
                self._acked.wait(0.1)
        with contextlib.suppress(KafkaException, RuntimeError):
            self._commit(consumer, asynchronous=False, only=gone)
        with self._lock:
            for key in gone:
                state = self._partitions.pop(key, None)
                if state is not None:
                    self._held -= len(state.handed)
                    self._held_bytes -= sum(entry[2] for entry in state.handed)
        log.info(
            "Kafka group %r revoked %s",
            self.group,
            ", ".join(f"{t}[{p}]" for t, p in sorted(gone)) or "nothing",
        )

    def _forget(self, gone: set[tuple[str, int]], done: threading.Event) -> None:
        """Drop the buffered records of revoked partitions (on the loop):
        their new owner reads them from the committed offset."""
        dropped: dict[tuple[str, int], set[int]] = {}
        kept: deque[Incoming] = deque()
        for message in self._buffer:
            token = message.ack_token
            assert isinstance(token, Token)
            if (token.topic, token.partition) in gone:
                dropped.setdefault((token.topic, token.partition), set()).add(token.offset)
            else:
                kept.append(message)
        # In place: a batch being gathered (brokers.take_batch) holds this deque.
        self._buffer.clear()
        self._buffer.extend(kept)
        with self._lock:
            for key, offsets in dropped.items():
                state = self._partitions.get(key)
                if state is not None:
                    kept_entries = deque(e for e in state.handed if e[0] not in offsets)
                    self._held -= len(state.handed) - len(kept_entries)
                    self._held_bytes -= sum(e[2] for e in state.handed) - sum(
                        e[2] for e in kept_entries
                    )
                    state.handed = kept_entries
            self._acked.notify_all()
        done.set()

    def _consume_or_fail(self) -> None:
        """The consume thread: whatever ends it unexpectedly reaches the
        loop as a failure (the receiver reconnects), never a silent stall."""
        try:
            self._consume()
        except Exception as exc:
            log.exception("the Kafka consume thread failed")
            self._fail(BrokerUnavailable(f"Kafka consumer of {', '.join(self.topics)}: {exc!r}"))

    def _consume(self) -> None:
        consumer = self._consumer
        assert consumer is not None
        self._unhanded = deque()
        paused = False
        over_since: float | None = None  # since when over the bounds, not paused
        wait = CONSUME_IDLE
        while not self._stop.is_set():
            try:
                if self._commit_due.is_set():
                    self._commit_due.clear()
                    self._commit(consumer, asynchronous=True)
                if self._down_since is not None:
                    self._probe(consumer)
                if not self._over(1):
                    over_since = None
                    if paused and not self._over(2):
                        consumer.resume(consumer.assignment())
                        paused = False
                elif not paused:
                    # Over the limit: wait for acknowledgements without
                    # consuming (librdkafka's prefetched records stay). Only
                    # a longer wait pauses, so that rebalances are served:
                    # pause() throws the prefetched records away and resume()
                    # fetches them again.
                    now = time.monotonic()
                    over_since = over_since or now
                    if now - over_since < PAUSE_AFTER:
                        with self._lock:
                            if self._over(1) and not self._stop.is_set():
                                self._acked.wait(0.05)
                        continue
                    consumer.pause(consumer.assignment())
                    paused = True
                # Paused, consume() serves rebalances (it brings no record).
                if paused or not self._unhanded:
                    messages = consumer.consume(self._count(), wait)
                    wait = CONSUME_BUSY if messages else CONSUME_IDLE
                    self._unhanded.extend(messages)
            except (KafkaException, RuntimeError) as exc:
                self._fail(BrokerUnavailable(f"Kafka consumer of {', '.join(self.topics)}: {exc}"))
                return
            got = self._take()
            if got:
                self._loop_call(self._deliver, got)

    def _count(self) -> int:
        """How many records the next consume() asks for: CONSUME_COUNT, or
        as many as the byte bound has room for at the mean size of the last
        records handed out (at least one), so that large records stay in
        librdkafka's buffers, not copied out beside them, until their turn."""
        limit = self.max_held_bytes
        if limit is None or self._record_bytes <= 0:
            return CONSUME_COUNT
        room = (limit - self._held_bytes) / self._record_bytes
        return max(1, min(CONSUME_COUNT, int(room)))

    def _over(self, fraction: int) -> bool:
        """Whether the records held are at `1/fraction` of either bound
        (count, bytes) or past it: 1 to pause, 2 to resume."""
        if self._held >= self.max_held // fraction:
            return True
        limit = self.max_held_bytes
        return limit is not None and self._held_bytes >= limit // fraction

    def _take(self) -> list[Incoming]:
        """The records consumed and not handed out yet, as the inbox sees
        them, each one handed out while what is held is below the bounds
        (so it stays within them plus one record, however large), and
        noted as handed out (in the consume thread: the hot path, one pass,
        each partition's state looked up once a call)."""
        got: list[Incoming] = []
        states: dict[tuple[str, int], _Partition | None] = {}
        unhanded = self._unhanded
        taken = 0
        with self._lock:
            while unhanded and not self._over(1):
                message = unhanded.popleft()
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        continue
                    if error.code() in _MISSING_TOPIC or error.fatal():
                        self._fail(
                            BrokerUnavailable(
                                f"Kafka consumer of {message.topic()!r}: {_describe(error)}"
                            )
                        )
                    else:
                        log.warning("Kafka consumer: %s", _describe(error))
                    continue
                place = (message.topic() or "", message.partition() or 0)
                if place in states:
                    state = states[place]
                else:
                    state = states[place] = self._partitions.get(place)
                if state is None:  # revoked meanwhile
                    continue
                offset = message.offset() or 0
                token = Token(place[0], place[1], offset, state.epoch)
                try:
                    got.append(to_incoming(message, token))
                except Exception as exc:  # one record never stops the consumer
                    got.append(unreadable(message, token, _unreadable_why(exc)))
                size = len(got[-1].body)
                state.handed.append([offset, 0, size])
                self._held_bytes += size
                self._held += 1
                taken += size
        if got:
            self._record_bytes = taken / len(got)
        return got

    def _loop_call(self, fn: Callable[..., None], *args: Any) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, got: list[Incoming]) -> None:
        self._buffer.extend(got)
        self._arrived.set()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            log.warning("%s", exc)
        self._loop_call(self._arrived.set)

    # -- the event loop's side ------------------------------------------------

    def _failed(self) -> bool:
        return self._failure is not None or self._unreachable is not None

    async def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        while True:
            await self.connect()
            batch = await take_batch(self._buffer, self._arrived, self._failed, max_size, max_wait)
            if batch:
                yield batch  # any failure shows on the next round
                continue
            failure = self._failure
            if failure is None and self._unreachable is not None:
                # The consumer is kept (librdkafka reconnects by itself, the
                # group keeps this member): the receiver waits with backoff
                # and asks again, and batches flow once the cluster answers.
                raise BrokerUnavailable(
                    f"Kafka at {_where(self.broker)} is unreachable: {self._unreachable}"
                )
            await self.close()
            if isinstance(failure, BrokerUnavailable):
                raise failure
            raise BrokerUnavailable(f"Kafka consumer stopped: {failure!r}") from failure

    async def ack(self, batch: Sequence[Incoming]) -> None:
        """The batch's rows are committed: each partition's offset moves to
        just after its last record whose row, and every earlier one's, is."""
        if not batch:
            return
        with self._lock:
            for message in batch:
                token = message.ack_token
                assert isinstance(token, Token)
                state = self._partitions.get((token.topic, token.partition))
                if state is None or state.epoch != token.epoch:
                    continue  # revoked since: its new owner reads it again (a duplicate)
                for entry in state.handed:
                    if entry[0] == token.offset:
                        entry[1] = 1
                        break
                while state.handed and state.handed[0][1]:
                    offset, _, size = state.handed.popleft()
                    state.committable = offset + 1
                    self._held -= 1
                    self._held_bytes -= size
            self._acked.notify_all()
        if self._consumer is None:
            raise BrokerUnavailable("Kafka consumer closed before the batch was committed")
        self._commit_due.set()  # by the consume thread, at once (close() commits the rest)

    def _commit(
        self, consumer: RdConsumer, *, asynchronous: bool, only: set[tuple[str, int]] | None = None
    ) -> None:
        with self._lock:
            offsets = [
                TopicPartition(topic, partition, state.committable)
                for (topic, partition), state in self._partitions.items()
                if state.committable is not None
                and state.committable != state.committed
                and (only is None or (topic, partition) in only)
            ]
            for tp in offsets:
                self._partitions[(tp.topic, tp.partition)].committed = tp.offset
        if offsets and asynchronous:
            consumer.commit(offsets=offsets, asynchronous=True)
        elif offsets:
            consumer.commit(offsets=offsets, asynchronous=False)

    # -- the lag metric ---------------------------------------------------------

    async def readings(self) -> list[Reading]:
        if self._thread is not None and self._thread.is_alive():
            async with self._lag_lock:
                if time.monotonic() - self._lag_at >= LAG_MAX_AGE:
                    with self._lock:
                        assigned = list(self._partitions)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.to_thread(self._measure, assigned), 30)
        return [
            Reading(
                "relay_inbox_kafka_lag",
                "Records between the consumer group's committed offset and the partition's end",
                ("topic", "partition"),
                tuple(
                    ((topic, str(partition)), float(n))
                    for (topic, partition), n in sorted(self.lag.items())
                ),
            ),
            Reading(
                "relay_inbox_kafka_rebalances",
                "Rebalances of the consumer group this process took part in "
                "(each assignment of partitions to it, its first join included)",
                (),
                (((), float(self.rebalances)),),
                kind="counter",
            ),
        ]

    def _measure(self, assigned: list[tuple[str, int]]) -> None:
        """relay_inbox_kafka_lag: by (topic, partition) of `assigned` (the
        partitions assigned here), the records between the group's committed
        offset and the partition's end, asked of the cluster through the lag
        client (a consumer of the group that never subscribes, made on first
        use), in a worker thread. On a failure the last measure stands."""
        found: dict[tuple[str, int], int] = {}
        try:
            if self._lag_client is None:
                self._lag_client = RdConsumer(
                    {**self.config, "error_cb": self._lag_error, "logger": LIBRDKAFKA_LOG}
                )
            client = self._lag_client
            partitions = [TopicPartition(topic, partition) for topic, partition in assigned]
            committed = client.committed(partitions, timeout=CONNECT_TIMEOUT) if partitions else []
            for tp in committed:
                low, high = client.get_watermark_offsets(
                    TopicPartition(tp.topic, tp.partition), timeout=CONNECT_TIMEOUT, cached=False
                )
                start = tp.offset if tp.offset >= 0 else low
                found[(tp.topic, tp.partition)] = max(0, high - start)
        except (KafkaException, RuntimeError) as exc:
            log.debug("cannot measure the Kafka lag: %s", exc)
            fatal = isinstance(exc, KafkaException) and exc.args[0].fatal()
            if fatal or self._lag_unusable:
                self._drop_lag_client(str(exc))
            return
        self.lag, self._lag_at = found, time.monotonic()

    def _lag_error(self, error: KafkaError) -> None:
        if error.fatal():
            self._lag_unusable = True

    def _drop_lag_client(self, why: str) -> None:
        """The lag client hit a fatal error: closed, and a new one made on
        the next measure."""
        client, self._lag_client = self._lag_client, None
        self._lag_unusable = False
        log.warning("the Kafka lag client can be used no more (%s): a new one replaces it", why)
        if client is not None:
            with contextlib.suppress(KafkaException, RuntimeError):
                client.close()
