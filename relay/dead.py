"""Dead messages: list, show, group, edit, retry and discard them.

The library behind `relay dead …` and the console (relay.console). Both
tables are covered; a filter picks rows by table, consumer, topic, type,
key, error text, error group and age. Lists are paged by keyset on `seq`
(newest first, outbox before inbox), walking the dead-only partial indexes
of schema/004_dead_messages.sql, so a page costs the same beside a million
live rows. Retries run the store's own RETRY statement; a discard moves the
rows whole into `relay_discarded` in the same transaction (see
docs/dead-messages.md for why a table and not a status).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import re
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from relay import storable
from relay.audit import Actor, edit_state, record
from relay.claimcheck.inbound import Fetch
from relay.claimcheck.retry import Restore, fetch_from
from relay.config import ClaimCheckURL
from relay.db import AsyncConnection, Store, retry_in
from relay.db import dead as sql
from relay.errors import Ambiguous, DeadError, NotFound

TABLES = ("outbox", "inbox")
MAX_PAGE = 500


@dataclass(frozen=True)
class DeadFilter:
    """Which dead rows: every field that is set must match."""

    table: str | None = None  # outbox, inbox, or None for both
    consumer: str | None = None
    topic: str | None = None
    type: str | None = None
    key: str | None = None
    error: str | None = None  # text anywhere in last_error, case-insensitive
    group: str | None = None  # the error group, exactly (see relay.db.dead.error_line)
    older_than: float | None = None  # seconds since the row was written
    newer_than: float | None = None

    def __post_init__(self) -> None:
        if self.table is not None and self.table not in TABLES:
            raise DeadError(f"unknown table {self.table!r}: use outbox or inbox")
        if self.consumer is not None and self.table == "outbox":
            raise DeadError("a consumer applies to the inbox only")
        for name in ("older_than", "newer_than"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise DeadError(f"{name.replace('_', '-')} must not be negative")

    def tables(self) -> tuple[str, ...]:
        if self.table is not None:
            return (self.table,)
        # A consumer only exists in the inbox.
        return ("inbox",) if self.consumer is not None else TABLES

    def is_empty(self) -> bool:
        return all(getattr(self, f.name) is None for f in dataclasses.fields(self))

    def where(self, table: str) -> tuple[str, dict[str, Any]]:
        """The SQL condition (on alias `d`) and its parameters."""
        return sql.condition(table, self)


@dataclass(frozen=True)
class DeadSummary:
    """One dead row in a list."""

    table: str
    id: str  # outbox: the UUID; inbox: the message_id
    consumer: str | None
    seq: int
    topic: str | None
    key: str | None
    type: str | None
    attempts: int
    error: str  # the error group: exception type and first line
    written_at: datetime  # created_at (outbox) or received_at (inbox)
    available_at: datetime

    def to_json(self) -> dict[str, Any]:
        """The row as `relay dead list --json` prints it."""
        out: dict[str, Any] = {"table": self.table}
        if self.table == "outbox":
            out["id"] = self.id
        else:
            out["message_id"] = self.id
            out["consumer"] = self.consumer
        out.update(
            topic=self.topic,
            type=self.type,
            key=self.key,
            attempts=self.attempts,
            last_error=self.error,
            seq=self.seq,
        )
        out["created_at" if self.table == "outbox" else "received_at"] = self.written_at.isoformat()
        out["available_at"] = self.available_at.isoformat()
        return out


@dataclass(frozen=True)
class DeadRow:
    """One dead row in full."""

    summary: DeadSummary
    payload: Any  # the JSON value; None both for JSON null and for a non-JSON body
    payload_text: str | None  # the payload's JSON text as stored, None when not JSON
    headers: dict[str, Any]
    body: bytes | None  # inbox: the raw body when it was not JSON
    last_error: str
    raw_properties: str | None

    def to_json(self) -> dict[str, Any]:
        out = self.summary.to_json()
        out.update(
            payload=self.payload,
            headers=self.headers,
            last_error=self.last_error,
            error_group=self.summary.error,
        )
        if self.body is not None:
            out["body_base64"] = base64.b64encode(self.body).decode()
        if self.raw_properties is not None:
            out["raw_properties"] = json.loads(self.raw_properties)
        return out

    @property
    def body_text(self) -> str | None:
        """The raw body as text for people to read: undecodable bytes and control
        characters (a NUL, an escape sequence) as \\x escapes, so a terminal or
        a page shows them rather than acting on them."""
        if self.body is None:
            return None
        text = self.body.decode("utf-8", errors="backslashreplace")
        return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True)
class Page:
    rows: list[DeadSummary]
    next_cursor: str | None  # give it as `after` for the next page


@dataclass(frozen=True)
class ErrorGroup:
    table: str
    error: str
    count: int
    newest: datetime


def summarize(rows: Sequence[DeadSummary], limit: int = 20) -> list[ErrorGroup]:
    """The error groups of these rows, as DeadMessages.groups would count them."""
    found: dict[tuple[str, str], ErrorGroup] = {}
    for r in rows:
        g = found.get((r.table, r.error))
        found[(r.table, r.error)] = ErrorGroup(
            r.table,
            r.error,
            (g.count if g else 0) + 1,
            max(g.newest, r.written_at) if g else r.written_at,
        )
    return sorted(found.values(), key=lambda g: (-g.count, g.table, g.error))[:limit]


def _cursor(table: str, seq: int) -> str:
    return f"{table}:{seq}"


def parse_cursor(text: str | None) -> tuple[str, int] | None:
    """`outbox:123` or `inbox:45` (from Page.next_cursor), or DeadError."""
    if not text:
        return None
    table, _, seq = text.partition(":")
    if table not in TABLES or not seq.isdigit():
        raise DeadError(f"invalid cursor {text!r}: give the one a page printed")
    return table, int(seq)


class DeadMessages:
    """Dead rows of one database. Use as `async with DeadMessages(url) as dead:`,
    or give it a Store that outlives it (the console's)."""

    def __init__(self, store: Store, fetch: Fetch | None = None) -> None:
        self.store = store
        # Fetches the S3 object of an inbox row kept as a claim check
        # pointer before it is retried (relay.db.store.retry_in); without
        # it such rows stay dead, saying so.
        self.restore = Restore(fetch)

    # -- reading ----------------------------------------------------------------

    async def page(self, where: DeadFilter, *, limit: int = 50, after: str | None = None) -> Page:
        """One page of dead rows, newest first; outbox rows before inbox rows."""
        if not 1 <= limit <= MAX_PAGE:
            raise DeadError(f"a page holds 1 to {MAX_PAGE} rows")
        position = parse_cursor(after)
        tables = where.tables()
        if position is not None and position[0] in tables:
            tables = tables[tables.index(position[0]) :]
        rows: list[DeadSummary] = []
        async with self._connect() as conn:
            for table in tables:
                want = limit + 1 - len(rows)
                if want <= 0:
                    break
                after_seq = position[1] if position is not None and position[0] == table else None
                result = await sql.page(conn, table, where, limit=want, after_seq=after_seq)
                rows.extend(DeadSummary(table, *r) for r in result)
        more = len(rows) > limit
        rows = rows[:limit]
        return Page(rows, _cursor(rows[-1].table, rows[-1].seq) if more and rows else None)

    async def count(self, where: DeadFilter, cap: int | None = None) -> dict[str, int]:
        """Matching dead rows per table; counting stops at `cap` when given."""
        counts: dict[str, int] = {}
        async with self._connect() as conn:
            for table in where.tables():
                counts[table] = await sql.count(conn, table, where, cap)
        return counts

    async def groups(
        self, where: DeadFilter, limit: int = 100, newest: int | None = None
    ) -> list[ErrorGroup]:
        """Dead rows by error group (exception type and first line), largest first;
        of only the `newest` rows of each table when given (a page's quick look)."""
        found: list[ErrorGroup] = []
        async with self._connect() as conn:
            for table in where.tables():
                result = await sql.groups(conn, table, where, limit=limit, newest=newest)
                for error, count, latest in result:
                    found.append(ErrorGroup(table, error, count, latest))
        found.sort(key=lambda g: (-g.count, g.table, g.error))
        return found[:limit]

    async def get(
        self, row_id: str, *, table: str | None = None, consumer: str | None = None
    ) -> DeadRow:
        """One dead row by its id (outbox) or message_id (inbox); NotFound or Ambiguous."""
        where = DeadFilter(table=table, consumer=consumer)
        found: list[DeadRow] = []
        async with self._connect() as conn:
            for name in where.tables():
                found.extend(await self._fetch(conn, name, row_id, consumer))
        if not found:
            raise NotFound(f"no dead row with id {row_id!r}")
        if len(found) > 1:
            places = ", ".join(
                r.summary.table
                if r.summary.consumer is None
                else f"inbox consumer {r.summary.consumer!r}"
                for r in found
            )
            raise Ambiguous(
                f"id {row_id!r} is dead in several places ({places}): "
                "say which with --table and --consumer"
            )
        return found[0]

    async def _fetch(
        self, conn: AsyncConnection, table: str, row_id: str, consumer: str | None
    ) -> list[DeadRow]:
        if table == "outbox" and not _is_uuid(row_id):
            return []
        rows = []
        for r in await sql.get(conn, table, row_id, consumer):
            payload_text, headers_text, last_error, body, raw = r[10:]
            rows.append(
                DeadRow(
                    summary=DeadSummary(table, *r[:10]),
                    payload=_loads(payload_text),
                    payload_text=payload_text,
                    headers=_loads(headers_text) or {},
                    body=bytes(body) if body is not None else None,
                    last_error=last_error,
                    raw_properties=raw,
                )
            )
        return rows

    # -- changing -----------------------------------------------------------------

    async def retry(
        self, where: DeadFilter, *, ids: Sequence[str] = (), by: Actor | None = None
    ) -> dict[str, int]:
        """Dead rows matching `where` (and, when given, with these ids) back to
        pending with attempts reset; returns how many per table. With `by`,
        the audit trail records it in the same transaction."""
        done: dict[str, int] = {}
        async with self._transaction() as conn:
            for table in where.tables():
                count = 0
                for consumer, chosen in (await self._select(conn, table, where, ids)).items():
                    count += await _retry_rows(conn, table, chosen, consumer, self.restore)
                done[table] = count
            await _audit(conn, by, "retry", where, ids, done)
        return done

    async def edit(
        self,
        row_id: str,
        *,
        table: str | None = None,
        consumer: str | None = None,
        payload: str | None = None,
        headers: str | None = None,
        retry: bool = True,
        by: Actor | None = None,
    ) -> DeadRow:
        """Replace a dead row's payload and/or headers (JSON texts), then retry it
        (unless retry=False), in one transaction. Returns the row as it was.
        With `by`, the audit trail records it, the payload and headers before
        and after, in the same transaction."""
        if payload is None and headers is None:
            raise DeadError("nothing to edit: give a payload or headers")
        new_payload = _check_payload(payload) if payload is not None else None
        new_headers = _check_headers(headers) if headers is not None else None
        before = await self.get(row_id, table=table, consumer=consumer)
        table, consumer = before.summary.table, before.summary.consumer
        async with self._transaction() as conn:
            changed = await sql.edit(
                conn, table, row_id, consumer, payload=new_payload, headers=new_headers
            )
            if changed != 1:
                raise NotFound(f"the row {row_id!r} is no longer dead")
            if retry:
                await _retry_rows(conn, table, [row_id], consumer)
            if by is not None:
                old_headers = json.dumps(before.headers)
                await record(
                    conn,
                    by,
                    "edit",
                    table=table,
                    filter={"consumer": consumer} if consumer is not None else None,
                    ids=[row_id],
                    count=1,
                    before=edit_state(before.payload_text, old_headers, before.body_text),
                    after=edit_state(
                        new_payload if new_payload is not None else before.payload_text,
                        new_headers if new_headers is not None else old_headers,
                        before.body_text,
                    ),
                    detail="edited and retried" if retry else "edited",
                )
        return before

    async def discard(
        self,
        where: DeadFilter,
        *,
        ids: Sequence[str] = (),
        reason: str | None = None,
        by: Actor | None = None,
    ) -> dict[str, int]:
        """Delete dead rows matching `where` (and these ids), each copied whole into
        relay_discarded in the same transaction; returns how many per table.
        With `by`, the audit trail records it in the same transaction."""
        done: dict[str, int] = {}
        async with self._transaction() as conn:
            for table in where.tables():
                count = 0
                for consumer, chosen in (await self._select(conn, table, where, ids)).items():
                    count += await _discard_rows(conn, table, chosen, consumer, reason)
                done[table] = count
            await _audit(conn, by, "discard", where, ids, done, reason)
        return done

    async def _select(
        self, conn: AsyncConnection, table: str, where: DeadFilter, ids: Sequence[str]
    ) -> dict[str | None, list[str]]:
        """Ids of the matching dead rows, locked, by consumer (None for the outbox)."""
        if ids and table == "outbox":
            ids = [i for i in ids if _is_uuid(i)]
            if not ids:
                return {}
        return await sql.lock(conn, table, where, ids)

    # -- connections ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _connect(self) -> AsyncIterator[AsyncConnection]:
        async with self.store.connection() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection]:
        async with self.store.transaction() as conn:
            yield conn


