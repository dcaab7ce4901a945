"""Issue 24's scenarios: a long backlog, and a table whose retention window is full.

- backlog: `relay outbox --once` over N pending rows, and `relay inbox` over
  a queue preloaded with N messages in the outbox's wire format (a
  one-INSERT handler), 100 keys each, with no VACUUM in between: the rate
  over the first fifth of the messages beside the rate over the last
  fifth. The inbox also runs over 20,000 messages on a fresh database,
  twice before the backlog and once after: its reference rate is the
  median of the three.
- retention: each daemon over the same number of messages with the table
  empty and with 1,000,000 finished rows already in it (inside the
  retention window, vacuumed, as autovacuum leaves a table in its steady
  state), side by side: three rounds on each table, alternating, and the
  median of each (the empty table holds the earlier rounds' rows, 60,000
  at most).

Their queues are lazy (`x-queue-mode: lazy`, LAZY): on RabbitMQ before
3.12 a default classic queue keeps every message in its process's memory,
and a million of them cost the broker's CPU per message enough to set the
rate of both daemons on this machine's two cores; from 3.12 classic queues
work that way without the argument (docs/backlog.md, *Fourth round: the
broker's deep queue*).

Rates come from the batches' own timestamps (`published_at`,
`processed_at`: the start of each batch's transaction), as in bench.run.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import aio_pika

from bench import limits
from bench.common import (
    AMQP_URL,
    PAYLOAD_SQL,
    BenchError,
    Resources,
    batch_times,
    connect,
    free_port,
    payload,
    scalar,
    settle,
)
from bench.harness import Report, Sizes, create_effects, daemon_args, handle_all

KEYS = 100
REFERENCE = 20_000  # the inbox's reference run (issue 24)
# relay inbox's --consumer-name here: a service's name, as users pick it,
# not the run's unique queue name (30 characters). The consumer leads every
# entry of the inbox's primary key, which takes a random place for each
# message: with the queue's name that key grew to 14,400 pages over
# 1,000,000 messages, past shared_buffers (16,384 pages by default), and the
# rate slid with it (docs/backlog.md, "Sixth round").
CONSUMER = "bench"


def window_rate(points: Sequence[tuple[float, int]], lo: float, hi: float) -> float | None:
    """Rows per second from the batch that starts once `lo` of the rows are
    done to the batch that starts once `hi` of them are (the last batch for
    hi = 1), over the time between their starts. None without two batches."""
    total = sum(n for _, n in points)
    if len(points) < 2 or not total:
        return None
    done, first, last = 0, None, None
    for t, n in points:
        if first is None and done >= lo * total:
            first = (t, done)
        if done <= hi * total:
            last = (t, done)
        done += n
    if first is None or last is None or last[0] <= first[0]:
        return None
    return (last[1] - first[1]) / (last[0] - first[0])


def fifths(points: Sequence[tuple[float, int]]) -> tuple[float | None, float | None]:
    """The rate over the first fifth of the rows and over the last."""
    return window_rate(points, 0.0, 0.2), window_rate(points, 0.8, 1.0)


MEASURED_TOPIC = "bench.backlog"
# The queues' arguments in these scenarios (see above); relay inbox declares
# its queue with the same (--queue-arg), as an operator would.
LAZY: dict[str, Any] = {"x-queue-mode": "lazy"}
RETAINED_TOPIC = "bench.retained"


async def preload_outbox(
    url: str, count: int, *, status: str = "pending", age_hours: float = 0.0
) -> None:
    """`count` outbox rows of 100 keys; finished ones published over the
    last `age_hours` hours (inside the default retention of a day)."""
    finished = status != "pending"
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, key, type, payload, status, published_at, created_at) "
            f"SELECT %s, 'k' || (i %% {KEYS}), 'Bench', {PAYLOAD_SQL}, %s, "
            "CASE WHEN %s THEN now() - make_interval(secs => %s * 3600 * (1 - i::float8 / %s)) "
            "END, now() - make_interval(secs => %s * 3600 * (1 - i::float8 / %s)) "
            "FROM generate_series(1, %s) AS i",
            (
                RETAINED_TOPIC if finished else MEASURED_TOPIC,
                status,
                finished,
                age_hours,
                count,
                age_hours,
                count,
                count,
            ),
        )
        await conn.execute("VACUUM ANALYZE outbox" if finished else "ANALYZE outbox")


async def preload_inbox_rows(url: str, consumer: str, count: int, age_hours: float) -> None:
    """`count` processed inbox rows of `consumer`, processed over the last
    `age_hours` hours (inside the default retention of a week), vacuumed."""
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO inbox (consumer, message_id, topic, key, type, payload, status, "
            "processed_at, received_at) "
            f"SELECT %s, gen_random_uuid()::text, %s, 'k' || (i %% {KEYS}), "
            f"'Bench', {PAYLOAD_SQL}, 'processed', "
            "now() - make_interval(secs => %s * 3600 * (1 - i::float8 / %s)), "
            "now() - make_interval(secs => %s * 3600 * (1 - i::float8 / %s)) "
            "FROM generate_series(1, %s) AS i",
            (consumer, RETAINED_TOPIC, age_hours, count, age_hours, count, count),
        )
        await conn.execute("VACUUM ANALYZE inbox")


def keyed_message(i: int) -> aio_pika.Message:
    """A message as `relay outbox` sends a row of one of 100 keys."""
    return aio_pika.Message(
        payload(i),
        content_type="application/json",
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        message_id=str(uuid.uuid4()),
        type="Bench",
        headers={"x-relay-key": f"k{i % KEYS}"},
    )


async def fill_queue(res: Resources, exchange: str, queue: str, count: int) -> None:
    await limits.publish_window(AMQP_URL, exchange, MEASURED_TOPIC, count, make=keyed_message)
    depth = await res.queue_depth(queue)
    if depth != count:
        raise BenchError(f"queue holds {depth} of {count} messages before the run")


async def dead_tuples(url: str, table: str) -> int:
    return int(
        await scalar(url, "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s", (table,))
        or 0
    )


def _since(column: str, since: float | None) -> str:
    """The condition that keeps one round's batches (since: the database's
    clock at its start, Unix time) out of the earlier rounds' on the same table."""
    return "" if since is None else f" AND {column} >= to_timestamp({float(since)!r})"


