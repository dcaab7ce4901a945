"""What the SQS and SNS adapters share: boto3 in threads, AWS's errors,
the message attributes relay sets, and the batched publisher.

SQS's SendMessageBatch and SNS's PublishBatch are the same shape: at most
10 entries and 256 KiB a call, each entry a body and the same typed
message attributes, each reported on in the answer. So one publisher
(BatchPublisher) groups rows by destination, keeps each key's rows in one
lane in seq order, splits lanes into calls and reads the answers; each
adapter says how a topic becomes its destination, how a row becomes an
entry and what the call is (relay.brokers.sqs, relay.brokers.sns).

boto3 is synchronous: its calls run in a thread pool each adapter owns.
One client per adapter serves every thread (clients are thread-safe;
sessions are not).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bce
import orjson
from botocore.config import Config

from relay.brokers import (
    Outcome,
    PublishResult,
    check_topic,
    encode_failure,
    row_body,
    row_headers,
)
from relay.config import BrokerURL, redact_url
from relay.errors import BadMessage, BrokerUnavailable, ConfigError
from relay.rows import Failure, OutboxRow

log = logging.getLogger(__name__)

T = TypeVar("T")

# SendMessageBatch, PublishBatch and friends take at most 10 entries...
BATCH_ENTRIES = 10
# ... of at most 256 KiB together. A single bigger message (SQS queues
# allowing up to 1 MiB) goes alone in its call.
BATCH_BYTES = 256 * 1024
# Calls in flight per publish(): one slow call does not stall the rest.
LANES = 8
CONNECT_TIMEOUT = 5

# The characters SQS accepts in bodies and attribute values (the XML 1.0
# set); SNS delivers to SQS, so its messages are held to the same.
_INVALID_CHARS = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId (SQS and SNS FIFO): 1-128 ASCII letters, digits and punctuation.
_GROUP_ID = re.compile(r"^[!-~]{1,128}$")

TRANSPORT_ERRORS = (bce.ConnectionError, bce.HTTPClientError)
CREDENTIAL_ERRORS = (
    bce.NoCredentialsError,
    bce.PartialCredentialsError,
    bce.CredentialRetrievalError,
)
AUTH_CODES = {
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
# SNS says AuthorizationError where SQS says AccessDenied.
ACCESS_DENIED = {"AccessDenied", "AccessDeniedException", "AuthorizationError"}


def code(exc: bce.ClientError) -> str:
    """The error code, without SQS's `AWS.SimpleQueueService.` prefix."""
    error = exc.response.get("Error", {})
    found = error.get("QueryErrorCode") or error.get("Code") or ""
    return str(found).removeprefix("AWS.SimpleQueueService.")


