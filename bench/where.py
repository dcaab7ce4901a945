"""Where the time goes (issue 21): one daemon over N messages of 100 keys,
with the CPU each process spent and, optionally, py-spy's samples.

    .venv/bin/python -m bench.where outbox --messages 20000 [--py-spy DIR]
    .venv/bin/python -m bench.where inbox --messages 20000 [--py-spy DIR]
    .venv/bin/python -m bench.where inbox --broker kafka --handlers bench.handlers:batch

--broker redis: the same on Redis Streams (redis-server on a free port, the
stream filled by `relay outbox --once`). --broker kafka: the same on Kafka
(Tansu started as bench.kafka does, a topic of six partitions; the inbox's
topic filled by a bare producer in relay's wire format); the broker's CPU
is then Tansu's or redis-server's.

outbox: `relay outbox` over N pending rows (until it has published them;
its /metrics give the workers' share of time spent publishing). inbox: `relay inbox`
over a queue preloaded with N messages in the outbox's wire format (a
one-INSERT handler). Prints the rate (from the batches' timestamps) and the
CPU per message of: the daemon's processes (from /proc while they run),
RabbitMQ (beam.smp) and PostgreSQL (every postgres process: other clients
of the same servers count too, so run it on a quiet machine or read it as
an upper bound). With --py-spy, the daemon runs under `py-spy record
--subprocesses --format raw` and the hottest frames are printed (self and
inclusive share of the samples); BENCH_PY_SPY_ARGS adds py-spy options
(`--gil`: only the samples of the thread holding the interpreter lock,
about what costs CPU). Reads the servers' processes only; changes nothing
in them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.backlog import MEASURED_TOPIC, fill_queue, preload_outbox
from bench.common import (
    REPO,
    BenchError,
    Resources,
    batch_times,
    descendants,
    free_port,
    loadavg,
    relay_command,
    steady_rate,
)
from bench.cpu import ServerCpu, TreeCpu, client_of_backends
from bench.harness import (
    AMQP_URL,
    create_effects,
    daemon_args,
    metrics,
    wait_handled,
    wait_metric,
)


def hottest(raw: Path, top: int = 25) -> list[str]:
    """The frames with the most samples in py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        # The event loop's samples only: start-up (imports) left out.
        # (and the Kafka consumer's consume thread).
        if not stack or "_find_and_load" in stack:
            continue
        if "run_forever" not in stack and "_consume (relay/brokers/kafka/consuming.py" not in stack:
            continue
        n = int(count)
        total += n
        # A function's frames counted together, whatever the line.
        frames = [
            f[:60] if f.startswith("process ") else re.sub(r":\d+\)$", ")", f)
            for f in stack.split(";")
        ]
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    total = max(total, 1)
    lines = [f"{total} samples in the event loop (start-up left out); self:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["inclusive:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    return lines


async def main(args: argparse.Namespace) -> None:
    from relay.outbox import WORKERS

    res = Resources(f"where_{args.daemon}")
    proc = None
    kafka = None
    try:
        url = await res.database()
        count = args.messages
        if args.broker == "kafka":
            kafka, broker = await _kafka(res, count if args.daemon == "inbox" else 0)
            exchange, queue = "relay", MEASURED_TOPIC  # the exchange: unused by Kafka
        elif args.broker == "redis":
            kafka, broker = await _redis(res, count if args.daemon == "inbox" else 0)
            exchange, queue = "relay", MEASURED_TOPIC  # the exchange: unused by Redis
        else:
            exchange, queue = res.names()
            await res.bind_queue(exchange, queue)
            broker = AMQP_URL
        if args.daemon == "outbox":
            await preload_outbox(url, count)
            port = free_port()
            argv_tail = ["outbox", *daemon_args(url, exchange, broker), "--http-port", str(port)]
        else:
            await create_effects(url)
            if args.broker == "rabbitmq":
                await fill_queue(res, exchange, queue, count)
            port = free_port()
            argv_tail = [
                "inbox",
                *daemon_args(url, exchange, broker),
                "--queue",
                queue,
                "--consumer-name",
                "bench",
                "--handlers",
                args.handlers,
                "--http-port",
                str(port),
            ]
        argv = [*relay_command(), *argv_tail, *args.relay_arg]
        if args.py_spy:
            out = Path(args.py_spy) / f"{args.daemon}.raw"
            out.parent.mkdir(parents=True, exist_ok=True)
            spy = str(Path(sys.executable).parent / "py-spy")
            argv = [
                spy,
                "record",
                "--subprocesses",
                "--format",
                "raw",
                "--rate",
                "250",
                "--nonblocking",
                *os.environ.get("BENCH_PY_SPY_ARGS", "").split(),
                "-o",
                str(out),
                "--",
                *argv,
            ]
        load = loadavg()
        proc = res.spawn(args.daemon, argv)
        tree = TreeCpu(proc.pid)
        stop = asyncio.Event()
        sampler = asyncio.create_task(tree.run(stop))
        started = "outbox relay started" if args.daemon == "outbox" else "inbox started"
        await proc.wait_log(started, timeout=120)
        # From here on: start-up (imports, connections) left out.
        tree.sample()
        at_start = {pid: seconds for pid, (_, seconds) in tree.seen.items()}
        server_names = {"kafka": "tansu*", "redis": "redis-server*", "rabbitmq": "beam.smp"}
        servers = [
            ServerCpu(server_names[args.broker]),
            ServerCpu("postgres"),
            ServerCpu("postgres", only=url.rsplit("/", 1)[1] + " "),
        ]
        for server in servers:
            server.start()
        watchers = [asyncio.create_task(server.run(stop)) for server in servers]
        began = time.monotonic()
        database = url.rsplit("/", 1)[1]
        await asyncio.sleep(1.0)  # every connection open
        backend_clients = await asyncio.to_thread(client_of_backends, database)
        publish_seconds = None
        if args.daemon == "outbox":
            ended = await wait_metric(
                proc,
                port,
                "relay_outbox_published_total",
                count,
                timeout=max(300.0, count / 150),
                interval=0.2,
            )
            publish_seconds = (await metrics(port)).get("relay_outbox_publish_seconds_sum")
        else:
            await wait_handled(proc, port, count, 0.5)
        tree.sample()
        # py-spy writes its samples once the daemon it runs exits.
        daemon = descendants(proc.pid)[0] if args.py_spy else proc.pid
        os.kill(daemon, signal.SIGTERM)
        code = await proc.wait_exit(timeout=60)
        if code != 0:
            raise BenchError(f"relay exited {code} on SIGTERM:\n{proc.tail()}")
        stop.set()
        await asyncio.gather(sampler, *watchers)
        for server in servers:
            server.sample()
        broker_name = {"kafka": "tansu", "redis": "redis"}.get(args.broker, "rabbitmq")
        used = {broker_name: servers[0].used(), "postgresql": servers[1].used()}
        backends = servers[2].used()
        table = "outbox" if args.daemon == "outbox" else "inbox"
        batches = await batch_times(url, table)
        rate = steady_rate(batches)
        print(
            f"{args.daemon}: {count:,} messages, {rate or 0:,.0f} msgs/s (steady), "
            f"{count / max(len(batches), 1):,.0f} a batch on average, "
            f"load average {load} -> {loadavg()}"
        )
        if args.daemon == "inbox":
            received = await batch_times(url, "inbox", "received_at")
            print(f"the receiver: {count / max(len(received), 1):,.0f} messages a batch on average")
        print("CPU per message, µs (from the daemon's 'started' line to the end):")
        for pid, (label, seconds) in tree.seen.items():
            if "py-spy" not in label:
                spent = seconds - at_start.get(pid, 0.0)
                print(f"  {spent / count * 1e6:7.1f}  {label}")
        print(
            f"  {backends / count * 1e6:7.1f}  postgresql: the backends of this "
            "benchmark's database; by the client process at the other end:"
        )
        by_client: collections.Counter[str] = collections.Counter()
        labels = {pid: label for pid, (label, _) in tree.seen.items()}
        for backend, seconds in servers[2].last.items():
            client = backend_clients.get(backend)
            label = labels.get(client, "another client") if client else "not matched"
            by_client[label] += seconds - servers[2].first.get(backend, 0.0)
        for label, seconds in by_client.most_common():
            print(f"  {seconds / count * 1e6:9.1f}  {label}")
        for name, seconds in used.items():
            print(
                f"  {seconds / count * 1e6:7.1f}  {name} (all its processes, other "
                "clients included)"
            )
        if publish_seconds is not None:
            # Each worker's time from its first write to the batch's last
            # confirm, against the time the workers had.
            share = publish_seconds / (WORKERS * (ended - began))
            print(
                f"outbox workers' time publishing (write to last confirm): {share:.0%}; "
                "the rest: claim, mark, commit, waiting for the event loop"
            )
        if args.py_spy:
            print("\n".join(hottest(Path(args.py_spy) / f"{args.daemon}.raw")))
    finally:
        # Under py-spy the daemon is py-spy's child: stop it first, or it
        # outlives the run (Resources only signals the process it started).
        for pid in descendants(proc.pid) if proc is not None else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGTERM)
        if kafka is not None:
            await asyncio.to_thread(kafka.close)
        problems = await res.close()
        if problems:
            print("cleanup:", problems, file=sys.stderr)


