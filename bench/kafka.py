"""Issue 46's scenario: relay on Kafka (Tansu, as the tests start it)
beside references measured in the same run.

    .venv/bin/python -m bench.run --only drain,kafka          # with the RabbitMQ drain
    .venv/bin/python -m bench.run --quick --only drain,kafka  # smoke size

- `pg`: the database's own claim-and-mark (bench.limits.limit_pg: one
  UPDATE … SKIP LOCKED a batch, no payload read) over N rows;
- `producer`: confluent-kafka's Producer, configured as relay's (idempotent,
  acks=all, murmur2_random, linger.ms=5), producing N records in relay's
  wire format (key, compact JSON value, id/type/content-type headers) and
  flushing: the broker side alone;
- `floor`: the serial floor 1 / (1/pg + 1/producer);
- `outbox`: `relay outbox --once` over N rows of 100 keys to a topic of six
  partitions, its steady rate from the batches' timestamps, over the floor
  and over the same run's RabbitMQ `drain` (when `drain` ran too);
- `consumer_bare`: a bare confluent-kafka consumer (assign, no group)
  reading the N records relay just produced (no database at all);
- `inbox_batch`: `relay inbox` with a batch handler (bench.handlers:batch)
  over those N records, as a consumer group, its steady rate over the
  Kafka drain (relay's `outbox` above, as `wire` judges the RabbitMQ inbox
  against the RabbitMQ drain) and over the bare consumer.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from bench import limits
from bench.backlog import KEYS, MEASURED_TOPIC, preload_outbox
from bench.common import BenchError, Resources, batch_times, free_port, payload, steady_rate
from bench.harness import Report, Sizes, create_effects, wait_metric
from relay.outbox import WORKERS

PARTITIONS = 6
# The Tansu group-join wait is half of session.timeout.ms (tests/kafka_server.py).
URL_PARAMS = "session.timeout.ms=6000&heartbeat.interval.ms=1000"


def bare_produce(bootstrap: str, topic: str, count: int) -> float:
    """Seconds for confluent-kafka to produce and flush `count` records as relay does."""
    from confluent_kafka import Producer

    from relay.brokers.kafka import PRODUCER, PRODUCER_DEFAULTS

    producer = Producer({**PRODUCER_DEFAULTS, **PRODUCER, "bootstrap.servers": bootstrap})
    failed: list[Any] = []

    def delivered(error: Any, _: Any) -> None:
        if error is not None:
            failed.append(error)

    # Connected, the topic's metadata known: what is timed is producing.
    producer.list_topics(topic, timeout=30)
    started = time.perf_counter()
    for i in range(count):
        while True:
            try:
                producer.produce(
                    topic,
                    value=payload(i),
                    key=f"k{i % KEYS}".encode(),
                    headers=[
                        ("id", str(uuid.uuid4()).encode()),
                        ("type", b"Bench"),
                        ("content-type", b"application/json"),
                    ],
                    on_delivery=delivered,
                )
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    left = producer.flush(120)
    seconds = time.perf_counter() - started
    if left or failed:
        raise BenchError(f"bare producer: {left} not delivered, {len(failed)} failed: {failed[:1]}")
    return seconds


def bare_drain(bootstrap: str, topic: str, count: int) -> float:
    """Seconds for a bare consumer (assign, no group) to read `count` records,
    from the first record to the last."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "bench-bare", "enable.auto.commit": False}
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    got, first = 0, 0.0
    deadline = time.monotonic() + 300
    try:
        while got < count and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                if message.error() is None:
                    if not got:
                        first = time.perf_counter()
                    got += 1
    finally:
        consumer.close()
    if got < count:
        raise BenchError(f"bare consumer read {got} of {count} records")
    return time.perf_counter() - first


async def scenario_kafka(res: Resources, sz: Sizes, report: Report) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    from tests.kafka_server import KafkaServer

    count = sz.multi
    server = await asyncio.to_thread(KafkaServer, res.workdir / "tansu.log")
    try:
        bootstrap = server.bootstrap
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for topic in ("bench.bare", MEASURED_TOPIC):
            for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
                future.result(30)

        url = await res.database("kafkapg")
        await preload_outbox(url, count)
        rows, seconds = await limits.limit_pg(url, batch=500, workers=WORKERS)
        if rows != count:
            raise BenchError(f"claimed {rows} of {count} rows")
        pg = rows / seconds
        await res.drop_database(url)
        producer = count / await asyncio.to_thread(bare_produce, bootstrap, "bench.bare", count)
        floor = 1 / (1 / pg + 1 / producer)
        report.add("kafka", "pg", pg, "rows/s", messages=count)
        report.add("kafka", "producer", producer, "msgs/s", partitions=PARTITIONS)
        report.add("kafka", "floor", floor, "msgs/s", formula="1 / (1/pg + 1/producer)")

        broker = f"kafka://{bootstrap}?{URL_PARAMS}"
        url = await res.database("kafka")
        await create_effects(url)
        await preload_outbox(url, count)
        proc = res.relay(
            "outbox-kafka", "outbox", "--once", "--database-url", url, "--broker-url", broker
        )
        await proc.wait_log("outbox relay started", timeout=120)
        code = await proc.wait_exit(timeout=max(300.0, count / 300))
        if code != 0:
            raise BenchError(f"relay outbox --once to Kafka exited {code}:\n{proc.tail()}")
        outbox = steady_rate(await batch_times(url, "outbox"))
        if outbox is None:
            raise BenchError("too few outbox batches for a steady rate: use more messages")
        report.add("kafka", "outbox", outbox, "msgs/s", messages=count)
        report.add("kafka", "outbox_over_floor", outbox / floor, "x")
        drain = report.get("drain", "rate")
        if drain:
            report.add("kafka", "outbox_over_rabbitmq_drain", outbox / drain, "x")

        consumer = count / await asyncio.to_thread(bare_drain, bootstrap, MEASURED_TOPIC, count)
        report.add("kafka", "consumer_bare", consumer, "msgs/s")
        port = free_port()
        inbox = res.relay(
            "inbox-kafka",
            "inbox",
            "--database-url",
            url,
            "--broker-url",
            broker,
            "--queue",
            MEASURED_TOPIC,
            "--consumer-name",
            "bench",
            "--handlers",
            "bench.handlers:batch",
            "--http-port",
            str(port),
        )
        await inbox.wait_log("inbox started", timeout=120)
        await wait_metric(
            inbox,
            port,
            "relay_inbox_processed_total",
            count,
            timeout=max(300.0, count / 150),
            fail_on="relay_inbox_failed_total",
        )
        code = await inbox.stop()
        if code != 0:
            raise BenchError(f"relay inbox exited {code} on SIGTERM:\n{inbox.tail()}")
        handled = steady_rate(await batch_times(url, "inbox"))
        if handled is None:
            raise BenchError("too few inbox batches for a steady rate: use more messages")
        report.add("kafka", "inbox_batch", handled, "msgs/s", messages=count)
        # "The Kafka drain": relay's own outbox drain to Kafka, as `wire`
        # judges the RabbitMQ inbox against the RabbitMQ drain.
        report.add("kafka", "inbox_batch_over_drain", handled / outbox, "x")
        report.add("kafka", "inbox_batch_over_consumer_bare", handled / consumer, "x")
        await res.drop_database(url)
    finally:
        await asyncio.to_thread(server.close)