def message(exc: bce.ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Message") or exc)


def status(exc: bce.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def throttled(error_code: str) -> bool:
    return "Throttl" in error_code or error_code in ("RequestThrottled", "SlowDown")


def is_unavailable(exc: BaseException) -> bool:
    """The endpoint, the credentials or the service, not the message, is the problem."""
    if isinstance(exc, TRANSPORT_ERRORS + CREDENTIAL_ERRORS):
        return True
    if isinstance(exc, bce.ClientError):
        return code(exc) in AUTH_CODES or status(exc) >= 500
    return False


def describe(exc: BaseException) -> str:
    if isinstance(exc, bce.ClientError):
        return f"{code(exc)}: {message(exc)}"
    if isinstance(exc, CREDENTIAL_ERRORS):
        return f"no usable AWS credentials ({exc})"
    return f"{type(exc).__name__}: {exc}"


def make_client(
    service: str, broker: BrokerURL, pool: int, read_timeout: int, *, endpoint: bool = True
) -> Any:
    """A boto3 client of `service` with the broker URL's region and (if
    `endpoint`) its endpoint; ConfigError when neither the URL nor the
    environment gives a region."""
    config = Config(
        retries={"mode": "standard", "max_attempts": 3},
        max_pool_connections=pool,
        connect_timeout=CONNECT_TIMEOUT,
        read_timeout=read_timeout,
        user_agent_extra="relay",
    )
    try:
        return boto3.session.Session().client(
            service,
            region_name=broker.aws_region,
            endpoint_url=broker.aws_endpoint_url if endpoint else None,
            config=config,
        )
    except bce.NoRegionError:
        raise ConfigError(
            f"no AWS region for {broker.kind.upper()}: set AWS_DEFAULT_REGION or use "
            f"{broker.kind}://?region=..."
        ) from None
    except ValueError as exc:  # an endpoint botocore refuses (or an empty region)
        raise ConfigError(f"invalid {broker.kind.upper()} endpoint or region: {exc}") from None


def where(client: Any) -> str:
    return f"{redact_url(client.meta.endpoint_url)} ({client.meta.region_name})"


class AwsAdapter:
    """The client, the thread pool and the health flag an adapter keeps."""

    service = ""  # boto3's name: "sqs", "sns"
    read_timeout = 30

    def __init__(self, broker: BrokerURL, pool: int) -> None:
        self.broker = broker
        self._pool = pool
        self._client: Any = None
        self._executor: ThreadPoolExecutor | None = None
        self._healthy = False

    @property
    def name(self) -> str:
        return self.service.upper()

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self._pool, thread_name_prefix=f"relay-{self.service}"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def _ensure_client(self) -> Any:
        if self._client is None:
            # Loading the service model takes a moment: not on the event loop.
            self._client = await self._call(
                make_client, self.service, self.broker, self._pool + 4, self.read_timeout
            )
        return self._client

    def _unavailable(self, exc: BaseException, what: str = "") -> BrokerUnavailable:
        place = where(self._client) if self._client is not None else self.name
        return BrokerUnavailable(f"{what or self.name} at {place}: {describe(exc)}")

    def _shutdown_executor(self) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------
# Entries: a row as one entry of a batch call
# --------------------------------------------------------------------------


@dataclass(slots=True)
class Entry:
    index: int  # position in publish()'s rows
    topic: str
    order_key: str | None  # what per-key order is kept for: the group id, else the key
    size: int  # body and attributes, as SQS and SNS count them
    params: dict[str, Any] = field(default_factory=dict)


def _attribute(value: str) -> dict[str, str]:
    return {"DataType": "String", "StringValue": value}


def message_attributes(row: OutboxRow) -> dict[str, dict[str, str]]:
    """The row's message attributes as SQS and SNS take them (the
    contract's `message_id`, `type`, `key`, `headers`, then those added
    above the broker, relay.rows), or BadMessage."""
    headers = row_headers(row)
    attributes = {"message_id": _attribute(row.id)}
    if row.type:
        attributes["type"] = _attribute(row.type)
    if row.key:
        attributes["key"] = _attribute(row.key)
    if headers:
        attributes["headers"] = _attribute(orjson.dumps(headers).decode())
    for name, value in row.attributes:
        attributes[name] = (
            {"DataType": "Number", "StringValue": str(value)}
            if isinstance(value, int)
            else _attribute(value)
        )
    return attributes


def entry(
    row: OutboxRow,
    index: int,
    *,
    service: str,
    body_field: str,
    names: re.Pattern[str],
    naming: str,
) -> Entry:
    """The batch entry for a row: its body (JSON) in `body_field`, its
    message attributes, its FIFO fields when the topic ends in `.fifo`,
    checked and sized. BadMessage for what `service` refuses, a topic
    `names` does not match among it (`naming` says what it takes)."""
    check_topic(row)
    if not names.match(row.topic):
        raise BadMessage(f"topic {row.topic!r} is not a valid {naming}")
    attributes = message_attributes(row)
    body = row_body(row).decode("utf-8")
    for name, text in [("body", body)] + [
        (f"attribute {n!r}", a["StringValue"]) for n, a in attributes.items()
    ]:
        bad = _INVALID_CHARS.search(text)
        if bad:
            raise BadMessage(
                f"{name} contains U+{ord(bad.group()):04X}, a character {service} does not accept"
            )
    size = len(body.encode()) + sum(
        len(n.encode()) + len(a["DataType"]) + len(a["StringValue"].encode())
        for n, a in attributes.items()
    )
    params: dict[str, Any] = {"Id": str(index), body_field: body, "MessageAttributes": attributes}
    order_key = row.key or None
    if row.topic.endswith(".fifo"):
        group = row.key or row.topic
        if not _GROUP_ID.match(group):
            raise BadMessage(
                f"key {group!r} cannot be an {service} MessageGroupId "
                "(1-128 ASCII letters, digits and punctuation)"
            )
        params["MessageGroupId"] = group
        params["MessageDeduplicationId"] = row.id
        order_key = group
    return Entry(index, row.topic, order_key, size, params)


def lanes(entries: Sequence[Entry], count: int = LANES) -> list[list[Entry]]:
    """Entries of one destination split into lanes that may run in parallel.

    Every entry of an order key lands in the same lane, in seq order, and a
    lane sends its calls one after another: so a key's messages reach the
    broker in seq order (FIFO: one MessageGroupId is never in two calls in
    flight at once), while different keys use the parallel lanes. Rows
    without a key on a standard queue or topic have no order to keep and
    are spread.
    """
    needed = max(1, math.ceil(len(entries) / BATCH_ENTRIES))
    count = max(1, min(count, needed))
    split: list[list[Entry]] = [[] for _ in range(count)]
    for n, item in enumerate(entries):
        if item.order_key is None:
            split[n % count].append(item)
        else:
            split[zlib.crc32(item.order_key.encode()) % count].append(item)
    return [lane for lane in split if lane]


def chunks(entries: Sequence[Entry], max_bytes: int = BATCH_BYTES) -> list[list[Entry]]:
    """Consecutive calls of at most 10 entries and `max_bytes` (a bigger entry goes alone)."""
    calls: list[list[Entry]] = []
    current: list[Entry] = []
    size = 0
    for item in entries:
        if current and (len(current) >= BATCH_ENTRIES or size + item.size > max_bytes):
            calls.append(current)
            current, size = [], 0
        current.append(item)
        size += item.size
    if current:
        calls.append(current)
    return calls


# --------------------------------------------------------------------------
# The batched publisher
# --------------------------------------------------------------------------


def call_failure(
    exc: bce.ClientError,
    topic: str,
    service: str,
    what: str,
    missing: frozenset[str],
    bad_content: frozenset[str],
) -> Failure:
    """What a failed batch call means for each message in it (not for
    unavailability): a missing `what`, throttling and a denial count an
    attempt; a refusal of the content (`bad_content`) is permanent."""
    error_code = code(exc)
    if error_code in missing:
        return Failure(f"{what} {topic!r} does not exist")
    if throttled(error_code):
        return Failure(f"throttled by {service}: {error_code}: {message(exc)}")
    if error_code in ACCESS_DENIED:
        return Failure(f"{service} denied access to {what} {topic!r}: {message(exc)}")
    return Failure(
        f"{service} refused the message: {error_code}: {message(exc)}",
        permanent=error_code in bad_content,
    )


def entry_failure(failed: dict[str, Any], service: str) -> Failure:
    """One entry of a batch call's `Failed` list."""
    error_code = str(failed.get("Code", "")).removeprefix("AWS.SimpleQueueService.")
    text = failed.get("Message") or ""
    if throttled(error_code):
        return Failure(f"throttled by {service}: {error_code}: {text}")
    return Failure(
        f"{service} rejected the message: {error_code}: {text}",
        permanent=bool(failed.get("SenderFault")),
    )


@dataclass(slots=True)
class Destination:
    """Where a topic's entries go: an SQS queue's URL or an SNS topic's ARN."""

    target: str
    max_size: int


class BatchPublisher(AwsAdapter):
    """Publishes outbox rows in batch calls, each row to the destination its
    topic names; what differs between SQS and SNS is the subclass's."""

    what = ""  # the destination, for errors: "SQS queue", "SNS topic"
    # Call-level error codes: a missing destination; the content of one of
    # the entries (the call is split to find it).
    missing_codes: frozenset[str] = frozenset()
    bad_content: frozenset[str] = frozenset()
    batch_call = ""  # the call's name, for errors

    def __init__(self, broker: BrokerURL, *, workers: int) -> None:
        # The outbox workers share the publisher, each with LANES calls in flight.
        super().__init__(broker, pool=workers * LANES)
        self._destinations: dict[str, Destination] = {}

    # What a subclass gives -------------------------------------------------

    def build_entry(self, row: OutboxRow, index: int) -> Entry:
        raise NotImplementedError

    def _probe(self, client: Any) -> None:
        """One cheap call that proves the endpoint and the credentials (in a thread)."""
        raise NotImplementedError

    def _lookup(self, topic: str) -> Destination | Failure:
        """The topic's destination (in a thread), or why there is none; a
        ClientError of `missing_codes` also says it does not exist."""
        raise NotImplementedError

    def _send_batch(self, target: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """The batch call (in a thread): its answer's Successful and Failed."""
        raise NotImplementedError

    def call_failure(self, exc: bce.ClientError, topic: str) -> Failure:
        return call_failure(exc, topic, self.name, self.what, self.missing_codes, self.bad_content)

    # The Publisher port ----------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._client is not None and self._healthy

    blocked: str | None = None  # AWS never blocks a client (it throttles calls)

    async def wait_unblocked(self) -> None:
        return

    async def connect(self) -> None:
        if self.connected:
            return
        client = await self._ensure_client()
        try:
            await self._call(self._probe, client)
        except bce.ClientError as exc:
            # Denied still proves the endpoint answers and the credentials
            # are valid; a least-privilege publisher may lack the right.
            if code(exc) not in ACCESS_DENIED:
                raise self._unavailable(exc) from exc
        except (*TRANSPORT_ERRORS, *CREDENTIAL_ERRORS) as exc:
            raise self._unavailable(exc) from exc
        self._healthy = True
        log.info("connected to %s at %s", self.name, where(client))

    async def close(self) -> None:
        self._healthy = False
        self._shutdown_executor()

    async def _destination(self, topic: str) -> Destination | Failure | Outcome:
        """The topic's destination, looked up once; or what to report instead."""
        known = self._destinations.get(topic)
        if known is not None:
            return known
        try:
            found = await self._call(self._lookup, topic)
        except Exception as exc:
            if is_unavailable(exc):
                self._lost(exc)
                return Outcome.RELEASE
            if isinstance(exc, bce.ClientError):
                return self.call_failure(exc, topic)
            if isinstance(exc, bce.BotoCoreError):
                return Failure(f"looking up {self.what} {topic!r} failed: {describe(exc)}")
            raise
        if isinstance(found, Destination):
            self._destinations[topic] = found
        return found

    def _lost(self, exc: BaseException) -> None:
        if self._healthy:
            log.warning("%s", self._unavailable(exc))
        self._healthy = False

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        await self.connect()
        results: list[PublishResult] = [None] * len(rows)
        by_topic: dict[str, list[Entry]] = {}
        held: set[str] = set()  # keys whose row failed here: their later rows wait
        for index, row in enumerate(rows):
            if row.key is not None and row.key in held:
                results[index] = Outcome.RELEASE
                continue
            try:
                made = self.build_entry(row, index)
            except Exception as exc:  # noqa: BLE001 - whatever it is, it is this row's
                results[index] = encode_failure(exc)
                if row.key is not None:
                    held.add(row.key)
                continue
            by_topic.setdefault(row.topic, []).append(made)

        topics = list(by_topic)
        found = await asyncio.gather(*(self._destination(t) for t in topics))
        work = []
        for topic, destination in zip(topics, found, strict=True):
            entries = by_topic[topic]
            if not isinstance(destination, Destination):
                for item in entries:
                    results[item.index] = destination
                continue
            sendable = []
            for item in entries:
                if item.size > destination.max_size:
                    results[item.index] = Failure(
                        f"message is {item.size} bytes (body and attributes), over the "
                        f"{destination.max_size}-byte limit of {self.what} {topic!r}",
                        permanent=True,
                    )
                else:
                    sendable.append(item)
            work += [self._send_lane(topic, destination, lane, results) for lane in lanes(sendable)]
        await asyncio.gather(*work)
        return results

    async def _send_lane(
        self, topic: str, destination: Destination, lane: list[Entry], results: list[PublishResult]
    ) -> None:
        # Once a message of a key failed, later ones of that key in this lane
        # are not sent: RELEASE leaves them pending without an attempt, and
        # the next claim decides (they wait while the failed row backs off).
        # Entries inside one batch call are already on their way.
        held: set[str] = set()
        gone = False  # the endpoint is unreachable: send nothing more
        for call in chunks(lane):
            ready = []
            for item in call:
                if gone or (item.order_key is not None and item.order_key in held):
                    results[item.index] = Outcome.RELEASE
                else:
                    ready.append(item)
            if not ready:
                continue
            sent = await self._send(topic, destination, ready)
            for item, result in zip(ready, sent, strict=True):
                results[item.index] = result
                if result is Outcome.RELEASE:
                    gone = True
                if result is not None and item.order_key is not None:
                    held.add(item.order_key)

    async def _send(
        self, topic: str, destination: Destination, call: list[Entry]
    ) -> list[PublishResult]:
        try:
            response = await self._call(
                self._send_batch, destination.target, [e.params for e in call]
            )
        except Exception as exc:
            if is_unavailable(exc):
                self._lost(exc)
                return [Outcome.RELEASE] * len(call)
            if isinstance(exc, bce.BotoCoreError):
                return [Failure(f"{self.batch_call} failed: {describe(exc)}")] * len(call)
            if not isinstance(exc, bce.ClientError):
                raise
            if code(exc) in self.missing_codes:
                # Deleted since: look it up again next time.
                self._destinations.pop(topic, None)
            if code(exc) in self.bad_content and len(call) > 1:
                # One entry spoils the call: send them one by one to find it.
                singles: list[PublishResult] = []
                for item in call:
                    singles += await self._send(topic, destination, [item])
                return singles
            return [self.call_failure(exc, topic)] * len(call)
        self._healthy = True
        sent = {s["Id"] for s in response.get("Successful", [])}
        failed = {f["Id"]: entry_failure(f, self.name) for f in response.get("Failed", [])}
        return [
            None
            if e.params["Id"] in sent
            else failed.get(e.params["Id"], Failure(f"{self.name} did not report on this message"))
            for e in call
        ]