async def _kafka(res: Resources, count: int) -> tuple[Any, str]:
    """Tansu (as bench.kafka starts it) with MEASURED_TOPIC of six
    partitions holding `count` records in relay's wire format; its URL."""
    from bench.kafka import bare_produce, measured_topic

    server, broker = await measured_topic(res, "tansu.log")
    if count:
        await asyncio.to_thread(bare_produce, server.bootstrap, MEASURED_TOPIC, count)
    return server, broker


async def _redis(res: Resources, count: int) -> tuple[Any, str]:
    """redis-server (as bench.redis_streams starts it) with the stream
    MEASURED_TOPIC holding `count` entries that `relay outbox --once` sent
    (relay's own fields); its URL."""
    from tests.redis_server import RedisServer

    workdir = res.workdir / "redis"
    workdir.mkdir(exist_ok=True)
    server = await asyncio.to_thread(RedisServer, workdir)
    broker = server.url(direct=True)
    if count:
        url = await res.database("fill")
        await preload_outbox(url, count)
        fill = res.relay("fill", "outbox", "--once", *daemon_args(url, "relay", broker))
        code = await fill.wait_exit(timeout=600)
        if code != 0:
            raise BenchError(f"relay outbox --once exited {code}:\n{fill.tail()}")
        await res.drop_database(url)
    return server, broker


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.where")
    parser.add_argument("daemon", choices=("outbox", "inbox"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument(
        "--handlers",
        default="bench.handlers",
        help="inbox: bench.handlers (one INSERT) or bench.handlers:noop",
    )
    parser.add_argument("--broker", choices=("rabbitmq", "kafka", "redis"), default="rabbitmq")
    parser.add_argument("--py-spy", metavar="DIR", help="record the daemon with py-spy into DIR")
    parser.add_argument(
        "--relay-arg",
        action="append",
        default=[],
        help="a flag for the daemon, e.g. --relay-arg=--cloudevents-source=URI (repeatable)",
    )
    os.chdir(REPO)
    asyncio.run(main(parser.parse_args()))
