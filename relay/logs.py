"""Logging: one logger per module under `relay`, to stderr, text or JSON.

Every record passes a filter that masks the configured secrets, so a
password can reach neither a log line nor an exception text printed in one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from datetime import UTC, datetime

import orjson

# Attributes a LogRecord always has; anything else came in through `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class RedactingFilter(logging.Filter):
    """Replaces each secret with *** in the message, its arguments and extras."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self.secrets = [s for s in secrets if s]

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
                record.exc_text = self._clean(
                    logging.Formatter().formatException(record.exc_info)
                )
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


def setup(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    """Configure the root logger for a relay command; safe to call twice."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JSONFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RedactingFilter(secrets))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # Libraries log connection chatter at INFO; keep it for DEBUG runs.
    for noisy in ("aio_pika", "aiormq", "botocore", "apscheduler", "sqlalchemy"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
