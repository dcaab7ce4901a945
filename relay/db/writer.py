"""The inbox receiver's writer: one INSERT per received batch, through psycopg.

It runs in the receiver's child process (relay.receiver_process), which loads no
SQLAlchemy: this module, relay.db.sql, relay.db.connect and relay.db.errors
import none either (tests/test_db.py checks).
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Sequence
from typing import Any

import orjson
import psycopg
from psycopg.types.json import Json

from relay.db import connect as pg
from relay.db import namespace
from relay.db.errors import Refused, any_driver_error, unavailable
from relay.db.sql import pyformat, query
from relay.errors import DatabaseUnavailable
from relay.rows import NewInboxRow

INSERT_INBOX = pyformat(query("inbox_insert"))


def rows_json(
    batch: Sequence[NewInboxRow],
    statuses: Sequence[str] | None = None,
    seqs: Sequence[int] | None = None,
) -> Json:
    """A received batch as the JSON array INSERT_INBOX reads. Payloads and
    headers are JSON texts already (checked when received): they go in as
    they are. The array is made here, as bytes, once: psycopg sends them as
    they are (a json parameter), where a text parameter cost two more copies
    of the batch's bodies (orjson's bytes decoded, then encoded again).
    `statuses`: the rows' statuses, if not their own, and `seqs`, their
    reserved `seq` (the receiving transaction's, Store.store_received)."""
    rows: list[dict[str, object]] = [
        {
            "message_id": m.message_id,
            "topic": m.topic,
            "key": m.key,
            "type": m.type,
            "payload": None if m.payload is None else orjson.Fragment(m.payload),
            "body": None if m.body is None else base64.b64encode(m.body).decode(),
            "headers": orjson.Fragment(m.headers),
            "status": m.status if statuses is None else statuses[i],
            "last_error": m.last_error,
            # As a string: json_to_recordset would unescape a nested \u0000.
            "raw_properties": m.raw_properties,
        }
        for i, m in enumerate(batch)
    ]
    if seqs is not None:
        for row, seq in zip(rows, seqs, strict=True):
            row["seq"] = seq
    data = orjson.dumps(rows)
    return Json(None, dumps=lambda _: data)


class InboxWriter:
    """Inserts received batches on one autocommit connection of psycopg's
    (one statement, one round trip), opened on first use and after a break."""

    def __init__(self, database_url: str, schema: str | None = None) -> None:
        self.conninfo = pg.libpq_url(database_url)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        # Under --schema the one statement names its table in full: no
        # search_path to set, behind a pooler or not.
        self._insert = INSERT_INBOX
        if schema is not None:
            self._insert = INSERT_INBOX.replace(
                "INSERT INTO inbox ", f"INSERT INTO {namespace.qualified('inbox', schema)} ", 1
            )

    async def insert(self, consumer: str, batch: Sequence[NewInboxRow]) -> set[str]:
        """Insert a batch; returns the ids that were new. Raises Refused for a
        value PostgreSQL will not take, DatabaseUnavailable when it is away."""
        if not batch:
            return set()
        try:
            params = {"consumer": consumer, "rows": rows_json(batch)}
        except (orjson.JSONEncodeError, TypeError, ValueError) as exc:  # cannot happen
            raise Refused(f"the row could not be encoded: {exc}") from exc
        try:
            if self._conn is None or self._conn.closed:
                self._conn = await pg.connect(self.conninfo)
            cursor = await self._conn.execute(self._insert, params)
            return {row[0] for row in await cursor.fetchall()}
        except Exception as exc:
            # Any failure but a refused value is the server's or the
            # connection's (gone, read only, out of disk): close the
            # connection, raise DatabaseUnavailable, and the batch waits,
            # unacknowledged.
            error = unavailable(exc, any_driver_error)
            if error is None:
                raise
            if isinstance(error, DatabaseUnavailable):
                await self.close()
            raise error from exc

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.close()
