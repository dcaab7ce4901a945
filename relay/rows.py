"""The rows the loops and the adapters pass around.

A module of its own, free of SQLAlchemy, so that the inbox's receiver
process (relay.receiving) and the broker adapters load without it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

# Message attributes added above the brokers: (name, value) pairs.
Attributes = tuple[tuple[str, str | int], ...]


# Not frozen: a frozen dataclass's __init__ sets each field through
# object.__setattr__, 1.9 µs a row against 0.3 µs, paid for every claimed row
# and again for each row a wrapper above the brokers remakes with attributes
# (relay.cloudevents). Nothing assigns to a row's fields once made: wrappers
# make new rows (dataclasses.replace), never change the claimed ones.
@dataclass(slots=True)
class OutboxRow:
    """A claimed outbox row, as the publishers see it."""

    id: str  # the UUID's text
    seq: int
    topic: str
    key: str | None
    type: str | None
    payload: str  # JSON text as PostgreSQL renders it
    headers: str  # JSON object text
    created_at: datetime
    attempts: int
    # The seam between the layers above the brokers (the claim check, and
    # any envelope put around a publisher by the wiring) and the adapters:
    # message attributes that a layer adds, which every adapter writes where
    # its wire carries a message's own attributes (an AMQP header, an SQS
    # message attribute, a Kafka header). An int is a number: an AMQP
    # integer, an SQS Number attribute, a Kafka header's decimal text. No
    # adapter knows which layer added which name.
    attributes: Attributes = ()


class InboxRow(NamedTuple):
    """A claimed inbox row, as the dispatcher sees it (a named tuple: a
    batch makes hundreds of them from the claim's rows)."""

    message_id: str
    seq: int
    topic: str | None
    key: str | None
    type: str | None
    payload: str | None  # JSON text, or None for a body that is not JSON
    headers: str
    attempts: int


class Reserved(NamedTuple):
    """`seq` values reserved for received rows, ascending, in their order of
    arrival, and the server's time when they were (Store.reserve_seqs)."""

    seqs: list[int]
    at: datetime


# Not frozen either (the receiver makes one for every message it takes),
# and pickled as its fields, as it crosses the socket pair to the daemon
# under --dispatch received (relay.receiver_process): a frozen slots
# dataclass's own state methods cost 2.2 µs a row to pickle and 2.7 to
# unpickle, the constructor's arguments 0.8 and 0.3, and its __init__ 1.9
# µs against 0.3.
@dataclass(slots=True)
class NewInboxRow:
    """A received message ready for the receiver's INSERT (relay.db.writer)."""

    message_id: str
    topic: str | None
    key: str | None
    type: str | None
    payload: str | None  # JSON text
    body: bytes | None  # the raw body, kept when it is not JSON
    headers: str  # JSON object text
    status: str = "pending"
    last_error: str | None = None
    raw_properties: str | None = None  # JSON text (relay.storable)

    def __reduce__(self) -> tuple[Callable[..., NewInboxRow], tuple[Any, ...]]:
        return (NewInboxRow, _new_inbox_fields(self))


_new_inbox_fields = operator.attrgetter(*NewInboxRow.__slots__)


@dataclass(frozen=True, slots=True)
class Failure:
    """Why one message could not be published or handled."""

    error: str
    permanent: bool = False  # retrying cannot help: dead at once
