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
  against the RabbitMQ drain) and over the bare consumer;
- `*_relay_us_per_msg`, `*_pg_us_per_msg`: the CPU a message of relay's
  processes and of its database's backends (Spent) for each daemon, and
  `rabbitmq_*` the same two daemons over RabbitMQ in the same run.

    .venv/bin/python -m bench.run --only kafka_backlog [--backlog N]

`kafka_backlog` (opt-in too): each daemon over N (1,000,000) messages on
Kafka, the rate over the first fifth and the last, and the CPU a message.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import resource
import statistics
import time
import uuid
from typing import Any

from bench import limits
from bench.backlog import KEYS, MEASURED_TOPIC, preload_outbox
from bench.common import (
    AMQP_URL,
    BenchError,
    Proc,
    Resources,
    batch_times,
    connect,
    free_port,
    loadavg,
    payload,
    steady_rate,
)
from bench.cpu import ServerCpu, TreeCpu, cpu_seconds
from bench.harness import (
    CLOUDEVENTS_SOURCE,
    Report,
    Sizes,
    create_effects,
    daemon_args,
    handle_all,
)
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


def children_cpu() -> float:
    """CPU seconds of this process's finished children (the relays waited for,
    with their own children: the inbox's receiver)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# What the server did besides the daemon's work (Spent).
SERVER_WORK = """
SELECT extract(epoch FROM clock_timestamp())::float8,
       (SELECT count(*) FROM pg_stat_activity
        WHERE backend_type = 'autovacuum worker' AND datname = current_database()),
       (SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)
"""


class Spent:
    """The CPU one daemon's run cost from its "started" line to its exit:
    relay's (its processes, from getrusage of the finished children less what
    they had spent by that line) and its database's (the backends of its
    database, sampled from /proc every 0.2 s: a backend's last fifth of a second
    before it exits can be missed). Sampled with it, on the server's clock:
    whether an autovacuum worker ran on the database, and the checkpoints
    begun (what else the server did while the rate was measured)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.before = children_cpu()
        self.pg = ServerCpu("postgres", only=url.rsplit("/", 1)[1] + " ")
        self.relay = self.db = 0.0
        # (server time, autovacuum workers on the database, checkpoints so far)
        self.server: list[tuple[float, int, int]] = []
        self._at_start = 0.0
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def started(self, proc: Proc) -> None:
        tree = TreeCpu(proc.pid)
        tree.sample()
        self._at_start = sum(seconds for _, seconds in tree.seen.values())
        self.pg.start()
        self._task = asyncio.create_task(self._sample())

    async def _sample(self) -> None:
        async with await connect(self.url, autocommit=True) as conn:
            while not self._stop.is_set():
                self.pg.sample()
                cur = await conn.execute(SERVER_WORK)
                row = await cur.fetchone()
                assert row is not None
                self.server.append((float(row[0]), int(row[1]), int(row[2])))
                await asyncio.sleep(0.2)

    def server_work(self, points: list[tuple[float, int]]) -> dict[str, list[float]]:
        """Per fifth of the rows (as bench.backlog.window_rate cuts them):
        seconds with an autovacuum worker on the database, checkpoints begun."""
        total = sum(n for _, n in points)
        starts: list[float] = []
        done = 0
        for t, n in points:
            while len(starts) < 5 and done >= len(starts) / 5 * total:
                starts.append(t)
            done += n
        bounds = [*starts, points[-1][0] if points else 0.0]
        vacuum, checkpoints = [0.0] * 5, [0.0] * 5
        for (t0, workers, begun), (t1, _, after) in itertools.pairwise(self.server):
            for fifth in range(len(bounds) - 1):
                if bounds[fifth] <= t0 < bounds[fifth + 1]:
                    vacuum[fifth] += (t1 - t0) if workers else 0.0
                    checkpoints[fifth] += after - begun
        return {"autovacuum_s": [round(v, 1) for v in vacuum], "checkpoints": checkpoints}

    async def finished(self) -> None:
        """After the daemon exited (and was waited for)."""
        self._stop.set()
        if self._task is not None:
            await self._task
        self.pg.sample()
        self.relay = children_cpu() - self.before - self._at_start
        self.db = self.pg.used()

    def report(self, report: Report, scenario: str, who: str, count: int) -> None:
        report.add(scenario, f"{who}_relay_us_per_msg", self.relay / count * 1e6, "us")
        report.add(scenario, f"{who}_pg_us_per_msg", self.db / count * 1e6, "us")


