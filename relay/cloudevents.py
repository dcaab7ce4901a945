"""CloudEvents 1.0, both ways: the one module that knows the envelope.

Outbox: `relay outbox --cloudevents-source URI` puts a CloudEventsPublisher
around the broker's publisher (outside the claim check's, so that a large
structured event goes to S3 whole). It turns each row into the event in
the binding of the broker it goes to (BINDINGS, by BrokerURL.kind):

- binary mode (RabbitMQ, Kafka, NATS): the attributes as message attributes
  (relay.rows.OutboxRow.attributes: `cloudEvents_id`, `ce_id`, ...), the
  body as it is; `datacontenttype` is the content type the adapter already
  sets (application/json);
- structured mode (SQS): the body is the event as JSON with the payload
  as its `data`, and the attribute `content-type` says so.

Inbox: `received` turns each received message that is an event, in either
mode and from any producer, into the message the inbox stores: the dedup
key `source id`, the type and (when the broker gave none) key from the
event, the data as the body, every other attribute as a `ce_` header. An
event that breaks the specification is kept as received, dead, with the
reason (Incoming.rejected). The receiver calls it at one point, after the
claim check's fetch, for every broker; no adapter knows CloudEvents.

Handlers: `CloudEvent`, the read-only view of a row's `ce_` headers that
relay.Message.cloudevent gives.

No SDK at run time: the few rules are cheaper written out here (one pass
over a message's headers) than an SDK event object built for each message;
the tests read and write events with the CloudEvents Python SDK.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import operator
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from relay.brokers import KINDS, Incoming, Publisher, PublisherWrapper, PublishResult
from relay.errors import ContentError
from relay.rows import OutboxRow
from relay.storable import loads

SPECVERSION = "1.0"
STRUCTURED_TYPE = "application/cloudevents+json"
DATA_TYPE = "application/json"
# The row's headers name each attribute so (ce_id, ce_source, ...).
HEADER_PREFIX = "ce_"
CONTENT_TYPE_ATTRIBUTE = "content-type"

REQUIRED = ("id", "source", "specversion", "type")
# Optional attributes of the specification, each a non-empty string.
OPTIONAL_STRINGS = ("datacontenttype", "dataschema", "subject")
# The Integer of the specification's type system.
INT_MIN, INT_MAX = -(2**31), 2**31 - 1

_EXTENSION_NAME = re.compile(r"[a-z0-9]+")
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?([Zz]|[+-]\d{2}:\d{2})"
)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Binding:
    """How a broker carries an event: binary mode with these attribute
    prefixes (the first one written), or structured mode (no prefixes)."""

    prefixes: tuple[str, ...]
    # Binary mode: the header that holds datacontenttype, written here when
    # it is not the one the adapter already sets (NATS: `content-type`
    # beside its own `Content-Type`).
    content_type: str | None = None

    @property
    def binary(self) -> bool:
        return bool(self.prefixes)


# By BrokerURL.kind, as the kinds table (relay.brokers.KINDS) says. RabbitMQ:
# the AMQP binding as the CloudEvents SDKs write it (application properties
# are AMQP 0-9-1 headers); Kafka and NATS: `ce_` headers (NATS: `ce-` too,
# as the Go SDK writes its NATS binding, read); SQS has no
# binding of its own: structured mode, the JSON event format, in the body.
BINDINGS: dict[str, Binding] = {
    name: Binding(kind.cloudevents, kind.cloudevents_content_type) for name, kind in KINDS.items()
}
STRUCTURED = Binding(())


def binding(kind: str | None) -> Binding:
    """The binding of a broker kind; the tests' memory broker (None) is
    shaped as RabbitMQ is, and a broker with no binding here gets structured
    mode, which needs nothing of the broker but a body and a content type."""
    return BINDINGS.get("amqp" if kind is None else kind, STRUCTURED)


def rfc3339(moment: datetime) -> str:
    """`moment` as RFC 3339 text in UTC, to the microsecond (a naive one is UTC)."""
    text = moment.isoformat(timespec="microseconds")
    if text.endswith("+00:00"):  # PostgreSQL's timestamptz, as psycopg reads it
        return text[:-6] + "Z"
    if moment.tzinfo is None:
        return text + "Z"
    return moment.astimezone(UTC).isoformat(timespec="microseconds")[:-6] + "Z"


def parse_time(text: str) -> datetime | None:
    """An RFC 3339 timestamp as an aware datetime; None if it is not one.
    A leap second (:60) reads as :59.999999, which Python cannot hold."""
    match = _RFC3339.fullmatch(text)
    if match is None:
        return None
    leap = match[6] == "60"
    normal = text[:17] + "59" + text[19:] if leap else text
    try:
        moment = datetime.fromisoformat(normal.upper())
    except ValueError:
        return None
    return moment.replace(microsecond=999999) if leap else moment


# --------------------------------------------------------------------------
# Outbox: each row as an event
# --------------------------------------------------------------------------


def _traceparent(row: OutboxRow) -> str | None:
    """The row's `traceparent` header, if it has one (the adapter reports
    headers that are not a JSON object of strings)."""
    if "traceparent" not in row.headers:
        return None
    try:
        headers = orjson.loads(row.headers)
    except orjson.JSONDecodeError:
        return None
    value = headers.get("traceparent") if isinstance(headers, dict) else None
    return value if isinstance(value, str) else None


# A row with attributes added, without dataclasses.replace's per-call look
# at the fields (half of binary mode's cost a row): the fields read at once,
# `attributes` last.
_ROW_FIELDS = tuple(f.name for f in dataclasses.fields(OutboxRow))
_row_values = operator.attrgetter(*_ROW_FIELDS[:-1])
assert _ROW_FIELDS[-1] == "attributes"


def _with_attributes(row: OutboxRow, added: tuple[tuple[str, str | int], ...]) -> OutboxRow:
    return OutboxRow(*_row_values(row), row.attributes + added if row.attributes else added)  # type: ignore[call-arg]


class CloudEventsPublisher(PublisherWrapper):
    """A Publisher that sends every row as a CloudEvent through the broker's
    Publisher (`inner`), in `binding`'s mode; results are the inner's."""

    def __init__(self, inner: Publisher, source: str, binding: Binding) -> None:
        super().__init__(inner)
        self.source = source
        self.binding = binding
        prefix = binding.prefixes[0] if binding.binary else ""
        self._names = {name: prefix + name for name in (*REQUIRED, "time", "subject")}
        self._traceparent = prefix + "traceparent"
        # The same two pairs on every row: made once (fewer objects a row,
        # fewer garbage collections in the drain).
        self._constant: tuple[tuple[str, str | int], ...] = (
            (self._names["specversion"], SPECVERSION),
            (self._names["source"], source),
        )
        if binding.binary and binding.content_type:
            self._constant += ((binding.content_type, DATA_TYPE),)

    def attributes(self, row: OutboxRow) -> tuple[tuple[str, str | int], ...]:
        """The event's attributes for a row, but its data and (binary mode:
        the adapter's content type) datacontenttype, named as the binding
        writes them. Built directly: this is the drain's per-row cost."""
        names = self._names
        found: tuple[tuple[str, str | int], ...] = (
            *self._constant,
            (names["id"], row.id),
            (names["type"], row.type or row.topic),
            (names["time"], rfc3339(row.created_at)),
        )
        if row.key:  # the specification's subject is never empty
            found += ((names["subject"], row.key),)
        if "traceparent" in row.headers:
            traceparent = _traceparent(row)
            if traceparent is not None:
                found += ((self._traceparent, traceparent),)
        return found

    def event(self, row: OutboxRow) -> OutboxRow:
        """The row as its event: attributes added (binary mode), or its
        payload the event's JSON (structured mode)."""
        if self.binding.binary:
            return _with_attributes(row, self.attributes(row))
        found = dict(self.attributes(row))
        found["datacontenttype"] = DATA_TYPE
        # The payload's text as PostgreSQL rendered it, untouched: the
        # adapter compacts the whole event as it does a payload, every
        # number exact.
        head = orjson.dumps(found)[:-1].decode()
        return dataclasses.replace(
            row,
            payload=f'{head},"data":{row.payload}}}',
            attributes=(*row.attributes, (CONTENT_TYPE_ATTRIBUTE, STRUCTURED_TYPE)),
        )

    async def publish(self, rows: Sequence[OutboxRow]) -> list[PublishResult]:
        return await self.inner.publish([self.event(row) for row in rows])


