"""Amazon SQS through boto3: the outbox publisher and the inbox consumer.

boto3 is synchronous, so every call runs in a thread: short calls
(SendMessageBatch, DeleteMessageBatch, ...) in a thread pool each adapter
owns, long polls in daemon threads of their own, because a thread cannot be
cancelled and a 20-second poll must not hold up shutdown. One boto3 client
per adapter serves every thread (clients are thread-safe; sessions are not).

Region, endpoint and credentials are boto3's own resolution (AWS_DEFAULT_REGION,
AWS_ENDPOINT_URL_SQS, the credentials chain), overridden by the broker URL's
`region` and `endpoint_url`. relay never creates queues: that is the
infrastructure's job, and a queue relay would create has no dead-letter
queue, encryption or retention chosen by anyone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
import zlib
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bce
import orjson
from botocore.config import Config

from relay.brokers import (
    ConsumerOptions,
    Incoming,
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
    take_batch,
)
from relay.config import BrokerURL, redact_url
from relay.errors import BadMessage, BrokerUnavailable, ConfigError
from relay.rows import Failure, OutboxRow

log = logging.getLogger(__name__)

T = TypeVar("T")

# SendMessageBatch and friends take at most 10 entries.
BATCH_ENTRIES = 10
# Total size of one SendMessageBatch call. 256 KiB is the classic limit and
# still valid everywhere; a single bigger message (queues allowing up to
# 1 MiB) goes alone in its call.
BATCH_BYTES = 256 * 1024
# The per-message limit when the queue's MaximumMessageSize cannot be read.
DEFAULT_MAX_MESSAGE = 256 * 1024
# SendMessageBatch calls in flight per publish(): one slow call does not stall the rest.
LANES = 8
# Long-polling receivers per consumer, and how long each poll waits.
RECEIVERS = 4
WAIT_SECONDS = 20
# Messages received and not yet deleted, at most (the receivers pause beyond it).
MAX_HELD = 100
CONNECT_TIMEOUT = 5
RELEASE_TIMEOUT = 3.0

# The characters SQS accepts in bodies and attribute values (the XML 1.0 set).
_INVALID_CHARS = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId: 1-128 ASCII letters, digits and punctuation.
_GROUP_ID = re.compile(r"^[!-~]{1,128}$")
# Queue names: 1-80 letters, digits, - and _, the .fifo suffix included.
_QUEUE_NAME = re.compile(r"^(?=.{1,80}$)[A-Za-z0-9_-]+(\.fifo)?$")

_TRANSPORT_ERRORS = (bce.ConnectionError, bce.HTTPClientError)
_CREDENTIAL_ERRORS = (
    bce.NoCredentialsError,
    bce.PartialCredentialsError,
    bce.CredentialRetrievalError,
)
_MISSING_QUEUE = {"QueueDoesNotExist", "NonExistentQueue"}
_AUTH_CODES = {
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
    "UnrecognizedClientException",
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidAccessKeyId",
    "IncompleteSignature",
    "MissingAuthenticationToken",
    "InvalidSecurity",
    "AuthFailure",
}
_ACCESS_DENIED = {"AccessDenied", "AccessDeniedException"}
# Call-level errors caused by the content of one of the entries.
_BAD_CONTENT = {
    "InvalidMessageContents",
    "InvalidParameterValue",
    "BatchRequestTooLong",
    "MessageTooLong",
    "InvalidAttributeValue",
    "InvalidAttributeName",
}


def _code(exc: bce.ClientError) -> str:
    """The SQS error code without its `AWS.SimpleQueueService.` prefix."""
    error = exc.response.get("Error", {})
    code = error.get("QueryErrorCode") or error.get("Code") or ""
    return str(code).removeprefix("AWS.SimpleQueueService.")


def _message(exc: bce.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message") or exc)


def _status(exc: bce.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _throttled(code: str) -> bool:
    return "Throttl" in code or code in ("RequestThrottled", "SlowDown")


def _is_unavailable(exc: BaseException) -> bool:
    """The endpoint, the credentials or the service, not the message, is the problem."""
    if isinstance(exc, _TRANSPORT_ERRORS + _CREDENTIAL_ERRORS):
        return True
    if isinstance(exc, bce.ClientError):
        return _code(exc) in _AUTH_CODES or _status(exc) >= 500
    return False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        return f"{_code(exc)}: {_message(exc)}"
    if isinstance(exc, _CREDENTIAL_ERRORS):
        return f"no usable AWS credentials ({exc})"
    return f"{type(exc).__name__}: {exc}"


def _make_client(broker: BrokerURL, pool: int) -> Any:
    config = Config(
        retries={"mode": "standard", "max_attempts": 3},
        max_pool_connections=pool,
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=WAIT_SECONDS + 10,
        user_agent_extra="relay",
    )
    try:
        return boto3.session.Session().client(
            "sqs",
            region_name=broker.sqs_region,
            endpoint_url=broker.sqs_endpoint_url,
            config=config,
        )
    except bce.NoRegionError:
        raise ConfigError(
            "no AWS region for SQS: set AWS_DEFAULT_REGION or use sqs://?region=..."
        ) from None
    except ValueError as exc:  # an endpoint botocore refuses (or an empty region)
        raise ConfigError(f"invalid SQS endpoint or region: {exc}") from None


def _where(client: Any) -> str:
    return f"{redact_url(client.meta.endpoint_url)} ({client.meta.region_name})"


class _Adapter:
    """The client, the thread pool and the health flag both adapters share."""

    def __init__(self, broker: BrokerURL, pool: int) -> None:
        self.broker = broker
        self._pool = pool
        self._client: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._healthy = False

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._pool, thread_name_prefix="relay-sqs")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _ensure_client(self) -> Any:
        if self._client is None:
            # Loading the service model takes a moment: not on the event loop.
            self._client = await self._call(_make_client, self.broker, self._pool + 4)
        return self._client

    def _unavailable(self, exc: BaseException, what: str = "SQS") -> BrokerUnavailable:
        where = _where(self._client) if self._client is not None else "SQS"
        return BrokerUnavailable(f"{what} at {where}: {_describe(exc)}")

    def _shutdown_executor(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------
# Outbox → SQS
# --------------------------------------------------------------------------


@dataclass(slots=True)
class _Queue:
    url: str
    max_size: int


@dataclass(slots=True)
class _Entry:
    index: int  # position in publish()'s rows
    topic: str
    order_key: str | None  # what per-key order is kept for: the group id, else the key
    size: int  # body and attributes, as SQS counts them
    params: dict[str, Any] = field(default_factory=dict)


def _attribute(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def build_entry(row: OutboxRow, index: int) -> _Entry:
    """The SendMessageBatch entry for a row (the contract's wire format), or BadMessage."""
    check_topic(row)
    if not _QUEUE_NAME.match(row.topic):
        raise BadMessage(
            f"topic {row.topic!r} is not a valid SQS queue name "
            "(1-80 letters, digits, - and _, ending in .fifo for a FIFO queue)"
        )
    headers = row_headers(row)
    body = row_body(row).decode("utf-8")
    attributes = {"message_id": _attribute(row.id)}
    if row.type:
        attributes["type"] = _attribute(row.type)
    if row.key:
        attributes["key"] = _attribute(row.key)
    if headers:
        attributes["headers"] = _attribute(orjson.dumps(headers).decode())
    for name, value in row.attributes:  # added above the broker (relay.rows)
        attributes[name] = (
            {"DataType": "Number", "StringValue": str(value)}
            if isinstance(value, int)
            else _attribute(value)
        )
    for name, text in [("body", body)] + [
        (f"attribute {n!r}", a["StringValue"]) for n, a in attributes.items()
    ]:
        bad = _INVALID_CHARS.search(text)
        if bad:
            raise BadMessage(
                f"{name} contains U+{ord(bad.group()):04X}, a character SQS does not accept"
            )
    size = len(body.encode()) + sum(
        len(n.encode()) + len(a["DataType"]) + len(a["StringValue"].encode())
        for n, a in attributes.items()
    )
    params: dict[str, Any] = {
        "Id": str(index),
        "MessageBody": body,
        "MessageAttributes": attributes,
    }
    order_key = row.key or None
    if row.topic.endswith(".fifo"):
        group = row.key or row.topic
        if not _GROUP_ID.match(group):
            raise BadMessage(
                f"key {group!r} cannot be an SQS MessageGroupId "
                "(1-128 ASCII letters, digits and punctuation)"
            )
        params["MessageGroupId"] = group
        params["MessageDeduplicationId"] = row.id
        order_key = group
    return _Entry(index, row.topic, order_key, size, params)


def lanes(entries: Sequence[_Entry], count: int = LANES) -> list[list[_Entry]]:
    """Entries of one queue split into lanes that may run in parallel.

    Every entry of an order key lands in the same lane, in seq order, and a
    lane sends its calls one after another: so a key's messages reach SQS in
    seq order (for a FIFO queue: one MessageGroupId is never in two calls in
    flight at once), while different keys use the parallel lanes. Rows
    without a key on a standard queue have no order to keep and are spread.
    """
    needed = max(1, math.ceil(len(entries) / BATCH_ENTRIES))
    count = max(1, min(count, needed))
    split: list[list[_Entry]] = [[] for _ in range(count)]
    for n, entry in enumerate(entries):
        if entry.order_key is None:
            split[n % count].append(entry)
        else:
            split[zlib.crc32(entry.order_key.encode()) % count].append(entry)
    return [lane for lane in split if lane]


def chunks(entries: Sequence[_Entry], max_bytes: int = BATCH_BYTES) -> list[list[_Entry]]:
    """Consecutive calls of at most 10 entries and `max_bytes` (a bigger entry goes alone)."""
    calls: list[list[_Entry]] = []
    current: list[_Entry] = []
    size = 0
    for entry in entries:
        if current and (len(current) >= BATCH_ENTRIES or size + entry.size > max_bytes):
            calls.append(current)
            current, size = [], 0
        current.append(entry)
        size += entry.size
    if current:
        calls.append(current)
    return calls


def call_failure(exc: bce.ClientError, topic: str) -> Failure:
    """What a failed call means for each message in it (not for unavailability)."""
    code = _code(exc)
    if code in _MISSING_QUEUE:
        return Failure(f"SQS queue {topic!r} does not exist")
    if _throttled(code):
        return Failure(f"throttled by SQS: {code}: {_message(exc)}")
    if code in _ACCESS_DENIED:
        return Failure(f"SQS denied access to queue {topic!r}: {_message(exc)}")
    return Failure(
        f"SQS refused the message: {code}: {_message(exc)}", permanent=code in _BAD_CONTENT
    )


def entry_failure(failed: dict[str, Any]) -> Failure:
    """One entry of SendMessageBatch's `Failed` list."""
    code = str(failed.get("Code", "")).removeprefix("AWS.SimpleQueueService.")
    message = failed.get("Message") or ""
    if _throttled(code):
        return Failure(f"throttled by SQS: {code}: {message}")
    return Failure(
        f"SQS rejected the message: {code}: {message}",
        permanent=bool(failed.get("SenderFault")),
    )


class SqsPublisher(_Adapter):
    """Publishes outbox rows to SQS queues named by their topic, with SendMessageBatch."""

    def __init__(self, broker: BrokerURL, *, workers: int) -> None:
        # The outbox workers share the publisher, each with LANES calls in flight.
        super().__init__(broker, pool=workers * LANES)
        self._queues: dict[str, _Queue] = {}

    @property
    def connected(self) -> bool:
        return self._client is not None and self._healthy

    blocked: str | None = None  # SQS never blocks a client (it throttles calls)

    async def wait_unblocked(self) -> None:
        return

    async def connect(self) -> None:
        if self.connected:
            return
        client = await self._ensure_client()
        try:
            await self._call(client.list_queues, MaxResults=1)
        except bce.ClientError as exc:
            # Denied ListQueues still proves the endpoint answers and the
            # credentials are valid; a least-privilege publisher may lack it.
            if _code(exc) not in _ACCESS_DENIED:
                raise self._unavailable(exc) from exc
        except (*_TRANSPORT_ERRORS, *_CREDENTIAL_ERRORS) as exc:
            raise self._unavailable(exc) from exc
        self._healthy = True
        log.info("connected to SQS at %s", _where(client))

    async def close(self) -> None:
        self._healthy = False
        self._shutdown_executor()

    def _lookup(self, topic: str) -> _Queue:
        client = self._client
        url = client.get_queue_url(QueueName=topic)["QueueUrl"]
        try:
            attrs = client.get_queue_attributes(
                QueueUrl=url, AttributeNames=["MaximumMessageSize"]
            )["Attributes"]
            max_size = int(attrs.get("MaximumMessageSize", DEFAULT_MAX_MESSAGE))
        except bce.ClientError as exc:
            if _code(exc) not in _ACCESS_DENIED:
                raise
            log.warning(
                "cannot read MaximumMessageSize of SQS queue %r (%s); assuming %d bytes",
                topic,
                _code(exc),
                DEFAULT_MAX_MESSAGE,
            )
            max_size = DEFAULT_MAX_MESSAGE
        return _Queue(url, max_size)

    async def _queue(self, topic: str) -> _Queue | Failure | Outcome:
        """The queue's URL and size limit, looked up once; or what to report instead."""
        queue = self._queues.get(topic)
        if queue is not None:
            return queue
        try:
            queue = await self._call(self._lookup, topic)
        except Exception as exc:
            if _is_unavailable(exc):
                self._lost(exc)
                return Outcome.RELEASE
            if isinstance(exc, bce.ClientError):
                return call_failure(exc, topic)
            if isinstance(exc, bce.BotoCoreError):
                return Failure(f"looking up SQS queue {topic!r} failed: {_describe(exc)}")
            raise
        self._queues[topic] = queue
        return queue

    def _lost(self, exc: BaseException) -> None:
        if self._healthy:
            log.warning("%s", self._unavailable(exc))
        self._healthy = False

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        results: list[PublishResult] = [None] * len(rows)
        by_topic: dict[str, list[_Entry]] = {}
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        for index, row in enumerate(rows):
            if row.key is not None and row.key in held:
                results[index] = Outcome.RELEASE
                continue
            try:
                entry = build_entry(row, index)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's
                results[index] = encode_failure(exc)
                if row.key is not None:
                    held.add(row.key)
                continue
            by_topic.setdefault(row.topic, []).append(entry)

        topics = list(by_topic)
        queues = await asyncio.gather(*(self._queue(t) for t in topics))
        work = []
        for topic, queue in zip(topics, queues, strict=True):
            entries = by_topic[topic]
            if not isinstance(queue, _Queue):
                for entry in entries:
                    results[entry.index] = queue
                continue
            sendable = []
            for entry in entries:
                if entry.size > queue.max_size:
                    results[entry.index] = Failure(
                        f"message is {entry.size} bytes (body and attributes), over the "
                        f"{queue.max_size}-byte limit of SQS queue {topic!r}",
                        permanent=True,
                    )
                else:
                    sendable.append(entry)
            work += [self._send_lane(topic, queue, lane, results) for lane in lanes(sendable)]
        await asyncio.gather(*work)
        return results

    async def _send_lane(
        self, topic: str, queue: _Queue, lane: list[_Entry], results: list[PublishResult]
    ) -> None:
        # Once a message of a key failed, later ones of that key in this lane
        # are not sent: RELEASE leaves them pending without an attempt, and
        # the next claim decides (they wait while the failed row backs off).
        # Entries inside one SendMessageBatch call are already on their way.
        held: set[str] = set()
        gone = False  # the endpoint is unreachable: send nothing more
        for call in chunks(lane):
            ready = []
            for entry in call:
                if gone or (entry.order_key is not None and entry.order_key in held):
                    results[entry.index] = Outcome.RELEASE
                else:
                    ready.append(entry)
            if not ready:
                continue
            for entry, result in zip(ready, await self._send(topic, queue, ready), strict=True):
                results[entry.index] = result
                if result is Outcome.RELEASE:
                    gone = True
                if result is not None and entry.order_key is not None:
                    held.add(entry.order_key)

    async def _send(self, topic: str, queue: _Queue, call: list[_Entry]) -> list[PublishResult]:
        try:
            response = await self._call(
                self._client.send_message_batch,
                QueueUrl=queue.url,
                Entries=[e.params for e in call],
            )
        except Exception as exc:
            if _is_unavailable(exc):
                self._lost(exc)
                return [Outcome.RELEASE] * len(call)
            if isinstance(exc, bce.BotoCoreError):
                return [Failure(f"SendMessageBatch failed: {_describe(exc)}")] * len(call)
            if not isinstance(exc, bce.ClientError):
                raise
            if _code(exc) in _MISSING_QUEUE:
                self._queues.pop(topic, None)  # deleted since: look it up again next time
            if _code(exc) in _BAD_CONTENT and len(call) > 1:
                # One entry spoils the call: send them one by one to find it.
                singles: list[PublishResult] = []
                for entry in call:
                    singles += await self._send(topic, queue, [entry])
                return singles
            return [call_failure(exc, topic)] * len(call)
        self._healthy = True
        sent = {s["Id"] for s in response.get("Successful", [])}
        failed = {f["Id"]: entry_failure(f) for f in response.get("Failed", [])}
        return [
            None
            if e.params["Id"] in sent
            else failed.get(e.params["Id"], Failure("SQS did not report on this message"))
            for e in call
        ]


# --------------------------------------------------------------------------
# SQS → inbox
# --------------------------------------------------------------------------

_RELAY_ATTRIBUTES = ("message_id", "type", "key", "headers")


def _text_attribute(attributes: dict[str, Any], name: str) -> str | None:
    value = attributes.get(name, {}).get("StringValue")
    return value or None


def to_incoming(message: dict[str, Any], queue: str) -> Incoming:
    """A received SQS message as the inbox sees it (the contract's mapping)."""
    attributes = message.get("MessageAttributes") or {}
    headers: dict[str, Any] = {}
    # Attributes a producer set itself (not relay's own four) are headers too.
    for name, value in attributes.items():
        if name not in _RELAY_ATTRIBUTES and "StringValue" in value:
            headers[name] = value["StringValue"]
    raw = _text_attribute(attributes, "headers")
    if raw is not None:
        try:
            decoded = orjson.loads(raw)
        except orjson.JSONDecodeError:
            decoded = None
        headers.update(decoded if isinstance(decoded, dict) else {"headers": raw})
    return Incoming(
        message_id=_text_attribute(attributes, "message_id"),
        topic=queue,
        key=_text_attribute(attributes, "key"),
        type=_text_attribute(attributes, "type") or queue,
        body=message.get("Body", "").encode("utf-8"),
        headers=headers,
        ack_token=message["ReceiptHandle"],
        original=lambda: {"message_attributes": attributes},
        content_type=_text_attribute(attributes, "content-type"),
    )


def _release(client: Any, url: str, handles: Sequence[str]) -> None:
    """Make messages visible again at once (best effort): another receiver takes them."""
    for start in range(0, len(handles), BATCH_ENTRIES):
        part = handles[start : start + BATCH_ENTRIES]
        try:
            client.change_message_visibility_batch(
                QueueUrl=url,
                Entries=[
                    {"Id": str(i), "ReceiptHandle": h, "VisibilityTimeout": 0}
                    for i, h in enumerate(part)
                ],
            )
        except Exception as exc:  # they come back after the visibility timeout anyway
            log.debug("could not release %d SQS messages: %r", len(part), exc)


def _release_received(client: Any, url: str, response: Any) -> None:
    if isinstance(response, dict):
        _release(client, url, [m["ReceiptHandle"] for m in response.get("Messages", [])])


class SqsConsumer(_Adapter):
    """Long-polls one SQS queue with several receivers; deletes what is stored."""

    def __init__(self, broker: BrokerURL, *, queue: str) -> None:
        if not _QUEUE_NAME.match(queue):
            raise ConfigError(
                f"invalid --queue {queue!r} for SQS: 1-80 letters, digits, - and _, "
                "ending in .fifo for a FIFO queue"
            )
        super().__init__(broker, pool=8)
        self.queue = queue
        self._url: str | None = None
        self._visibility = 30
        self._tasks: list[asyncio.Task[None]] = []
        self._buffer: deque[Incoming] = deque()
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        # receipt handle → when its visibility timeout was last (re)started
        self._held: dict[str, float] = {}
        self._failure: BaseException | None = None

    @property
    def connected(self) -> bool:
        return self._url is not None and self._failure is None

    async def connect(self) -> None:
        if self.connected:
            return
        await self.close()
        client = await self._ensure_client()
        try:
            url = (await self._call(client.get_queue_url, QueueName=self.queue))["QueueUrl"]
            attrs = (
                await self._call(
                    client.get_queue_attributes, QueueUrl=url, AttributeNames=["VisibilityTimeout"]
                )
            )["Attributes"]
        except Exception as exc:
            if isinstance(exc, bce.ClientError) and _code(exc) in _MISSING_QUEUE:
                raise BrokerUnavailable(
                    f"SQS queue {self.queue!r} does not exist at {_where(client)}; relay does "
                    "not create SQS queues: create it (and its dead-letter queue)"
                ) from exc
            if isinstance(exc, (bce.ClientError, *_TRANSPORT_ERRORS, *_CREDENTIAL_ERRORS)):
                raise self._unavailable(exc) from exc
            raise
        self._visibility = max(1, int(attrs.get("VisibilityTimeout", 30)))
        self._url = url
        self._failure = None
        self._room.set()
        self._tasks = [
            asyncio.create_task(self._receive(), name=f"sqs-receive-{n}") for n in range(RECEIVERS)
        ]
        self._tasks.append(asyncio.create_task(self._keep_invisible(), name="sqs-visibility"))
        log.info(
            "consuming SQS queue %r at %s (visibility timeout %ds)",
            self.queue,
            _where(client),
            self._visibility,
        )

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        url, self._url = self._url, None
        handles = list(self._held)
        self._held.clear()
        self._buffer.clear()
        if url is not None and handles and self._client is not None:
            # Received, not stored: visible again now, not after the timeout.
            try:
                await asyncio.wait_for(
                    self._call(_release, self._client, url, handles), RELEASE_TIMEOUT
                )
            except (TimeoutError, RuntimeError):
                pass
        self._shutdown_executor()

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._arrived.set()

    async def _receive(self) -> None:
        """One receiver: long-poll, buffer, repeat while there is room."""
        while True:
            while len(self._held) >= MAX_HELD:
                self._room.clear()
                await self._room.wait()
            try:
                response = await self._poll()
            except Exception as exc:
                if isinstance(exc, bce.ClientError) and _code(exc) in _MISSING_QUEUE:
                    self._fail(BrokerUnavailable(f"SQS queue {self.queue!r} does not exist"))
                elif isinstance(exc, (bce.ClientError, *_TRANSPORT_ERRORS, *_CREDENTIAL_ERRORS)):
                    self._fail(self._unavailable(exc, f"receiving from SQS queue {self.queue!r}"))
                else:
                    self._fail(exc)
                return
            now = time.monotonic()
            for message in response.get("Messages", []):
                incoming = to_incoming(message, self.queue)
                self._held[message["ReceiptHandle"]] = now
                self._buffer.append(incoming)
            if self._buffer:
                self._arrived.set()

    async def _poll(self) -> dict[str, Any]:
        """ReceiveMessage in a daemon thread; if abandoned, its messages are released."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        abandoned = threading.Event()
        client, url = self._client, self._url
        assert url is not None

        def deliver(response: Any, exc: BaseException | None) -> None:
            if future.done():  # cancelled while the answer was on its way
                threading.Thread(
                    target=_release_received, args=(client, url, response), daemon=True
                ).start()
            elif exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(response)

        def receive() -> None:
            response, error = None, None
            try:
                response = client.receive_message(
                    QueueUrl=url,
                    MaxNumberOfMessages=BATCH_ENTRIES,
                    WaitTimeSeconds=WAIT_SECONDS,
                    MessageAttributeNames=["All"],
                    MessageSystemAttributeNames=["All"],
                )
            except BaseException as exc:  # handed to the event loop
                error = exc
            if abandoned.is_set():
                _release_received(client, url, response)
                return
            try:
                loop.call_soon_threadsafe(deliver, response, error)
            except RuntimeError:  # the loop is closed
                _release_received(client, url, response)

        threading.Thread(target=receive, name="relay-sqs-receive", daemon=True).start()
        try:
            return await future
        except asyncio.CancelledError:
            abandoned.set()
            raise

    def _failed(self) -> bool:
        return self._failure is not None

    async def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        while True:
            await self.connect()
            batch = await take_batch(self._buffer, self._arrived, self._failed, max_size, max_wait)
            if batch:
                yield batch  # any failure shows on the next round
                continue
            failure = self._failure
            await self.close()
            if isinstance(failure, BrokerUnavailable):
                raise failure
            raise BrokerUnavailable(f"SQS receiver stopped: {failure!r}") from failure

    async def ack(self, batch: Sequence[Incoming]) -> None:
        if not batch:
            return
        url = self._url
        handles = [str(m.ack_token) for m in batch]
        for handle in handles:
            self._held.pop(handle, None)
        if len(self._held) < MAX_HELD:
            self._room.set()
        if url is None:
            raise BrokerUnavailable(
                f"SQS consumer of {self.queue!r} closed before the batch was deleted"
            )
        parts = [handles[i : i + BATCH_ENTRIES] for i in range(0, len(handles), BATCH_ENTRIES)]
        results = await asyncio.gather(
            *(
                self._call(
                    self._client.delete_message_batch,
                    QueueUrl=url,
                    Entries=[{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(p)],
                )
                for p in parts
            ),
            return_exceptions=True,
        )
        broken = None
        for result in results:
            if isinstance(result, (bce.ClientError, bce.BotoCoreError)):
                broken = broken or result
                continue
            if isinstance(result, BaseException):
                raise result
            for failed in result.get("Failed", []):
                # Typically the visibility timeout ran out and the message
                # went to another receiver: it is stored, so its next copy
                # counts as a duplicate.
                log.warning(
                    "SQS did not delete a stored message from %r: %s: %s",
                    self.queue,
                    failed.get("Code"),
                    failed.get("Message"),
                )
        if broken is not None:
            # The rows are committed; SQS delivers these again after the
            # visibility timeout and the inbox counts them as duplicates.
            error = self._unavailable(broken, f"deleting from SQS queue {self.queue!r}")
            self._fail(error)
            raise error

    async def _keep_invisible(self) -> None:
        """Extend the visibility of messages held longer than half the timeout."""
        half = self._visibility / 2
        while True:
            await asyncio.sleep(max(0.2, self._visibility / 4))
            now = time.monotonic()
            due = [h for h, since in self._held.items() if now - since >= half]
            url = self._url
            for start in range(0, len(due), BATCH_ENTRIES):
                part = due[start : start + BATCH_ENTRIES]
                try:
                    response = await self._call(
                        self._client.change_message_visibility_batch,
                        QueueUrl=url,
                        Entries=[
                            {
                                "Id": str(i),
                                "ReceiptHandle": h,
                                "VisibilityTimeout": self._visibility,
                            }
                            for i, h in enumerate(part)
                        ],
                    )
                except Exception as exc:
                    if not (isinstance(exc, bce.ClientError) or _is_unavailable(exc)):
                        raise
                    log.warning(
                        "cannot extend the visibility of %d SQS messages: %s",
                        len(part),
                        _describe(exc),
                    )
                    continue
                failed = {f["Id"] for f in response.get("Failed", [])}
                for i, handle in enumerate(part):
                    if str(i) not in failed and handle in self._held:
                        self._held[handle] = now
                if failed:
                    log.warning(
                        "SQS refused to extend the visibility of %d messages of %r",
                        len(failed),
                        self.queue,
                    )


# The factory's entry points (relay.brokers.KINDS). An SQS queue has no
# exchange, bindings or queue arguments (relay.config refuses them).


def publisher(
    broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str
) -> SqsPublisher:
    return SqsPublisher(broker, workers=workers)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> SqsConsumer:
    """Only the queue is read: the consumer holds at most MAX_HELD messages,
    of SQS's 1 MiB at most each (no bound by `max_bytes`)."""
    return SqsConsumer(broker, queue=options.queue)
