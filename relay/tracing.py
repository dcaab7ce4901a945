"""OpenTelemetry spans for each outbox row sent and each inbox message handled.

Optional: with the extra `relay-outbox[otel]` installed and OTEL_TRACES_EXPORTER
set (`console`, `otlp`, ...), the daemons configure the SDK from the
standard OTEL_* variables, as `opentelemetry-instrument` would, and trace:

- each outbox row: a PRODUCER span `send <topic>`, child of the row's
  `traceparent` header (the producer's request), from the publish to the
  broker's confirm;
- each inbox message: a CONSUMER span `process <topic>`, child of the
  message's `traceparent`, around its handler, which runs inside it (the
  handler's own spans and log lines belong to it);
- each call of a batch handler: a CONSUMER span `process batch <type>`,
  current while the handler runs, and for each of its messages a span
  `process <topic>` as above, child of the message's `traceparent` and
  linked to every batch span the message took part in (a batch that
  failed runs again in parts), from the first call to the message's fate.

On the producer's side, `relay.enqueue` adds the app's current context
(`traceparent`, and `tracestate`/`baggage` when set) to the row's headers
when the app runs inside a span and gave no `traceparent` itself: that needs
only OpenTelemetry's API, which the app has if it traces.

Attributes follow OpenTelemetry's messaging semantic conventions. Without
the SDK, or with OTEL_TRACES_EXPORTER unset or `none`, nothing here runs
per message: `enabled` is False and the loops skip it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

# The messaging.system value per broker kind (relay.config.BrokerURL.kind).
SYSTEMS = {"amqp": "rabbitmq", "sqs": "aws_sqs", "kafka": "kafka"}

enabled = False
_tracer: Any = None
_provider: Any = None


def setup(service: str) -> bool:
    """Configure the SDK from OTEL_* if it is installed and asked for; True
    if spans will be exported. Safe to call more than once."""
    global enabled, _tracer, _provider
    if enabled:
        return True
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter or exporter == "none":
        return False
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk._configuration import _OTelSDKConfigurator
    except ImportError:
        log.warning(
            "OTEL_TRACES_EXPORTER is set but OpenTelemetry's SDK is not installed "
            "(pip install 'relay-outbox[otel]'): no spans are exported"
        )
        return False
    attributes = {}
    if "OTEL_SERVICE_NAME" not in os.environ and "service.name" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        attributes["service.name"] = service
    try:
        configurator = _OTelSDKConfigurator()  # type: ignore[no-untyped-call]
        configurator.configure(  # type: ignore[no-untyped-call]
            resource_attributes=attributes
        )
    except Exception as exc:  # an unknown exporter name, say: tracing is not worth a crash
        log.warning(
            "OpenTelemetry could not be configured from OTEL_* (%s: %s): no spans are exported",
            type(exc).__name__,
            exc,
        )
        return False
    _provider = trace.get_tracer_provider()
    _tracer = trace.get_tracer("relay")
    enabled = True
    log.info("tracing: spans exported to %s", exporter)
    return True


def shutdown() -> None:
    """Export what is buffered (before the process exits)."""
    if _provider is not None and hasattr(_provider, "shutdown"):
        with contextlib.suppress(Exception):
            _provider.shutdown()


async def flush() -> None:
    """shutdown() for a daemon's on_stop list."""
    shutdown()


_propagation: Any = None  # (get_current_span, inject) once looked up; False: no OpenTelemetry


def add_current_context(headers: dict[str, str]) -> None:
    """Put the caller's current trace context into an outbox row's headers,
    unless they carry a traceparent already or no span is current."""
    global _propagation
    if _propagation is None:
        try:
            from opentelemetry.propagate import inject
            from opentelemetry.trace import get_current_span
        except ImportError:
            _propagation = False
        else:
            _propagation = (get_current_span, inject)
    if not _propagation or "traceparent" in headers:
        return
    get_current_span, inject = _propagation
    if not get_current_span().get_span_context().is_valid:
        return
    carrier: dict[str, str] = {}
    inject(carrier)
    for name, value in carrier.items():
        if isinstance(value, str):
            headers.setdefault(name, value)


