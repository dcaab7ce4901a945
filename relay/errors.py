"""The errors relay raises, organised by what the caller should do about them."""

from __future__ import annotations


class RelayError(Exception):
    """Base of every error relay raises on purpose."""


class ConfigError(RelayError):
    """Bad configuration: the command exits 2 with this message, no traceback."""


class SchemaError(RelayError):
    """The database schema is missing, or newer than this relay understands."""


class Unavailable(RelayError):
    """A server cannot be reached now. Retried with backoff; never a failed attempt."""


class DatabaseUnavailable(Unavailable):
    """PostgreSQL is unreachable or the connection broke."""


class BrokerUnavailable(Unavailable):
    """The broker is unreachable, or the connection or channel broke."""


class SchemaNotReady(SchemaError, Unavailable):
    """The tables are missing or older than this relay: waited for, not fatal."""


class HandlerError(RelayError):
    """Raised by the handler test helper when a handler run fails."""
