"""The business code: an order and its event, in one transaction."""

from django.db import connection, transaction

import relay
from shop.models import Order


def place_order(number: int, fail_after: bool = False) -> str:
    with transaction.atomic():
        Order.objects.create(number=number)
        message_id = relay.enqueue(
            connection,
            "shop.order_placed",
            {"order": number},
            key=f"order-{number}",
            type="OrderPlaced",
        )
        if fail_after:
            raise RuntimeError("payment refused")  # rolls back the order and its event
    return str(message_id)