def _parent(headers: Mapping[str, Any] | None) -> Any:
    from opentelemetry.propagate import extract

    carrier = {k: v for k, v in (headers or {}).items() if isinstance(v, str)}
    return extract(carrier)


def start_send(
    rows: Sequence[Any], system: str, destination: str | None, headers: Sequence[Mapping[str, Any]]
) -> list[Any]:
    """One PRODUCER span per outbox row (relay.rows.OutboxRow), started now."""
    from opentelemetry.trace import SpanKind

    spans = []
    for row, row_headers in zip(rows, headers, strict=True):
        attributes = {
            "messaging.system": system,
            "messaging.operation.type": "send",
            "messaging.operation.name": "send",
            "messaging.destination.name": destination or row.topic,
            "messaging.message.id": row.id,
            "relay.outbox.attempts": row.attempts,
        }
        if system == "rabbitmq":
            attributes["messaging.rabbitmq.destination.routing_key"] = row.topic
        if row.key is not None:
            attributes["relay.key"] = row.key
        spans.append(
            _tracer.start_span(
                f"send {row.topic}",
                context=_parent(row_headers),
                kind=SpanKind.PRODUCER,
                attributes=attributes,
            )
        )
    return spans


def end_send(spans: Sequence[Any], errors: Sequence[str | None]) -> None:
    """End the spans of start_send: an error text marks a span failed."""
    from opentelemetry.trace import Status, StatusCode

    for span, error in zip(spans, errors, strict=True):
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error.splitlines()[0] if error else ""))
        span.end()


def failed(span: Any, error: str) -> None:
    """Mark a span failed with the first line of an error text."""
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, error.splitlines()[-1] if error else ""))


def _consumer_attributes(system: str, consumer: str) -> dict[str, Any]:
    return {
        "messaging.system": system,
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.consumer.group.name": consumer,
    }


def _message_span(system: str, message: Any) -> dict[str, Any]:
    """The arguments of start_span for an inbox message (a relay.Message)."""
    from opentelemetry.trace import SpanKind

    attributes = _consumer_attributes(system, message.consumer)
    attributes["messaging.message.id"] = message.id
    attributes["relay.inbox.attempts"] = message.attempts
    if message.topic is not None:
        attributes["messaging.destination.name"] = message.topic
    if message.type is not None:
        attributes["relay.message.type"] = message.type
    return {
        "name": f"process {message.topic or message.type or message.consumer}",
        "context": _parent(message.headers),
        "kind": SpanKind.CONSUMER,
        "attributes": attributes,
    }


@contextlib.contextmanager
def process(system: str, message: Any) -> Iterator[Any]:
    """A CONSUMER span around one handler run for `message` (a
    relay.Message), current while it runs."""
    with _tracer.start_as_current_span(
        **_message_span(system, message), record_exception=True, set_status_on_exception=True
    ) as span:
        yield span


@contextlib.contextmanager
def process_batch(system: str, consumer: str, type_: str | None, count: int) -> Iterator[Any]:
    """A CONSUMER span around one call of a batch handler, current while it runs."""
    from opentelemetry.trace import SpanKind

    attributes = _consumer_attributes(system, consumer)
    attributes["messaging.batch.message_count"] = count
    if type_ is not None:
        attributes["relay.message.type"] = type_
    with _tracer.start_as_current_span(
        f"process batch {type_ or consumer}",
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        record_exception=True,
        set_status_on_exception=True,
    ) as span:
        yield span


def batch_message(
    system: str, message: Any, *, batches: Sequence[Any], started: int, error: str | None
) -> None:
    """The span of one message (a relay.Message) of a batch handler, ended
    now: child of the message's trace, linked to the `batches` (spans of
    process_batch) it took part in, from `started` (time.time_ns()) on."""
    from opentelemetry.trace import Link

    span = _tracer.start_span(
        **_message_span(system, message),
        links=[Link(batch.get_span_context()) for batch in batches],
        start_time=started,
    )
    if error is not None:
        failed(span, error)
    span.end()
