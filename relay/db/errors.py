"""The one translation of driver and SQLAlchemy errors into relay's own.

Errors that mean "the server went away" become DatabaseUnavailable, with
`raise … from exc`, so the loops catch one class and retry with backoff;
a value PostgreSQL refuses in a received batch becomes Refused; an outbox
worker's share lock waited for past lock_timeout becomes ShareBusy. Every path
to PostgreSQL in relay.db goes through `translate_errors` (or, where it
must close a connection first, `unavailable`).

This module imports psycopg but not SQLAlchemy (the receiver's process
loads it): a SQLAlchemy error can only exist once SQLAlchemy is loaded, so
its classes are looked up in sys.modules.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import psycopg

from relay.errors import DatabaseUnavailable, Refused, ShareBusy

Predicate = Callable[[BaseException], bool]

__all__ = [
    "Refused",
    "ShareBusy",
    "any_driver_error",
    "connection_invalidated",
    "describe",
    "failed_command",
    "is_disconnect",
    "is_driver_error",
    "lock_not_available",
    "refused_by_content",
    "server_unavailable",
    "statement_gone",
    "translate_errors",
    "unavailable",
]


def _sqlalchemy(exc: BaseException, name: str) -> bool:
    module = sys.modules.get("sqlalchemy.exc")
    return module is not None and isinstance(exc, getattr(module, name))


def connection_invalidated(exc: BaseException) -> bool:
    """A SQLAlchemy error on a connection its pool has thrown away."""
    return _sqlalchemy(exc, "DBAPIError") and bool(getattr(exc, "connection_invalidated", False))


# What a database answers while it fails over, starts, stops or refuses
# connections: read only (a demoted writer, a hot standby), admin_shutdown,
# crash_shutdown, cannot_connect_now, object_not_in_prerequisite_state,
# too_many_connections. relay waits these out like a server that is away,
# on a new connection: the one that got the answer may stay read only.
UNAVAILABLE_SQLSTATES = frozenset({"25006", "57P01", "57P02", "57P03", "55000", "53300"})


def server_unavailable(exc: BaseException) -> bool:
    """Did the server answer that it cannot take relay's work now (see
    UNAVAILABLE_SQLSTATES)? Looks through SQLAlchemy's wrapper."""
    return getattr(_driver(exc), "sqlstate", None) in UNAVAILABLE_SQLSTATES


def is_disconnect(exc: BaseException) -> bool:
    """Does `exc` mean the server or the connection went away, or that the
    server cannot take writes now (server_unavailable)?"""
    if server_unavailable(exc):
        return True
    if _sqlalchemy(exc, "DBAPIError"):
        return connection_invalidated(exc) or isinstance(
            getattr(exc, "orig", None), psycopg.OperationalError
        )
    return isinstance(exc, (psycopg.OperationalError, OSError)) or _sqlalchemy(
        exc, "InterfaceError"
    )


def statement_gone(exc: BaseException) -> bool:
    """A prepared statement is missing from the session (a pooler between
    relay and the server, say): mended like a lost connection."""
    return isinstance(exc, psycopg.errors.InvalidSqlStatementName)


def _driver(exc: BaseException) -> BaseException:
    """The driver's own error under SQLAlchemy's wrapper, else `exc`."""
    orig = getattr(exc, "orig", None) if _sqlalchemy(exc, "DBAPIError") else None
    return orig if isinstance(orig, BaseException) else exc


def any_driver_error(exc: BaseException) -> bool:
    """Any psycopg error or socket error, also under SQLAlchemy's wrapper:
    the server's or the connection's (gone, read only, out of disk)."""
    return isinstance(_driver(exc), (psycopg.Error, OSError))


def lock_not_available(exc: BaseException) -> bool:
    """A lock waited for past lock_timeout (SQLSTATE 55P03): the connection is
    fine, the transaction is aborted."""
    return isinstance(exc, psycopg.errors.LockNotAvailable)


def is_driver_error(exc: BaseException) -> bool:
    """Did the driver raise it (rather than relay's code, or a cancellation)?
    Looks through SQLAlchemy's wrapper."""
    return isinstance(_driver(exc), psycopg.Error)


def refused_by_content(exc: BaseException) -> bool:
    """Did PostgreSQL refuse a value rather than the connection fail? (See
    Refused.) Looks through SQLAlchemy's wrapper."""
    exc = _driver(exc)
    if isinstance(exc, (psycopg.DataError, psycopg.errors.ProgramLimitExceeded)):
        return True
    sqlstate = getattr(exc, "sqlstate", None) or ""
    return sqlstate.startswith(("22", "54"))


def describe(exc: BaseException) -> str:
    """`Type: first line` of the driver's error, for logs and DatabaseUnavailable."""
    orig = getattr(exc, "orig", None) or exc
    text = str(orig).strip().splitlines()
    return f"{type(orig).__name__}: {text[0] if text else ''}"


def failed_command(command: str, message: str, *, connection_bad: bool) -> Exception:
    """The error for a command sent straight to libpq that failed (the
    handlers' savepoints, relay.db.store.Savepoint): DatabaseUnavailable when
    the connection is gone, else the driver's DatabaseError."""
    if connection_bad:
        return DatabaseUnavailable(f"OperationalError: {message.strip()}")
    return psycopg.DatabaseError(f"{command}: {message.strip()}")


def unavailable(
    exc: BaseException, lost: Predicate = is_disconnect, *, busy: Predicate | None = None
) -> BaseException | None:
    """relay's own error for `exc`, or None when `exc` goes on as it is:
    DatabaseUnavailable when `lost(exc)` (by default: the server went away),
    Refused for a value PostgreSQL would not take when `lost` takes any
    driver error, ShareBusy when `busy(exc)` (the outbox workers' sessions
    pass lock_not_available: the only lock they wait for is their share's)."""
    if isinstance(exc, (DatabaseUnavailable, ShareBusy)) or not isinstance(exc, Exception):
        return None
    if busy is not None and busy(exc):
        return ShareBusy(describe(exc))
    if lost is any_driver_error and is_driver_error(exc) and refused_by_content(exc):
        # The driver's text: SQLAlchemy's adds the statement and its values.
        first = str(_driver(exc)).strip().splitlines()
        return Refused(first[0] if first else type(exc).__name__)
    if lost(exc):
        return DatabaseUnavailable(describe(exc))
    return None


@contextlib.contextmanager
def translate_errors(lost: Predicate = is_disconnect) -> Iterator[None]:
    """Raise relay's own error (see `unavailable`) for what the block raises."""
    try:
        yield
    except Exception as exc:
        error = unavailable(exc, lost)
        if error is None:
            raise
        raise error from exc
