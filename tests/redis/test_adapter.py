"""The Redis consumer in this process (relay.brokers.redis), where what it
promises shows on the server itself: the entries it holds unacknowledged
(the group's pending entries) stay within about `max_bytes`, and a live
consumer keeps what it holds while its rows are stored slowly."""

from __future__ import annotations

import asyncio

from relay.brokers import Incoming, make_consumer
from relay.config import BrokerURL
from tests.redis_server import Redis

SIZE = 10_000


async def test_the_entries_held_unacknowledged_stay_within_about_max_bytes(redis_streams: Redis):
    stream = redis_streams.name("bound")
    for n in range(40):
        redis_streams.add(stream, [(b"id", b"b-%d" % n), (b"payload", b'"' + b"x" * SIZE + b'"')])
    consumer = make_consumer(
        BrokerURL.parse(redis_streams.url()),
        queue=stream,
        exchange="relay",
        binds=(),
        prefetch=1000,
        max_bytes=3 * SIZE,
    )
    batches = consumer.batches(100, 0.3)
    got: list[Incoming] = []
    most = 0
    try:
        async with asyncio.timeout(60):
            while len(got) < 40:
                batch = await anext(batches)
                await asyncio.sleep(0.3)  # the reader had time to fill what room there is
                most = max(most, redis_streams.pending(stream, stream))
                await consumer.ack(batch)
                got += batch
    finally:
        await batches.aclose()
        await consumer.close()
    assert sorted(m.message_id or "" for m in got) == sorted(f"b-{n}" for n in range(40))
    # About max_bytes: three entries, and the one read while under it.
    assert 1 <= most <= 4, most
    assert redis_streams.pending(stream, stream) == 0


async def test_a_live_consumer_keeps_what_it_holds_past_claim_idle(redis_streams: Redis):
    stream = redis_streams.name("kept")
    for n in range(5):
        redis_streams.add(stream, [(b"id", b"k-%d" % n), (b"payload", b"{}")])
    slow = make_consumer(
        BrokerURL.parse(redis_streams.url()),
        queue=stream,
        exchange="relay",
        binds=(),
        prefetch=100,
        claim_idle=2.0,
    )
    batches = slow.batches(10, 0.3)
    stolen: list[object] = []
    try:
        held = await asyncio.wait_for(anext(batches), 30)
        assert len(held) == 5
        # Held unacknowledged for 2.5 times claim_idle while another
        # consumer of the group claims, ten times a second, whatever is
        # idle over 1.6 s (less than claim_idle: its own may differ): it
        # gets none.
        for _ in range(50):
            await asyncio.sleep(0.1)
            reply = await asyncio.to_thread(
                redis_streams.client.xautoclaim, stream, stream, "thief", 1600
            )
            stolen += reply[1]
        await slow.ack(held)
    finally:
        await batches.aclose()
        await slow.close()
    assert stolen == []
    assert redis_streams.pending(stream, stream) == 0
