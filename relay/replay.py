"""Replay: finished rows back to `pending`, to be published or handled again.

The library behind `relay replay outbox|inbox` and the console's replay.
Published outbox rows go back to pending with their id and seq, attempts
reset: the relay publishes them again in their key's order (a consumer that
had them drops them as duplicates, a new one gets them). Processed inbox
rows go back to pending and run through their handlers again. Dead rows are
not replayed: `relay retry` and `relay dead retry` are theirs.

Order against the rows still pending: a replayed row keeps its seq, lower
than that of any pending row of its key, so the claims take it first, as
they take every key's rows in seq order. One race is closed by a hold (see
queries/replay.sql): a claim that began before the replay committed reads
the key in a snapshot where the replayed rows are still finished, and would
take the key's next pending row ahead of them; the hold keeps those rows
locked until such claims have ended. docs/replay.md has the details.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from relay.audit import Actor, record
from relay.config import parse_duration
from relay.db import Store
from relay.db import replay as sql
from relay.errors import ConfigError, ReplayBusy, ReplayError

log = logging.getLogger("relay.replay")

TABLES = ("outbox", "inbox")
# How long the hold waits for the claims that began before the replay
# committed (a claim takes milliseconds; a statement that runs longer is
# someone else's, and waiting on it helps nothing).
HOLD_TIMEOUT = 3.0
# How long the hold waits for the batches that hold its keys' pending rows
# (a batch takes milliseconds; an inbox handler up to --handler-timeout).
LOCK_TIMEOUT = 60.0


@dataclass(frozen=True)
class ReplayFilter:
    """Which finished rows: every field that is set must match; one at least."""

    table: str
    since: datetime | None = None  # written at or after (created_at, received_at)
    until: datetime | None = None  # written before
    topic: str | None = None  # a RabbitMQ topic pattern: `*` one word, `#` any
    type: str | None = None
    key: str | None = None
    consumer: str | None = None  # inbox only

    def __post_init__(self) -> None:
        if self.table not in TABLES:
            raise ReplayError(f"unknown table {self.table!r}: use outbox or inbox")
        if self.consumer is not None and self.table == "outbox":
            raise ReplayError("--consumer applies to the inbox only")
        if all(getattr(self, f) is None for f in self.filter_fields()):
            raise ReplayError(
                "replay which rows? give at least one filter: --since, --until, --topic, "
                "--type, --key" + (", --consumer" if self.table == "inbox" else "")
            )
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise ReplayError("--since must be before --until")
        if self.topic is not None and not self.topic:
            raise ReplayError("--topic is empty")

    @staticmethod
    def filter_fields() -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(ReplayFilter) if f.name != "table")

    def topic_regex(self) -> str:
        assert self.topic is not None
        return topic_regex(self.topic)

    def describe(self) -> dict[str, str]:
        """The filter as text, for the audit trail and the confirmations."""
        out = {"table": self.table}
        for name in self.filter_fields():
            value = getattr(self, name)
            if value is not None:
                out[name] = value.isoformat() if isinstance(value, datetime) else str(value)
        return out


def topic_regex(pattern: str) -> str:
    """A RabbitMQ topic pattern as a regular expression (of PostgreSQL's and
    Python's alike) over the topic with a '.' in front: words are separated
    by dots, `*` is exactly one word and `#` zero or more. Every word is
    matched after its dot, so `#` (any number of dot-word pairs) can stand
    for none at all: `orders.#` matches `orders` and `orders.a.b`."""
    parts = []
    for word in pattern.split("."):
        if word == "#":
            parts.append(r"(\.[^.]*)*")
        elif word == "*":
            parts.append(r"\.[^.]*")
        else:
            parts.append(r"\." + "".join(c if c.isalnum() or c == "_" else "\\" + c for c in word))
    return "^" + "".join(parts) + "$"


def parse_when(text: str, now: datetime | None = None) -> datetime:
    """An ISO time (UTC unless it says otherwise) or a duration back from
    now (`90s`, `30m`, `2h`, `7d`, plain seconds)."""
    now = now or datetime.now(UTC)
    try:
        return now - timedelta(seconds=parse_duration(text))
    except ConfigError:
        pass
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ReplayError(
            f"invalid time {text!r}: give an ISO time (2026-11-26T09:00:00Z) "
            "or a duration back from now (90s, 30m, 2h, 7d)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


async def count(store: Store, where: ReplayFilter) -> int:
    """How many rows a replay would move now (the dry run)."""
    async with store.connection() as conn:
        return await sql.count(conn, where.table, where)


async def replay(
    store: Store,
    where: ReplayFilter,
    *,
    by: Actor | None = None,
    hold_timeout: float = HOLD_TIMEOUT,
    lock_timeout: float = LOCK_TIMEOUT,
) -> int:
    """Move the matching finished rows back to pending; returns how many.
    With `by`, the audit trail records it in the same transaction. When the
    keys' pending rows stay locked past `lock_timeout` seconds: ReplayBusy,
    and nothing moved.

    Needs two connections of the store: the hold's and the replay's."""
    async with store.transaction() as held:
        await sql.hold(held, where.table, where, lock_timeout)
        async with store.transaction() as conn:
            moved = await sql.move(conn, where.table, where)
            if by is not None:
                chosen = {k: v for k, v in where.describe().items() if k != "table"}
                await record(conn, by, "replay", table=where.table, filter=chosen, count=moved)
        if not await sql.wait_out_older_statements(held, hold_timeout):
            log.warning(
                "replay: statements older than the replay still ran after %.0fs; "
                "the hold on the replayed keys' pending rows ends anyway",
                hold_timeout,
            )
    log.debug("replayed %d %s rows", moved, where.table, extra={"action": "replay"})
    return moved


async def run(
    database_url: str,
    where: ReplayFilter,
    *,
    dry_run: bool = False,
    by: Actor | None = None,
    schema: str | None = None,
) -> int:
    """`relay replay`: the count (dry run) or the replay, on a store of its own
    (on `schema`'s tables)."""
    store = Store(database_url, pool_size=2, schema=schema)
    try:
        await store.check_schema()
        if dry_run:
            return await count(store, where)
        return await replay(store, where, by=by)
    finally:
        await store.close()


__all__ = [
    "ReplayBusy",
    "ReplayError",
    "ReplayFilter",
    "count",
    "parse_when",
    "replay",
    "run",
    "topic_regex",
]
