"""The errors relay raises, organised by what the caller should do about them.

    RelayError
    ├── ConfigError          fix the configuration: the command exits 2, one line, no traceback
    ├── SchemaError          fix or apply the schema: exits 2
    │   └── SchemaNotReady   (also Unavailable) the tables are not there yet: wait for them
    ├── Unavailable          a server is away: retry with backoff, never a failed attempt
    │   ├── DatabaseUnavailable
    │   └── BrokerUnavailable
    ├── ShareBusy            another worker holds an outbox worker's share of the keys:
    │                        claim again at once, never a failed attempt, nothing to log
    ├── ContentError         a message relay cannot carry as given (also a ValueError):
    │   │                    never retried as it is; dead, with the reason
    │   ├── InvalidMessage   enqueue refuses it: the app's call raises
    │   ├── BadMessage       an outbox row no broker can carry
    │   ├── NotCarried       received content relay cannot keep as given
    │   └── Refused          PostgreSQL refused a value of a received message
    ├── RestartNeeded        only a fresh process mends it: the daemon exits 1 for its
    │   │                    supervisor to restart it
    │   ├── HandlerHung
    │   └── ReceiverExited
    └── DeadError            a request about dead rows that cannot be done as asked:
        │                    `relay dead` exits 2, the console answers 400
        ├── NotFound         no such dead row: `relay dead` exits 1, the console 404
        └── Ambiguous        the id is dead in several places: name the table or consumer

A wrong argument type (TypeError) or a broken invariant (AssertionError,
RuntimeError) is a programming error and stays Python's own.
"""

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


class ShareBusy(RelayError):
    """An outbox worker's share of the keys is held by another worker (of
    any relay) past the wait (PostgreSQL's lock_not_available), or a scout
    found one share held: its transaction is rolled back and it claims again
    (a scout hands the keys back to their workers). Not an error, not an
    attempt: only DEBUG logs it."""


# -- a message's content -------------------------------------------------------


class ContentError(RelayError, ValueError):
    """A message whose content relay, the broker or PostgreSQL cannot take as
    given: trying it again as it is cannot help, so it is dead with the reason
    (an outbox row at once; a received message is kept as a dead row)."""


class InvalidMessage(ContentError):
    """A message relay.enqueue cannot write as given (a NUL character, JSON
    nested too deep, a name over the broker's limit): nothing is written."""


class BadMessage(ContentError):
    """An outbox row no broker can carry; publishing it again cannot help."""


class NotCarried(ContentError):
    """Received content relay cannot keep as given (invalid UTF-8 or JSON, a
    NUL character, JSON nested too deep): the row keeps it escaped, or dead."""


class Refused(ContentError):
    """PostgreSQL refused a value of the batch: a data exception (SQLSTATE
    class 22: NUL characters, bad encodings, numbers out of range) or a
    program limit (class 54: an index entry too big). The message's fault,
    not the connection's. `stored`: the ids of rows of the batch that were
    stored all the same (the receiving transactions of its other keys,
    relay.inbox.Handing)."""

    stored: frozenset[str] = frozenset()


# -- only a fresh process mends it ---------------------------------------------


class RestartNeeded(RelayError):
    """A part of the daemon is beyond repair in this process: the daemon
    exits 1 so that its supervisor starts a fresh one."""


class HandlerHung(RestartNeeded):
    """A handler ran far past --handler-timeout and could not be interrupted."""


class ReceiverExited(RestartNeeded):
    """The receiver process ended without being asked to."""


# -- the dead-message workflow -------------------------------------------------


class DeadError(RelayError):
    """A request about dead rows that cannot be done as asked (bad input, no such row)."""


class NotFound(DeadError):
    """No dead row matches."""


class Ambiguous(DeadError):
    """An id matches dead rows in more than one table or consumer."""


class ReplayError(ConfigError):
    """A replay asked for as it cannot be done: no filter, a bad time or pattern."""


class ReplayBusy(RelayError):
    """A replay's keys stayed held by other transactions past its lock
    timeout: nothing was replayed; try again."""
