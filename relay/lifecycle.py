"""One lifecycle for both daemons: stop event, signals, supervision, probes, systemd.

A Daemon runs one or more Services (the outbox relay, the inbox, the demo's
producer) in one process. Signal handlers only set the stop event (a second
signal exits at once). The main loops are asked to stop and given the rest
of --shutdown-timeout to finish the batch in hand; after that they are
cancelled, which rolls their transactions back and so releases the batch.
Every background task (listener, scheduler, HTTP server, watchdog) is
supervised: if one ends, the daemon stops and exits non-zero so that its
supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from relay.errors import ConfigError, SchemaError, Unavailable
from relay.metrics import ReadyMetric

log = logging.getLogger(__name__)

# Exit codes, for supervisors and scripts.
EXIT_OK = 0  # done, or stopped by SIGTERM/SIGINT after finishing or releasing the batch in hand
EXIT_FAILURE = 1  # a loop or background task died; restart me
EXIT_CONFIG = 2  # bad configuration or an incompatible schema; restarting will not help
EXIT_SIGNAL = 130  # a second SIGTERM/SIGINT: exited at once

# A main loop that has not finished a unit of work for this long (plus the
# service's own allowance) while its servers answer is stuck: /healthz turns
# 503 and the systemd watchdog stops being fed. Above the longest wait a
# healthy loop can be in: a publisher confirm (60 s) or a reconnect backoff (5 s).
STALL_AFTER = 120.0
# Probes answer within this, below the usual probe timeouts (Kubernetes: 1 s
# by default, 3 s in examples/kubernetes); a check that takes longer fails.
PROBE_TIMEOUT = 2.0

Started = Callable[[], None]
Factory = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


@dataclass
class Service:
    """What one daemon brings to the lifecycle; several share a Daemon in `relay demo`.

    `main(started)` runs the main loop and calls `started()` once connected;
    `stop()` asks it to finish the batch in hand and return. `background`
    tasks get the stop event and are cancelled after the main loop ends.
    `progress()` is the monotonic time of the main loop's last finished unit
    of work; `ready()` tells whether the database and broker answer;
    `unready()` gives a reason to be not ready although they do (the broker
    blocks publishing: a resource alarm), or None.
    """

    name: str
    main: Callable[[Started], Coroutine[Any, Any, None]]
    stop: Callable[[], None]
    background: dict[str, Factory] = field(default_factory=dict)
    ready: Callable[[], Awaitable[bool]] | None = None
    unready: Callable[[], str | None] | None = None
    metrics: Callable[[], bytes] | None = None
    progress: Callable[[], float] | None = None
    stall_after: float = STALL_AFTER
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


@dataclass
class Daemon:
    """Runs services with supervised background tasks until they return or are stopped."""

    name: str
    services: list[Service]
    shutdown_timeout: float
    http_port: int = 0
    # True when this daemon is the whole process (the CLI). If the batch in
    # hand had to be released at the timeout, the process then exits at once:
    # a sync handler still running in a thread cannot be interrupted, and
    # Python would wait for it at exit. Exiting closes its connection, which
    # rolls its transaction back.
    own_process: bool = False

    def __post_init__(self) -> None:
        self.stop_event = asyncio.Event()
        self.started_event = asyncio.Event()
        self.released = False
        self.http_server: asyncio.Server | None = None
        self._started: set[str] = set()
        self._started_at = 0.0
        self._signals = 0
        self._deadline: float | None = None
        self._excused: dict[str, float] = {}
        self._stalled: set[str] = set()
        self._main_task: asyncio.Task[None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ready_metric = ReadyMetric()

    # -- state ----------------------------------------------------------------

    @property
    def started(self) -> bool:
        """True once every service is connected (READY=1 was sent)."""
        return self.started_event.is_set()

    def alive(self) -> bool:
        """True while the main loops and every background task run."""
        tasks = [self._main_task, *self._tasks.values()]
        return all(t is not None and not t.done() for t in tasks)

    async def healthy(self) -> bool:
        """Alive, and every started main loop makes progress or waits for a server.

        A loop that waits for an unreachable database or broker is doing its
        job: liveness must not restart a daemon because of an outage."""
        if self.stop_event.is_set() or not self.alive():
            return False
        if not self.started:
            return True
        now = time.monotonic()
        for service in self.services:
            if service.progress is None:
                continue
            since = max(service.progress(), self._started_at, self._excused.get(service.name, 0))
            if now - since <= service.stall_after:
                self._stalled.discard(service.name)
                continue
            if await self._service_unready(service) is not None:
                self._excused[service.name] = now
                continue
            if service.name not in self._stalled:
                self._stalled.add(service.name)
                log.error(
                    "%s: the %s loop made no progress for %.0fs although the database and "
                    "broker answer; reporting unhealthy",
                    self.name,
                    service.name,
                    now - since,
                    extra={"action": "stalled"},
                )
            return False
        return True

    async def ready(self) -> bool:
        """Started, not stopping, and every service's database and broker answer."""
        return await self.unready_reason() is None

    async def unready_reason(self) -> str | None:
        """Why the daemon is not ready (for /readyz's body), or None if it is."""
        if not self.started:
            return "starting"
        if self.stop_event.is_set():
            return "stopping"
        if not self.alive():
            return "a loop or background task has died"
        for service in self.services:
            failure = await self._service_unready(service)
            if failure is not None:
                # Which of several databases (relay.sources), when it can say.
                which = service.unready() if service.unready is not None else None
                return f"{service.name}: {failure}" + (f" ({which})" if which else "")
            reason = service.unready() if service.unready is not None else None
            if reason:
                return f"{service.name}: {reason}"
        return None

    async def _service_unready(self, service: Service) -> str | None:
        """Why the service's database or broker does not answer (or cannot
        take its work, as a read-only database), or None when they do."""
        if service.ready is None:
            return None
        try:
            if await asyncio.wait_for(service.ready(), PROBE_TIMEOUT):
                return None
            return "the database or the broker does not answer"
        except TimeoutError:
            return f"the database or the broker did not answer within {PROBE_TIMEOUT:g}s"
        except Exception as exc:  # an unreachable server: not ready, and why
            log.debug("%s: %s not ready: %r", self.name, service.name, exc)
            return str(exc) or type(exc).__name__

    def metrics(self) -> bytes | None:
        """Every service's metrics in the Prometheus text format, or None without any."""
        parts = [service.metrics() for service in self.services if service.metrics]
        return b"".join(parts) if parts else None

    async def scrape(self) -> bytes | None:
        """/metrics: metrics(), and relay_ready, /readyz's answer now (an
        alert rule sees what a Kubernetes readiness probe sees)."""
        body = self.metrics()
        if body is None:
            return None
        return body + self._ready_metric.render(await self.unready_reason() is None)

    # -- stopping --------------------------------------------------------------

    def request_stop(self, reason: str = "stop requested") -> None:
        """Stop taking work; the main loops get the rest of --shutdown-timeout."""
        if self.stop_event.is_set():
            return
        log.info("%s: %s; stopping", self.name, reason, extra={"action": "stopping"})
        self._deadline = time.monotonic() + self.shutdown_timeout
        self.stop_event.set()
        sd_notify("STOPPING=1")
        for service in self.services:
            try:
                service.stop()
            except Exception:  # one service failing to stop must not keep the others going
                log.exception("%s: stopping %s failed", self.name, service.name)

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning(
                "second %s: exiting at once",
                signal.Signals(signum).name,
                extra={"action": "exit_now"},
            )
            exit_now(EXIT_SIGNAL)
        self.request_stop(f"received {signal.Signals(signum).name}")

    def _started_callback(self, service: Service) -> Started:
        def started() -> None:
            self._started.add(service.name)
            if not self.started and self._started >= {s.name for s in self.services}:
                self._started_at = time.monotonic()
                self.started_event.set()
                sd_notify("READY=1")

        return started

    # -- running -----------------------------------------------------------------

    async def run(self) -> int:
        """Run until done or stopped; returns the exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, self._on_signal, signum)
        code = EXIT_FAILURE
        try:
            if self.http_port:
                try:
                    self.http_server = await start_http(self, self.http_port)
                except OSError as exc:
                    log.error(
                        "%s: cannot serve HTTP on port %d: %s",
                        self.name,
                        self.http_port,
                        exc,
                        extra={"action": "http_failed"},
                    )
                    return EXIT_FAILURE
                self._tasks["http"] = asyncio.create_task(
                    self.http_server.serve_forever(), name="http"
                )
            mains = [service.main(self._started_callback(service)) for service in self.services]
            self._main_task = asyncio.create_task(run_together(*mains), name=f"{self.name}-main")
            for service in self.services:
                for task_name, factory in service.background.items():
                    full = task_name if len(self.services) == 1 else f"{service.name}-{task_name}"
                    self._tasks[full] = asyncio.create_task(factory(self.stop_event), name=full)
            interval = watchdog_interval()
            if interval is not None:
                self._tasks["watchdog"] = asyncio.create_task(
                    self._watchdog(interval), name="watchdog"
                )
            code = await self._supervise()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signum)
            await self._shutdown()
        if self.released and self.own_process:
            exit_now(code)
        return code

    async def _supervise(self) -> int:
        main = self._main_task
        assert main is not None
        stop_wait = asyncio.create_task(self.stop_event.wait())
        try:
            done, _ = await asyncio.wait(
                {main, stop_wait, *self._tasks.values()}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop_wait.cancel()
        if main in done:
            return self._outcome(main)
        if self.stop_event.is_set():
            return await self._finish_main()
        for task_name, task in self._tasks.items():
            if task in done:
                exc = None if task.cancelled() else task.exception()
                log.error(
                    "%s: background task %r died: %r; exiting so that the supervisor restarts us",
                    self.name,
                    task_name,
                    exc,
                    exc_info=exc,
                    extra={"action": "task_died"},
                )
                self.request_stop(f"background task {task_name!r} died")
                await self._finish_main()
                return EXIT_FAILURE
        raise AssertionError("unreachable: a watched task finished")

    def _outcome(self, task: asyncio.Task[None]) -> int:
        """The exit code for a main task that has finished."""
        if task.cancelled():
            return EXIT_OK
        exc = task.exception()
        if exc is None:
            return EXIT_OK
        if isinstance(exc, (ConfigError, SchemaError)) and not isinstance(exc, Unavailable):
            raise exc  # the CLI turns it into exit status 2 with one clear line
        log.error(
            "%s: main loop crashed: %s: %s; exiting so that the supervisor restarts us",
            self.name,
            type(exc).__name__,
            exc,
            exc_info=exc,
            extra={"action": "crashed"},
        )
        return EXIT_FAILURE

    def _remaining(self, reserve: float = 0.0) -> float:
        deadline = self._deadline or (time.monotonic() + self.shutdown_timeout)
        return max(deadline - time.monotonic() - reserve, 0.0)

    async def _finish_main(self) -> int:
        """Wait for the main loops to finish their batch; release it at the deadline."""
        task = self._main_task
        assert task is not None
        # Keep a little of the timeout for closing connections.
        reserve = min(2.0, self.shutdown_timeout * 0.2)
        done, _ = await asyncio.wait({task}, timeout=self._remaining(reserve))
        if done:
            return self._outcome(task)
        log.warning(
            "%s: the batch in hand did not finish within the shutdown timeout (%gs); releasing it",
            self.name,
            self.shutdown_timeout,
            extra={"action": "released"},
        )
        self.released = True
        task.cancel()
        await asyncio.wait({task}, timeout=reserve / 2)
        return EXIT_OK

    async def _shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        tasks = set(self._tasks.values())
        if self._main_task is not None and not self._main_task.done():
            self._main_task.cancel()
            tasks.add(self._main_task)
        if tasks:
            await asyncio.wait(tasks, timeout=max(self._remaining(), 1.0))
        for task in tasks:  # retrieved, so asyncio does not log them again
            if task.done() and not task.cancelled():
                task.exception()
        if self.http_server is not None:
            self.http_server.close()
        for service in self.services:
            for close in service.on_stop:
                try:
                    await asyncio.wait_for(close(), max(self._remaining(), 0.5))
                except Exception as exc:  # closing is best effort
                    log.debug("%s: closing failed: %r", self.name, exc)
        log.info("%s: stopped", self.name, extra={"action": "stopped"})

    async def _watchdog(self, interval: float) -> None:
        """WATCHDOG=1 at half systemd's interval, while the main loops are healthy."""
        while True:
            if await self.healthy():
                sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval)