def wrap(publisher: Publisher, source: str | None, kind: str) -> Publisher:
    """`publisher` behind a CloudEventsPublisher when a source is given."""
    if source is None:
        return publisher
    return CloudEventsPublisher(publisher, source, binding(kind))


# --------------------------------------------------------------------------
# Inbox: events as the messages the inbox stores
# --------------------------------------------------------------------------


class _Invalid(ContentError):
    """Why a message is not a valid CloudEvent (caught here, never raised out)."""


def _is_structured(content_type: str | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == STRUCTURED_TYPE


def received(batch: Sequence[Incoming], binding: Binding) -> list[Incoming]:
    """The batch with each CloudEvent (binary or structured mode) as the
    message the inbox stores; every other message as it is."""
    return [receive(message, binding) for message in batch]


def receive(message: Incoming, binding: Binding) -> Incoming:
    """One message: as the event's row should hold it, as it is when it is
    no event, or as received with `rejected` set when it is an invalid one."""
    if message.undecodable is not None or message.unfetched is not None:
        return message  # dead already, kept as received
    try:
        if _is_structured(message.content_type):
            return _from_structured(message)
        if binding.binary and message.headers:
            prefixes = binding.prefixes
            for name in message.headers:
                if isinstance(name, str) and name.startswith(prefixes):
                    return _from_binary(message, prefixes)
    except _Invalid as why:
        return dataclasses.replace(
            message,
            rejected=f"not a valid CloudEvent: {why}; the message is kept as received",
        )
    return message


def _text(name: str, value: Any) -> str:
    """A String attribute's value (UTF-8 bytes, as Kafka headers carry it, too)."""
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise _Invalid(f"attribute {name!r} is not valid UTF-8") from None
    if not isinstance(value, str):
        raise _Invalid(f"attribute {name!r} is a {_kind(value)}, not a string")
    return value


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (bytearray, memoryview)):
        return "byte array"
    return {dict: "object", list: "array", float: "number", int: "integer"}.get(
        type(value), type(value).__name__
    )


