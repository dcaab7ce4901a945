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
import re
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import botocore.exceptions as bce
import orjson

from relay.brokers import ConsumerOptions, Incoming, aws, buffered_batches
from relay.brokers.aws import (
    ACCESS_DENIED,
    BATCH_ENTRIES,
    CREDENTIAL_ERRORS,
    TRANSPORT_ERRORS,
    AwsAdapter,
    BatchPublisher,
    Destination,
    Entry,
    code,
    describe,
    entry,
    is_unavailable,
    where,
)
from relay.brokers.sns import Notification, open_notification
from relay.config import BrokerURL
from relay.errors import BrokerUnavailable, ConfigError
from relay.rows import Failure, OutboxRow

log = logging.getLogger(__name__)

# The per-message limit when the queue's MaximumMessageSize cannot be read.
DEFAULT_MAX_MESSAGE = 256 * 1024
# Long-polling receivers per consumer, and how long each poll waits.
RECEIVERS = 4
WAIT_SECONDS = 20
# Messages received and not yet deleted, at most (the receivers pause beyond it).
MAX_HELD = 100
RELEASE_TIMEOUT = 3.0

# Queue names: 1-80 letters, digits, - and _, the .fifo suffix included.
_QUEUE_NAME = re.compile(r"^(?=.{1,80}$)[A-Za-z0-9_-]+(\.fifo)?$")

_MISSING_QUEUE = frozenset({"QueueDoesNotExist", "NonExistentQueue"})
# Call-level errors caused by the content of one of the entries.
_BAD_CONTENT = frozenset(
    {
        "InvalidMessageContents",
        "InvalidParameterValue",
        "BatchRequestTooLong",
        "MessageTooLong",
        "InvalidAttributeValue",
        "InvalidAttributeName",
    }
)


class _Sqs(AwsAdapter):
    service = "sqs"
    read_timeout = WAIT_SECONDS + 10


# --------------------------------------------------------------------------
# Outbox → SQS
# --------------------------------------------------------------------------


def build_entry(row: OutboxRow, index: int) -> Entry:
    """The SendMessageBatch entry for a row (the contract's wire format), or BadMessage."""
    return entry(
        row,
        index,
        service="SQS",
        body_field="MessageBody",
        names=_QUEUE_NAME,
        naming="SQS queue name (1-80 letters, digits, - and _, ending in .fifo for a FIFO queue)",
    )


class SqsPublisher(_Sqs, BatchPublisher):
    """Publishes outbox rows to SQS queues named by their topic, with SendMessageBatch."""

    what = "SQS queue"
    missing_codes = _MISSING_QUEUE
    bad_content = _BAD_CONTENT
    batch_call = "SendMessageBatch"

    def build_entry(self, row: OutboxRow, index: int) -> Entry:
        return build_entry(row, index)

    def _probe(self, client: Any) -> None:
        client.list_queues(MaxResults=1)

    def _lookup(self, topic: str) -> Destination:
        client = self._client
        url = client.get_queue_url(QueueName=topic)["QueueUrl"]
        try:
            attrs = client.get_queue_attributes(
                QueueUrl=url, AttributeNames=["MaximumMessageSize"]
            )["Attributes"]
            max_size = int(attrs.get("MaximumMessageSize", DEFAULT_MAX_MESSAGE))
        except bce.ClientError as exc:
            if code(exc) not in ACCESS_DENIED:
                raise
            log.warning(
                "cannot read MaximumMessageSize of SQS queue %r (%s); assuming %d bytes",
                topic,
                code(exc),
                DEFAULT_MAX_MESSAGE,
            )
            max_size = DEFAULT_MAX_MESSAGE
        return Destination(url, max_size)

    def _send_batch(self, target: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return self._client.send_message_batch(QueueUrl=target, Entries=entries)  # type: ignore[no-any-return]


def call_failure(exc: bce.ClientError, topic: str) -> Failure:
    """What a failed SendMessageBatch means for each message in it."""
    return aws.call_failure(exc, topic, "SQS", "SQS queue", _MISSING_QUEUE, _BAD_CONTENT)


def entry_failure(failed: dict[str, Any]) -> Failure:
    """One entry of SendMessageBatch's `Failed` list."""
    return aws.entry_failure(failed, "SQS")


# --------------------------------------------------------------------------
# SQS → inbox
# --------------------------------------------------------------------------

_RELAY_ATTRIBUTES = ("message_id", "type", "key", "headers")


def _text_attribute(attributes: dict[str, Any], name: str) -> str | None:
    value = attributes.get(name, {}).get("StringValue")
    return value or None


def to_incoming(message: dict[str, Any], queue: str) -> Incoming:
    """A received SQS message as the inbox sees it (the contract's mapping).

    A message SNS delivered without raw message delivery (no attributes,
    an SNS notification envelope for a body) is opened first: its
    Message is the body, its MessageAttributes the attributes, and the
    type falls back to the topic's name. An envelope that cannot be opened
    is kept whole, dead, with the reason."""
    attributes = message.get("MessageAttributes") or {}
    text = message.get("Body", "")
    body = text.encode("utf-8")
    fallback = queue
    original: dict[str, Any] = {"message_attributes": attributes}
    undecodable = None
    if not attributes:
        opened = open_notification(text)
        if isinstance(opened, Notification):
            attributes, body, fallback = opened.attributes, opened.message, opened.topic
            original = {"message_attributes": attributes, "sns_notification": opened.envelope}
        elif opened is not None:
            undecodable = opened
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
        type=_text_attribute(attributes, "type") or fallback,
        body=body,
        headers=headers,
        ack_token=message["ReceiptHandle"],
        original=lambda: original,
        undecodable=undecodable,
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


class SqsConsumer(_Sqs):
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
            if isinstance(exc, bce.ClientError) and code(exc) in _MISSING_QUEUE:
                raise BrokerUnavailable(
                    f"SQS queue {self.queue!r} does not exist at {where(client)}; relay does "
                    "not create SQS queues: create it (and its dead-letter queue)"
                ) from exc
            if isinstance(exc, (bce.ClientError, *TRANSPORT_ERRORS, *CREDENTIAL_ERRORS)):
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
            where(client),
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
                if isinstance(exc, bce.ClientError) and code(exc) in _MISSING_QUEUE:
                    self._fail(BrokerUnavailable(f"SQS queue {self.queue!r} does not exist"))
                elif isinstance(exc, (bce.ClientError, *TRANSPORT_ERRORS, *CREDENTIAL_ERRORS)):
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

    def batches(self, max_size: int, max_wait: float) -> AsyncGenerator[list[Incoming], None]:
        return buffered_batches(self, "SQS receiver", max_size, max_wait)

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
                    if not (isinstance(exc, bce.ClientError) or is_unavailable(exc)):
                        raise
                    log.warning(
                        "cannot extend the visibility of %d SQS messages: %s",
                        len(part),
                        describe(exc),
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
