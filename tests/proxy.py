"""A TCP proxy for taking a server away from relay and bringing it back.

It runs its own event loop in a thread, so tests that wait synchronously
(`wait_until`) do not stall it. `stop()` closes the listening socket and
cuts every connection (the server seems gone: connections break, new ones
are refused); `start()` listens again on the same port. `blackhole()` keeps the
connections open but drops every byte either way (requests go unanswered:
in flight), as a network that fails silently does before the connections
break.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest


class Proxy:
    """127.0.0.1:<port> → target_host:target_port."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port: int = sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="test-proxy", daemon=True
        )
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._dropping = False

    def _call(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=10)

    # -- public ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        """Stop listening and cut every open connection."""
        self._call(self._stop())

    def blackhole(self) -> None:
        """Drop every byte both ways until stop() or start()."""
        self._dropping = True

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    # -- in the proxy's loop ---------------------------------------------------------

    async def _start(self) -> None:
        self._dropping = False
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    async def _stop(self) -> None:
        self._dropping = False
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()  # RST-like: no graceful goodbye
        self._writers.clear()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            return
        self._writers |= {client_w, server_w}

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    if self._dropping:
                        continue
                    writer.write(data)
                    await writer.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    writer.transport.abort()

        await asyncio.gather(pipe(client_r, server_w), pipe(server_r, client_w))
        self._writers -= {client_w, server_w}


@contextlib.contextmanager
def _running(target_host: str, target_port: int) -> Iterator[Proxy]:
    proxy = Proxy(target_port, target_host)
    proxy.start()
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def pg_proxy() -> Iterator[Proxy]:
    """A proxy to the test PostgreSQL server."""
    from tests.conftest import PG_HOST, PG_PORT

    with _running(PG_HOST, PG_PORT) as proxy:
        yield proxy


@pytest.fixture
def amqp_proxy() -> Iterator[Proxy]:
    """A proxy to the test RabbitMQ server."""
    from tests.conftest import AMQP_URL

    parts = urllib.parse.urlsplit(AMQP_URL)
    with _running(parts.hostname or "127.0.0.1", parts.port or 5672) as proxy:
        yield proxy
