"""Issue 53's NATS scenario: relay on NATS JetStream (nats-server with a
file store, as tests/nats_server.py starts it, reached directly) beside a
bare client measured in the same run.

    .venv/bin/python -m bench.run --only nats          # opt-in: a server of its own
    .venv/bin/python -m bench.run --quick --only nats  # smoke size

- `publisher_bare`: nats-py alone, publishing N messages in relay's wire
  format (compact JSON data; Nats-Msg-Id, type, key, Content-Type headers)
  to a stream with publish_async, each acknowledged by it, at most 512
  acknowledgements awaited at once: the guarantee relay gives, without a
  database;
- `outbox`: `relay outbox --once` over N rows of 100 keys to the stream,
  its steady rate from the batches' timestamps, and over the bare one
  (issue 53's target: >= 0.8);
- `inbox_batch`: `relay inbox` with a batch handler (bench.handlers:batch)
  over those N messages, as the durable consumer `bench`, over relay's own
  drain to NATS (`outbox`), as the Kafka scenario judges its inbox.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from typing import Any

from bench.backlog import KEYS, MEASURED_TOPIC
from bench.common import BenchError, Resources, payload, steady_rate
from bench.harness import Report, Sizes
from bench.kafka import run_inbox, run_outbox

IN_FLIGHT = 512
BARE_SUBJECT = "bare.bench"


async def bare_publish(url: str, count: int) -> float:
    """Seconds for nats-py to have `count` messages acknowledged by the
    stream, at most IN_FLIGHT awaited at once, through its fastest way:
    publish_async (one future an acknowledgement on one reply
    subscription; js.publish, a request each with a timer of its own, ran
    at about half its rate here)."""
    import nats

    client = await nats.connect(url)
    js = client.jetstream(publish_async_max_pending=IN_FLIGHT)
    try:
        futures: list[Any] = []
        started = time.perf_counter()
        for i in range(count):
            headers = {
                "Nats-Msg-Id": str(uuid.uuid4()),
                "type": "Bench",
                "key": f"k{i % KEYS}",
                "Content-Type": "application/json",
            }
            # Waits while IN_FLIGHT acknowledgements are awaited.
            futures.append(await js.publish_async(BARE_SUBJECT, payload(i), headers=headers))
        acks = await asyncio.gather(*futures)
        seconds = time.perf_counter() - started
        if len(acks) != count:
            raise BenchError(f"bare publisher: {len(acks)} of {count} acknowledged")
        return seconds
    finally:
        await client.close()


async def make_streams(url: str) -> None:
    import nats

    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.add_stream(name="BARE", subjects=["bare.>"])
        await js.add_stream(name="BENCH", subjects=[MEASURED_TOPIC])
    finally:
        await client.close()


async def scenario_nats(res: Resources, sz: Sizes, report: Report) -> None:
    from tests.nats_server import NatsServer

    count = sz.multi
    base = res.workdir / "nats"
    server = await asyncio.to_thread(
        functools.partial(NatsServer, base / "store", res.workdir / "nats-server.log")
    )
    try:
        broker = server.direct
        await make_streams(broker)
        bare = count / await bare_publish(broker, count)
        report.add("nats", "publisher_bare", bare, "msgs/s", in_flight=IN_FLIGHT, messages=count)

        url = await res.database("nats")
        points, outbox_cpu = await run_outbox(res, url, broker, count)
        outbox = steady_rate(points)
        if outbox is None:
            raise BenchError("too few outbox batches for a steady rate: use more messages")
        report.add("nats", "outbox", outbox, "msgs/s", messages=count)
        report.add("nats", "outbox_over_bare", outbox / bare, "x")
        outbox_cpu.report(report, "nats", "outbox", count)

        points, inbox_cpu = await run_inbox(res, url, broker, "BENCH", count)
        handled = steady_rate(points)
        if handled is None:
            raise BenchError("too few inbox batches for a steady rate: use more messages")
        report.add("nats", "inbox_batch", handled, "msgs/s", messages=count)
        report.add("nats", "inbox_batch_over_drain", handled / outbox, "x")
        inbox_cpu.report(report, "nats", "inbox", count)
        await res.drop_database(url)
    finally:
        await asyncio.to_thread(server.close)