async def db_now(url: str) -> float:
    """The database's clock (Unix time): where a round's batches begin."""
    return float(await scalar(url, "SELECT extract(epoch FROM clock_timestamp())::float8"))


async def run_outbox(
    res: Resources, url: str, exchange: str, count: int, since: float | None = None
) -> list[tuple[float, int]]:
    """`relay outbox --once` until every pending row is published; its batches
    (those from `since` on, when given)."""

    proc = res.relay("outbox", "outbox", "--once", *daemon_args(url, exchange))
    await proc.wait_log("outbox relay started", timeout=120)
    code = await proc.wait_exit(timeout=max(300.0, count / 300))
    if code != 0:
        raise BenchError(f"relay outbox --once exited {code}:\n{proc.tail()}")
    where = f"AND topic = '{MEASURED_TOPIC}'" + _since("published_at", since)
    return await batch_times(url, "outbox", where=where)


async def run_inbox(
    res: Resources,
    url: str,
    exchange: str,
    queue: str,
    count: int,
    already: int = 0,
    queue_args: dict[str, Any] | None = None,
    since: float | None = None,
    batch: bool = False,
) -> list[tuple[float, int]]:
    """`relay inbox` until `count` rows are processed; its batches (those from
    `since` on, when given). `already`: handler rows from earlier rounds.
    `batch`: with the batch handler (bench.handlers:batch)."""

    port = free_port()
    declared = [f"--queue-arg={name}={value}" for name, value in (queue_args or {}).items()]
    proc = res.relay(
        "inbox",
        "inbox",
        *daemon_args(url, exchange),
        "--queue",
        queue,
        "--handlers",
        "bench.handlers:batch" if batch else "bench.handlers",
        "--consumer-name",
        CONSUMER,
        "--http-port",
        str(port),
        *declared,
    )
    await proc.wait_log("inbox started", timeout=120)
    await handle_all(proc, port, count)
    got = await scalar(url, "SELECT count(*) FROM bench_effects")
    if got != already + count:
        raise BenchError(f"handler rows: {got}, expected {already + count}")
    where = f"AND topic = '{MEASURED_TOPIC}'" + _since("processed_at", since)
    return await batch_times(url, "inbox", where=where)


def _report_fifths(
    report: Report,
    scenario: str,
    who: str,
    points: Sequence[tuple[float, int]],
    count: int,
    **extra: Any,
) -> None:
    first, last = fifths(points)
    every = [window_rate(points, i / 5, (i + 1) / 5) for i in range(5)]
    report.add(
        scenario,
        f"{who}_first_fifth",
        first,
        "msgs/s",
        messages=count,
        fifths=[round(r) if r else None for r in every],
        **extra,
    )
    report.add(scenario, f"{who}_last_fifth", last, "msgs/s")
    report.add(scenario, f"{who}_whole", window_rate(points, 0.0, 1.0), "msgs/s")
    # Always recorded, None where a fifth had no rate (a smoke-size run's
    # few batches), so that the figure's absence never hides a scenario
    # that stopped reporting it.
    ratio = last / first if first and last else None
    report.add(scenario, f"{who}_last_over_first", ratio, "x")


