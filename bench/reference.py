"""Issue 21's scenarios: each of relay's figures beside a reference that is
not the bottleneck, measured in the same invocation.

- wire: `relay outbox --once` over N rows of 100 keys, then `relay inbox`
  over the N messages it published (a one-INSERT handler), then the same
  in a fresh database with a batch handler inserting its effects in one
  statement per batch (issue 33), then Node's
  amqplib (bench/amqp_limit.js, not CPU-bound) publishing N messages in
  relay's wire format to the same topic exchange and queue, and to the
  queue through the default exchange. Full size: two rounds, medians.
- sqs_ref: against one moto server, plain boto3 loops (SendMessageBatch
  with relay's SQS publisher's concurrency; ReceiveMessage and
  DeleteMessageBatch with its inbox's), then `relay outbox --once` and
  `relay inbox` over as many messages.
- latency_offered: commit-to-receipt latency through a running `relay
  outbox` at 2,000 single-row transactions a second, offered by several
  producer processes (bench/producer.py); the rate achieved is reported.
- multi: three `relay outbox --once` processes on one table vs one; per-key
  order checked at the consumer (the queue read back in its order).

amqplib comes from the npm registry, installed by the benchmark into
bench/.node/ (ignored by git) on first use; without node or npm the wire
scenario is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aio_pika
import orjson

from bench.backlog import KEYS, MEASURED_TOPIC, preload_outbox, run_inbox, run_outbox
from bench.common import (
    AMQP_URL,
    PAYLOAD_SQL,
    REPO,
    BenchError,
    Resources,
    batch_times,
    connect,
    free_port,
    loadavg,
    relay_env,
    scalar,
    steady_rate,
)
from bench.cpu import cpu_seconds, pids_named
from bench.harness import (
    Report,
    Sizes,
    commit_to_receipt,
    create_effects,
    daemon_args,
    report_latency,
    started_outbox,
    wait_metric,
)
from tests.moto_main import MOTO_MAIN

NODE_DIR = REPO / "bench" / ".node"
AMQPLIB = "amqplib@2.3.1"
NODE_SCRIPT = REPO / "bench" / "amqp_limit.js"
WINDOW = 1000  # publishes in flight, as limit_amqp


# --------------------------------------------------------------------------
# wire: the drain and the inbox beside Node's amqplib
# --------------------------------------------------------------------------


def ensure_amqplib() -> str | None:
    """Install amqplib into bench/.node once; None when ready, else why not."""
    if (NODE_DIR / "node_modules" / "amqplib" / "package.json").exists():
        return None
    if not shutil.which("node") or not shutil.which("npm"):
        return "node and npm are needed for the wire-format limit (Node's amqplib)"
    NODE_DIR.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            [
                "npm",
                "install",
                "--prefix",
                str(NODE_DIR),
                "--no-audit",
                "--no-fund",
                "--loglevel",
                "error",
                AMQPLIB,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"npm install {AMQPLIB} failed: {exc}"
    if done.returncode != 0:
        return f"npm install {AMQPLIB} failed: {(done.stderr or done.stdout)[-500:]}"
    return None


async def node_limit(exchange: str, routing_key: str, count: int) -> dict[str, Any]:
    """Node's amqplib publishing `count` messages in relay's wire format."""
    env = {**os.environ, "NODE_PATH": str(NODE_DIR / "node_modules")}
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(NODE_SCRIPT),
        AMQP_URL,
        exchange,
        routing_key,
        str(count),
        str(WINDOW),
        env=env,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=max(120.0, count / 500))
    if proc.returncode != 0:
        raise BenchError(f"node amqp_limit.js exited {proc.returncode}: {err.decode()[-800:]}")
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    if result["returned"]:
        raise BenchError(f"{result['returned']} of the Node client's messages came back")
    return result


async def _purge(res: Resources, queue: str) -> None:
    channel = await (await res.amqp()).channel()
    try:
        await (await channel.declare_queue(queue, passive=True)).purge()
    finally:
        await channel.close()


async def _expect_depth(res: Resources, queue: str, count: int, who: str) -> None:
    depth = await res.queue_depth(queue)
    if depth != count:
        raise BenchError(f"{who}: the queue holds {depth} of {count} messages")


async def scenario_wire(res: Resources, sz: Sizes, report: Report) -> None:
    """The drain and the inbox beside the wire-format limit of Node's amqplib."""

    why = await asyncio.to_thread(ensure_amqplib)
    if why:
        report.scenarios.setdefault("wire", {})["skipped"] = why
        return
    count = sz.wire
    figures: dict[str, list[float]] = {
        "drain": [],
        "inbox": [],
        "inbox_batch": [],
        "limit_topic": [],
        "limit_default": [],
        "node_cpu_s": [],
        "rabbitmq_us_per_msg_drain": [],
        "rabbitmq_us_per_msg_amqplib": [],
    }
    loads = []
    for n in range(sz.wire_rounds):
        url = await res.database(f"wire{n}")
        await create_effects(url)
        exchange, queue = res.names(f"wire{n}")
        await res.bind_queue(exchange, queue)
        await preload_outbox(url, count)  # 100 keys, topic bench.backlog
        loads.append(loadavg()[0])
        beam = beam_cpu()
        drained = steady_rate(await run_outbox(res, url, exchange, count))
        beam_drain = beam_cpu() - beam
        await _expect_depth(res, queue, count, "relay outbox")
        # The inbox takes the N messages relay just published.
        handled = steady_rate(await run_inbox(res, url, exchange, queue, count))
        await _expect_depth(res, queue, 0, "relay inbox")
        await res.drop_database(url)
        # The same again in a fresh database (the outbox drained, not
        # measured), for the inbox with a batch handler that inserts its
        # effects in one statement per batch (issue 33).
        url = await res.database(f"wire{n}batch")
        await create_effects(url)
        await preload_outbox(url, count)
        await run_outbox(res, url, exchange, count)
        await _expect_depth(res, queue, count, "relay outbox, again")
        batched = steady_rate(await run_inbox(res, url, exchange, queue, count, batch=True))
        await _expect_depth(res, queue, 0, "relay inbox with a batch handler")
        await res.drop_database(url)
        beam = beam_cpu()
        topic = await node_limit(exchange, MEASURED_TOPIC, count)
        beam_node = beam_cpu() - beam
        await _expect_depth(res, queue, count, "amqplib via the topic exchange")
        await _purge(res, queue)
        default = await node_limit("", queue, count)
        await _expect_depth(res, queue, count, "amqplib via the default exchange")
        await _purge(res, queue)
        if drained is None or handled is None or batched is None:
            raise BenchError("too few batches for a steady rate: use more messages")
        figures["drain"].append(drained)
        figures["inbox"].append(handled)
        figures["inbox_batch"].append(batched)
        figures["limit_topic"].append(count / topic["seconds"])
        figures["limit_default"].append(count / default["seconds"])
        figures["node_cpu_s"].append(topic["cpu_seconds"])
        figures["rabbitmq_us_per_msg_drain"].append(beam_drain / count * 1e6)
        figures["rabbitmq_us_per_msg_amqplib"].append(beam_node / count * 1e6)
    loads.append(loadavg()[0])
    extra = {"messages": count, "rounds": sz.wire_rounds, "loadavg_1m": loads}
    for name, unit in (
        ("drain", "msgs/s"),
        ("inbox", "msgs/s"),
        ("inbox_batch", "msgs/s"),
        ("limit_topic", "msgs/s"),
        ("limit_default", "msgs/s"),
        ("node_cpu_s", "s"),
        # beam.smp's CPU over each phase: other clients of the
        # broker count too (on a shared machine, read as a bound).
        ("rabbitmq_us_per_msg_drain", "us"),
        ("rabbitmq_us_per_msg_amqplib", "us"),
    ):
        report.add(
            "wire",
            name,
            statistics.median(figures[name]),
            unit,
            each=[round(v, 1) for v in figures[name]],
            **extra,
        )
    drain, inbox = report.get("wire", "drain"), report.get("wire", "inbox")
    topic_limit = report.get("wire", "limit_topic")
    if drain and topic_limit:
        report.add("wire", "drain_over_limit", drain / topic_limit, "x")
    if drain and inbox:
        report.add("wire", "inbox_over_drain", inbox / drain, "x")
    inbox_batch = report.get("wire", "inbox_batch")
    if drain and inbox_batch:
        report.add("wire", "inbox_batch_over_drain", inbox_batch / drain, "x")


