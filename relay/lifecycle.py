"""One lifecycle for both daemons: stop event, signals, supervision, probes.

Signal handlers only set the stop event (a second signal exits at once).
The main loop is asked to stop and given --shutdown-timeout to finish the
batch in hand; after that it is cancelled, which rolls its transaction
back and so releases the batch. Every background task is supervised: if
one ends, the daemon stops and exits non-zero so its supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Exit codes, for supervisors and scripts.
EXIT_OK = 0
EXIT_FAILURE = 1  # a loop or background task died; restart me
EXIT_CONFIG = 2  # bad configuration or an incompatible schema; restarting will not help
EXIT_SIGNAL = 130  # a second SIGTERM/SIGINT: exited at once


class BackgroundTaskDied(Exception):
    """A supervised task ended while the daemon was running."""


@dataclass
class Daemon:
    """Runs `main` with supervised background tasks until it returns or is stopped."""

    name: str
    main: Callable[[], Coroutine[Any, Any, None]]
    stop_main: Callable[[], None]
    shutdown_timeout: float
    background: dict[str, Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=dict)
    ready: Callable[[], Awaitable[bool]] | None = None
    http_port: int = 0
    metrics: Callable[[], bytes] | None = None
    on_stop: list[Callable[[], Awaitable[None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stop_event = asyncio.Event()
        self._signals = 0
        self._main_task: asyncio.Task[None] | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.http_server: asyncio.Server | None = None

    def alive(self) -> bool:
        """True while the main loop and every background task run."""
        tasks = [self._main_task, *self._tasks.values()]
        return all(t is not None and not t.done() for t in tasks)

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self.stop_event.is_set():
            log.info("%s: %s; stopping", self.name, reason, extra={"action": "stopping"})
        self.stop_event.set()
        self.stop_main()

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second %s: exiting at once", signal.Signals(signum).name)
            os._exit(EXIT_SIGNAL)
        self.request_stop(f"received {signal.Signals(signum).name}")

    async def run(self) -> int:
        """Run until done; returns the exit code."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signum, self._on_signal, signum)
        code = EXIT_OK
        try:
            if self.http_port:
                self.http_server = await start_http(self, self.http_port)
            self._main_task = asyncio.create_task(self.main(), name=f"{self.name}-main")
            for task_name, factory in self.background.items():
                self._tasks[task_name] = asyncio.create_task(factory(), name=task_name)
            code = await self._supervise()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signum)
            await self._shutdown()
        return code

    async def _supervise(self) -> int:
        assert self._main_task is not None
        stop_wait = asyncio.create_task(self.stop_event.wait())
        watched = {self._main_task, stop_wait, *self._tasks.values()}
        try:
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_wait.cancel()
        if self._main_task in done:
            self._main_task.result()  # a crash of the main loop propagates
            return EXIT_OK
        if self.stop_event.is_set():
            await self._finish_main()
            return EXIT_OK
        for task_name, task in self._tasks.items():
            if task in done:
                exc = None if task.cancelled() else task.exception()
                log.error(
                    "%s: background task %r died: %r; exiting so the supervisor restarts us",
                    self.name, task_name, exc, exc_info=exc,
                    extra={"action": "task_died"},
                )
                self.request_stop(f"background task {task_name!r} died")
                await self._finish_main()
                return EXIT_FAILURE
        raise AssertionError("unreachable: a watched task finished")

    async def _finish_main(self) -> None:
        task = self._main_task
        assert task is not None
        done, _ = await asyncio.wait({task}, timeout=self.shutdown_timeout)
        if not done:
            log.warning(
                "%s: the batch in hand did not finish within %.0fs; releasing it",
                self.name, self.shutdown_timeout,
            )
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        elif not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]

    async def _shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._main_task is not None and not self._main_task.done():
            self._main_task.cancel()
            await asyncio.gather(self._main_task, return_exceptions=True)
        if self.http_server is not None:
            self.http_server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.http_server.wait_closed(), 2)
        for close in self.on_stop:
            try:
                await asyncio.wait_for(close(), 5)
            except Exception as exc:  # closing is best effort
                log.debug("close failed: %r", exc)
        log.info("%s: stopped", self.name, extra={"action": "stopped"})


# --------------------------------------------------------------------------
# HTTP probes and metrics: read-only, three paths, nothing else.
# --------------------------------------------------------------------------

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def start_http(daemon: Daemon, port: int) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 10)
            while (await asyncio.wait_for(reader.readline(), 10)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here needs them
            parts = request.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
            status, ctype, body = await _route(daemon, method, path)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + (body if method != "HEAD" else b""))
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
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
        ok = daemon.alive() and not daemon.stop_event.is_set()
        return (200, text, b"ok\n") if ok else (503, text, b"not alive\n")
    if path == "/readyz":
        ok = False
        if daemon.ready is not None and daemon.alive() and not daemon.stop_event.is_set():
            try:
                ok = await asyncio.wait_for(daemon.ready(), 5)
            except Exception:
                ok = False
        return (200, text, b"ready\n") if ok else (503, text, b"not ready\n")
    if path == "/metrics" and daemon.metrics is not None:
        return 200, "text/plain; version=0.0.4; charset=utf-8", daemon.metrics()
    return 404, text, b"not found\n"


# --------------------------------------------------------------------------
# systemd: READY=1 once connected, WATCHDOG=1 while the loops are alive.
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


async def systemd_watchdog(daemon: Daemon, healthy: Callable[[], bool]) -> None:
    """Ping the systemd watchdog at half its interval while `healthy()` holds."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not os.environ.get("NOTIFY_SOCKET"):
        await daemon.stop_event.wait()
        return
    interval = int(usec) / 2e6
    while not daemon.stop_event.is_set():
        if healthy():
            sd_notify("WATCHDOG=1")
        await asyncio.sleep(interval)
