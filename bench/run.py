"""relay's benchmark: every scenario of issue 7 in one run, a table and JSON.

    .venv/bin/python -m bench.run [--quick] [--only NAME,...] [--scale F] [--out FILE]

Needs PostgreSQL and RabbitMQ on 127.0.0.1 (BENCH_PG_URL, BENCH_AMQP_URL to
change), and moto for the SQS scenario. Each scenario makes its own
database (`relay schema apply`), exchange and queue, and removes them at the
end, failed or not. The relay daemons run as real subprocesses
(`.venv/bin/relay ...`), their RSS read from /proc every 0.5 s.

Rates: "rate" is the steady part of a run, from the batches' own timestamps
in the database (`published_at` / `processed_at` are the start of each
batch's transaction): rows between the batch that crosses 10 % of the rows
and the one that crosses 90 %, over the time between them. "rate_wall" is
all rows over the time from the daemon's "started" log line to the end.
Fewer than five batches give no "rate" (a 1,000-row SQS drain is two claims).

--quick: a few thousand messages per scenario, memory and scale at smoke
size (their targets are not judged); about 2.5 minutes on a busy 2-core machine. --scale multiplies
every message count. Exit status 0 unless something is broken (a daemon
failed, messages went missing); a missed target is reported, not an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import resource
import signal
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika

import relay
from bench import common, limits
from bench.backlog import scenario_backlog, scenario_retention
from bench.common import (
    AMQP_URL,
    REPO,
    BenchError,
    Resources,
    batch_times,
    connect,
    db_url,
    free_port,
    insert_backlog,
    loadavg,
    relay_env,
    steady_rate,
)
from bench.harness import (
    CLOUDEVENTS_SOURCE,
    FULL,
    QUICK,
    Report,
    Sizes,
    create_effects,
    daemon_args,
    expect,
    latency_at,
    metrics,
    outbox_once,
    rss_figures,
    started_outbox,
    wait_metric,
)
from bench.kafka import scenario_kafka, scenario_kafka_backlog, scenario_kafka_cloudevents
from bench.naive import run_naive
from bench.nats import scenario_nats
from bench.pgserver import own_postgres
from bench.redis_streams import scenario_redis
from bench.reference import (
    OFFERED,
    beam_cpu,
    scenario_latency_offered,
    scenario_multi,
    scenario_sqs_ref,
    scenario_wire,
    start_moto,
)
from bench.wal import WAL_SETTINGS, scenario_wal_latency
from relay.outbox import WORKERS

RESULTS = REPO / "bench" / "results"


# --------------------------------------------------------------------------
# Scenarios
# --------------------------------------------------------------------------


async def scenario_limit_pg(res: Resources, sz: Sizes, report: Report) -> None:
    """Claim-and-mark only: batched FOR UPDATE SKIP LOCKED updates, no broker."""
    url = await res.database()
    await insert_backlog(url, sz.limit_pg, topic="bench.limit")
    rows, seconds = await limits.limit_pg(url, batch=500, workers=WORKERS)
    if rows != sz.limit_pg:
        raise BenchError(f"claimed {rows} of {sz.limit_pg} rows")
    report.add("limit_pg", "rate", rows / seconds, "rows/s", rows=rows, batch=500, workers=WORKERS)


async def scenario_limit_amqp(res: Resources, sz: Sizes, report: Report) -> None:
    """Publish only: plain aio-pika, persistent, confirms, 1,000 in flight, no database."""
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    count, seconds = await limits.limit_amqp(
        AMQP_URL, exchange, "bench.limit", sz.limit_amqp, window=1000
    )
    depth = await res.queue_depth(queue)
    if depth != count:
        raise BenchError(f"queue holds {depth} of {count} messages")
    report.add("limit_amqp", "rate", count / seconds, "msgs/s", messages=count, window=1000)


async def scenario_naive(res: Resources, sz: Sizes, report: Report) -> None:
    """The article relay: one row per transaction, publish, await confirm, mark, commit."""
    url = await res.database()
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    await insert_backlog(url, sz.naive, topic="bench.naive")
    done, seconds = await run_naive(url, AMQP_URL, exchange, seconds=sz.naive_seconds)
    await expect(
        url, "SELECT count(*) FROM outbox WHERE status = 'published'", done, "published rows"
    )
    depth = await res.queue_depth(queue)
    if depth != done:
        raise BenchError(f"queue holds {depth} of {done} messages")
    report.add(
        "naive",
        "rate",
        done / seconds,
        "msgs/s",
        messages=done,
        backlog=sz.naive,
        seconds=round(seconds, 2),
    )


# Flags bench.run's --cloudevents-source adds to the drain's `relay outbox`.
DRAIN_ARGS: list[str] = []


async def scenario_drain(
    res: Resources,
    sz: Sizes,
    report: Report,
    scenario: str = "drain",
    extra: tuple[str, ...] = (),
    cpu: dict[str, float] | None = None,
) -> None:
    """`relay outbox --once` draining a backlog; with `cpu`, the CPU seconds
    the drain cost relay (its processes) and RabbitMQ (beam.smp) added to it."""
    url = await res.database()
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    await insert_backlog(url, sz.drain, topic="bench.drain")
    args = [*daemon_args(url, exchange), *DRAIN_ARGS, *extra]
    before = _children_cpu(), beam_cpu()
    await outbox_once(res, report, scenario, url, sz.drain, args)
    if cpu is not None:
        cpu["relay"] = cpu.get("relay", 0.0) + _children_cpu() - before[0]
        cpu["rabbitmq"] = cpu.get("rabbitmq", 0.0) + beam_cpu() - before[1]
    depth = await res.queue_depth(queue)
    if depth != sz.drain:
        raise BenchError(f"queue holds {depth} of {sz.drain} messages")
    await res.drop_database(url)


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the relays run and waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


async def scenario_cloudevents(res: Resources, sz: Sizes, report: Report) -> None:
    """Issue 42's A/B: the drain without and with --cloudevents-source,
    interleaved (AB BA ...) so that the machine's load falls on both alike;
    each variant's median over the rounds, their ratio, and the CPU a
    message of relay and of RabbitMQ (beam.smp: every client's) in each."""
    rounds = 1 if sz.drain < 10_000 else 4
    rates: dict[str, list[float]] = {"plain": [], "cloudevents": []}
    cpu: dict[str, dict[str, float]] = {"plain": {}, "cloudevents": {}}
    for round_ in range(rounds):
        order = ["plain", "cloudevents"] if round_ % 2 == 0 else ["cloudevents", "plain"]
        for variant in order:
            extra = ("--cloudevents-source", CLOUDEVENTS_SOURCE) if variant != "plain" else ()
            one = Report()
            await scenario_drain(res, sz, one, "drain", extra, cpu[variant])
            rate = one.get("drain", "rate")
            if rate is None:
                raise BenchError(f"no rate for the {variant} drain")
            rates[variant].append(rate)
            report.add("cloudevents", f"rate_{variant}_{round_}", rate, "msgs/s", load=loadavg())
    plain, ce = (statistics.median(rates[v]) for v in ("plain", "cloudevents"))
    report.add("cloudevents", "rate_plain", plain, "msgs/s", rounds=rounds)
    report.add("cloudevents", "rate_cloudevents", ce, "msgs/s", rounds=rounds)
    report.add("cloudevents", "ratio", ce / plain, "x", messages=sz.drain)
    for variant, spent in cpu.items():
        for who, seconds in spent.items():
            per = seconds / (rounds * sz.drain) * 1e6
            report.add("cloudevents", f"{who}_us_per_msg_{variant}", per, "us")


async def scenario_latency(res: Resources, sz: Sizes, report: Report) -> None:
    """Commit-to-receipt latency through a running `relay outbox` at fixed offered rates."""
    url, queue, relay = await started_outbox(res)
    for rate in sz.latency_rates:
        await latency_at(res, report, "latency", url, queue, rate, sz.latency_seconds)
        await asyncio.sleep(0.5)
    if relay.popen.poll() is not None:
        raise BenchError(f"relay outbox exited {relay.popen.returncode}:\n{relay.tail()}")
    rss_figures(report, "latency", "outbox", relay)


async def _inbox_until(
    res: Resources,
    report: Report,
    scenario: str,
    url: str,
    count: int,
    args: list[str],
    env: dict[str, str] | None = None,
    min_rate: float = 200,
) -> None:
    """Run `relay inbox` until `count` rows are processed and report its rates.

    It fails if that takes longer than at `min_rate` msgs/s (or 2 min)."""
    port = free_port()
    proc = res.relay(
        "inbox", "inbox", *args, "--handlers", "bench.handlers", "--http-port", str(port), env=env
    )
    ready = await proc.wait_log("inbox started", timeout=60)
    done = await wait_metric(
        proc,
        port,
        "relay_inbox_processed_total",
        count,
        timeout=max(120.0, count / min_rate),
        fail_on="relay_inbox_failed_total",
    )
    samples = await metrics(port)
    code = await proc.stop()
    if code != 0:
        raise BenchError(f"relay inbox exited {code} on SIGTERM:\n{proc.tail()}")
    await expect(
        url, "SELECT count(*) FROM inbox WHERE status = 'processed'", count, "processed inbox rows"
    )
    await expect(url, "SELECT count(*) FROM bench_effects", count, "handler rows")
    points = await batch_times(url, "inbox")
    report.add(scenario, "rate", steady_rate(points), "msgs/s", messages=count, batches=len(points))
    # Receiving alone (insert batches): tells which half limits the daemon.
    received = await batch_times(url, "inbox", "received_at")
    report.add(scenario, "receive_rate", steady_rate(received), "msgs/s", batches=len(received))
    report.add(scenario, "rate_wall", count / (done - ready), "msgs/s")
    report.add(scenario, "startup", ready - proc.started, "s")
    # The daemon's own histogram: one handler run (its savepoint is not timed).
    handled = samples.get("relay_inbox_handler_seconds_count")
    if handled:
        report.add(
            scenario,
            "handler_mean",
            samples["relay_inbox_handler_seconds_sum"] / handled * 1000,
            "ms",
        )
    rss_figures(report, scenario, "inbox", proc)


async def scenario_inbox(res: Resources, sz: Sizes, report: Report) -> None:
    """`relay inbox` over a queue holding N messages, a handler inserting one row each."""
    url = await res.database()
    await create_effects(url)
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    await limits.publish_window(AMQP_URL, exchange, "bench.inbox", sz.inbox)
    depth = await res.queue_depth(queue)
    if depth != sz.inbox:
        raise BenchError(f"queue holds {depth} of {sz.inbox} messages before the run")
    await _inbox_until(
        res, report, "inbox", url, sz.inbox, [*daemon_args(url, exchange), "--queue", queue]
    )
    depth = await res.queue_depth(queue)
    if depth:
        raise BenchError(f"{depth} messages left in the queue")


async def scenario_sqs(res: Resources, sz: Sizes, report: Report) -> None:
    """Outbox and inbox against moto's SQS (figures only)."""
    if importlib.util.find_spec("relay.brokers.sqs") is None:
        report.scenarios.setdefault("sqs", {})["skipped"] = (
            "relay.brokers.sqs does not exist in this checkout"
        )
        return
    import boto3

    endpoint = await start_moto(res)
    aws = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL_SQS": endpoint,
    }
    client = boto3.client(
        "sqs",
        region_name="us-east-1",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    queue = f"bench-sqs-{uuid.uuid4().hex[:8]}"
    queue_url = (await asyncio.to_thread(client.create_queue, QueueName=queue))["QueueUrl"]
    url = await res.database()
    await create_effects(url)
    await insert_backlog(url, sz.sqs, topic=queue)
    broker = f"sqs://?region=us-east-1&endpoint_url={endpoint}"
    env = relay_env(**aws)
    await outbox_once(
        res,
        report,
        "sqs_outbox",
        url,
        sz.sqs,
        ["--database-url", url, "--broker-url", broker],
        env,
        min_rate=3,
    )
    attributes = await asyncio.to_thread(
        client.get_queue_attributes,
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages"],
    )
    depth = int(attributes["Attributes"]["ApproximateNumberOfMessages"])
    if depth != sz.sqs:
        raise BenchError(f"SQS queue holds {depth} of {sz.sqs} messages")
    await _inbox_until(
        res,
        report,
        "sqs_inbox",
        url,
        sz.sqs,
        ["--database-url", url, "--broker-url", broker, "--queue", queue],
        env,
        min_rate=3,
    )


async def scenario_memory(res: Resources, sz: Sizes, report: Report) -> None:
    """Both daemons over N messages: outbox → RabbitMQ → inbox; RSS of each."""
    count = sz.memory
    url = await res.database()
    await create_effects(url)
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    await insert_backlog(url, count, topic="bench.memory")
    in_port, out_port = free_port(), free_port()
    inbox = res.relay(
        "inbox",
        "inbox",
        *daemon_args(url, exchange),
        "--queue",
        queue,
        "--handlers",
        "bench.handlers",
        "--http-port",
        str(in_port),
    )
    await inbox.wait_log("inbox started", timeout=60)
    outbox = res.relay(
        "outbox", "outbox", *daemon_args(url, exchange), "--http-port", str(out_port)
    )
    start = await outbox.wait_log("outbox relay started", timeout=60)
    interval = 1.0 if count >= 100_000 else 0.1
    published = await wait_metric(
        outbox,
        out_port,
        "relay_outbox_published_total",
        count,
        timeout=max(300.0, count / 150),
        interval=interval,
    )
    end = await wait_metric(
        inbox,
        in_port,
        "relay_inbox_processed_total",
        count,
        timeout=max(300.0, count / 150),
        interval=interval,
        fail_on="relay_inbox_failed_total",
    )
    for proc in (outbox, inbox):
        code = await proc.stop()
        if code != 0:
            raise BenchError(f"{proc.name} exited {code} on SIGTERM:\n{proc.tail()}")
    await expect(url, "SELECT count(*) FROM bench_effects", count, "handler rows")
    report.add("memory", "messages", count, "msgs")
    report.add(
        "memory",
        "outbox_rate",
        count / (published - start),
        "msgs/s",
        note="outbox daemon, inbox consuming at the same time",
    )
    report.add("memory", "pipeline_rate", count / (end - start), "msgs/s")
    # Each daemon's RSS over its own part: the outbox is done long before the inbox.
    for who, proc, until in (("outbox", outbox, published), ("inbox", inbox, end)):
        summary = rss_figures(report, "memory", who, proc, start, until)
        first, last = summary.get("rss_10pct_mb"), summary.get("rss_90pct_mb")
        if first and last:
            report.add("memory", f"{who}_rss_growth_10_to_90pct", (last - first) / first * 100, "%")


async def scenario_scale(res: Resources, sz: Sizes, report: Report) -> None:
    """Per-message cost of publishing the same rows with few or many other rows pending.

    The measured rows come first in seq order; the `pending` extra rows come
    after them, so the relay publishes the measured rows while all the
    extras wait in the table."""
    measured = sz.scale_measured
    exchange, queue = res.names()
    await res.bind_queue(exchange, queue)
    costs: list[float] = []
    for pending in sz.scale_pending:
        url = await res.database(f"scale{pending}")
        await insert_backlog(url, measured + pending, topic="bench.scale")
        port = free_port()
        proc = res.relay(
            f"outbox{pending}", "outbox", *daemon_args(url, exchange), "--http-port", str(port)
        )
        await proc.wait_log("outbox relay started", timeout=60)
        await wait_metric(
            proc,
            port,
            "relay_outbox_published_total",
            measured,
            timeout=max(120.0, measured / 100),
            interval=0.05,
        )
        code = await proc.stop()
        if code != 0:
            raise BenchError(f"relay outbox exited {code} on SIGTERM:\n{proc.tail()}")
        points = await batch_times(url, "outbox", where=f"AND seq <= {int(measured)}")
        rate = steady_rate(points)
        if not rate:
            raise BenchError(f"no steady rate with {pending} pending ({len(points)} batches)")
        costs.append(1e6 / rate)
        report.add(
            "scale",
            f"cost@{pending}_pending",
            1e6 / rate,
            "us/msg",
            rate=round(rate, 1),
            measured_rows=measured,
            extra_pending=pending,
        )
        await res.drop_database(url)
        channel = await (await res.amqp()).channel()
        await (await channel.declare_queue(queue, passive=True)).purge()
        await channel.close()
    report.add("scale", "cost_ratio", costs[1] / costs[0], "x", pending=list(sz.scale_pending))


SCENARIOS: dict[str, Callable[[Resources, Sizes, Report], Awaitable[None]]] = {
    "limit_pg": scenario_limit_pg,
    "limit_amqp": scenario_limit_amqp,
    "naive": scenario_naive,
    "drain": scenario_drain,
    "latency": scenario_latency,
    "inbox": scenario_inbox,
    "sqs": scenario_sqs,
    "memory": scenario_memory,
    "scale": scenario_scale,
    "backlog": scenario_backlog,
    "retention": scenario_retention,
    "wire": scenario_wire,
    "sqs_ref": scenario_sqs_ref,
    "latency_offered": scenario_latency_offered,
    "multi": scenario_multi,
    "kafka": scenario_kafka,
    "kafka_backlog": scenario_kafka_backlog,
    "kafka_cloudevents": scenario_kafka_cloudevents,
    "cloudevents": scenario_cloudevents,
    "redis": scenario_redis,
    "nats": scenario_nats,
    "wal_latency": scenario_wal_latency,
}
# Run only when named (--only): `kafka`, `redis` and `nats` start a broker of
# their own (Tansu, redis-server, nats-server), and the quick run of every
# scenario is near its time limit in the tests.
OPT_IN = frozenset({"kafka", "kafka_backlog", "kafka_cloudevents", "redis", "nats", "wal_latency"})
# Judged with PostgreSQL's default server settings (issue 24): they run on a
# cluster of their own (bench.pgserver) unless --shared-postgres; with the
# settings given here, always (the shared server keeps wal_level = replica).
OWN_SERVER: dict[str, tuple[str, ...]] = {
    "backlog": (),
    "retention": (),
    "kafka_backlog": (),
    "wal_latency": WAL_SETTINGS,
}


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


def evaluate(report: Report, quick: bool) -> list[dict[str, Any]]:
    """The issue's targets, as ratios and limits from this run."""
    g = report.get
    pg, amqp = g("limit_pg", "rate"), g("limit_amqp", "rate")
    if pg and amqp and g("limits", "combined") is None:
        report.add(
            "limits",
            "combined",
            1 / (1 / pg + 1 / amqp),
            "msgs/s",
            formula="1 / (1/limit_pg + 1/limit_amqp)",
        )
    drain = g("drain", "rate")
    checks: list[dict[str, Any]] = []

    def check(
        name: str,
        value: float | None,
        op: str,
        target: float | None,
        unit: str = "",
        judged: bool = True,
    ) -> None:
        if value is None:
            return
        ok = None
        if target is not None and judged:
            ok = value >= target if op == ">=" else value <= target
        checks.append(
            {
                "check": name,
                "value": round(value, 3),
                "unit": unit,
                "target": f"{op} {target:g}{unit}" if target is not None else "-",
                "pass": ok,
            }
        )

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    check("outbox drain / limit_amqp", ratio(drain, amqp), ">=", 2, "x")
    check("outbox drain / naive", ratio(drain, g("naive", "rate")), ">=", 20, "x")
    check("outbox drain / combined limit", ratio(drain, g("limits", "combined")), ">=", None, "x")
    check("latency p50 at 500/s", g("latency", "p50@500"), "<=", 5, " ms")
    check("latency p99 at 500/s", g("latency", "p99@500"), "<=", 25, " ms")
    check("latency p99 at 2000/s", g("latency", "p99@2000"), "<=", 100, " ms")
    check("inbox / outbox drain", ratio(g("inbox", "rate"), drain), ">=", 0.5, "x")
    for who in ("outbox", "inbox"):
        check(
            f"{who} peak RSS over the memory run",
            g("memory", f"{who}_peak_rss"),
            "<=",
            120,
            " MB",
            judged=not quick,
        )
        check(
            f"{who} RSS growth 10%->90% of the run",
            g("memory", f"{who}_rss_growth_10_to_90pct"),
            "<=",
            10,
            "%",
            judged=not quick,
        )
    check(
        "cost at 1M pending / cost at 1k pending",
        g("scale", "cost_ratio"),
        "<=",
        1.3,
        "x",
        judged=not quick,
    )
    for who in ("outbox", "inbox"):
        check(
            f"backlog: {who} last fifth / first fifth",
            g("backlog", f"{who}_last_over_first"),
            ">=",
            0.9,
            "x",
            judged=not quick,
        )
    check(
        "backlog: inbox over the backlog / over 20,000",
        ratio(g("backlog", "inbox_whole"), g("backlog", "inbox_reference_rate")),
        ">=",
        0.9,
        "x",
        judged=not quick,
    )
    for who in ("outbox", "inbox"):
        check(
            f"retention: {who} with 1M finished rows / empty",
            g("retention", f"{who}_full_over_empty"),
            ">=",
            0.9,
            "x",
            judged=not quick,
        )
    # Issue 21: each beside a reference measured in the same run.
    check(
        "21: outbox drain / wire-format limit (amqplib)",
        g("wire", "drain_over_limit"),
        ">=",
        0.85,
        "x",
    )
    check("21: inbox / outbox drain (wire)", g("wire", "inbox_over_drain"), ">=", 0.8, "x")
    check("42: drain with CloudEvents / without", g("cloudevents", "ratio"), ">=", 0.95, "x")
    check(
        "42: drain to Kafka with CloudEvents / without",
        g("kafka_cloudevents", "ratio"),
        ">=",
        0.95,
        "x",
    )
    check(
        "21: SQS outbox / plain boto3 SendMessageBatch",
        g("sqs_ref", "outbox_over_plain"),
        ">=",
        0.9,
        "x",
    )
    check(
        "21: SQS inbox / plain boto3 receive+delete",
        g("sqs_ref", "inbox_over_plain"),
        ">=",
        0.9,
        "x",
    )
    achieved = g("latency_offered", "achieved")
    kept = achieved is not None and achieved >= 0.95 * OFFERED
    for q, limit in ((50, 2), (99, 10)):
        check(
            f"21: latency p{q} at {OFFERED:,}/s offered ({_fmt(achieved)}/s achieved)",
            g("latency_offered", f"p{q}"),
            "<=",
            limit,
            " ms",
            judged=kept,
        )
    check("21: three outbox processes / one", g("multi", "three_over_one"), ">=", 0.9, "x")
    for procs in (1, 3):
        check(
            f"21: per-key order violations, {procs} outbox process(es)",
            g("multi", f"order_violations_{procs}"),
            "<=",
            0,
            " msgs",
        )
    # Issue 46: Kafka (bench.kafka).
    check("46: outbox to Kafka / serial floor", g("kafka", "outbox_over_floor"), ">=", 0.4, "x")
    check(
        "46: outbox to Kafka / RabbitMQ drain",
        g("kafka", "outbox_over_rabbitmq_drain"),
        ">=",
        1.5,
        "x",
    )
    check(
        "46: inbox (batch handler) / Kafka drain",
        g("kafka", "inbox_batch_over_drain"),
        ">=",
        0.8,
        "x",
    )
    for daemon in ("outbox", "inbox"):
        check(
            f"46: {daemon} Kafka backlog, last fifth / first",
            g("kafka_backlog", f"{daemon}_last_over_first"),
            ">=",
            0.9,
            "x",
        )
    # Issue 52: commit-to-publish latency with --capture wal (bench.wal).
    check(
        f"52: latency p50 @{OFFERED}/s offered, --capture wal",
        g("wal_latency", "wal_p50"),
        "<=",
        5,
        "ms",
        judged=not quick,
    )
    check(
        f"52: latency p99 @{OFFERED}/s offered, wal / poll",
        g("wal_latency", "wal_over_poll_p99"),
        "<=",
        1.0,
        "x",
        judged=not quick,
    )
    # Issue 53: Redis Streams (bench.redis_streams).
    check("53: outbox to Redis / serial floor", g("redis", "outbox_over_floor"), ">=", 0.4, "x")
    check(
        "53: inbox (batch handler) / Redis drain",
        g("redis", "inbox_batch_over_drain"),
        ">=",
        0.5,
        "x",
    )
    # Issue 53: NATS JetStream (bench.nats).
    check("53: outbox to NATS / bare nats-py", g("nats", "outbox_over_bare"), ">=", 0.8, "x")
    check(
        "53: inbox (batch handler) / NATS drain",
        g("nats", "inbox_batch_over_drain"),
        ">=",
        0.5,
        "x",
    )
    return checks


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def print_table(report: Report, checks: list[dict[str, Any]]) -> None:
    def unit(f: dict[str, Any]) -> str:
        peaks = f.get("process_peaks_mb") or []
        return f["unit"] + (f" ({' + '.join(map(str, peaks))})" if len(peaks) > 1 else "")

    rows = [(f["scenario"], f["figure"], _fmt(f["value"]), unit(f)) for f in report.figures]
    widths = [
        max(len(r[i]) for r in [("scenario", "figure", "value", "unit"), *rows]) for i in range(4)
    ]
    line = "  ".join
    print()
    print(
        line(
            h.ljust(w) for h, w in zip(("scenario", "figure", "value", "unit"), widths, strict=True)
        )
    )
    print(line("-" * w for w in widths))
    for r in rows:
        print(
            line(
                [
                    r[0].ljust(widths[0]),
                    r[1].ljust(widths[1]),
                    r[2].rjust(widths[2]),
                    r[3].ljust(widths[3]),
                ]
            )
        )
    if checks:
        crow = [
            (
                c["check"],
                _fmt(c["value"]) + c["unit"],
                c["target"],
                {True: "PASS", False: "MISS", None: "n/a"}[c["pass"]],
            )
            for c in checks
        ]
        cw = [
            max(len(r[i]) for r in [("target", "measured", "want", "result"), *crow])
            for i in range(4)
        ]
        print()
        print(
            line(
                h.ljust(w)
                for h, w in zip(("target", "measured", "want", "result"), cw, strict=True)
            )
        )
        print(line("-" * w for w in cw))
        for r in crow:
            print(line([r[0].ljust(cw[0]), r[1].rjust(cw[1]), r[2].ljust(cw[2]), r[3]]))
    for name, info in report.scenarios.items():
        if info.get("error"):
            print(f"\n{name}: ERROR {info['error']}\n(logs kept in {info.get('logs')})")
        elif info.get("skipped"):
            print(f"\n{name}: skipped ({info['skipped']})")


async def server_settings() -> dict[str, str]:
    """The PostgreSQL settings that move these figures, of the server in use."""
    async with await connect(db_url("postgres"), autocommit=True) as conn:
        settings = {}
        for name in (
            "server_version",
            "shared_buffers",
            "synchronous_commit",
            "fsync",
            "autovacuum",
            "autovacuum_naptime",
            "max_connections",
        ):
            row = await (await conn.execute(f"SHOW {name}")).fetchone()
            settings[name] = row[0] if row else ""
    return settings


async def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "relay": relay.__version__,
        "aio_pika": importlib.metadata.version("aio-pika"),
        "psycopg": importlib.metadata.version("psycopg"),
        "sqlalchemy": importlib.metadata.version("sqlalchemy"),
    }
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    try:
        settings = await server_settings()
        info["postgresql"] = settings.pop("server_version")
        info["postgresql_settings"] = settings
    except Exception as exc:
        info["postgresql"] = f"unreachable: {exc}"
    try:
        connection = await aio_pika.connect(AMQP_URL)
        props = connection.transport.connection.server_properties  # type: ignore[union-attr]
        version = props.get("version")
        info["rabbitmq"] = version.decode() if isinstance(version, bytes) else version
        await connection.close()
    except Exception as exc:
        info["rabbitmq"] = f"unreachable: {exc}"
    return info


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> int:
    quick = args.quick
    sizes = (QUICK if quick else FULL).scaled(args.scale)
    if args.backlog:
        sizes = dataclasses.replace(sizes, backlog=args.backlog)
    names = args.only or [n for n in SCENARIOS if n not in OPT_IN]
    report = Report()
    started_at = datetime.now(UTC)
    info = await machine_info()
    info["loadavg_start"] = loadavg()
    mode = "quick" if quick else "full"
    out = Path(args.out) if args.out else RESULTS / "latest.json"
    print(
        f"relay benchmark ({mode}), {info['nproc']} cores, load average "
        f"{info['loadavg_start']}, PostgreSQL {info.get('postgresql')}, "
        f"RabbitMQ {info.get('rabbitmq')}",
        flush=True,
    )
    if info["loadavg_start"][0] >= 1.0:
        print("warning: the machine is busy (load average >= 1.0); figures will be low", flush=True)

    def save(checks: list[dict[str, Any]], interrupted: bool) -> None:
        info["loadavg_end"] = loadavg()
        result = {
            "timestamp": started_at.isoformat(timespec="seconds"),
            "mode": mode,
            "command": " ".join(["python", "-m", "bench.run", *sys.argv[1:]]),
            "complete": not interrupted and len(report.scenarios) == len(names),
            "sizes": dataclasses.asdict(sizes),
            "machine": info,
            "figures": report.figures,
            "targets": checks,
            "scenarios": report.scenarios,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

    failed = interrupted = False
    for name in names:
        res = Resources(name)
        began = time.monotonic()
        print(f"- {name} ...", end=" ", flush=True)
        state: dict[str, Any] = report.scenarios.setdefault(name, {})
        try:
            async with contextlib.AsyncExitStack() as stack:
                if name in OWN_SERVER and (OWN_SERVER[name] or not args.shared_postgres):
                    server = await stack.enter_async_context(own_postgres(OWN_SERVER[name]))
                    stack.callback(setattr, common, "PG_URL", common.PG_URL)
                    common.PG_URL = server.url
                    state["postgresql_settings"] = await server_settings()
                await SCENARIOS[name](res, sizes, report)
        except asyncio.CancelledError:
            # Ctrl-C or SIGTERM: clean up, keep what was measured, stop.
            interrupted = res.failed = True
            state["error"] = "interrupted"
            state["logs"] = str(res.workdir)
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        except Exception as exc:
            failed = res.failed = True
            state["error"] = f"{type(exc).__name__}: {exc}"
            state["traceback"] = traceback.format_exc()
            state["logs"] = str(res.workdir)
        finally:
            problems = await res.close()
            if problems:
                state["cleanup_problems"] = problems
        state["seconds"] = round(time.monotonic() - began, 1)
        print(
            "skipped" if state.get("skipped") else "ERROR" if state.get("error") else "ok",
            f"({state['seconds']}s)",
            flush=True,
        )
        save(evaluate(report, quick), interrupted)  # a long run keeps what it measured
        if interrupted:
            break
    checks = evaluate(report, quick)  # saved by the last scenario's save() above
    if not args.out:
        stamped = RESULTS / f"{started_at:%Y%m%dT%H%M%SZ}-{mode}.json"
        stamped.write_text(out.read_text())
    print_table(report, checks)
    print(f"\nresults: {out}  (load average at the end: {info['loadavg_end']})")
    if interrupted:
        print("interrupted; everything created so far was removed", file=sys.stderr)
        return 130
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description="relay's benchmark (issue 7)."
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few thousand messages per scenario; memory and scale at "
        "smoke size, their targets not judged",
    )
    parser.add_argument(
        "--only",
        type=lambda s: [n.strip() for n in s.split(",") if n.strip()],
        help=f"comma-separated scenarios: {','.join(SCENARIOS)}",
    )
    parser.add_argument(
        "--scale", type=float, default=1.0, help="multiply every message count by this (default 1)"
    )
    parser.add_argument(
        "--backlog",
        type=int,
        help="messages per daemon in the backlog scenario [default: 1,000,000; --quick 5,000]",
    )
    parser.add_argument(
        "--shared-postgres",
        action="store_true",
        help="run backlog and retention on BENCH_PG_URL's server too, instead "
        "of a cluster of their own with the default settings",
    )
    parser.add_argument(
        "--cloudevents-source",
        metavar="URI",
        help="the drain scenario's relay outbox sends CloudEvents with this source "
        "(issue 42; the cloudevents scenario runs the A/B by itself)",
    )
    parser.add_argument(
        "--out",
        help="JSON results file [default: bench/results/latest.json and a timestamped copy]",
    )
    args = parser.parse_args()
    if args.cloudevents_source:
        DRAIN_ARGS.extend(["--cloudevents-source", args.cloudevents_source])
    unknown = [n for n in args.only or [] if n not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(unknown)}")
    if args.scale <= 0:
        parser.error("--scale must be positive")

    # psycopg warns on stderr about every query a cancellation interrupts.
    logging.getLogger("psycopg").setLevel(logging.ERROR)

    async def guarded() -> int:
        task = asyncio.current_task()
        assert task is not None
        # SIGTERM cancels like Ctrl-C does, so every finally (cleanup) runs.
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        return await run(args)

    try:
        sys.exit(asyncio.run(guarded()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("\ninterrupted; everything created so far was removed", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