def beam_cpu() -> float:
    """RabbitMQ's CPU seconds so far (every beam.smp process on the machine)."""

    return sum(cpu_seconds(p) for p in pids_named("beam.smp"))


# --------------------------------------------------------------------------
# sqs_ref: relay's SQS daemons beside plain boto3 loops
# --------------------------------------------------------------------------

AWS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


async def start_moto(res: Resources) -> str:
    port = free_port()
    # moto's server, with the tests' mends (tests.moto_main): a message
    # sent while another is deleted is kept.
    argv = [sys.executable, "-c", MOTO_MAIN, "-H", "127.0.0.1", "-p", str(port)]
    res.spawn("moto", argv, relay_env())
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return f"http://127.0.0.1:{port}"
        if time.monotonic() > deadline:
            raise BenchError("moto_server did not start in 30s")
        await asyncio.sleep(0.1)


def sqs_client(endpoint: str, pool: int) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.session.Session().client(
        "sqs",
        region_name="us-east-1",
        endpoint_url=endpoint,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        config=Config(max_pool_connections=pool, retries={"mode": "standard", "max_attempts": 3}),
    )


def plain_send(client: Any, queue_url: str, count: int, threads: int) -> float:
    """SendMessageBatch calls of 10 entries shaped as relay's (body, message_id,
    type and key attributes), `threads` calls in flight; the seconds it took."""
    from bench.common import payload

    def entries(first: int) -> list[dict[str, Any]]:
        return [
            {
                "Id": str(i),
                "MessageBody": payload(i).decode(),
                "MessageAttributes": {
                    "message_id": {"DataType": "String", "StringValue": str(uuid.uuid4())},
                    "type": {"DataType": "String", "StringValue": "Bench"},
                    "key": {"DataType": "String", "StringValue": f"k{i % KEYS}"},
                },
            }
            for i in range(first, min(first + 10, count))
        ]

    def send(first: int) -> None:
        response = client.send_message_batch(QueueUrl=queue_url, Entries=entries(first))
        if response.get("Failed"):
            raise BenchError(f"SendMessageBatch failed: {response['Failed'][:1]}")

    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(send, first) for first in range(0, count, 10)]:
            future.result()
    return time.perf_counter() - started


