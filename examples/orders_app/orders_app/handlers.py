"""The app's inbox handlers. `relay inbox` runs each one inside the
transaction that marks its inbox row processed, so the writes below happen
exactly once per message, however often the broker delivers it."""

from __future__ import annotations

import logging

import sqlalchemy as sa

import relay

log = logging.getLogger(__name__)
registry = relay.HandlerRegistry()

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id     bigint PRIMARY KEY,
    status text   NOT NULL DEFAULT 'placed',
    paid   numeric NOT NULL DEFAULT 0
);
"""


@registry.handler("PaymentReceived")
def payment_received(message: relay.Message, conn: sa.Connection) -> None:
    """Add the payment to its order; mark the order paid when it is covered."""
    order_id = message.payload["order_id"]
    amount = message.payload["amount"]
    updated = conn.execute(
        sa.text("UPDATE orders SET paid = paid + :amount WHERE id = :id RETURNING paid"),
        {"amount": amount, "id": order_id},
    ).first()
    if updated is None:
        # Raising rolls this message's writes back; relay retries it with
        # backoff (the order may not be replicated yet) and parks it as
        # dead after --max-attempts, for an operator to look at.
        raise LookupError(f"order {order_id} does not exist")
    log.info("payment of %s for order %s", amount, order_id)
    # The reaction is itself an outbox message, in the same transaction.
    relay.enqueue(
        conn,
        "orders.paid",
        {"order_id": order_id},
        key=f"order-{order_id}",
        type="OrderPaid",
        headers={"traceparent": message.headers.get("traceparent", "")}
        if message.headers.get("traceparent")
        else None,
    )


@registry.handler("OrderCancelled")
async def order_cancelled(message: relay.Message, conn) -> None:
    """Async handlers get an AsyncConnection."""
    await conn.execute(
        sa.text("UPDATE orders SET status = 'cancelled' WHERE id = :id"),
        {"id": message.payload["order_id"]},
    )