async def run_outbox(
    res: Resources,
    url: str,
    broker: str,
    count: int,
    exchange: str = "relay",
    extra: tuple[str, ...] = (),
) -> tuple[list[tuple[float, int]], Spent]:
    """`relay outbox --once` (with `extra` flags) over `count` fresh rows of
    100 keys to `broker`: its batches and what it spent."""
    await create_effects(url)
    await preload_outbox(url, count)
    spent = Spent(url)
    proc = res.relay(
        "outbox-kafka", "outbox", "--once", *daemon_args(url, exchange, broker), *extra
    )
    await proc.wait_log("outbox relay started", timeout=120)
    spent.started(proc)
    code = await proc.wait_exit(timeout=max(300.0, count / 300))
    if code != 0:
        raise BenchError(f"relay outbox --once to {broker} exited {code}:\n{proc.tail()}")
    await spent.finished()
    return await batch_times(url, "outbox"), spent


async def run_inbox(
    res: Resources, url: str, broker: str, queue: str, count: int, exchange: str = "relay"
) -> tuple[list[tuple[float, int]], Spent]:
    """`relay inbox` with the batch handler over `count` messages waiting in
    `queue` (a topic on Kafka), until it has processed them: its batches and
    what it spent."""
    port = free_port()
    spent = Spent(url)
    inbox = res.relay(
        "inbox-kafka",
        "inbox",
        *daemon_args(url, exchange, broker),
        "--queue",
        queue,
        "--consumer-name",
        "bench",
        "--handlers",
        "bench.handlers:batch",
        "--http-port",
        str(port),
    )
    await inbox.wait_log("inbox started", timeout=120)
    spent.started(inbox)
    await handle_all(inbox, port, count)
    await spent.finished()
    return await batch_times(url, "inbox"), spent


async def scenario_kafka(res: Resources, sz: Sizes, report: Report) -> None:
    from tests.kafka_server import KafkaServer

    count = sz.multi
    server = await asyncio.to_thread(
        functools.partial(KafkaServer, res.workdir / "tansu.log", proxied=False)
    )
    try:
        bootstrap = server.bootstrap
        for topic in ("bench.bare", MEASURED_TOPIC):
            make_topic(bootstrap, topic)

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
        outbox_points, outbox_cpu = await run_outbox(res, url, broker, count)
        outbox = steady_rate(outbox_points)
        if outbox is None:
            raise BenchError("too few outbox batches for a steady rate: use more messages")
        report.add("kafka", "outbox", outbox, "msgs/s", messages=count)
        report.add("kafka", "outbox_over_floor", outbox / floor, "x")
        drain = report.get("drain", "rate")
        if drain:
            report.add("kafka", "outbox_over_rabbitmq_drain", outbox / drain, "x")

        consumer = count / await asyncio.to_thread(bare_drain, bootstrap, MEASURED_TOPIC, count)
        report.add("kafka", "consumer_bare", consumer, "msgs/s")
        inbox_points, inbox_cpu = await run_inbox(res, url, broker, MEASURED_TOPIC, count)
        handled = steady_rate(inbox_points)
        if handled is None:
            raise BenchError("too few inbox batches for a steady rate: use more messages")
        report.add("kafka", "inbox_batch", handled, "msgs/s", messages=count)
        # "The Kafka drain": relay's own outbox drain to Kafka, as `wire`
        # judges the RabbitMQ inbox against the RabbitMQ drain.
        report.add("kafka", "inbox_batch_over_drain", handled / outbox, "x")
        report.add("kafka", "inbox_batch_over_consumer_bare", handled / consumer, "x")
        await res.drop_database(url)
        outbox_cpu.report(report, "kafka", "outbox", count)
        inbox_cpu.report(report, "kafka", "inbox", count)

        # The same two daemons over RabbitMQ in the same run: rates and CPU
        # a message beside Kafka's.
        url = await res.database("kafka_rabbitmq")
        exchange, queue = res.names("kafka_rabbitmq")
        await res.bind_queue(exchange, queue)
        points, cpu = await run_outbox(res, url, AMQP_URL, count, exchange)
        report.add("kafka", "rabbitmq_outbox", steady_rate(points) or 0.0, "msgs/s")
        cpu.report(report, "kafka", "rabbitmq_outbox", count)
        points, cpu = await run_inbox(res, url, AMQP_URL, queue, count, exchange)
        report.add("kafka", "rabbitmq_inbox_batch", steady_rate(points) or 0.0, "msgs/s")
        cpu.report(report, "kafka", "rabbitmq_inbox", count)
        await res.drop_database(url)
    finally:
        await asyncio.to_thread(server.close)


