"""The inbox's receiver: broker → inbox table, acknowledging only what is committed.

The receiver takes batches from the broker, inserts them in one statement
with ON CONFLICT DO NOTHING (the producer's id is the dedup key), and only
after that commit acknowledges them.

`relay inbox` runs it in a child process of its own (`python -m
relay.receiving`, started and watched by ReceiverProcess). Receiving is
Python work on every message, and on the interpreter lock of the
dispatchers it delayed each of their round trips to PostgreSQL (the
measurements are in docs/inbox.md). `relay demo`, one
process by contract, runs it on its own event loop (LocalReceiver).
Either way this module loads neither SQLAlchemy nor handler code, so the
child stays small.

The parent and the child talk over a socket pair, in length-prefixed
pickles (both ends are this module, in one process tree):

    parent → child   ("start", settings, pace limit, logging), ("lead", n, seen), ("stop",)
    child → parent   ("alive", connected), ("stored", received, new, dead),
                     ("config_error", text)

The child exits with its parent: PR_SET_PDEATHSIG on Linux, and an end of
file on the socket anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from relay import logs
from relay.backoff import Backoff, sleep_unless, until_available
from relay.brokers import Consumer, Incoming, make_consumer
from relay.config import InboxSettings
from relay.db.writer import InboxWriter, Refused
from relay.errors import ConfigError, Unavailable
from relay.rows import NewInboxRow
from relay.storable import last_resort, to_row, without_payload

log = logging.getLogger("relay.inbox")

# How long the receiver waits to fill a batch once a message has arrived.
BATCH_WAIT = 0.005
# The child says it is alive (and whether it is connected) this often; a
# child silent for STALL_AFTER (relay.lifecycle) makes the daemon unhealthy.
ALIVE_INTERVAL = 1.0

# (messages received, rows new to the table, new rows stored as dead)
Report = Callable[[int, int, int], None]


# --------------------------------------------------------------------------
# Messages to rows
# --------------------------------------------------------------------------


# relay.storable turns each received message into one row, whatever it holds.


# --------------------------------------------------------------------------
# The inbox table
# --------------------------------------------------------------------------

# The receiver's INSERT and its connection are relay.db.writer's (no
# SQLAlchemy there either).


# --------------------------------------------------------------------------
# The receiver
# --------------------------------------------------------------------------


class Gate(Protocol):
    """Holds the receiver back while the rows it stored wait for the
    dispatchers (relay.inbox.Pace; LeadGate in the child process)."""

    async def wait(self, stopping: asyncio.Event) -> None: ...

    def release(self) -> None:
        """Wake a wait() (the receiver is stopping)."""


class Receiver:
    """Broker → inbox table, acknowledging only what is committed."""

    def __init__(
        self,
        settings: InboxSettings,
        writer: InboxWriter,
        consumer: Consumer,
        pace: Gate,
        report: Report,
    ) -> None:
        self.settings = settings
        self.writer = writer
        self.consumer = consumer
        self.pace = pace
        self.report = report
        self.stopping = asyncio.Event()
        self.reconnect = Backoff(0.5, 30.0)

    def stop(self) -> None:
        self.stopping.set()
        self.pace.release()

    async def run(self) -> None:
        await until_available(self._consume, self.stopping, self.reconnect, log)

    async def _consume(self) -> None:
        batches = self.consumer.batches(self.settings.batch_size, BATCH_WAIT)
        stop = asyncio.ensure_future(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                await self.pace.wait(self.stopping)
                next_batch = asyncio.ensure_future(anext(batches))
                await asyncio.wait({next_batch, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not next_batch.done():
                    # Stopping: what was received and not stored is not
                    # acknowledged, so the broker delivers it again.
                    next_batch.cancel()
                    await asyncio.gather(next_batch, return_exceptions=True)
                    return
                batch = next_batch.result()
                await self.store_batch(batch)
        finally:
            stop.cancel()
            await batches.aclose()

    async def store_batch(self, batch: Sequence[Incoming]) -> None:
        """Insert and commit, then acknowledge. Holds on to the batch (unacked)
        while the database is away, unless stopping."""
        rows = [to_row(m) for m in batch]
        failures = 0
        while True:
            try:
                new = await self._insert(batch, rows)
                break
            except Unavailable as exc:
                if self.stopping.is_set():
                    raise
                failures += 1
                delay = self.reconnect.delay(failures)
                log.warning(
                    "cannot store %d received messages: %s; retrying in %.1fs",
                    len(rows), exc, delay, extra={"action": "store_wait"},
                )
                await sleep_unless(self.stopping, delay)
        await self.consumer.ack(batch)
        dead = 0
        for row in rows:
            if row.status == "dead" and row.message_id in new:
                dead += 1
                log.warning(
                    "stored as dead: %s", row.last_error,
                    extra={"action": "received_dead", "message_id": row.message_id,
                           "topic": row.topic},
                )
        self.report(len(rows), len(new), dead)

    async def _insert(self, batch: Sequence[Incoming], rows: list[NewInboxRow]) -> set[str]:
        """Store the rows; a row PostgreSQL refuses (one statement fails for
        all) is stored again by itself, and if refused again, as a dead row
        of what cannot be refused (relay.storable.last_resort). Replaces the
        refused rows in `rows`, so that the report counts what was stored."""
        consumer = self.settings.consumer_name
        try:
            return await self.writer.insert(consumer, rows)
        except Refused:
            pass
        new: set[str] = set()
        for index, (message, row) in enumerate(zip(batch, rows, strict=True)):
            try:
                new |= await self.writer.insert(consumer, [row])
            except Refused as exc:
                refused = str(exc)
            else:
                continue
            for kept in (without_payload(row, message, refused),
                         last_resort(row, message, refused)):
                try:
                    new |= await self.writer.insert(consumer, [kept])
                except Refused as exc:
                    refused = str(exc)
                    continue
                rows[index] = kept
                break
            else:  # relay.storable's last resort holds nothing PostgreSQL refuses
                raise RuntimeError(f"PostgreSQL refused even the last-resort row: {refused}")
        return new


class LocalReceiver:
    """A Receiver on the running event loop, with its consumer and writer."""

    def __init__(self, settings: InboxSettings, pace: Gate, report: Report) -> None:
        assert settings.broker is not None
        self.consumer = make_consumer(
            settings.broker, queue=settings.queue, exchange=settings.exchange,
            binds=settings.binds, prefetch=settings.prefetch,
            queue_type=settings.queue_type, queue_args=settings.queue_args,
        )
        self.writer = InboxWriter(settings.database_url)
        self.receiver = Receiver(settings, self.writer, self.consumer, pace, report)
        self.stopping = self.receiver.stopping

    @property
    def connected(self) -> bool:
        return self.consumer.connected

    @property
    def last_alive(self) -> float:
        """It runs on the daemon's own loop, which answers the probes: alive."""
        return time.monotonic()

    async def start(self) -> bool:
        """Connect to the broker (waiting out outages); False if stopped first."""
        return await until_available(
            self.consumer.connect, self.stopping, self.receiver.reconnect, log)

    async def run(self) -> None:
        await self.receiver.run()

    def stop(self) -> None:
        self.receiver.stop()

    async def close(self) -> None:
        await self.consumer.close()
        await self.writer.close()


