"""The inbox's receiver as a process: started, fed and watched by the daemon.

`relay inbox` runs its Receiver (relay.receiving) in a child process of
its own (`python -m relay.receiver_process`, started and watched by
ReceiverProcess). Receiving is Python work on every message, and on the
interpreter lock of the dispatchers it delayed each of their round trips
to PostgreSQL (the measurements are in docs/inbox.md). `relay demo`, one
process by contract, runs it on its own event loop (LocalReceiver).
Either way nothing here loads SQLAlchemy or handler code, so the child
stays small.

The parent and the child talk over a socket pair, in length-prefixed
pickles (both ends are this module, in one process tree):

    parent → child   Start (the receiver's parts, pace limit, logging), Lead (relay.pacing), Stop
    child → parent   Alive (connected), Stored (received, new, dead), ConfigProblem (text)

The child exits with its parent: PR_SET_PDEATHSIG on Linux, and an end of
file on the socket anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import pickle
import signal
import socket
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from relay import logs
from relay.backoff import until_available
from relay.brokers import Consumer, Reading
from relay.db.connect import password_command, use_password_command
from relay.errors import (
    ConfigError,
    DatabaseUnavailable,
    ReceiverExited,
    Refused,
    Unavailable,
)
from relay.pacing import Gate, Lead, LeadGate, Pace
from relay.receiving import Envelope, Receiver, Report, Stage, Writer
from relay.rows import NewInboxRow
from relay.runtime import tune_gc

log = logging.getLogger("relay.inbox")

# The child says it is alive (and whether it is connected) this often; a
# child silent for STALL_AFTER (relay.lifecycle) makes the daemon unhealthy.
ALIVE_INTERVAL = 1.0
# How often the consumer's readings (relay.brokers.Reading) are taken.
READINGS_INTERVAL = 5.0


@dataclass(frozen=True)
class ReceiverParts:
    """What a receiver is built from, as wiring made it: its collaborators'
    factories, called where the receiver runs (in ReceiverProcess's child
    they travel pickled: module-level functions, classes and
    functools.partial of them), and the values it uses."""

    consumer: Callable[[], Consumer]
    # relay.receiving.Writer; None: the batches go to the daemon, whose
    # `handing` stores and handles them (--dispatch received, ReceiverProcess)
    writer: Callable[[], Writer] | None
    stage: Callable[[], Stage] | None  # relay.receiving.Stage: the claim check's
    envelope: Envelope | None  # relay.receiving.Envelope: CloudEvents'
    consumer_name: str
    batch_size: int


class LocalReceiver:
    """A Receiver on the running event loop, with its consumer and writer."""

    def __init__(
        self, parts: ReceiverParts, pace: Gate, report: Report, writer: Writer | None = None
    ) -> None:
        self.consumer = parts.consumer()
        if writer is None:
            assert parts.writer is not None, "a receiver without a writer"
            writer = parts.writer()
        self.writer = writer
        self.receiver = Receiver(
            self.writer,
            self.consumer,
            pace,
            report,
            consumer_name=parts.consumer_name,
            batch_size=parts.batch_size,
            stage=parts.stage() if parts.stage is not None else None,
            envelope=parts.envelope,
        )
        # The consumer's figures on its broker (relay.brokers.Reading), for /metrics.
        self.readings: list[Reading] = []
        self.on_readings: Callable[[list[Reading]], None] | None = None
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
            self.consumer.connect, self.stopping, self.receiver.reconnect, log
        )

    async def run(self) -> None:
        watch = asyncio.ensure_future(self._watch_readings())
        try:
            await self.receiver.run()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _watch_readings(self) -> None:
        """Ask the consumer for its readings every READINGS_INTERVAL, if it has any."""
        measure = getattr(self.consumer, "readings", None)
        if measure is None:
            return
        while True:
            try:
                self.readings = await measure()
            except Exception as exc:  # noqa: BLE001 - a figure missing is no reason to stop
                log.debug("cannot read the broker's figures: %r", exc)
            else:
                if self.on_readings is not None:
                    self.on_readings(self.readings)
            await asyncio.sleep(READINGS_INTERVAL)

    def stop(self) -> None:
        self.receiver.stop()

    async def close(self) -> None:
        await self.consumer.close()
        await self.writer.close()
        await self.receiver.close()


# --------------------------------------------------------------------------
# The receiver in a process of its own
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Start:
    """The parent's first message: what to receive, the pace, the logging."""

    parts: ReceiverParts
    limit: int  # the Pace's limit (rows stored ahead of the dispatchers)
    logging: tuple[str, str, tuple[str, ...]]  # relay.logs.configuration()