async def _audit(
    conn: AsyncConnection,
    by: Actor | None,
    action: str,
    where: DeadFilter,
    ids: Sequence[str],
    done: dict[str, int],
    detail: str | None = None,
) -> None:
    """The trail's rows for a retry or discard (none without an actor): one
    per table that had rows, or one saying that nothing matched."""
    if by is None:
        return
    chosen = {
        f.name: getattr(where, f.name)
        for f in dataclasses.fields(where)
        if f.name != "table" and getattr(where, f.name) is not None
    }
    counts: dict[str | None, int] = {t: n for t, n in done.items() if n} or {where.table: 0}
    for table, count in counts.items():
        await record(
            conn, by, action, table=table, filter=chosen, ids=ids, count=count, detail=detail
        )


async def _retry_rows(
    conn: AsyncConnection,
    table: str,
    ids: Sequence[str],
    consumer: str | None,
    restore: Restore | None = None,
) -> int:
    """The store's RETRY statement (that of `relay retry`) on these rows, then a wake-up."""
    return int(
        await retry_in(conn, table, ids=ids, all_dead=False, consumer=consumer, restore=restore)
    )


async def _discard_rows(
    conn: AsyncConnection, table: str, ids: Sequence[str], consumer: str | None, reason: str | None
) -> int:
    return await sql.discard(conn, table, ids, consumer, reason)


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _loads(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return storable.loads(text)
    except ValueError:
        return json.loads(text)


def _check_payload(text: str) -> str:
    """The payload as JSON text PostgreSQL takes, or DeadError saying why not."""
    try:
        storable.loads(text)
    except ValueError as exc:
        raise DeadError(f"the payload is not usable JSON: {exc}") from None
    return text


def _check_headers(text: str) -> str:
    try:
        value = storable.loads(text)
    except ValueError as exc:
        raise DeadError(f"the headers are not usable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise DeadError("the headers must be a JSON object")
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        raise DeadError(f"header values must be strings: {', '.join(map(repr, bad[:5]))}")
    return text


@contextlib.asynccontextmanager
async def open_dead(
    database_url: str,
    claim_check: ClaimCheckURL | None = None,
    schema: str | None = None,
) -> AsyncIterator[DeadMessages]:
    """DeadMessages over a Store of its own (on `schema`'s tables), closed on
    exit; with `claim_check`, retries fetch claim checked inbox rows' objects."""
    store = Store(database_url, pool_size=1, schema=schema)
    objects = None
    if claim_check is not None:
        from relay.claimcheck.s3 import ObjectStore

        objects = ObjectStore(claim_check)
    try:
        yield DeadMessages(store, fetch_from(objects))
    finally:
        await store.close()
        if objects is not None:
            await objects.close()


__all__ = [
    "Ambiguous",
    "DeadError",
    "DeadFilter",
    "DeadMessages",
    "DeadRow",
    "DeadSummary",
    "ErrorGroup",
    "NotFound",
    "Page",
    "open_dead",
    "parse_cursor",
    "summarize",
]