# --------------------------------------------------------------------------
# The receiver in a process of its own
# --------------------------------------------------------------------------


def _send(writer: asyncio.StreamWriter, message: tuple[Any, ...]) -> None:
    if writer.is_closing():  # the other end has gone: nobody to tell
        return
    data = pickle.dumps(message)
    writer.write(len(data).to_bytes(4, "big") + data)


async def _receive(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    """The next message, or None when the other end has gone."""
    try:
        head = await reader.readexactly(4)
        return pickle.loads(await reader.readexactly(int.from_bytes(head, "big")))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class ReceiverExited(RuntimeError):
    """The receiver process ended without being asked to."""


class ReceiverProcess:
    """`relay inbox`'s receiver in a child process: same face as LocalReceiver.

    The child stores batches and reports each one; here the report feeds the
    metrics, the Pace and the dispatchers' wake-up, as a LocalReceiver's
    would, and the Pace's lead goes back to the child after every change."""

    def __init__(self, settings: InboxSettings, pace: Any, report: Report) -> None:
        self.settings = settings
        self.pace = pace  # relay.inbox.Pace: its limit, lead, stored_total and changed event
        self.report = report
        self.stopping = asyncio.Event()
        self.connected = False
        self.last_alive = time.monotonic()
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def start(self) -> bool:
        """Start the child and wait until it is connected to the broker (it
        waits out outages itself); False if stopped first. A ConfigError the
        child met is raised here."""
        # -P, and the package's own directory first on the path: the working
        # directory must not shadow the relay package.
        package_root = str(Path(__file__).resolve().parent.parent)  # noqa: ASYNC240 - once
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
        ours, theirs = socket.socketpair()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-P", "-m", "relay.receiving",
                str(theirs.fileno()), str(os.getpid()),
                pass_fds=(theirs.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        _send(self._writer, ("start", self.settings, self.pace.limit,
                             logs.configuration() or ("INFO", "text", ())))
        if self.stopping.is_set():
            _send(self._writer, ("stop",))
        log.debug("receiver process %d started", self._proc.pid)
        while not self.connected:
            if not await self._next():
                await self._ended()
                return False
        return True

    async def _next(self) -> bool:
        """Handle the child's next message; False once it has gone."""
        assert self._reader is not None
        message = await _receive(self._reader)
        if message is None:
            return False
        self.last_alive = time.monotonic()
        kind = message[0]
        if kind == "alive":
            self.connected = message[1]
        elif kind == "stored":
            self.report(*message[1:])
        elif kind == "config_error":
            raise ConfigError(message[1])
        return True

    async def _ended(self) -> None:
        """The child has gone: fine if asked to stop, else ReceiverExited."""
        assert self._proc is not None
        code = await self._proc.wait()
        self.connected = False
        if code == 0 and self.stopping.is_set():
            return
        raise ReceiverExited(f"the receiver process exited with status {code}")

    async def run(self) -> None:
        """Carry the child's reports until it exits (after stop(), with 0)."""
        leads = asyncio.ensure_future(self._send_leads())
        try:
            while await self._next():
                pass
            await self._ended()
        finally:
            leads.cancel()
            await asyncio.gather(leads, return_exceptions=True)

    async def _send_leads(self) -> None:
        while True:
            await self.pace.changed.wait()
            self.pace.changed.clear()
            if self._writer is not None:
                _send(self._writer, ("lead", self.pace.lead, self.pace.stored_total))

    def stop(self) -> None:
        """Ask the child to stop taking messages, store what it holds, and exit."""
        self.stopping.set()
        if self._writer is not None:
            _send(self._writer, ("stop",))

    async def close(self) -> None:
        """Make sure the child is gone (killed if it outlived the shutdown)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self._writer is not None:
            self._writer.close()


class LeadGate:
    """The child's Gate: how far its stored rows are ahead of the parent's
    dispatchers, from the lead the parent sends after each change plus what
    was stored since the parent counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stored_total = 0
        self._lead = 0
        self._seen = 0  # the parent's count of stored rows when it sent _lead
        self.changed = asyncio.Event()

    @property
    def lead(self) -> int:
        return self._lead + self.stored_total - self._seen

    def stored(self, rows: int) -> None:
        self.stored_total += rows

    def update(self, lead: int, seen: int) -> None:
        self._lead, self._seen = lead, seen
        self.changed.set()

    async def wait(self, stopping: asyncio.Event) -> None:
        while self.lead > self.limit and not stopping.is_set():
            self.changed.clear()
            await sleep_unless(self.changed, 1.0)

    def release(self) -> None:
        self.changed.set()


def _die_with_parent(parent: int) -> None:
    """Be killed when the parent ends, however it ends (Linux); the socket's
    end of file covers the rest."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it ended before prctl
        os._exit(1)


async def _child(fd: int) -> int:
    reader, writer = await asyncio.open_connection(sock=socket.socket(fileno=fd))
    start = await _receive(reader)
    if start is None:
        return 0
    _, settings, limit, (level, fmt, secrets) = start
    logs.setup(level, fmt, secrets)
    gate = LeadGate(limit)

    def report(received: int, new: int, dead: int) -> None:
        gate.stored(new)
        _send(writer, ("stored", received, new, dead))

    try:
        await _receive_until_stopped(LocalReceiver(settings, gate, report), reader, writer, gate)
        return 0
    except ConfigError as exc:
        _send(writer, ("config_error", str(exc)))
        return 2
    finally:
        with contextlib.suppress(Exception):
            await writer.drain()
            writer.close()


async def _receive_until_stopped(
    local: LocalReceiver, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
    gate: LeadGate,
) -> None:
    async def listen() -> None:
        while (message := await _receive(reader)) is not None:
            if message[0] == "lead":
                gate.update(*message[1:])
            elif message[0] == "stop":
                break
        local.stop()  # asked to, or the parent has gone

    async def alive() -> None:
        while True:
            _send(writer, ("alive", local.connected))
            await asyncio.sleep(ALIVE_INTERVAL)

    helpers = [asyncio.ensure_future(listen()), asyncio.ensure_future(alive())]
    try:
        if await local.start():
            _send(writer, ("alive", True))
            await local.run()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await local.close()


def main() -> None:
    """`python -m relay.receiving FD PARENT_PID`: run by ReceiverProcess only."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    # The parent handles SIGTERM and SIGINT (a terminal's Ctrl-C reaches the
    # whole process group) and tells this process when to stop.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    try:
        code = asyncio.run(_child(fd))
    except Exception:
        log.exception("the receiver process crashed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