@dataclass(frozen=True)
class Stop:
    """Stop taking messages, store what is in hand, and exit 0."""


@dataclass(frozen=True)
class Alive:
    """The child is alive (every ALIVE_INTERVAL) and connected to the broker, or not."""

    connected: bool


@dataclass(frozen=True)
class Stored:
    """One batch stored and acknowledged (the Receiver's Report)."""

    received: int
    new: int
    dead: int
    fetched: int = 0  # bodies fetched from S3 (claim check)
    fetched_bytes: int = 0


@dataclass(frozen=True)
class Store:
    """A received batch for the daemon to store and handle (--dispatch
    received: the parent's `handing`, relay.inbox.Handing)."""

    number: int
    consumer: str
    rows: list[NewInboxRow]


@dataclass(frozen=True)
class StoreDone:
    """The daemon's answer to Store `number`: the new ids, or what failed
    (`error`: refused or unavailable, with its text, and the ids the
    batch's other parts stored all the same)."""

    number: int
    new: set[str]
    error: str | None = None
    text: str = ""


@dataclass(frozen=True)
class Readings:
    """The consumer's latest readings on its broker (relay.brokers.Reading)."""

    readings: list[Reading]


@dataclass(frozen=True)
class ConfigProblem:
    """The child met a ConfigError (the parent raises it): the daemon exits 2."""

    text: str


ToChild = Start | Lead | Stop | StoreDone
ToParent = Alive | Stored | Readings | ConfigProblem | Store


# The slices a large message goes through the socket pair in (bytes), and
# the messages held back while one goes (see _send_large), by writer.
SLICE = 256 * 1024
_sending_large: weakref.WeakKeyDictionary[asyncio.StreamWriter, list[bytes]] = (
    weakref.WeakKeyDictionary()
)


def _send(writer: asyncio.StreamWriter, message: ToChild | ToParent) -> None:
    if writer.is_closing():  # the other end has gone: nobody to tell
        return
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    frame = [len(data).to_bytes(4, "big"), data]
    held = _sending_large.get(writer)
    if held is not None:  # a batch is going out a slice at a time: after it
        held += frame
        return
    for part in frame:  # not joined: no copy of a large message
        writer.write(part)


