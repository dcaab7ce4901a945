"""relay.db.pgoutput: pgoutput's messages encoded here as PostgreSQL's
documentation lays them out (random values), decoded, compared; bytes
that are not a message raise PgoutputError and nothing else."""

from __future__ import annotations

import struct
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.db import pgoutput
from relay.db.pgoutput import (
    UNCHANGED,
    Begin,
    Column,
    Commit,
    Ignored,
    Insert,
    Inserts,
    Origin,
    PgoutputError,
    Relation,
    Transaction,
    Truncate,
    Type,
    decode,
)

u8 = st.integers(-128, 127)
u32 = st.integers(0, 2**32 - 1)
i32 = st.integers(-(2**31), 2**31 - 1)
u64 = st.integers(0, 2**64 - 1)
i64 = st.integers(-(2**63), 2**63 - 1)
names = st.text(st.characters(exclude_characters="\x00", exclude_categories=["Cs"]), max_size=20)
values = st.one_of(st.none(), st.just(UNCHANGED), st.binary(max_size=40))


def _s(text: str) -> bytes:
    return text.encode() + b"\x00"


def _tuple(cols: tuple[bytes | None, ...]) -> bytes:
    out = struct.pack(">h", len(cols))
    for value in cols:
        if value is None:
            out += b"n"
        elif value == UNCHANGED:
            out += b"u"
        else:
            out += b"t" + struct.pack(">i", len(value)) + value
    return out


def encode(message: pgoutput.Message) -> bytes:
    """A message as PostgreSQL's pgoutput (protocol 1) writes it."""
    if isinstance(message, Begin):
        return b"B" + struct.pack(">QqI", message.final_lsn, message.commit_time, message.xid)
    if isinstance(message, Commit):
        return b"C" + struct.pack(
            ">bQQq", message.flags, message.commit_lsn, message.end_lsn, message.commit_time
        )
    if isinstance(message, Origin):
        return b"O" + struct.pack(">Q", message.lsn) + _s(message.name)
    if isinstance(message, Relation):
        out = b"R" + struct.pack(">I", message.oid) + _s(message.namespace) + _s(message.name)
        out += struct.pack(">bh", message.replica_identity, len(message.columns))
        for c in message.columns:
            out += (
                struct.pack(">b", c.flags)
                + _s(c.name)
                + struct.pack(">Ii", c.type_oid, c.type_modifier)
            )
        return out
    if isinstance(message, Type):
        return b"Y" + struct.pack(">I", message.oid) + _s(message.namespace) + _s(message.name)
    if isinstance(message, Insert):
        return b"I" + struct.pack(">I", message.relation) + b"N" + _tuple(message.values)
    if isinstance(message, Truncate):
        out = b"T" + struct.pack(">ib", len(message.relations), message.options)
        return out + b"".join(struct.pack(">I", oid) for oid in message.relations)
    raise AssertionError(message)


columns = st.builds(Column, u8, names, u32, i32)
messages = st.one_of(
    st.builds(Begin, u64, i64, u32),
    st.builds(Commit, u8, u64, u64, i64),
    st.builds(Origin, u64, names),
    st.builds(Relation, u32, names, names, u8, st.tuples(columns, columns) | st.just(())),
    st.builds(Type, u32, names, names),
    st.builds(Insert, u32, st.lists(values, max_size=6).map(tuple)),
    st.builds(Truncate, u8, st.lists(u32, max_size=5).map(tuple)),
)


@given(messages)
def test_every_message_decodes_to_what_was_encoded(message: pgoutput.Message) -> None:
    assert decode(encode(message)) == message


@given(messages, st.data())
def test_a_message_cut_short_or_with_bytes_after_it_is_refused(
    message: pgoutput.Message, data: st.DataObject
) -> None:
    raw = encode(message)
    cut = data.draw(st.integers(1, len(raw) - 1)) if len(raw) > 1 else None
    if cut is not None:
        with pytest.raises(PgoutputError):
            decode(raw[:cut])
    with pytest.raises(PgoutputError, match="left over"):
        decode(raw + data.draw(st.binary(min_size=1, max_size=8)))


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_any_bytes_decode_or_raise_pgoutput_error(raw: bytes) -> None:
    try:
        message = decode(raw)
    except PgoutputError:
        return
    assert isinstance(message, (Begin, Commit, Origin, Relation, Type, Insert, Truncate, Ignored))


def test_updates_deletes_and_logical_messages_are_ignored() -> None:
    assert decode(b"U\x00\x00\x00\x01N\x00\x00") == Ignored("U")
    assert decode(b"D anything") == Ignored("D")
    assert decode(b"M") == Ignored("M")


def _outbox(oid: int, namespace: str = "public", *extra: str) -> Relation:
    names_ = ("id", *extra, "seq")
    return Relation(oid, namespace, "outbox", 100, tuple(Column(0, n, 25, -1) for n in names_))