def plain_receive(
    client: Any, queue_url: str, count: int, receivers: int, deleters: int, timeout: float
) -> float:
    """`receivers` threads long-polling ReceiveMessage (10 at a time, every
    attribute, as relay's inbox), each batch deleted by DeleteMessageBatch in
    a pool of `deleters` threads, until `count` are deleted; the seconds."""
    deleted = 0
    lock = threading.Lock()
    finished = threading.Event()
    errors: list[BaseException] = []
    deadline = time.monotonic() + timeout

    def delete(handles: list[str]) -> None:
        nonlocal deleted
        try:
            response = client.delete_message_batch(
                QueueUrl=queue_url,
                Entries=[{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(handles)],
            )
            with lock:
                deleted += len(response.get("Successful", []))
                if deleted >= count:
                    finished.set()
        except BaseException as exc:
            errors.append(exc)
            finished.set()

    def receive(pool: ThreadPoolExecutor) -> None:
        while not finished.is_set() and time.monotonic() < deadline:
            try:
                response = client.receive_message(
                    QueueUrl=queue_url,
                    MaxNumberOfMessages=10,
                    WaitTimeSeconds=1,
                    MessageAttributeNames=["All"],
                    MessageSystemAttributeNames=["All"],
                )
            except BaseException as exc:
                errors.append(exc)
                finished.set()
                return
            messages = response.get("Messages", [])
            if messages:
                pool.submit(delete, [m["ReceiptHandle"] for m in messages])

    started = time.perf_counter()
    with ThreadPoolExecutor(deleters) as pool:
        threads = [
            threading.Thread(target=receive, args=(pool,), daemon=True) for _ in range(receivers)
        ]
        for t in threads:
            t.start()
        finished.wait(max(0.0, deadline - time.monotonic()))
        elapsed = time.perf_counter() - started
        for t in threads:
            t.join(5)
    if errors:
        raise BenchError(f"plain receive loop failed: {errors[0]!r}")
    if deleted < count:
        raise BenchError(f"plain receive loop deleted {deleted} of {count} in {timeout:.0f}s")
    return elapsed


def _depth(client: Any, queue_url: str) -> int:
    attributes = client.get_queue_attributes(
        QueueUrl=queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )
    return sum(int(v) for v in attributes["Attributes"].values())


async def scenario_sqs_ref(res: Resources, sz: Sizes, report: Report) -> None:
    """relay's SQS outbox and inbox beside plain boto3 loops, one moto server."""
    from relay.brokers import aws, sqs
    from relay.outbox import WORKERS

    count = sz.sqs_ref
    endpoint = await start_moto(res)
    send_threads = WORKERS * aws.LANES  # relay's publisher: each worker's batch in 8 lanes
    client = sqs_client(endpoint, send_threads + sqs.RECEIVERS + 8)
    loads = [loadavg()[0]]
    queues = {}
    for who in ("plain", "relay"):
        name = f"bench-sqsref-{who}-{uuid.uuid4().hex[:8]}"
        queues[who] = (
            name,
            (await asyncio.to_thread(client.create_queue, QueueName=name))["QueueUrl"],
        )

    _, plain_url = queues["plain"]
    seconds = await asyncio.to_thread(plain_send, client, plain_url, count, send_threads)
    if (got := await asyncio.to_thread(_depth, client, plain_url)) != count:
        raise BenchError(f"plain SendMessageBatch: the queue holds {got} of {count}")
    report.add(
        "sqs_ref", "plain_send", count / seconds, "msgs/s", messages=count, in_flight=send_threads
    )
    seconds = await asyncio.to_thread(
        plain_receive, client, plain_url, count, sqs.RECEIVERS, 8, max(120.0, count / 3)
    )
    report.add(
        "sqs_ref",
        "plain_receive_delete",
        count / seconds,
        "msgs/s",
        receivers=sqs.RECEIVERS,
        deleters=8,
    )

    name, relay_url = queues["relay"]
    url = await res.database("sqsref")
    await create_effects(url)
    async with await connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO outbox (topic, key, type, payload) "
            f"SELECT %s, 'k' || (i %% {KEYS}), 'Bench', {PAYLOAD_SQL} "
            "FROM generate_series(1, %s) AS i",
            (name, count),
        )
        await conn.execute("ANALYZE outbox")
    broker = f"sqs://?region=us-east-1&endpoint_url={endpoint}"
    env = relay_env(**AWS, AWS_ENDPOINT_URL_SQS=endpoint)
    proc = res.relay(
        "outbox", "outbox", "--once", "--database-url", url, "--broker-url", broker, env=env
    )
    ready = await proc.wait_log("outbox relay started", timeout=60)
    code = await proc.wait_exit(timeout=max(120.0, count / 3))
    ended = time.monotonic()
    if code != 0:
        raise BenchError(f"relay outbox --once exited {code}:\n{proc.tail()}")
    if (got := await asyncio.to_thread(_depth, client, relay_url)) != count:
        raise BenchError(f"relay outbox: the SQS queue holds {got} of {count}")
    exited = time.time()
    first = await scalar(url, "SELECT extract(epoch FROM min(published_at))::float8 FROM outbox")
    # From the first claim to the exit: the boto3 client's start-up (after
    # the "started" line) left out, as the plain loop's is.
    batches = await scalar(url, "SELECT count(DISTINCT published_at) FROM outbox")
    report.add(
        "sqs_ref",
        "relay_outbox",
        count / (exited - first),
        "msgs/s",
        note="from the first claim to the exit",
        batches=batches,
    )
    report.add(
        "sqs_ref",
        "relay_outbox_wall",
        count / (ended - ready),
        "msgs/s",
        note="from the 'started' log line to the exit",
    )

    port = free_port()
    proc = res.relay(
        "inbox",
        "inbox",
        "--database-url",
        url,
        "--broker-url",
        broker,
        "--queue",
        name,
        "--handlers",
        "bench.handlers",
        "--http-port",
        str(port),
        env=env,
    )
    ready = await proc.wait_log("inbox started", timeout=60)
    done = await wait_metric(
        proc,
        port,
        "relay_inbox_processed_total",
        count,
        timeout=max(120.0, count / 3),
        interval=0.05,
        fail_on="relay_inbox_failed_total",
    )
    done_wall = time.time() - (time.monotonic() - done)
    code = await proc.stop()
    if code != 0:
        raise BenchError(f"relay inbox exited {code} on SIGTERM:\n{proc.tail()}")
    got = await scalar(url, "SELECT count(*) FROM bench_effects")
    if got != count:
        raise BenchError(f"handler rows: {got}, expected {count}")
    first = await scalar(url, "SELECT extract(epoch FROM min(received_at))::float8 FROM inbox")
    # From the first batch stored to the last processed (the receiver
    # process's start-up and its first poll left out).
    report.add(
        "sqs_ref",
        "relay_inbox",
        count / (done_wall - first),
        "msgs/s",
        note="from the first batch stored to the last processed",
    )
    report.add(
        "sqs_ref",
        "relay_inbox_wall",
        count / (done - ready),
        "msgs/s",
        note="from the 'started' log line to the last processed",
    )
    loads.append(loadavg()[0])
    g = report.get
    for who, ref in (("outbox", "plain_send"), ("inbox", "plain_receive_delete")):
        mine, theirs = g("sqs_ref", f"relay_{who}"), g("sqs_ref", ref)
        if mine and theirs:
            report.add("sqs_ref", f"{who}_over_plain", mine / theirs, "x", loadavg_1m=loads)
    for _, queue_url in queues.values():
        with contextlib.suppress(Exception):
            await asyncio.to_thread(client.delete_queue, QueueUrl=queue_url)