def _time(value: Any, binary: bool) -> str:
    """The time attribute as RFC 3339 text: a string as it is (checked); in
    binary mode, an AMQP timestamp or integer milliseconds since the epoch
    (as the SDKs write the AMQP binding) converted."""
    if binary and isinstance(value, datetime):
        return rfc3339(value)
    if binary and isinstance(value, int) and not isinstance(value, bool):
        try:
            return rfc3339(_EPOCH + timedelta(milliseconds=value))
        except OverflowError:
            raise _Invalid(f"attribute 'time' is {value} milliseconds, out of range") from None
    text = _text("time", value)
    if parse_time(text) is None:
        raise _Invalid(f"attribute 'time' is {text[:80]!r}, not an RFC 3339 timestamp")
    return text


def _extension(name: str, value: Any) -> Any:
    """An extension's value as the row's headers keep it: String, Boolean,
    Integer as they are; Binary as base64 text; Timestamp as RFC 3339."""
    if not _EXTENSION_NAME.fullmatch(name):
        raise _Invalid(
            f"attribute name {name[:80]!r} is not lower-case letters a-z and digits only"
        )
    if name == "data":
        raise _Invalid("attribute name 'data' is reserved")
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not INT_MIN <= value <= INT_MAX:
            raise _Invalid(f"attribute {name!r} is {value}, past the 32-bit Integer's range")
        return value
    if isinstance(value, bytes):
        return _text(name, value)  # a Kafka header's value, or a long string that was not UTF-8
    if isinstance(value, (bytearray, memoryview)):  # an AMQP byte array: Binary
        return base64.b64encode(bytes(value)).decode()
    if isinstance(value, datetime):
        return rfc3339(value)
    raise _Invalid(f"attribute {name!r} is a {_kind(value)}, which no attribute can be")


