"""Outbox → Kafka: relay's rows as records of an idempotent producer.

confluent-kafka's Producer is a synchronous handle on librdkafka's own
threads. The publisher produces from the event loop (a produce() only
queues the record) and polls for the delivery reports there too (a task
while idle, every millisecond while a batch waits), which resolve one
future per publish() call, as faststream's polling task does. A producer
that hit a fatal error is replaced (docs/kafka.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from relay.brokers import (
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.brokers.kafka.common import (
    _DENIED,
    _MISSING_TOPIC,
    _RELEASE,
    _TOO_LARGE,
    _TOPIC_NAME,
    _UNUSABLE,
    CONNECT_TIMEOUT,
    DEFAULT_MESSAGE_MAX_BYTES,
    LIBRDKAFKA_LOG,
    PROBE_TIMEOUT,
    PRODUCER,
    PRODUCER_DEFAULTS,
    _config_error,
    _describe,
    _where,
    client_config,
    log,
)
from relay.config import BrokerURL
from relay.errors import BadMessage, BrokerUnavailable
from relay.rows import Failure, OutboxRow

# How often the producer's reports are polled for: while a batch waits, idle.
BUSY_POLL = 0.001
IDLE_POLL = 0.1


@dataclass(slots=True)
class Record:
    """One row as a Kafka record (the contract's wire format)."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[tuple[str, str | bytes | None]]
    timestamp: int  # milliseconds

    @property
    def size(self) -> int:
        """Key, value and headers, as librdkafka counts them against message.max.bytes."""
        return (
            len(self.value)
            + len(self.key or b"")
            + sum(len(n.encode()) + len(v or b"") for n, v in self.headers)
        )


def build_record(row: OutboxRow) -> Record:
    """The record for a row, or BadMessage saying why none can be."""
    check_topic(row)
    if not _TOPIC_NAME.match(row.topic) or row.topic in (".", ".."):
        raise BadMessage(
            f"topic {row.topic[:300]!r} is not a valid Kafka topic name "
            "(1-249 letters, digits, . _ and -)"
        )
    headers: list[tuple[str, str | bytes | None]] = [("id", row.id.encode())]
    if row.type:
        headers.append(("type", row.type.encode()))
    headers.append(("content-type", b"application/json"))
    attributes = [
        (name, value.encode() if type(value) is str else str(value).encode())
        for name, value in row.attributes
    ]
    given = row_headers(row)
    if given:
        # relay's own headers win over the row's of the same name: a second
        # `id` would be the one Java's lastHeader() and relay's inbox read.
        own = {name for name, _ in headers} | {name for name, _ in attributes}
        headers += [(name, value.encode()) for name, value in given.items() if name not in own]
    headers += attributes
    return Record(
        topic=row.topic,
        key=row.key.encode() if row.key is not None else None,
        value=row_body(row),
        headers=headers,
        timestamp=int(row.created_at.timestamp() * 1000),
    )


class _Batch:
    """The delivery reports of one publish() call, resolved on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, size: int) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()
        self.reports: list[KafkaError | bool | None] = [False] * size  # False: none yet
        self.lock = threading.Lock()
        self.waiting = 0
        self.sealed = False

    def callback(self, index: int) -> Callable[[KafkaError | None, Message], None]:
        with self.lock:
            self.waiting += 1

        def delivered(error: KafkaError | None, _: Message) -> None:
            self.reports[index] = error
            with self.lock:
                self.waiting -= 1
                done = self.sealed and self.waiting == 0
            if done:
                with contextlib.suppress(RuntimeError):  # the loop has closed
                    self.loop.call_soon_threadsafe(self._finish)

        return delivered

    def seal(self) -> None:
        """Every record is produced: the future resolves with the last report."""
        with self.lock:
            self.sealed = True
            done = self.waiting == 0
        if done:
            self._finish()

    def _finish(self) -> None:
        if not self.future.done():
            self.future.set_result(None)


class KafkaPublisher:
    """Produces outbox rows to the Kafka topics named by their topic."""

    def __init__(self, broker: BrokerURL) -> None:
        self.broker = broker
        self.config = client_config(broker, PRODUCER, PRODUCER_DEFAULTS)
        self.limit = int(self.config.get("message.max.bytes", DEFAULT_MESSAGE_MAX_BYTES))
        self._producer: Producer | None = None
        self._poller: asyncio.Future[None] | None = None
        self._down: str | None = "not connected yet"  # why the cluster is unreachable
        self._topics: set[str] = set()  # known to exist
        self._last_error: str | None = None  # librdkafka's last error report
        # The producer's number (one more for each made) and, once it hit a
        # fatal error, why: it can produce no more, and the next connect()
        # replaces it (_renew), one worker doing so for all.
        self._generation = 0
        self._fatal: str | None = None
        self._renewing = asyncio.Lock()

    @property
    def connected(self) -> bool:
        return self._producer is not None and self._down is None

    @property
    def reason(self) -> str | None:
        """Why the cluster is unreachable now, or None."""
        return self._down

    blocked: str | None = None  # Kafka throttles a producer; it never blocks one

    async def wait_unblocked(self) -> None:
        return

    def _on_error(self, generation: int) -> Callable[[KafkaError], None]:
        """librdkafka's error_cb for the `generation`-th producer (served in
        the event loop's polls): a replaced producer's late errors are not
        its successor's."""

        def error_cb(error: KafkaError) -> None:
            if generation == self._generation:
                self._error(error)

        return error_cb

    def _error(self, error: KafkaError) -> None:
        self._last_error = _describe(error)
        if error.fatal():
            self._unusable(_describe(error))
        elif error.code() == KafkaError._ALL_BROKERS_DOWN:
            if self._down is None:
                log.warning("Kafka at %s is unreachable: %s", _where(self.broker), _describe(error))
            self._down = _describe(error)
        else:
            log.debug("Kafka producer: %s", _describe(error))

    def _unusable(self, why: str) -> None:
        """The producer hit a fatal error (librdkafka: it can never produce
        again): said once, with the cluster's reason; replaced by connect()."""
        if self._fatal is None:
            self._fatal = why
            log.warning(
                "the Kafka producer for %s can produce no more (%s): its records in flight "
                "are released (sent again, no attempt counted) and a new producer replaces it",
                _where(self.broker),
                why,
            )

    def _poll(self, producer: Producer) -> None:
        """Serve the delivery reports and errors that have arrived, on the
        event loop's thread (no thread of its own: its callbacks fought the
        loop for the interpreter lock)."""
        try:
            producer.poll(0)
        except Exception:  # a callback's error: the reports go on
            log.exception("serving Kafka delivery reports")

    async def _serve(self, producer: Producer) -> None:
        """While idle, errors are served too (a cluster going away is seen)."""
        while True:
            self._poll(producer)
            await asyncio.sleep(IDLE_POLL)

    def _make(self) -> None:
        self._generation += 1
        self._fatal = None
        try:
            self._producer = Producer(
                {
                    **self.config,
                    "error_cb": self._on_error(self._generation),
                    "logger": LIBRDKAFKA_LOG,
                }
            )
        except KafkaException as exc:
            raise _config_error(exc, self.broker) from None
        self._poller = asyncio.ensure_future(self._serve(self._producer))

    async def connect(self) -> None:
        if self._producer is None or self._fatal is not None:
            async with self._renewing:  # one worker makes it, for all
                if self._producer is not None and self._fatal is not None:
                    # It can produce no more: what it still holds is purged
                    # (released by its reports), a new one made (a new
                    # producer id, whose sequences start again).
                    await self._discard(everything=True)
                    log.info("a new Kafka producer replaces the one that failed")
                if self._producer is None:
                    self._make()
        if self._down is None:
            return
        assert self._producer is not None
        try:
            await asyncio.to_thread(self._producer.list_topics, None, PROBE_TIMEOUT)
        except KafkaException as exc:
            # librdkafka's last error says more (`Connect to … failed: …`).
            self._down = self._last_error or _describe(exc.args[0])
            raise BrokerUnavailable(f"Kafka at {_where(self.broker)}: {self._down}") from None
        if self._down is None:  # another worker's probe said so meanwhile
            return
        if self._down != "not connected yet":
            log.info("Kafka at %s is reachable again", _where(self.broker))
        else:
            log.info("connected to Kafka at %s", _where(self.broker))
        self._down = None

    async def close(self) -> None:
        self._down = "closed"
        await self._discard(everything=False)

    async def _discard(self, *, everything: bool) -> None:
        """Let the producer go: what is queued is released (its rows stay
        pending: nothing waits), what is in flight is waited for a second
        (or, `everything`, purged too: a failed producer delivers nothing)."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        with contextlib.suppress(KafkaException):
            producer.purge(in_queue=True, in_flight=everything, blocking=False)
        deadline = time.monotonic() + 1.0
        while len(producer) and time.monotonic() < deadline:
            self._poll(producer)
            await asyncio.sleep(0.01)
        self._poll(producer)
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)

    async def _check_topics(self, topics: set[str]) -> dict[str, PublishResult]:
        """The topics not known yet looked up in the cluster's metadata (no
        client of relay's asks for a topic to be made): what a row of a
        missing or forbidden one gets instead of a record."""
        unknown = topics - self._topics
        found: dict[str, PublishResult] = {}
        producer = self._producer
        assert producer is not None
        for topic in unknown:
            try:
                metadata = await asyncio.to_thread(producer.list_topics, topic, CONNECT_TIMEOUT)
            except KafkaException as exc:
                self._down = _describe(exc.args[0])
                raise BrokerUnavailable(f"Kafka at {_where(self.broker)}: {self._down}") from None
            described = metadata.topics.get(topic)
            error = described.error if described is not None else None
            if described is None or (error is not None and error.code() in _MISSING_TOPIC):
                why = _describe(error) if error is not None else "not in the cluster's metadata"
                found[topic] = Failure(
                    f"Kafka topic {topic!r} does not exist ({why}; relay never creates topics)"
                )
            elif error is not None and error.code() in _DENIED:
                found[topic] = Failure(
                    f"Kafka refused topic {topic!r}: {_describe(error)} (check the ACLs)"
                )
            elif error is not None:
                found[topic] = Failure(f"Kafka topic {topic!r}: {_describe(error)}")
            else:
                self._topics.add(topic)
        return found

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        producer, generation = self._producer, self._generation
        assert producer is not None
        results: list[PublishResult] = [None] * len(rows)
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        records: dict[int, Record] = {}
        for index, row in enumerate(rows):
            try:
                records[index] = build_record(row)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's
                results[index] = encode_failure(exc)
        by_topic = await self._check_topics({record.topic for record in records.values()})
        batch = _Batch(asyncio.get_running_loop(), len(rows))
        sent: list[int] = []
        for index, row in enumerate(rows):
            record = records.get(index)
            if row.key is not None and row.key in held:
                results[index] = Outcome.RELEASE
                continue
            if record is None:  # not encodable: dead, and its key's later rows wait
                if row.key is not None:
                    held.add(row.key)
                continue
            refused = by_topic.get(record.topic)
            if refused is None and record.size > self.limit:
                refused = self._too_large(record.size, self.limit)
            if refused is None:
                refused = await self._produce(producer, generation, record, batch.callback(index))
                if refused is None:
                    sent.append(index)
            if refused is not None:
                results[index] = refused
                if row.key is not None:
                    held.add(row.key)
        batch.seal()
        await self._delivered(producer, batch)
        for index in sent:
            results[index] = self._outcome(batch.reports[index], records[index], generation)
            report = batch.reports[index]
            if isinstance(report, KafkaError) and report.code() in _MISSING_TOPIC:
                self._topics.discard(rows[index].topic)  # deleted since: look it up again
        return self._in_key_order(rows, results)

    async def _produce(
        self, producer: Producer, generation: int, record: Record, callback: Callable[..., None]
    ) -> PublishResult:
        while True:
            try:
                producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key,
                    headers=record.headers,
                    timestamp=record.timestamp,
                    on_delivery=callback,
                )
                return None
            except BufferError:  # librdkafka's queue is full: let it drain
                await asyncio.sleep(0.005)
            except KafkaException as exc:
                callback(exc.args[0], None)  # balance the batch's count
                return self._outcome(exc.args[0], record, generation)

    def _outcome(
        self, error: KafkaError | bool | None, record: Record, generation: int
    ) -> PublishResult:
        """A record's result from the `generation`-th producer. Once that
        producer hit a fatal error (or was replaced), whatever it did not
        deliver is released: the producer's fault, not the row's."""
        if error is None:
            return None
        current = generation == self._generation
        if isinstance(error, KafkaError) and error.code() in _UNUSABLE and current:
            self._unusable(_describe(error))
        if not current or self._fatal is not None:
            return Outcome.RELEASE
        return self._result(error, record)

    async def _delivered(self, producer: Producer, batch: _Batch) -> None:
        """Wait for every delivery report, polling for them. If the cluster
        becomes unreachable meanwhile, the records still queued are purged
        (never sent: released)."""
        checked = time.monotonic()
        while not batch.future.done():
            self._poll(producer)
            if batch.future.done():
                break
            await asyncio.sleep(BUSY_POLL)
            now = time.monotonic()
            if now - checked >= 0.5:
                checked = now
                if self._producer is producer and (self._down or self._fatal) is not None:
                    with contextlib.suppress(KafkaException):
                        producer.purge(
                            in_queue=True, in_flight=self._fatal is not None, blocking=False
                        )
        await batch.future

    def _result(
        self, error: KafkaError | bool | None, record: Record | None = None
    ) -> PublishResult:
        if error is None:
            return None
        if error is False or error is True:
            return Outcome.RELEASE
        code = error.code()
        if code in _TOO_LARGE:  # the cluster's limit, below the client's: not told
            size = record.size if record is not None else None
            told = f"{size} bytes (value, key and headers)" if size is not None else "a record"
            return Failure(
                f"record is {told}, refused by the cluster as too large ({_describe(error)}): "
                f"over the topic's max.message.bytes (or the broker's message.max.bytes), "
                f"which is below relay's {self.limit}-byte message.max.bytes",
                permanent=True,
            )
        if code in _RELEASE:
            if code == KafkaError._MSG_TIMED_OUT:
                log.warning("a Kafka delivery timed out (%s): sent again later", error.str())
            return Outcome.RELEASE
        if code in _MISSING_TOPIC:
            return Failure(
                f"Kafka topic does not exist (relay never creates topics): {error.str()}"
            )
        if code in _DENIED:
            return Failure(f"Kafka refused the record: {_describe(error)} (check the ACLs)")
        return Failure(f"Kafka refused the record: {_describe(error)}")

    @staticmethod
    def _too_large(size: int, limit: int) -> Failure:
        return Failure(
            f"record is {size} bytes (value, key and headers), over the {limit}-byte limit "
            "(message.max.bytes)",
            permanent=True,
        )

    @staticmethod
    def _in_key_order(
        rows: Sequence[OutboxRow], results: list[PublishResult]
    ) -> list[PublishResult]:
        """After a key's row failed or was released, its later rows that were
        not delivered wait too (released); one delivered after it is logged."""
        failed: set[str] = set()
        for row, result in zip(rows, results, strict=True):
            if row.key is None:
                continue
            if row.key in failed and result is None:
                log.warning(
                    "a row of key %r reached Kafka after an earlier row of its key failed",
                    row.key,
                )
            if result is not None:
                failed.add(row.key)
        return results
