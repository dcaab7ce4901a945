"""Decoding PostgreSQL's `pgoutput` messages (logical replication protocol 1).

What `pg_logical_slot_peek_binary_changes(..., 'proto_version', '1',
'publication_names', ...)` returns, one message a row, as PostgreSQL's
documentation ("Logical Replication Message Formats") lays them out; every
integer is big-endian, every string NUL-terminated:

- Begin `B`: final LSN of the transaction (int64), commit time (int64,
  microseconds since 2000-01-01), xid (int32).
- Commit `C`: flags (int8), the commit's LSN (int64), the transaction's end
  LSN (int64), commit time (int64).
- Origin `O`: the commit's LSN on the origin (int64), origin name (string).
- Relation `R`: oid (int32), namespace (string), name (string), replica
  identity (int8), columns (int16), each: flags (int8), name (string),
  type oid (int32), type modifier (int32).
- Type `Y`: oid (int32), namespace (string), name (string).
- Insert `I`: relation oid (int32), `N`, a tuple.
- Update `U` and Delete `D`: relation oid, then tuples (relay publishes only
  inserts; their bodies are not read).
- Truncate `T`: relations (int32), options (int8), oids (int32 each).
- Message `M`: flags (int8), LSN (int64), prefix (string), content (int32
  length, bytes).
- A tuple: columns (int16), each `n` (null), `u` (unchanged TOAST value),
  `t` (text: int32 length, bytes) or `b` (binary: the same).

Anything else, or a message cut short or with bytes left over, raises
PgoutputError: relay stops reading that slot rather than guess.
No psycopg here: pure functions over bytes.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}").fullmatch
# A tuple's column: None (null), UNCHANGED (an unchanged TOAST value) or its bytes.
UNCHANGED = b"\x00unchanged-toast"
Value = bytes | None


class PgoutputError(ValueError):
    """Bytes that are not a pgoutput message relay knows."""


@dataclass(frozen=True)
class Begin:
    final_lsn: int
    commit_time: int
    xid: int


@dataclass(frozen=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True)
class Origin:
    lsn: int
    name: str


@dataclass(frozen=True)
class Column:
    flags: int
    name: str
    type_oid: int
    type_modifier: int


@dataclass(frozen=True)
class Relation:
    oid: int
    namespace: str
    name: str
    replica_identity: int
    columns: tuple[Column, ...]


@dataclass(frozen=True)
class Type:
    oid: int
    namespace: str
    name: str


@dataclass(frozen=True)
class Insert:
    relation: int
    values: tuple[Value, ...]


@dataclass(frozen=True)
class Truncate:
    options: int
    relations: tuple[int, ...]


@dataclass(frozen=True)
class Ignored:
    """A message relay has no use for (Update, Delete, a logical message)."""

    kind: str


Message = Begin | Commit | Origin | Relation | Type | Insert | Truncate | Ignored


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.at = 0

    def take(self, n: int) -> bytes:
        end = self.at + n
        if n < 0 or end > len(self.data):
            raise PgoutputError(f"message cut short: {n} bytes wanted at offset {self.at}")
        chunk = self.data[self.at : end]
        self.at = end
        return chunk

    def unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        value: int = struct.unpack(fmt, self.take(size))[0]
        return value

    def int8(self) -> int:
        return self.unpack(">b")

    def int16(self) -> int:
        return self.unpack(">h")

    def int32(self) -> int:
        return self.unpack(">i")

    def uint32(self) -> int:
        return self.unpack(">I")

    def int64(self) -> int:
        return self.unpack(">q")

    def uint64(self) -> int:
        return self.unpack(">Q")

    def string(self) -> str:
        end = self.data.find(b"\x00", self.at)
        if end < 0:
            raise PgoutputError(f"string without its NUL at offset {self.at}")
        raw = self.data[self.at : end]
        self.at = end + 1
        try:
            return raw.decode()
        except UnicodeDecodeError as exc:
            raise PgoutputError(f"string not UTF-8 at offset {self.at}") from exc

    def tuple_(self) -> tuple[Value, ...]:
        count = self.int16()
        if count < 0:
            raise PgoutputError(f"a tuple of {count} columns")
        values: list[Value] = []
        for _ in range(count):
            kind = self.take(1)
            if kind == b"n":
                values.append(None)
            elif kind == b"u":
                values.append(UNCHANGED)
            elif kind in (b"t", b"b"):
                length = self.int32()
                values.append(self.take(length))
            else:
                raise PgoutputError(f"unknown tuple column kind {kind!r}")
        return tuple(values)

    def end(self) -> None:
        if self.at != len(self.data):
            raise PgoutputError(f"{len(self.data) - self.at} bytes left over")


def decode(data: bytes) -> Message:
    """One pgoutput message; PgoutputError for anything else."""
    if not data:
        raise PgoutputError("an empty message")
    r = _Reader(bytes(data))
    kind = r.take(1)
    message: Message
    if kind == b"B":
        message = Begin(r.uint64(), r.int64(), r.uint32())
    elif kind == b"C":
        message = Commit(r.int8(), r.uint64(), r.uint64(), r.int64())
    elif kind == b"O":
        message = Origin(r.uint64(), r.string())
    elif kind == b"R":
        oid, namespace, name, identity = r.uint32(), r.string(), r.string(), r.int8()
        count = r.int16()
        if count < 0:
            raise PgoutputError(f"a relation of {count} columns")
        columns = tuple(Column(r.int8(), r.string(), r.uint32(), r.int32()) for _ in range(count))
        message = Relation(oid, namespace, name, identity, columns)
    elif kind == b"Y":
        message = Type(r.uint32(), r.string(), r.string())
    elif kind == b"I":
        oid = r.uint32()
        if r.take(1) != b"N":
            raise PgoutputError("an insert without its new tuple")
        message = Insert(oid, r.tuple_())
    elif kind == b"T":
        count = r.int32()
        options = r.int8()
        if count < 0:
            raise PgoutputError(f"a truncate of {count} relations")
        message = Truncate(options, tuple(r.uint32() for _ in range(count)))
    elif kind in (b"U", b"D", b"M"):
        return Ignored(kind.decode())  # nothing read: relay does not use them
    else:
        raise PgoutputError(f"unknown message type {kind!r}")
    r.end()
    return message


@dataclass
class Transaction:
    """One committed transaction's inserts into the watched table: the
    (id, seq) of each row in the order inserted, the LSN just past its
    commit, where a slot may be confirmed to once they are all done, and
    its xid."""

    end_lsn: int
    rows: list[tuple[str, int]]
    xid: int = 0


class Inserts:
    """Folds a stream of messages into the committed transactions' inserts
    into one table (`namespace`.`name`); keeps the relations it was told
    of across calls, as PostgreSQL sends each once per decoding session."""

    def __init__(self, namespace: str, name: str) -> None:
        self.namespace = namespace
        self.name = name
        self._relations: dict[int, tuple[int, int] | None] = {}  # oid -> (id, seq) columns
        self._open: list[tuple[str, int]] | None = None
        self._xid = 0

    @property
    def open(self) -> bool:
        """Whether a transaction has begun and not yet committed."""
        return self._open is not None

    def feed_bytes(self, data: bytes) -> Transaction | None:
        """feed(decode(data)), with inserts read in place: the messages of a
        busy outbox are nearly all inserts, and building each as an Insert
        cost several times what reading its two columns does."""
        if data[:1] != b"I" or self._open is None:
            return self.feed(decode(data))
        try:
            oid, new, count = _INSERT_HEAD.unpack_from(data, 1)
        except struct.error:
            return self.feed(decode(data))  # (its error)
        if new != b"N" or oid not in self._relations or count < 0:
            return self.feed(decode(data))
        columns = self._relations[oid]
        if columns is None:  # another table's (not ours: nothing to read)
            decode(data)  # but it must be a whole message
            return None
        values: list[Value] = []
        at = _INSERT_HEAD.size + 1
        for _ in range(count):
            kind = data[at : at + 1]
            if kind in (b"t", b"b"):
                if at + 5 > len(data):
                    return self.feed(decode(data))
                (length,) = _INT32.unpack_from(data, at + 1)
                end = at + 5 + length
                if length < 0 or end > len(data):
                    return self.feed(decode(data))
                values.append(data[at + 5 : end])
                at = end
            elif kind in (b"n", b"u"):
                values.append(None if kind == b"n" else UNCHANGED)
                at += 1
            else:
                return self.feed(decode(data))
        if at != len(data):
            return self.feed(decode(data))
        self._open.append(_row(values, *columns))
        return None

    def feed(self, message: Message) -> Transaction | None:
        """Take one message; returns the transaction its Commit ended."""
        if isinstance(message, Begin):
            self._open = []
            self._xid = message.xid
        elif isinstance(message, Relation):
            names = [c.name for c in message.columns]
            ours = (message.namespace, message.name) == (self.namespace, self.name)
            if ours and "id" in names and "seq" in names:
                self._relations[message.oid] = (names.index("id"), names.index("seq"))
            elif ours:
                raise PgoutputError(f"relation {message.name} has no id and seq columns")
            else:
                self._relations[message.oid] = None
        elif isinstance(message, Insert):
            if self._open is None:
                raise PgoutputError("an insert outside a transaction")
            if message.relation not in self._relations:
                raise PgoutputError(f"an insert into relation {message.relation} never described")
            columns = self._relations[message.relation]
            if columns is not None:
                self._open.append(_row(message.values, *columns))
        elif isinstance(message, Commit):
            if self._open is None:
                raise PgoutputError("a commit without its begin")
            rows, self._open = self._open, None
            return Transaction(message.end_lsn, rows, self._xid)
        return None


_INSERT_HEAD = struct.Struct(">Ich")
_INT32 = struct.Struct(">i")


def _row(values: Sequence[Value], id_at: int, seq_at: int) -> tuple[str, int]:
    try:
        raw_id, raw_seq = values[id_at], values[seq_at]
    except IndexError:
        raise PgoutputError("an insert with fewer columns than its relation") from None
    if (
        not isinstance(raw_id, bytes)
        or not isinstance(raw_seq, bytes)
        or UNCHANGED
        in (
            raw_id,
            raw_seq,
        )
    ):
        raise PgoutputError("an insert without its id or seq")
    try:
        row_id, seq = raw_id.decode("ascii"), int(raw_seq)
    except (UnicodeDecodeError, ValueError) as exc:
        raise PgoutputError(f"an insert whose id or seq is not text: {exc}") from exc
    if not _UUID(row_id):
        raise PgoutputError(f"an insert whose id is not a UUID: {row_id[:40]!r}")
    return row_id, seq


def lsn(text: str) -> int:
    """A pg_lsn's text (`16/B374D848`) as a number."""
    high, _, low = text.partition("/")
    return int(high, 16) << 32 | int(low, 16)


def lsn_text(value: int) -> str:
    """A number as pg_lsn's text."""
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"