# --------------------------------------------------------------------------
# latency_offered: 2,000 msgs/s from several producer processes
# --------------------------------------------------------------------------

PRODUCERS = 4
PRODUCER_LANES = 5  # connections per producer process (10: commits slower, nothing gained)
OFFERED = 2000


async def offered_latency(
    res: Resources,
    report: Report,
    scenario: str,
    url: str,
    queue: str,
    seconds: float,
    prefix: str = "",
) -> int:
    """Single-row transactions offered at OFFERED msgs/s by PRODUCERS
    processes for `seconds` into `url`, whose running `relay outbox`
    publishes to `queue`: the commit-to-receipt percentiles
    (`{prefix}p50`, ...) as bench.consumer receives them; how many were
    committed."""
    consumer, receipts_file = await res.consumer(f"consumer{prefix}", queue)
    loads = [loadavg()[0]]
    producers = []
    for n in range(PRODUCERS):
        out = res.workdir / f"producer{prefix}{n}.json"
        proc = res.spawn(
            f"producer{prefix}{n}",
            [
                sys.executable,
                "-m",
                "bench.producer",
                "--database-url",
                url,
                "--topic",
                "bench.latency",
                "--rate",
                str(OFFERED / PRODUCERS),
                "--seconds",
                str(seconds),
                "--out",
                str(out),
                "--lanes",
                str(PRODUCER_LANES),
                "--offset",
                str(n),
                "--stride",
                str(PRODUCERS),
            ],
            relay_env(),
            stdin=True,
            stdout_pipe=True,
        )
        producers.append((proc, out))
    for proc, _ in producers:  # imported and connected
        assert proc.popen.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.popen.stdout.readline), 60)
        if line.strip() != b"ready":
            raise BenchError(f"{proc.name} did not start:\n{proc.tail()}")
    start = time.time() + 0.2
    for proc, _ in producers:
        assert proc.popen.stdin is not None
        proc.popen.stdin.write(f"{start}\n".encode())
        proc.popen.stdin.flush()
    commits: dict[str, tuple[float, float]] = {}
    durations: list[float] = []
    last = 0.0
    for proc, out in producers:
        code = await proc.wait_exit(timeout=seconds + 120)
        if code != 0:
            raise BenchError(f"{proc.name} exited {code}:\n{proc.tail()}")
        result = orjson.loads(out.read_bytes())
        commits.update({k: (v[0], v[1]) for k, v in result["commits"].items()})
        durations += result["durations_ms"]
        last = max(last, result["last"])
    loads.append(loadavg()[0])
    achieved = len(commits) / (last - start)
    receipts = await res.receipts(consumer, receipts_file, len(commits))
    latencies, warmup = commit_to_receipt(commits, receipts, seconds)
    report_latency(
        report,
        scenario,
        latencies,
        durations,
        achieved,
        OFFERED,
        warmup,
        prefix,
        producers=PRODUCERS,
        loadavg_1m=loads,
    )
    return len(commits)


