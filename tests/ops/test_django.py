"""A real Django project (tests/apps/django_shop: settings, an app with a
model and its migration, a management command) on PostgreSQL produces with
relay.enqueue inside transaction.atomic(); `relay outbox` publishes what
committed, and nothing of what rolled back."""

from __future__ import annotations

import os
import subprocess
import sys

import orjson

from tests.conftest import REPO, rows

SHOP = REPO / "tests" / "apps" / "django_shop"


def manage(database: str, *args: str) -> str:
    env = {
        **os.environ,
        "SHOP_DATABASE_URL": database.replace("+psycopg", ""),
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=SHOP,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


async def test_an_order_placed_in_atomic_is_published_and_a_rolled_back_one_is_not(
    engine, database, rabbit, run_relay
):
    queue = await rabbit.queue("shop.#")
    manage(database, "migrate", "--verbosity", "0")
    kept = manage(database, "place_order", "7")
    assert manage(database, "place_order", "8", "--fail") == "rolled back: payment refused"
    assert rows(engine, "SELECT number FROM shop_order") == [(7,)]

    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange)
    assert result.returncode == 0, result.stderr
    [message] = await rabbit.drain(queue, 1)
    assert (message.message_id, message.type) == (kept, "OrderPlaced")
    assert orjson.loads(message.body) == {"order": 7}
    assert message.headers["x-relay-key"] == "order-7"
    assert await queue.get(no_ack=True, fail=False) is None  # order 8's never was
    assert rows(engine, "SELECT id::text, status FROM outbox") == [(kept, "published")]
