"""Where the time goes (issue 21): one daemon over N messages of 100 keys,
with the CPU each process spent and, optionally, py-spy's samples.

    .venv/bin/python -m bench.where outbox --messages 20000 [--py-spy DIR]
    .venv/bin/python -m bench.where inbox --messages 20000 [--py-spy DIR]

outbox: `relay outbox --once` over N pending rows. inbox: `relay inbox`
over a queue preloaded with N messages in the outbox's wire format (a
one-INSERT handler). Prints the rate (from the batches' timestamps) and the
CPU per message of: the daemon's processes (from /proc while they run),
RabbitMQ (beam.smp) and PostgreSQL (every postgres process: other clients
of the same servers count too, so run it on a quiet machine or read it as
an upper bound). With --py-spy, the daemon runs under `py-spy record
--subprocesses --format raw` and the hottest frames are printed (self and
inclusive share of the samples). Reads the servers' processes only; changes
nothing in them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
from pathlib import Path

from bench.backlog import fill_queue, preload_outbox
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

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def pids_named(name: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == name:
                    found.append(int(entry))
            except OSError:
                pass
    return found


def server_cpu() -> dict[str, float]:
    return {"rabbitmq": sum(cpu_seconds(p) for p in pids_named("beam.smp")),
            "postgresql": sum(cpu_seconds(p) for p in pids_named("postgres"))}


class TreeCpu:
    """The last CPU seen of each process in a tree, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, tuple[str, float]] = {}

    def sample(self) -> None:
        for pid in [self.pid, *descendants(self.pid)]:
            seconds = cpu_seconds(pid)
            if seconds:
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    label = " ".join(c.decode(errors="replace") for c in cmd[:3])[-60:]
                except OSError:
                    label = str(pid)
                self.seen[pid] = (label, seconds)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sample()
            await asyncio.sleep(0.2)


def hottest(raw: Path, top: int = 25) -> list[str]:
    """The frames with the most samples in py-spy's raw (collapsed) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"{total} samples; self:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in own.most_common(top)]
    lines += ["inclusive:"]
    lines += [f"  {n / total:6.1%}  {f}" for f, n in inclusive.most_common(top)]
    return lines


async def main(args: argparse.Namespace) -> None:
    from bench.run import _create_effects, _daemon_args, wait_metric

    res = Resources(f"where_{args.daemon}")
    try:
        url = await res.database()
        exchange, queue = res.names()
        await res.bind_queue(exchange, queue)
        count = args.messages
        if args.daemon == "outbox":
            await preload_outbox(url, count)
            daemon_args = ["outbox", "--once", *_daemon_args(url, exchange)]
        else:
            await _create_effects(url)
            await fill_queue(res, exchange, queue, count)
            port = free_port()
            daemon_args = ["inbox", *_daemon_args(url, exchange), "--queue", queue,
                           "--handlers", "bench.handlers", "--http-port", str(port)]
        argv = [*relay_command(), *daemon_args]
        if args.py_spy:
            out = Path(args.py_spy) / f"{args.daemon}.raw"
            out.parent.mkdir(parents=True, exist_ok=True)
            spy = str(Path(sys.executable).parent / "py-spy")
            argv = [spy, "record", "--subprocesses", "--format", "raw", "--rate", "250",
                    "--nonblocking", "-o", str(out), "--", *argv]
        load = loadavg()
        servers = server_cpu()
        proc = res.spawn(args.daemon, argv)
        tree = TreeCpu(proc.pid)
        stop = asyncio.Event()
        sampler = asyncio.create_task(tree.run(stop))
        started = "outbox relay started" if args.daemon == "outbox" else "inbox started"
        await proc.wait_log(started, timeout=120)
        if args.daemon == "outbox":
            code = await proc.wait_exit(timeout=max(300.0, count / 300))
            if code != 0:
                raise BenchError(f"relay outbox exited {code}:\n{proc.tail()}")
        else:
            await wait_metric(proc, port, "relay_inbox_processed_total", count,
                              timeout=max(300.0, count / 150), interval=0.5,
                              fail_on="relay_inbox_failed_total")
            tree.sample()
            await proc.stop()
        stop.set()
        await sampler
        used = {k: v - servers[k] for k, v in server_cpu().items()}
        table = "outbox" if args.daemon == "outbox" else "inbox"
        rate = steady_rate(await batch_times(url, table))
        print(f"{args.daemon}: {count:,} messages, {rate or 0:,.0f} msgs/s (steady), "
              f"load average {load} -> {loadavg()}")
        print("CPU per message, µs (the daemon from start-up to exit):")
        for label, seconds in tree.seen.values():
            if "py-spy" not in label:
                print(f"  {seconds / count * 1e6:7.1f}  {label}")
        for name, seconds in used.items():
            print(f"  {seconds / count * 1e6:7.1f}  {name} (all its processes, other "
                  "clients included)")
        if args.py_spy:
            print("\n".join(hottest(Path(args.py_spy) / f"{args.daemon}.raw")))
    finally:
        problems = await res.close()
        if problems:
            print("cleanup:", problems, file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.where")
    parser.add_argument("daemon", choices=("outbox", "inbox"))
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--py-spy", metavar="DIR", help="record the daemon with py-spy into DIR")
    os.chdir(REPO)
    asyncio.run(main(parser.parse_args()))
