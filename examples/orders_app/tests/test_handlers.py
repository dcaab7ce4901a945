"""Testing the app's handlers without a broker, with relay.testing."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from orders_app.handlers import SCHEMA, registry
from sqlalchemy.ext.asyncio import create_async_engine

from relay.testing import handle, handle_async


@pytest.fixture
def conn(engine):
    with engine.connect() as conn, conn.begin() as tx:
        conn.exec_driver_sql(SCHEMA)
        conn.execute(sa.text("INSERT INTO orders (id) VALUES (7)"))
        yield conn
        tx.rollback()


def test_payment_marks_the_order_and_enqueues_order_paid(conn):
    handle(
        registry,
        conn,
        "PaymentReceived",
        {"order_id": 7, "amount": 30},
        headers={"traceparent": "00-abc-def-01"},
    )
    assert conn.execute(sa.text("SELECT paid FROM orders WHERE id = 7")).scalar() == 30
    topic, type_, headers = conn.execute(sa.text("SELECT topic, type, headers FROM outbox")).one()
    assert (topic, type_, headers) == ("orders.paid", "OrderPaid", {"traceparent": "00-abc-def-01"})


def test_payment_for_an_unknown_order_fails_and_leaves_nothing(conn):
    with pytest.raises(LookupError, match="order 8 does not exist"):
        handle(registry, conn, "PaymentReceived", {"order_id": 8, "amount": 1})
    assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar() == 0


def test_unknown_type_is_refused_like_the_daemon_does(conn):
    with pytest.raises(LookupError, match="'Refund'"):
        handle(registry, conn, "Refund", {})


async def test_async_handler(database):
    engine = create_async_engine(database)
    try:
        async with engine.connect() as conn, conn.begin() as tx:
            await conn.exec_driver_sql(SCHEMA)
            await conn.execute(sa.text("INSERT INTO orders (id) VALUES (7)"))
            await handle_async(registry, conn, "OrderCancelled", {"order_id": 7})
            status = await conn.scalar(sa.text("SELECT status FROM orders WHERE id = 7"))
            assert status == "cancelled"
            await tx.rollback()
    finally:
        await engine.dispose()