async def run_together(*coroutines: Coroutine[Any, Any, None]) -> None:
    """Run coroutines until all return; the first to raise cancels the others,
    and its exception propagates."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def exit_now(code: int) -> None:
    """Flush the logs and end the process without waiting for threads."""
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# --------------------------------------------------------------------------
# HTTP probes and metrics: read-only, three paths, GET and HEAD, nothing else.
# --------------------------------------------------------------------------

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}
_MAX_HEADER_LINES = 100


async def start_http(daemon: Daemon, port: int) -> asyncio.Server:
    """Listen on `port` for the probes and metrics (GET and HEAD only)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            for _ in range(_MAX_HEADER_LINES):  # headers: nothing here needs them
                if await asyncio.wait_for(reader.readline(), 10) in (b"\r\n", b"\n", b""):
                    break
            parts = request.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
            status, ctype, body = await _route(daemon, method, path)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (body if method != "HEAD" else b""))
            await writer.drain()
        except (OSError, TimeoutError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host="0.0.0.0", port=port)
    log.info("HTTP probes and metrics on port %d", port)
    return server


async def _route(daemon: Daemon, method: str, path: str) -> tuple[int, str, bytes]:
    text = "text/plain; charset=utf-8"
    if method not in ("GET", "HEAD"):
        return 405, text, b"method not allowed\n"
    if path == "/healthz":
        ok = await daemon.healthy()
        return (200, text, b"ok\n") if ok else (503, text, b"not healthy\n")
    if path == "/readyz":
        reason = await daemon.unready_reason()
        if reason is None:
            return 200, text, b"ready\n"
        return 503, text, f"not ready: {reason}\n".encode()
    if path == "/metrics":
        body = await daemon.scrape()
        if body is not None:
            return 200, "text/plain; version=0.0.4; charset=utf-8", body
    return 404, text, b"not found\n"


# --------------------------------------------------------------------------
# systemd: READY=1 once connected, WATCHDOG=1 while the main loops progress.
# --------------------------------------------------------------------------


def sd_notify(message: str) -> bool:
    """Send one sd_notify message if systemd asked for them; True if sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as exc:
        log.debug("sd_notify failed: %r", exc)
        return False


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half of WatchdogSec), or None when not asked."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        return None
    if pid and pid != str(os.getpid()):
        return None  # meant for another process
    try:
        return max(int(usec) / 2e6, 0.01)
    except ValueError:
        return None