async def _send_large(writer: asyncio.StreamWriter, message: ToParent) -> None:
    """_send for a batch (Store), a slice at a time as the socket takes
    them: the transport's buffer never holds a second copy of it."""
    if writer.is_closing():
        return
    data = memoryview(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
    held: list[bytes] = []
    _sending_large[writer] = held  # the other messages wait for the end of it
    try:
        writer.write(len(data).to_bytes(4, "big"))
        for start in range(0, len(data), SLICE):
            writer.write(data[start : start + SLICE])
            await writer.drain()
    except ConnectionError:
        return  # the daemon has gone: RemoteWriter.gone answers the batch
    finally:
        del _sending_large[writer]
        if not writer.is_closing():
            for part in held:
                writer.write(part)


async def _receive(reader: asyncio.StreamReader) -> ToChild | ToParent | None:
    """The next message, or None when the other end has gone. A large one
    (a batch) is read into one buffer of its size, not gathered in the
    reader's and copied out twice (relay.budget)."""
    try:
        size = int.from_bytes(await reader.readexactly(4), "big")
        if size <= SLICE:
            data: bytes | bytearray = await reader.readexactly(size)
        else:
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:
                chunk = await reader.read(min(size - got, SLICE))
                if not chunk:
                    return None
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
            del view
        message: ToChild | ToParent = pickle.loads(data)
        return message
    except (asyncio.IncompleteReadError, ConnectionError):
        return None


class ReceiverProcess:
    """`relay inbox`'s receiver in a child process: same face as LocalReceiver.

    The child stores batches and reports each one; here the report feeds the
    metrics, the Pace and the dispatchers' wake-up, as a LocalReceiver's
    would, and the Pace's lead goes back to the child after every change."""

    def __init__(
        self, parts: ReceiverParts, pace: Pace, report: Report, handing: Writer | None = None
    ) -> None:
        self.parts = parts
        self.pace = pace
        self.report = report
        # --dispatch received: stores and handles the child's batches here.
        self.handing = handing
        self._storing: set[asyncio.Task[None]] = set()
        self.stopping = asyncio.Event()
        self.connected = False
        self.last_alive = time.monotonic()
        self.readings: list[Reading] = []  # the child's consumer's, for /metrics
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
        command = password_command()
        if command is not None:  # given as a flag, or the variable itself
            env["RELAY_DATABASE_PASSWORD_COMMAND"] = command.command
        ours, theirs = socket.socketpair()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                "-m",
                "relay.receiver_process",
                str(theirs.fileno()),
                str(os.getpid()),
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._reader, self._writer = await asyncio.open_connection(sock=ours)
        # Under --dispatch received the child's rows are handled as they are
        # stored: none waits for the dispatchers, and the child is not paced.
        limit = self.pace.limit if self.handing is None else sys.maxsize
        _send(self._writer, Start(self.parts, limit, logs.configuration() or ("INFO", "text", ())))
        if self.stopping.is_set():
            _send(self._writer, Stop())
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
        if isinstance(message, Alive):
            self.connected = message.connected
        elif isinstance(message, Stored):
            self.report(
                message.received, message.new, message.dead, message.fetched, message.fetched_bytes
            )
        elif isinstance(message, Readings):
            self.readings = message.readings
        elif isinstance(message, Store):
            task = asyncio.ensure_future(self._store(message))
            self._storing.add(task)
            task.add_done_callback(self._storing.discard)
        elif isinstance(message, ConfigProblem):
            raise ConfigError(message.text)
        return True

    async def _store(self, message: Store) -> None:
        """Store and handle the child's batch (`handing`), and answer."""
        assert self.handing is not None, "a Store from a child that writes its own rows"
        try:
            done = StoreDone(
                message.number, await self.handing.insert(message.consumer, message.rows)
            )
        except Refused as exc:
            done = StoreDone(message.number, set(exc.stored), "refused", str(exc))
        except Unavailable as exc:
            done = StoreDone(message.number, set(), "unavailable", str(exc))
        except Exception as exc:  # relay's fault: the child raises it, and exits 1
            log.exception("storing a received batch failed")
            done = StoreDone(message.number, set(), "failed", f"{type(exc).__name__}: {exc}")
        if self._writer is not None:
            _send(self._writer, done)

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
            lead = await self.pace.next_lead()
            if self._writer is not None:
                _send(self._writer, lead)

    def stop(self) -> None:
        """Ask the child to stop taking messages, store what it holds, and exit."""
        self.stopping.set()
        if self._writer is not None:
            _send(self._writer, Stop())

    async def close(self) -> None:
        """Make sure the child is gone (killed if it outlived the shutdown)."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        if self._writer is not None:
            self._writer.close()


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
    if not isinstance(start, Start):  # the parent has gone
        return 0
    logs.setup(*start.logging)
    gate = LeadGate(start.limit)

    def report(received: int, new: int, dead: int, fetched: int, fetched_bytes: int) -> None:
        gate.stored(new)
        _send(writer, Stored(received, new, dead, fetched, fetched_bytes))

    remote = RemoteWriter(writer) if start.parts.writer is None else None
    try:
        local = LocalReceiver(start.parts, gate, report, remote)
        local.on_readings = lambda readings: _send(writer, Readings(readings))
        await _receive_until_stopped(local, reader, writer, gate, remote)
        return 0
    except ConfigError as exc:
        _send(writer, ConfigProblem(str(exc)))
        return 2
    finally:
        with contextlib.suppress(Exception):
            await writer.drain()
            writer.close()


async def _receive_until_stopped(
    local: LocalReceiver,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    gate: LeadGate,
    remote: RemoteWriter | None,
) -> None:
    async def listen() -> None:
        # After Stop, on to the end of file: the answers to the batches in
        # hand (StoreDone) may still come.
        while (message := await _receive(reader)) is not None:
            if isinstance(message, Lead):
                gate.update(message)
            elif isinstance(message, StoreDone) and remote is not None:
                remote.done(message)
            elif isinstance(message, Stop):
                local.stop()
        local.stop()  # the parent has gone
        if remote is not None:
            remote.gone()

    async def alive() -> None:
        while True:
            _send(writer, Alive(local.connected))
            await asyncio.sleep(ALIVE_INTERVAL)

    helpers = [asyncio.ensure_future(listen()), asyncio.ensure_future(alive())]
    try:
        if await local.start():
            _send(writer, Alive(True))
            await local.run()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        await local.close()


class RemoteWriter:
    """The child's writer under --dispatch received: each batch goes to the
    daemon (Store), which stores and handles it; the answer (StoreDone)
    resolves the insert, as the child's own INSERT would have."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._numbers = itertools.count()
        self._waiting: dict[int, asyncio.Future[StoreDone]] = {}

    async def insert(self, consumer: str, batch: Sequence[NewInboxRow]) -> set[str]:
        if not batch:
            return set()
        number = next(self._numbers)
        answer: asyncio.Future[StoreDone] = asyncio.get_running_loop().create_future()
        self._waiting[number] = answer
        try:
            await _send_large(self._writer, Store(number, consumer, list(batch)))
            done = await answer
        finally:
            self._waiting.pop(number, None)
        if done.error == "refused":
            refused = Refused(done.text)
            refused.stored = frozenset(done.new)
            raise refused
        if done.error == "unavailable":
            raise DatabaseUnavailable(done.text)
        if done.error is not None:
            raise RuntimeError(f"the inbox daemon could not store a batch: {done.text}")
        return done.new

    def done(self, message: StoreDone) -> None:
        answer = self._waiting.get(message.number)
        if answer is not None and not answer.done():
            answer.set_result(message)

    def gone(self) -> None:
        """The daemon has gone: what waits for it is not acknowledged."""
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_result(StoreDone(-1, set(), "unavailable", "the inbox is stopping"))

    async def close(self) -> None:
        pass


def main() -> None:
    """`python -m relay.receiver_process FD PARENT_PID`: run by ReceiverProcess only."""
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    _die_with_parent(parent)
    # The parent handles SIGTERM and SIGINT (a terminal's Ctrl-C reaches the
    # whole process group) and tells this process when to stop.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    use_password_command(os.environ.get("RELAY_DATABASE_PASSWORD_COMMAND") or None)
    tune_gc()
    try:
        code = asyncio.run(_child(fd))
    except Exception:
        log.exception("the receiver process crashed")
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    # Run by `python -m`, this file is the module __main__; the messages must
    # travel as relay.receiver_process's classes, which the parent unpickles
    # (and which the messages it sends are), so run that module's main.
    import relay.receiver_process  # noqa: PLW0406 - the module, not __main__

    relay.receiver_process.main()