async def scenario_latency_offered(res: Resources, sz: Sizes, report: Report) -> None:
    """Commit to receipt through a running `relay outbox` at 2,000 msgs/s offered
    by PRODUCERS processes."""

    url, queue, relay = await started_outbox(res)
    commits = await offered_latency(res, report, "latency_offered", url, queue, sz.latency_seconds)
    # Batches: transactions that published (published_at is each one's start).
    batches = await scalar(
        url, "SELECT count(DISTINCT published_at) FROM outbox WHERE status = 'published'"
    )
    if batches:
        report.add("latency_offered", "mean_batch", commits / batches, "rows", batches=batches)
    if relay.popen.poll() is not None:
        raise BenchError(f"relay outbox exited {relay.popen.returncode}:\n{relay.tail()}")


# --------------------------------------------------------------------------
# multi: three outbox processes on one table
# --------------------------------------------------------------------------


async def read_back(queue: str, count: int, timeout: float) -> tuple[int, int, int]:
    """Consume the queue in its order: (messages, per-key order violations,
    duplicates). Bodies carry i (seq order); x-relay-key the key."""
    last: dict[str, int] = {}
    seen: set[str] = set()
    got = violations = duplicates = 0
    done = asyncio.Event()
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=5000)
        q = await channel.declare_queue(queue, passive=True)

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            nonlocal got, violations, duplicates
            got += 1
            if message.message_id in seen:
                duplicates += 1
            else:
                seen.add(message.message_id or "")
                key = str((message.headers or {}).get("x-relay-key"))
                i = int(orjson.loads(message.body)["i"])
                if i < last.get(key, 0):
                    violations += 1
                last[key] = max(i, last.get(key, 0))
            if got >= count:
                done.set()

        await q.consume(on_message, no_ack=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout)
    finally:
        await connection.close()
    return got - duplicates, violations, duplicates


