"""Logging: one logger per module under `relay`, to stderr, text or JSON.

Every record passes two filters on the handler: the first adds the message
being handled (message_id, type, topic, traceparent), so that a handler's
own log lines carry them; the second masks the configured secrets, so a
password can reach neither a log line nor an exception text printed in one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import sys
import urllib.parse
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:  # relay.handlers loads SQLAlchemy; the receiver process logs without it
    from relay.handlers import Handler, HandlerRegistry, Message

# Attributes a LogRecord always has; anything else came in through `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


# The message a handler is running for. A sync handler runs through
# AsyncConnection.run_sync in a greenlet of the dispatcher's thread; the
# wrapper below sets the variable inside that call, where the handler's
# logging happens. Its log fields are made only for a record that is
# emitted: most handler runs log nothing.
_current_message: contextvars.ContextVar[Message | None] = contextvars.ContextVar(
    "relay_current_message", default=None
)


def message_fields(message: Message) -> dict[str, str]:
    """The log fields of a message: id, type, topic and traceparent when set."""
    fields = {
        "message_id": message.id,
        "type": message.type,
        "topic": message.topic,
        "traceparent": message.headers.get("traceparent"),
    }
    return {k: str(v) for k, v in fields.items() if v is not None}


@contextlib.contextmanager
def message_context(message: Message) -> Iterator[None]:
    """Log records emitted inside carry the message's id, type, topic and traceparent."""
    token = _current_message.set(message)
    try:
        yield
    finally:
        _current_message.reset(token)


# The source (`database/schema`) an outbox of several sources runs a loop
# for (relay.sources): set in the context its tasks are created in, so that
# every line of that source's loops, listener and jobs names it.
_current_source: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "relay_current_source", default=None
)


def set_source(label: str | None) -> None:
    """Log records of this context (and of tasks created in it) carry `source`."""
    _current_source.set(label)


class MessageContextFilter(logging.Filter):
    """Adds the fields of the message being handled (and the source, in an
    outbox of several) to records that lack them."""

    def filter(self, record: logging.LogRecord) -> bool:
        source = _current_source.get()
        if source is not None and not hasattr(record, "source"):
            record.source = source
        message = _current_message.get()
        if message is not None:
            for key, value in message_fields(message).items():
                if not hasattr(record, key):
                    setattr(record, key, value)
        return True


def _with_context(fn: Handler) -> Handler:
    from relay.handlers import is_async

    if is_async(fn):

        @functools.wraps(fn)
        async def run_async(message: Message, conn: Any) -> Any:
            with message_context(message):
                return await fn(message, conn)

        return run_async

    @functools.wraps(fn)
    def run(message: Message, conn: Any) -> Any:
        token = _current_message.set(message)  # message_context(), without a generator
        try:
            return fn(message, conn)
        finally:
            _current_message.reset(token)

    return run


def with_log_context(registry: HandlerRegistry) -> HandlerRegistry:
    """The same handlers, each running inside message_context(); batch
    handlers as they are."""
    from relay.handlers import HandlerRegistry

    wrapped = HandlerRegistry()
    for type_ in registry.types:
        handler = registry.get(type_)
        if handler is not None:
            wrapped.add(type_, _with_context(handler))
            continue
        # A batch handler runs for many messages at once: its log lines
        # carry none of them (each message has its span; relay.tracing).
        batch = registry.get_batch(type_)
        assert batch is not None
        wrapped.add_batch(type_, *batch)
    return wrapped


def _secret_forms(secrets: Iterable[str | None]) -> list[str]:
    """Each secret as given and percent-encoded (as it appears inside a URL)."""
    forms: list[str] = []
    for secret in secrets:
        if not secret:
            continue
        for form in (secret, urllib.parse.quote(secret, safe=""), urllib.parse.quote(secret)):
            if form not in forms:
                forms.append(form)
    # Longest first, so that a secret inside another is not half-masked.
    return sorted(forms, key=len, reverse=True)


class RedactingFilter(logging.Filter):
    """Replaces each secret with *** in the message, its arguments and extras."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = _secret_forms(secrets)

    def _clean(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if self.secrets:
            record.msg = self._clean(record.getMessage())
            record.args = None
            for key, value in list(vars(record).items()):
                if key in _STANDARD or key.startswith("_") or value is None:
                    continue
                text = value if isinstance(value, str) else str(value)
                if any(secret in text for secret in self.secrets):
                    setattr(record, key, self._clean(text))
            if record.exc_info and record.exc_info[1] is not None:
                record.exc_text = self._clean(logging.Formatter().formatException(record.exc_info))
                record.exc_info = None
        return True


class JSONFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["error"] = record.exc_text
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """`time level logger: message key=value ...`."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{key}={value}"
            for key, value in vars(record).items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        if extras:
            head, sep, tail = line.partition("\n")
            line = head + " " + " ".join(extras) + sep + tail
        return line


# What setup() was last given, for a helper process to log the same way.
_configured: tuple[str, str, tuple[str, ...]] | None = None


def configuration() -> tuple[str, str, tuple[str, ...]] | None:
    """(level, format, secrets) of the last setup(), or None before any."""
    return _configured


def add_secrets(secrets: Iterable[str]) -> None:
    """Mask these too from now on (sources read at run time)."""
    if _configured is None:
        return
    level, fmt, known = _configured
    more = [s for s in secrets if s and s not in known]
    if more:
        setup(level, fmt, [*known, *more])


def setup(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    """Configure the root logger for a relay command; safe to call twice."""
    global _configured
    _configured = (level, fmt, tuple(secrets))
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(MessageContextFilter())
    handler.addFilter(RedactingFilter(_configured[2]))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries log connection chatter at INFO; keep it for DEBUG runs.
    for noisy in ("aio_pika", "aiormq", "botocore", "apscheduler", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    # aiormq logs every failed connect and every connection the broker
    # closes as an ERROR of its own; relay logs each once, with what it does
    # next (reconnect_wait), so keep aiormq's for DEBUG runs: one line per retry.
    if root.level > logging.DEBUG:
        logging.getLogger("aiormq.connection").setLevel(logging.CRITICAL)
