"""`relay.enqueue` and `relay.enqueue_async` in the caller's transaction, on the real PostgreSQL."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

import relay
from tests.conftest import rows


class Boom(Exception):
    pass


def outbox_rows(engine: sa.Engine) -> list[sa.Row]:
    return rows(
        engine,
        "SELECT id, topic, key, type, payload, headers, available_at, created_at, status, "
        "attempts, last_error, published_at FROM outbox ORDER BY seq",
    )


def count(engine: sa.Engine) -> int:
    return rows(engine, "SELECT count(*) FROM outbox")[0][0]


@pytest.fixture
async def async_engine(database: str) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(database)
    yield eng
    await eng.dispose()


# --------------------------------------------------------------------------
# enqueue: Connection and Session
# --------------------------------------------------------------------------


def test_enqueue_with_a_connection_stores_every_field(engine):
    later = datetime.now(UTC) + timedelta(minutes=5)
    with engine.begin() as conn:
        message_id = relay.enqueue(
            conn,
            "orders.placed",
            {"order_id": 7, "items": [1, 2]},
            key="order-7",
            type="OrderPlaced",
            headers={"traceparent": "00-abc-01", "tenant": "t1"},
            available_at=later,
        )
    assert isinstance(message_id, uuid.UUID)
    [row] = outbox_rows(engine)
    assert row.id == message_id
    assert (row.topic, row.key, row.type) == ("orders.placed", "order-7", "OrderPlaced")
    assert row.payload == {"order_id": 7, "items": [1, 2]}
    assert row.headers == {"traceparent": "00-abc-01", "tenant": "t1"}
    assert row.available_at == later
    assert (row.status, row.attempts, row.last_error, row.published_at) == (
        "pending",
        0,
        None,
        None,
    )


def test_enqueue_defaults(engine):
    with engine.begin() as conn:
        message_id = relay.enqueue(conn, "plain", [1, "two", None])
    [row] = outbox_rows(engine)
    assert row.id == message_id
    assert (row.key, row.type, row.headers) == (None, None, {})
    assert row.payload == [1, "two", None]
    # available_at defaults to now: due at once.
    assert row.available_at == row.created_at
    assert abs(row.created_at - datetime.now(UTC)) < timedelta(minutes=1)


@pytest.mark.parametrize("given", ["uuid", "str"])
def test_enqueue_with_a_given_id_returns_it(engine, given):
    wanted = uuid.uuid4()
    with engine.begin() as conn:
        message_id = relay.enqueue(conn, "t", {}, id=wanted if given == "uuid" else str(wanted))
    assert message_id == wanted
    assert outbox_rows(engine)[0].id == wanted


def test_enqueue_is_part_of_the_callers_transaction(engine):
    with engine.begin() as conn:
        message_id = relay.enqueue(conn, "t", {"a": 1})
        # Visible in the caller's transaction, not yet to anyone else.
        seen = conn.execute(sa.text("SELECT id FROM outbox")).scalars().all()
        assert seen == [message_id]
        assert count(engine) == 0
    assert count(engine) == 1


def test_rollback_of_a_connection_leaves_no_row(engine):
    with pytest.raises(Boom), engine.begin() as conn:
        relay.enqueue(conn, "t", {"a": 1}, key="k")
        raise Boom
    assert count(engine) == 0


def test_enqueue_with_an_orm_session(engine):
    with Session(engine) as session, session.begin():
        first = relay.enqueue(
            session, "orders.placed", {"n": 1}, key="k", type="T", headers={"h": "v"}
        )
        second = relay.enqueue(session, "orders.placed", {"n": 2}, key="k")
    got = outbox_rows(engine)
    assert [r.id for r in got] == [first, second]  # insertion order
    assert (got[0].key, got[0].type, got[0].headers, got[0].payload) == (
        "k",
        "T",
        {"h": "v"},
        {"n": 1},
    )


def test_rollback_of_an_orm_session_leaves_no_row(engine):
    with Session(engine) as session:
        relay.enqueue(session, "t", {"a": 1})
        session.rollback()
    with pytest.raises(Boom), Session(engine) as session, session.begin():
        relay.enqueue(session, "t", {"a": 2})
        raise Boom
    assert count(engine) == 0


# --------------------------------------------------------------------------
# enqueue_async: AsyncConnection and AsyncSession
# --------------------------------------------------------------------------


async def test_enqueue_async_with_an_async_connection(engine, async_engine):
    later = datetime.now(UTC) + timedelta(hours=1)
    async with async_engine.begin() as conn:
        message_id = await relay.enqueue_async(
            conn,
            "orders.shipped",
            {"order_id": 8},
            key="order-8",
            type="OrderShipped",
            headers={"traceparent": "x"},
            available_at=later,
        )
    [row] = outbox_rows(engine)
    assert row.id == message_id
    assert (row.topic, row.key, row.type, row.payload, row.headers) == (
        "orders.shipped",
        "order-8",
        "OrderShipped",
        {"order_id": 8},
        {"traceparent": "x"},
    )
    assert row.available_at == later


async def test_enqueue_async_with_an_async_session(engine, async_engine):
    wanted = uuid.uuid4()
    async with AsyncSession(async_engine) as session, session.begin():
        message_id = await relay.enqueue_async(session, "t", {"s": True}, id=wanted, type="Typed")
    assert message_id == wanted
    [row] = outbox_rows(engine)
    assert (row.id, row.payload, row.type) == (wanted, {"s": True}, "Typed")


async def test_enqueue_async_rollbacks_leave_no_row(engine, async_engine):
    with pytest.raises(Boom):
        async with async_engine.begin() as conn:
            await relay.enqueue_async(conn, "t", {"a": 1})
            raise Boom
    async with AsyncSession(async_engine) as session:
        await relay.enqueue_async(session, "t", {"a": 2})
        await session.rollback()
    assert count(engine) == 0


# --------------------------------------------------------------------------
# Validation: nothing is inserted
# --------------------------------------------------------------------------


BAD_CALLS = [
    ("empty topic", ("", {"a": 1}), {}, ValueError),
    ("topic None", (None, {"a": 1}), {}, ValueError),
    ("payload None", ("t", None), {}, ValueError),
    ("int header value", ("t", {}), {"headers": {"n": 1}}, TypeError),
    ("None header value", ("t", {}), {"headers": {"n": None}}, TypeError),
    ("int header name", ("t", {}), {"headers": {1: "v"}}, TypeError),
    ("int key", ("t", {}), {"key": 7}, TypeError),
    ("int type", ("t", {}), {"type": 7}, TypeError),
]


def test_enqueue_rejects_bad_arguments_and_inserts_nothing(engine):
    with engine.begin() as conn:
        for case, args, kwargs, error in BAD_CALLS:
            try:
                relay.enqueue(conn, *args, **kwargs)
            except error:
                pass
            else:
                pytest.fail(f"{case}: no {error.__name__}")
            assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0, case
        relay.enqueue(conn, "ok", {"fine": True})  # the transaction is still usable
    assert [r.topic for r in outbox_rows(engine)] == ["ok"]


async def test_enqueue_async_rejects_bad_arguments_and_inserts_nothing(engine, async_engine):
    async with async_engine.begin() as conn:
        for case, args, kwargs, error in BAD_CALLS:
            try:
                await relay.enqueue_async(conn, *args, **kwargs)
            except error:
                pass
            else:
                pytest.fail(f"{case}: no {error.__name__}")
            assert (await conn.execute(sa.text("SELECT count(*) FROM outbox"))).scalar() == 0, case
    assert count(engine) == 0


# --------------------------------------------------------------------------
# enqueue: psycopg 3 and Django, no SQLAlchemy in the caller
# --------------------------------------------------------------------------


def _libpq(database: str) -> str:
    return database.replace("postgresql+psycopg://", "postgresql://")


def test_enqueue_with_a_psycopg_connection_commits_and_rolls_back_with_it(engine, database):
    import psycopg

    with psycopg.connect(_libpq(database)) as conn:
        message_id = relay.enqueue(
            conn,
            "orders.placed",
            {"order_id": 7, "big": 2**70},
            key="order-7",
            type="OrderPlaced",
            headers={"traceparent": "00-abc"},
        )
        assert count(engine) == 0  # not committed yet
        conn.commit()
        relay.enqueue(conn, "orders.placed", {"order_id": 8})
        conn.rollback()
    [row] = outbox_rows(engine)
    assert row.id == message_id
    assert (row.topic, row.key, row.type) == ("orders.placed", "order-7", "OrderPlaced")
    assert row.payload == {"order_id": 7, "big": 2**70}
    assert row.headers == {"traceparent": "00-abc"}


async def test_enqueue_async_with_a_psycopg_async_connection(engine, database):
    import psycopg

    async with await psycopg.AsyncConnection.connect(_libpq(database)) as conn:
        message_id = await relay.enqueue_async(conn, "t", {"n": 1}, key="k")
        await conn.commit()
        await relay.enqueue_async(conn, "t", {"n": 2})
        await conn.rollback()
    [row] = outbox_rows(engine)
    assert (row.id, row.payload, row.key) == (message_id, {"n": 1}, "k")


def test_enqueue_with_djangos_connection_inside_atomic(engine, database):
    """Django 4.2+ on psycopg 3: the row commits with the atomic block and
    is gone with its rollback. Run in a subprocess: Django's settings are
    process-wide."""
    import subprocess
    import sys
    import textwrap

    url = sa.make_url(database)
    script = textwrap.dedent(f"""
        import django
        from django.conf import settings
        settings.configure(DATABASES={{"default": {{
            "ENGINE": "django.db.backends.postgresql", "NAME": {url.database!r},
            "HOST": {url.host!r}, "PORT": {url.port or 5432!r}, "USER": {url.username!r}}}}})
        django.setup()
        from django.db import connection, transaction
        import relay

        with transaction.atomic():
            kept = relay.enqueue(connection, "orders.placed", {{"order_id": 7}},
                                 key="order-7", type="OrderPlaced")
        try:
            with transaction.atomic():
                relay.enqueue(connection, "orders.placed", {{"order_id": 8}})
                raise RuntimeError("rolled back")
        except RuntimeError:
            pass
        print(kept)
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    [row] = outbox_rows(engine)
    assert str(row.id) == result.stdout.strip()
    assert (row.payload, row.key, row.type) == ({"order_id": 7}, "order-7", "OrderPlaced")