async def scenario_multi(res: Resources, sz: Sizes, report: Report) -> None:
    """`relay outbox --once`: three processes on one table vs one, 100 keys."""

    count = sz.multi
    loads = [loadavg()[0]]
    for procs in (1, 3):
        url = await res.database(f"multi{procs}")
        exchange, queue = res.names(f"multi{procs}")
        await res.bind_queue(exchange, queue)
        await preload_outbox(url, count)
        name = url.rsplit("/", 1)[1]
        xacts = f"SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = '{name}'"
        before = await scalar(url, xacts)
        started = [
            res.relay(f"outbox{procs}_{n}", "outbox", "--once", *daemon_args(url, exchange))
            for n in range(procs)
        ]
        for proc in started:
            await proc.wait_log("outbox relay started", timeout=120)
        for proc in started:
            code = await proc.wait_exit(timeout=max(300.0, count / 300))
            if code != 0:
                raise BenchError(f"{proc.name} exited {code}:\n{proc.tail()}")
        published = await scalar(url, "SELECT count(*) FROM outbox WHERE status = 'published'")
        if published != count:
            raise BenchError(f"{procs} relays published {published} of {count} rows")
        rate = steady_rate(await batch_times(url, "outbox"))
        # Claims that found only rows whose key another relay holds are
        # transactions that publish nothing: transactions per 1,000 rows
        # tells how many (the statistics lag by up to 0.5 s: wait for them).
        await asyncio.sleep(1.0)
        spent = await scalar(url, xacts) - before
        received, violations, duplicates = await read_back(queue, count, 120)
        if received != count:
            raise BenchError(f"{procs} relays: the consumer got {received} of {count}")
        report.add("multi", f"rate_{procs}", rate, "msgs/s", messages=count, processes=procs)
        report.add(
            "multi",
            f"transactions_per_1000_rows_{procs}",
            spent / count * 1000,
            "xacts",
            note="every transaction in the database: claims, marks, LISTEN",
        )
        report.add(
            "multi",
            f"order_violations_{procs}",
            violations,
            "msgs",
            duplicates=duplicates,
            keys=KEYS,
        )
        await res.drop_database(url)
    loads.append(loadavg()[0])
    one, three = report.get("multi", "rate_1"), report.get("multi", "rate_3")
    if one and three:
        report.add("multi", "three_over_one", three / one, "x", loadavg_1m=loads)