async def scenario_backlog(res: Resources, sz: Sizes, report: Report) -> None:
    """Each daemon over a backlog of N messages (100 keys, no VACUUM)."""

    count = sz.backlog
    # relay inbox over 20,000 messages (the reference), twice before N and
    # once after: a run of 20,000 lasts 3 to 6 s, and one alone moved by
    # half between full runs (docs/backlog.md), so the reference is the
    # median of three taken around the backlog, beside the machine's drift.
    reference = min(sz.backlog_reference, count)
    references: list[float] = []
    for label, n in (
        ("inbox_reference", reference),
        ("inbox_reference", reference),
        ("inbox", count),
        ("inbox_reference", reference),
    ):
        url = await res.database(f"backlog_{label}")
        await create_effects(url)
        exchange, queue = res.names(f"backlog_{label}")
        await res.bind_queue(exchange, queue, arguments=LAZY)
        await fill_queue(res, exchange, queue, n)
        calm = await settle(url, quiet_for=sz.quiet_for)
        points = await run_inbox(res, url, exchange, queue, n, queue_args=LAZY)
        if label == "inbox":
            _report_fifths(report, "backlog", "inbox", points, n, consumer=CONSUMER, **calm)
            # The receiver's storing rate per fifth: tells a slower handling
            # from a receiver (or broker) that fell behind.
            stored = await batch_times(
                url, "inbox", "received_at", where=f"AND topic = '{MEASURED_TOPIC}'"
            )
            report.add(
                "backlog",
                "inbox_receive_fifths",
                window_rate(stored, 0.0, 1.0),
                "msgs/s",
                fifths=[
                    round(r) if (r := window_rate(stored, i / 5, (i + 1) / 5)) else None
                    for i in range(5)
                ],
            )
            report.add(
                "backlog", "inbox_dead_tuples_at_end", await dead_tuples(url, "inbox"), "rows"
            )
        elif (rate := window_rate(points, 0.0, 1.0)) is not None:
            references.append(rate)
        await res.drop_database(url)
    if references:
        report.add(
            "backlog",
            "inbox_reference_rate",
            statistics.median(references),
            "msgs/s",
            messages=reference,
            runs=[round(r) for r in references],
            of="the median of the runs (two before the backlog, one after)",
        )

    # Then relay outbox --once over N rows. Last, so that the broker's
    # clean-up of the N messages it leaves in its queue does not run beside
    # the inbox (in that order, the inbox over 150,000 lost up to 4/5 of its
    # rate from its first fifth to its last; alone, it ran flat).
    url = await res.database("backlog_out")
    exchange, queue = res.names("backlog_out")
    await res.bind_queue(exchange, queue, arguments=LAZY)
    await preload_outbox(url, count)
    calm = await settle(url, quiet_for=sz.quiet_for)
    started = time.monotonic()
    points = await run_outbox(res, url, exchange, count)
    _report_fifths(
        report,
        "backlog",
        "outbox",
        points,
        count,
        seconds=round(time.monotonic() - started, 1),
        **calm,
    )
    report.add("backlog", "outbox_dead_tuples_at_end", await dead_tuples(url, "outbox"), "rows")
    await res.drop_database(url)


async def scenario_retention(res: Resources, sz: Sizes, report: Report) -> None:
    """Each daemon over M messages, the table empty vs holding 1M finished
    rows: sz.retention_rounds rounds on each table, alternating, the median.
    A round of 30,000 messages lasts 2 s (outbox) to 6 s (inbox), and
    single rounds moved by more than the 10 % the target allows
    (docs/backlog.md, "Fifth round")."""

    measured, finished, rounds = sz.retention_measured, sz.retention_rows, sz.retention_rounds
    for table in ("outbox", "inbox"):
        tables = []
        for label, rows in (("empty", 0), ("full", finished)):
            url = await res.database(f"ret_{table}_{label}")
            exchange, queue = res.names(f"ret_{table}_{label}")
            await res.bind_queue(exchange, queue, arguments=LAZY)
            if table == "outbox" and rows:
                await preload_outbox(url, rows, status="published", age_hours=20)
            elif table == "inbox":
                await create_effects(url)
                if rows:
                    await preload_inbox_rows(url, CONSUMER, rows, age_hours=24 * 6)
            tables.append((label, rows, url, exchange, queue))
        rates: dict[str, list[float]] = {"empty": [], "full": []}
        calm: dict[str, dict[str, Any]] = {}  # each table's last settle()
        for done in range(rounds):
            for label, _rows, url, exchange, queue in tables:
                if table == "outbox":
                    await preload_outbox(url, measured)
                else:
                    await fill_queue(res, exchange, queue, measured)
                calm[label] = await settle(url, quiet_for=sz.quiet_for)
                since = await db_now(url)
                if table == "outbox":
                    points = await run_outbox(res, url, exchange, measured, since=since)
                else:
                    points = await run_inbox(
                        res,
                        url,
                        exchange,
                        queue,
                        measured,
                        already=done * measured,
                        queue_args=LAZY,
                        since=since,
                    )
                rate = window_rate(points, 0.0, 1.0)
                if rate is not None:
                    rates[label].append(rate)
        for label, rows, url, _exchange, _queue in tables:
            if rates[label]:
                report.add(
                    "retention",
                    f"{table}_{label}",
                    statistics.median(rates[label]),
                    "msgs/s",
                    messages=measured,
                    finished_rows=rows,
                    runs=[round(r) for r in rates[label]],
                    of=f"the median of {rounds} rounds, alternating empty and full",
                    **calm[label],
                )
            await res.drop_database(url)
        empty, full = (
            report.get("retention", f"{table}_empty"),
            report.get("retention", f"{table}_full"),
        )
        if empty and full:
            report.add("retention", f"{table}_full_over_empty", full / empty, "x")
