"""Amazon SNS through boto3: the outbox publisher, and SNS's notification
envelope as the SQS inbox opens it.

SNS is publish only: services read a topic through SQS queues subscribed
to it (`relay inbox --broker-url sqs://`), so relay has no SNS consumer.
A row goes to the topic its `topic` names in the account and region, with
the same body and message attributes as on SQS (relay.brokers.aws), in
PublishBatch calls. relay never creates topics; it finds a topic's ARN by
listing the region's topics (ListTopics, every page, once, then again only
for a name it has not seen), or, where the credentials may not list
topics, builds it from the account (STS GetCallerIdentity) and checks it
with GetTopicAttributes. docs/sns.md says why.

Region, endpoint and credentials are boto3's own resolution
(AWS_DEFAULT_REGION, AWS_ENDPOINT_URL_SNS, the credentials chain),
overridden by the broker URL's `region` and `endpoint_url`.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

import botocore.exceptions as bce
import orjson

from relay.brokers import ConsumerOptions
from relay.brokers.aws import (
    ACCESS_DENIED,
    BatchPublisher,
    Destination,
    Entry,
    code,
    entry,
    make_client,
)
from relay.config import PUBLISH_ONLY, BrokerURL
from relay.errors import ConfigError
from relay.limits import original_bytes
from relay.rows import Failure, OutboxRow

log = logging.getLogger(__name__)

# The largest message SNS takes: body and attributes together.
MAX_MESSAGE = 256 * 1024

# Topic names: 1-256 letters, digits, - and _, the .fifo suffix included.
_TOPIC_NAME = re.compile(r"^(?=.{1,256}$)[A-Za-z0-9_-]+(\.fifo)?$")
_MISSING_TOPIC = frozenset({"NotFound", "NotFoundException"})
# Call-level errors caused by the content of one of the entries.
_BAD_CONTENT = frozenset(
    {
        "InvalidParameter",
        "InvalidParameterValue",
        "ParameterValueInvalid",
        "BatchRequestTooLong",
        "ValidationError",
    }
)


# --------------------------------------------------------------------------
# Outbox → SNS
# --------------------------------------------------------------------------


def build_entry(row: OutboxRow, index: int) -> Entry:
    """The PublishBatch entry for a row (the contract's wire format), or BadMessage."""
    return entry(
        row,
        index,
        service="SNS",
        body_field="Message",
        names=_TOPIC_NAME,
        naming="SNS topic name (1-256 letters, digits, - and _, ending in .fifo for a FIFO topic)",
    )


class SnsPublisher(BatchPublisher):
    """Publishes outbox rows to SNS topics named by their topic, with PublishBatch."""

    service = "sns"
    what = "SNS topic"
    missing_codes = _MISSING_TOPIC
    bad_content = _BAD_CONTENT
    batch_call = "PublishBatch"

    def __init__(self, broker: BrokerURL, *, workers: int) -> None:
        super().__init__(broker, workers=workers)
        self._arns: dict[str, str] = {}  # topic name → ARN, from ListTopics
        self._listing = threading.Lock()  # one ListTopics walk at a time
        self._may_list = True  # False once ListTopics was denied
        self._account: tuple[str, str] | None = None  # (partition, account id)
        self._unverified: set[str] = set()  # ARNs GetTopicAttributes was denied for

    def build_entry(self, row: OutboxRow, index: int) -> Entry:
        return build_entry(row, index)

    def _probe(self, client: Any) -> None:
        client.list_topics()

    def _lookup(self, topic: str) -> Destination | Failure:
        arn = self._arns.get(topic)
        if arn is None and self._may_list:
            try:
                arn = self._list(topic)
            except bce.ClientError as exc:
                if code(exc) not in ACCESS_DENIED:
                    raise
                log.warning(
                    "SNS denied ListTopics (%s): topic ARNs are built from the account "
                    "(STS GetCallerIdentity) instead",
                    code(exc),
                )
                self._may_list = False
        if arn is None and not self._may_list:
            arn = self._built(topic)
        if arn is None:
            return Failure(f"SNS topic {topic!r} does not exist in {self._client.meta.region_name}")
        return Destination(arn, MAX_MESSAGE)

    def _list(self, topic: str) -> str | None:
        """Walk ListTopics' pages (100 topics each) and remember every
        topic's ARN; the ARN of `topic`, or None when it is not there."""
        with self._listing:
            if topic in self._arns:  # another lookup's walk found it
                return self._arns[topic]
            found: dict[str, str] = {}
            params: dict[str, str] = {}
            while True:
                page = self._client.list_topics(**params)
                for listed in page.get("Topics", []):
                    arn = listed.get("TopicArn", "")
                    found[arn.rpartition(":")[2]] = arn
                token = page.get("NextToken")
                if not token:
                    break
                params = {"NextToken": token}
            self._arns = found
            return found.get(topic)

    def _built(self, topic: str) -> str | None:
        """The ARN of `topic` in the caller's account and the client's
        region, checked with GetTopicAttributes; None when it does not exist."""
        if self._account is None:
            sts = make_client(
                "sts", self.broker, 1, self.read_timeout, endpoint=self._sts_endpoint()
            )
            try:
                identity = sts.get_caller_identity()
            finally:
                sts.close()
            partition = str(identity.get("Arn", "arn:aws:")).split(":")[1] or "aws"
            self._account = (partition, str(identity["Account"]))
        partition, account = self._account
        arn = f"arn:{partition}:sns:{self._client.meta.region_name}:{account}:{topic}"
        try:
            self._client.get_topic_attributes(TopicArn=arn)
        except bce.ClientError as exc:
            if code(exc) in _MISSING_TOPIC:
                return None
            if code(exc) not in ACCESS_DENIED:
                raise
            # May publish but not look: PublishBatch says whether it exists.
            if arn not in self._unverified:
                self._unverified.add(arn)
                log.warning("SNS denied GetTopicAttributes on %s; publishing to it unchecked", arn)
        return arn

    def _sts_endpoint(self) -> bool:
        """Whether STS is asked at the broker URL's endpoint_url: when one is
        given (an emulator serves every service on one port); else STS is
        where boto3 finds it (AWS_ENDPOINT_URL_STS, the region's endpoint)."""
        return self.broker.aws_endpoint_url is not None

    def _send_batch(self, target: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        return self._client.publish_batch(TopicArn=target, PublishBatchRequestEntries=entries)  # type: ignore[no-any-return]


# --------------------------------------------------------------------------
# SNS → SQS → inbox: the notification envelope
# --------------------------------------------------------------------------

# An SQS message that SNS delivered without raw message delivery has no
# message attributes and this body (SNS's HTTP/S and SQS format):
#   {"Type": "Notification", "MessageId": "...", "TopicArn": "arn:...:NAME",
#    "Message": "<the published body>", "Timestamp": "...",
#    "MessageAttributes": {"NAME": {"Type": "String", "Value": "..."}}, ...}
# Binary attribute values are base64 there; Number and String.Array are text.


@dataclass(frozen=True, slots=True)
class Notification:
    """An SNS notification envelope, opened: what SQS would have given with
    raw message delivery."""

    message: bytes  # the published Message, the body
    attributes: dict[str, dict[str, Any]]  # in SQS's shape: DataType, StringValue or BinaryValue
    topic: str  # the topic's name (the last part of TopicArn)
    envelope: dict[str, Any]  # everything else SNS wrote, for the row's raw_properties


def _loads(body: str) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:  # valid JSON orjson refuses (a lone surrogate's \\uD800 escape)
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _attributes(given: Any) -> dict[str, dict[str, Any]]:
    """The envelope's MessageAttributes in SQS's shape, or ValueError saying why not."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise ValueError(f"MessageAttributes is a {type(given).__name__}, not an object")
    attributes: dict[str, dict[str, Any]] = {}
    for name, attribute in given.items():
        kind = attribute.get("Type") if isinstance(attribute, dict) else None
        value = attribute.get("Value") if isinstance(attribute, dict) else None
        if not isinstance(kind, str) or not isinstance(value, str):
            raise ValueError(f"message attribute {name!r} is not a Type and a Value, both text")
        if kind.startswith("Binary"):
            try:
                data = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError(f"Binary message attribute {name!r} is not base64") from None
            attributes[name] = {"DataType": kind, "BinaryValue": data}
        elif kind.startswith(("String", "Number")):
            attributes[name] = {"DataType": kind, "StringValue": value}
        else:
            raise ValueError(f"message attribute {name!r} has the unknown Type {kind!r}")
    return attributes


def open_notification(body: str) -> Notification | str | None:
    """The SNS notification envelope `body` is, opened; a str saying why it
    is one that cannot be opened (the message is kept as received, dead,
    with that reason); None when it is not an envelope (an ordinary body).

    An envelope is a JSON object with `Type` = `Notification` and both a
    `TopicArn` and a `Message`: SNS's own, never a body of relay's or an
    app's by chance. Cheap for every other body."""
    if "Notification" not in body or "TopicArn" not in body or not body.lstrip().startswith("{"):
        return None
    envelope = _loads(body)
    if not (
        isinstance(envelope, dict)
        and envelope.get("Type") == "Notification"
        and "TopicArn" in envelope
        and "Message" in envelope
    ):
        return None
    published, arn = envelope["Message"], envelope["TopicArn"]
    if not isinstance(published, str):
        return f"an SNS notification whose Message is a {type(published).__name__}, not text"
    topic = arn.rpartition(":")[2] if isinstance(arn, str) else ""
    if not topic:
        return f"an SNS notification whose TopicArn {arn!r} names no topic"
    try:
        attributes = _attributes(envelope.get("MessageAttributes"))
    except ValueError as exc:
        return f"an SNS notification that cannot be opened: {exc}"
    rest = {name: value for name, value in envelope.items() if name != "Message"}
    return Notification(original_bytes(published), attributes, topic, rest)


# The factory's entry points (relay.brokers.KINDS). SNS is publish only:
# relay.config refuses `relay inbox` with sns:// before this is asked.


def publisher(
    broker: BrokerURL, *, exchange: str, workers: int, on_unroutable: str
) -> SnsPublisher:
    return SnsPublisher(broker, workers=workers)


def consumer(broker: BrokerURL, options: ConsumerOptions) -> Any:
    raise ConfigError(PUBLISH_ONLY["sns"])