def _checked(found: dict[str, Any], binary: bool) -> dict[str, Any]:
    """The attributes as the row's headers hold them (in the order given),
    or _Invalid saying what breaks the specification."""
    version = found.get("specversion")
    if version is not None and version != SPECVERSION and version != SPECVERSION.encode():
        raise _Invalid(f"specversion is {str(version)[:20]!r}, not {SPECVERSION!r}")
    missing = [name for name in REQUIRED if found.get(name) is None]
    if missing:
        raise _Invalid(f"required attribute {' and '.join(map(repr, missing))} missing")
    out: dict[str, Any] = {}
    for name, value in found.items():
        if value is None:
            continue  # JSON null: absent
        if name in REQUIRED or name in OPTIONAL_STRINGS:
            text = _text(name, value)
            if not text:
                raise _Invalid(f"attribute {name!r} is empty")
            out[name] = text
        elif name == "time":
            out[name] = _time(value, binary)
        else:
            out[name] = _extension(name, value)
    if out["specversion"] != SPECVERSION:
        raise _Invalid(f"specversion is {out['specversion'][:20]!r}, not {SPECVERSION!r}")
    return out


def _event(
    message: Incoming, found: dict[str, Any], others: dict[str, Any], body: bytes, binary: bool
) -> Incoming:
    """The message the inbox stores for a valid event."""
    checked = _checked(found, binary)
    headers = others
    for name, value in checked.items():
        headers[HEADER_PREFIX + name] = value
    # relay's tracing and log lines read the `traceparent` header: the
    # event's, when the producer set only the extension.
    traceparent = checked.get("traceparent")
    if isinstance(traceparent, str) and "traceparent" not in headers:
        headers["traceparent"] = traceparent
    return dataclasses.replace(
        message,
        message_id=f"{checked['source']} {checked['id']}",
        type=checked["type"],
        key=message.key if message.key is not None else checked.get("subject"),
        body=body,
        headers=headers,
    )


def _from_binary(message: Incoming, prefixes: tuple[str, ...]) -> Incoming:
    found: dict[str, Any] = {}
    others: dict[str, Any] = {}
    for name, value in message.headers.items():
        if isinstance(name, str) and name.startswith(prefixes):
            attribute = name[len(next(p for p in prefixes if name.startswith(p))) :]
            if attribute in found:
                raise _Invalid(f"attribute {attribute!r} is given twice")
            found[attribute] = value
        else:
            others[name] = value
    # datacontenttype is the message's content type in binary mode.
    if message.content_type is not None:
        found["datacontenttype"] = message.content_type
    # An event with no data has an empty body: its payload is null.
    return _event(message, found, others, message.body or b"null", binary=True)