def make_topic(bootstrap: str, topic: str) -> None:
    """The topic `topic` of PARTITIONS partitions on the Kafka at `bootstrap`."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, PARTITIONS, 1)]).values():
        future.result(30)


def drop_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.delete_topics([topic]).values():
        future.result(30)


async def measured_topic(res: Resources, log: str) -> tuple[Any, str]:
    """Tansu, reached directly (no test proxy), with MEASURED_TOPIC of
    PARTITIONS partitions; the server and relay's URL for it."""
    from tests.kafka_server import KafkaServer

    server = await asyncio.to_thread(
        functools.partial(KafkaServer, res.workdir / log, proxied=False)
    )
    make_topic(server.bootstrap, MEASURED_TOPIC)
    return server, f"kafka://{server.bootstrap}?{URL_PARAMS}"


async def scenario_kafka_backlog(res: Resources, sz: Sizes, report: Report) -> None:
    """Issue 46's backlog: `relay outbox --once` over N pending rows to a
    Kafka topic of six partitions, then `relay inbox` (batch handler) over
    the N records it produced, as bench.backlog's `backlog` does on
    RabbitMQ (on a PostgreSQL of its own with the default settings, as
    `backlog`: bench.run's OWN_SERVER; no VACUUM between): each one's
    rate over its first fifth and its last, and the CPU a message."""
    from bench.backlog import _report_fifths, window_rate

    count = sz.backlog
    server, broker = await measured_topic(res, "tansu.log")
    try:
        url = await res.database("kafka_backlog")
        points, spent = await run_outbox(res, url, broker, count)
        work = spent.server_work(points)
        _report_fifths(report, "kafka_backlog", "outbox", points, count, **work)
        spent.report(report, "kafka_backlog", "outbox", count)
        points, spent = await run_inbox(res, url, broker, MEASURED_TOPIC, count)
        work = spent.server_work(points)
        _report_fifths(report, "kafka_backlog", "inbox", points, count, **work)
        spent.report(report, "kafka_backlog", "inbox", count)
        # The receiver's storing rate per fifth (as `backlog`'s): tells a
        # slower handling from a receiver (or broker) that fell behind.
        stored = await batch_times(url, "inbox", "received_at")
        report.add(
            "kafka_backlog",
            "inbox_receive_fifths",
            window_rate(stored, 0.0, 1.0) or 0.0,
            "msgs/s",
            fifths=[
                round(r) if (r := window_rate(stored, i / 5, (i + 1) / 5)) else None
                for i in range(5)
            ],
        )
        await res.drop_database(url)
    finally:
        await asyncio.to_thread(server.close)


async def scenario_kafka_cloudevents(res: Resources, sz: Sizes, report: Report) -> None:
    """Issue 42's A/B on Kafka: `relay outbox --once` to Kafka without and
    with --cloudevents-source (binary mode: six `ce_` headers a record),
    interleaved (AB BA AB BA), each variant's median rate, their ratio and
    relay's and PostgreSQL's CPU a message. On Kafka the broker is not the
    bound (relay's own path is), so this is what CloudEvents costs relay."""
    count = sz.multi
    rounds = 1 if count < 10_000 else 4
    server, broker = await measured_topic(res, "tansu-ce.log")
    try:
        rates: dict[str, list[float]] = {"plain": [], "cloudevents": []}
        cpu: dict[str, list[tuple[float, float, float]]] = {"plain": [], "cloudevents": []}
        for round_ in range(rounds):
            order = ["plain", "cloudevents"] if round_ % 2 == 0 else ["cloudevents", "plain"]
            for variant in order:
                extra = ("--cloudevents-source", CLOUDEVENTS_SOURCE) if variant != "plain" else ()
                url = await res.database(f"kafka_ce_{variant}")
                tansu = cpu_seconds(server.process.pid)
                points, spent = await run_outbox(res, url, broker, count, extra=extra)
                tansu = cpu_seconds(server.process.pid) - tansu
                await res.drop_database(url)
                rate = steady_rate(points)
                if rate is None:
                    raise BenchError("too few outbox batches for a steady rate: use more messages")
                rates[variant].append(rate)
                cpu[variant].append(
                    (spent.relay / count * 1e6, spent.db / count * 1e6, tansu / count * 1e6)
                )
                report.add(
                    "kafka_cloudevents", f"rate_{variant}_{round_}", rate, "msgs/s", load=loadavg()
                )
        plain, ce = (statistics.median(rates[v]) for v in ("plain", "cloudevents"))
        report.add("kafka_cloudevents", "rate_plain", plain, "msgs/s", rounds=rounds)
        report.add("kafka_cloudevents", "rate_cloudevents", ce, "msgs/s", rounds=rounds)
        report.add("kafka_cloudevents", "ratio", ce / plain, "x", messages=count)
        for variant, spent_list in cpu.items():
            for i, who in enumerate(("relay", "pg", "tansu")):
                report.add(
                    "kafka_cloudevents",
                    f"{who}_us_per_msg_{variant}",
                    statistics.median(figures[i] for figures in spent_list),
                    "us",
                )
    finally:
        await asyncio.to_thread(server.close)