transactions = st.lists(
    st.lists(st.tuples(st.uuids().map(str), st.integers(1, 2**62)), max_size=5),
    max_size=6,
)


@given(transactions, st.booleans())
def test_inserts_fold_into_committed_transactions(
    given_rows: list[list[tuple[str, int]]], other_table: bool
) -> None:
    """Begin, Relation (again in each transaction, as a new decoding session
    sends it), the inserts (interleaved with another table's), Commit."""
    stream: list[pgoutput.Message] = []
    expected = []
    lsn = 1000
    for xid, rows in enumerate(given_rows, start=7):
        stream.append(Begin(lsn + 50, 0, xid))
        stream.append(_outbox(16400, "public", "topic"))
        if other_table:
            stream.append(Relation(16500, "public", "orders", 100, (Column(1, "id", 23, -1),)))
        for row_id, seq in rows:
            stream.append(Insert(16400, (row_id.encode(), b"wal.topic", str(seq).encode())))
            if other_table:
                stream.append(Insert(16500, (b"1",)))
        stream.append(Commit(0, lsn + 50, lsn + 100, 0))
        expected.append(Transaction(lsn + 100, rows, xid))
        lsn += 200
    folding = Inserts("public", "outbox")
    found = [t for m in stream if (t := folding.feed(decode(encode(m)))) is not None]
    assert found == expected
    in_place = Inserts("public", "outbox")
    read = [in_place.feed_bytes(encode(m)) for m in stream]
    assert [t for t in read if t is not None] == expected


def _outcome(folding: Inserts, feed: Any) -> Any:
    try:
        return feed(), folding._open
    except PgoutputError:
        return "PgoutputError"


@settings(max_examples=300)
@given(st.binary(max_size=40), st.sampled_from([b"I", b""]))
def test_inserts_read_in_place_fare_as_decoded_ones(raw: bytes, head: bytes) -> None:
    """Hostile bytes after a Begin and the outbox's Relation (oid 5, two
    columns): read in place (feed_bytes) or decoded first, the same rows or
    the same PgoutputError."""
    data = head + raw if head else raw
    results = []
    for in_place in (False, True):
        folding = Inserts("public", "outbox")
        folding.feed(Begin(1, 0, 1))
        folding.feed(_outbox(5))
        feed = (
            (lambda f=folding: f.feed_bytes(data))
            if in_place
            else (lambda f=folding: f.feed(decode(data)))
        )
        results.append(_outcome(folding, feed))
    assert results[0] == results[1]


@given(st.lists(st.uuids().map(str), min_size=1, max_size=3), st.integers(0, 2**40))
def test_an_outbox_insert_read_in_place_matches_its_decoding(ids: list[str], seq: int) -> None:
    for row_id in ids:
        data = encode(Insert(5, (row_id.encode(), str(seq).encode())))
        for cut in (len(data), len(data) - 1):
            results = []
            for in_place in (False, True):
                folding = Inserts("public", "outbox")
                folding.feed(Begin(1, 0, 1))
                folding.feed(_outbox(5))
                feed = (
                    (lambda f=folding, d=data[:cut]: f.feed_bytes(d))
                    if in_place
                    else (lambda f=folding, d=data[:cut]: f.feed(decode(d)))
                )
                results.append(_outcome(folding, feed))
            assert results[0] == results[1]


def test_an_insert_into_a_relation_never_described_is_refused() -> None:
    folding = Inserts("public", "outbox")
    folding.feed(Begin(1, 0, 1))
    with pytest.raises(PgoutputError, match="never described"):
        folding.feed(Insert(1, (str(uuid.uuid4()).encode(), b"1")))


def test_another_schemas_outbox_is_not_ours() -> None:
    folding = Inserts("tenant", "outbox")
    folding.feed(Begin(1, 0, 1))
    folding.feed(_outbox(5, "public"))
    folding.feed(Insert(5, (str(uuid.uuid4()).encode(), b"1")))
    assert folding.feed(Commit(0, 1, 2, 0)) == Transaction(2, [], 1)


@pytest.mark.parametrize(
    "values",
    [(None, b"1"), (b"x", UNCHANGED), (b"\xff", b"1"), (b"x", b"1"), (b"x",)],
)
def test_an_outbox_insert_without_a_usable_id_or_seq_is_refused(values: tuple) -> None:
    folding = Inserts("public", "outbox")
    folding.feed(Begin(1, 0, 1))
    folding.feed(_outbox(5))
    with pytest.raises(PgoutputError):
        folding.feed(Insert(5, values))


def test_lsns_read_and_write_as_postgresql_spells_them() -> None:
    assert pgoutput.lsn("16/B374D848") == 0x16B374D848
    assert pgoutput.lsn_text(0x16B374D848) == "16/B374D848"
    assert pgoutput.lsn_text(pgoutput.lsn("0/0")) == "0/0"