def _loads(body: bytes) -> Any:
    """The structured event's JSON, numbers exact (relay.storable.loads)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Invalid(f"the body (structured mode) is not valid UTF-8 ({exc})") from None
    try:
        return loads(text)
    except ValueError as why:
        raise _Invalid(f"the body (structured mode) is {why}") from None


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):  # an integer past 64 bits
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )


def _from_structured(message: Incoming) -> Incoming:
    event = _loads(message.body)
    if not isinstance(event, dict):
        raise _Invalid(f"the body (structured mode) is a JSON {_kind(event)}, not an object")
    found = dict(event)
    data = found.pop("data", None)
    data_base64 = found.pop("data_base64", None)
    if data is not None and data_base64 is not None:
        raise _Invalid("the event has both data and data_base64")
    if data_base64 is not None:
        if not isinstance(data_base64, str):
            raise _Invalid(f"data_base64 is a {_kind(data_base64)}, not a string")
        try:
            body = base64.b64decode(data_base64, validate=True)
        except (binascii.Error, ValueError):
            raise _Invalid("data_base64 is not valid base64") from None
    else:
        body = _dumps(data)  # no data: null
    # The structured content type was the envelope's, not the data's.
    others = {
        name: value
        for name, value in message.headers.items()
        if not (
            isinstance(name, str)
            and name.lower() == CONTENT_TYPE_ATTRIBUTE
            and isinstance(value, str)
            and _is_structured(value)
        )
    }
    return _event(message, found, others, body, binary=False)


# --------------------------------------------------------------------------
# Handlers: the event's attributes
# --------------------------------------------------------------------------


class CloudEvent(Mapping[str, Any]):
    """The attributes of the event an inbox row came from (but its data,
    which is the message's payload): a read-only mapping by attribute name
    (`id`, `source`, `type`, `specversion`, `time`, extensions...), values
    as the row's `ce_` headers hold them, and the usual ones as properties,
    `time` as a datetime."""

    __slots__ = ("_attributes",)

    def __init__(self, attributes: Mapping[str, Any]) -> None:
        self._attributes = dict(attributes)

    @classmethod
    def from_headers(cls, headers: Mapping[str, Any]) -> CloudEvent | None:
        """The event of a row's headers, or None when they hold none."""
        if "ce_specversion" not in headers:
            return None
        found = {
            name[len(HEADER_PREFIX) :]: value
            for name, value in headers.items()
            if name.startswith(HEADER_PREFIX)
        }
        if any(not isinstance(found.get(name), str) for name in REQUIRED):
            return None
        return cls(found)

    def __getitem__(self, name: str) -> Any:
        return self._attributes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._attributes)

    def __len__(self) -> int:
        return len(self._attributes)

    def __repr__(self) -> str:
        return f"CloudEvent({self._attributes!r})"

    @property
    def id(self) -> str:
        return str(self._attributes["id"])

    @property
    def source(self) -> str:
        return str(self._attributes["source"])

    @property
    def type(self) -> str:
        return str(self._attributes["type"])

    @property
    def specversion(self) -> str:
        return str(self._attributes["specversion"])

    @property
    def subject(self) -> str | None:
        return self._optional("subject")

    @property
    def datacontenttype(self) -> str | None:
        return self._optional("datacontenttype")

    @property
    def dataschema(self) -> str | None:
        return self._optional("dataschema")

    @property
    def time(self) -> datetime | None:
        """The time attribute as an aware datetime, None when absent."""
        text = self._optional("time")
        return None if text is None else parse_time(text)

    @property
    def extensions(self) -> dict[str, Any]:
        """The attributes the specification does not define itself."""
        known = {*REQUIRED, *OPTIONAL_STRINGS, "time"}
        return {k: v for k, v in self._attributes.items() if k not in known}

    def _optional(self, name: str) -> str | None:
        value = self._attributes.get(name)
        return value if isinstance(value, str) else None


def headers_for(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """A row's `ce_` headers for an event's attributes (relay.testing);
    a datetime `time` written as RFC 3339."""
    return {
        HEADER_PREFIX + name: rfc3339(value) if isinstance(value, datetime) else value
        for name, value in attributes.items()
    }


__all__ = [
    "BINDINGS",
    "STRUCTURED_TYPE",
    "Binding",
    "CloudEvent",
    "CloudEventsPublisher",
    "binding",
    "headers_for",
    "parse_time",
    "receive",
    "received",
    "rfc3339",
    "wrap",
]
