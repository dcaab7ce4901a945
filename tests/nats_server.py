"""NATS with JetStream for the tests: nats-server (2.9), one per xdist
worker, storing its streams in a directory of its own, behind a TCP proxy.

The server advertises nothing (`--no_advertise`, no cluster), so a client
given the proxy's port knows no other address: `proxy.stop()` cuts every
client off, `proxy.start()` lets them back. `restart()` stops the server
and starts it again on its port with the same store (`-sd`): its streams
and consumers survive, as in production.

Streams are made per test (relay never makes them); `Nats` holds one
test's, and the blocking helpers the daemon tests use run nats-py in a
loop of their own (`run`).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from tests.conftest import free_port
from tests.proxy import Proxy

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"
T = TypeVar("T")


class NatsServer:
    """nats-server -js on `port`, reached through `proxy`."""

    def __init__(self, store: Path, log: Path) -> None:
        self.store = store
        self.log_path = log
        self.port = free_port()
        self.proxy = Proxy(self.port)
        self.process: subprocess.Popen[bytes] | None = None
        self.start()
        self.proxy.start()

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    NATS_SERVER,
                    "-js",
                    "-sd",
                    str(self.store),
                    "-a",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "--no_advertise",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not start: see {self.log_path}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def url(self) -> str:
        """A relay --broker-url for the server (through the proxy)."""
        return f"nats://127.0.0.1:{self.proxy.port}"

    @property
    def direct(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proxy.close()
        self.stop()


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    base = tmp_path_factory.mktemp("nats")
    server = NatsServer(base / "store", base / "nats-server.log")
    try:
        yield server
    finally:
        server.close()


class _Loop:
    """An event loop in a thread of its own, for blocking helpers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Awaitable[T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Nats:
    """One test's view of the server: its streams, a client, readers and writers.

    The async methods run on the caller's loop; `run(...)` runs one on the
    helper's own loop, for a blocking test."""

    def __init__(self, server: NatsServer) -> None:
        self.server = server
        self.proxy = server.proxy
        self.url = server.url
        self.streams: list[str] = []
        self._loop: _Loop | None = None

    def name(self, base: str = "t") -> str:
        return f"{base}-{uuid.uuid4().hex[:10]}"

    async def client(self) -> Client:
        return await nats.connect(self.server.direct, allow_reconnect=False)

    async def _with_client(self, work: Callable[[Client], Awaitable[T]]) -> T:
        client = await self.client()
        try:
            return await work(client)
        finally:
            await client.close()

    async def create(self, stream: str, subjects: list[str], **config: Any) -> str:
        async def make(client: Client) -> None:
            await client.jetstream().add_stream(
                StreamConfig(name=stream, subjects=subjects, **config)
            )

        await self._with_client(make)
        self.streams.append(stream)
        return stream

    async def stream(self, base: str = "s", **config: Any) -> tuple[str, str]:
        """A new stream capturing `SUBJECT` and `SUBJECT.>`: (stream, SUBJECT)."""
        name = self.name(base)
        await self.create(name, [name, f"{name}.>"], **config)
        return name, name

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> int:
        """One message, as nats-py sends it, acknowledged by the stream: its sequence."""

        async def send(client: Client) -> int:
            ack = await client.jetstream().publish(subject, data, headers=headers)
            return int(ack.seq)

        return await self._with_client(send)

    async def send(
        self,
        stream: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """A message to `stream` (its subject STREAM.x) with relay's headers
        where given (`Nats-Msg-Id`, `type`, `key`), as a producer sends it."""
        pairs = {"Nats-Msg-Id": message_id, "type": type, "key": key, **(headers or {})}
        given = {n: v for n, v in pairs.items() if v is not None}
        await self.publish(f"{stream}.x", body, headers=given or None)

    async def publish_many(self, messages: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """Messages as nats-py sends them, 256 acknowledgements awaited at once."""

        async def send(client: Client) -> None:
            js = client.jetstream()
            for start in range(0, len(messages), 256):
                await asyncio.gather(
                    *(
                        js.publish(subject, data, headers=headers)
                        for subject, data, headers in messages[start : start + 256]
                    )
                )

        await self._with_client(send)

    async def add_consumer(self, stream: str, name: str, **config: Any) -> None:
        """A durable pull consumer as relay makes one, with `config` besides."""

        async def make(client: Client) -> None:
            await client.jetstream().add_consumer(
                stream,
                ConsumerConfig(
                    durable_name=name,
                    ack_policy=AckPolicy.EXPLICIT,
                    deliver_policy=DeliverPolicy.ALL,
                    **config,
                ),
            )

        await self._with_client(make)

    async def publish_raw(self, messages: list[tuple[bytes, bytes | None, bytes]]) -> None:
        """Messages written on the wire byte by byte (HPUB): (subject, header
        block or None, data), as no client library would send them; each
        acknowledged by its stream."""
        client = await self.client()
        try:
            inbox = client.new_inbox()
            sub = await client.subscribe(inbox + ".*")
            for n, (subject, header, data) in enumerate(messages):
                reply = f"{inbox}.{n}".encode()
                if header is None:
                    command = b"PUB %s %s %d\r\n%s\r\n" % (subject, reply, len(data), data)
                else:
                    command = b"HPUB %s %s %d %d\r\n%s%s\r\n" % (
                        subject,
                        reply,
                        len(header),
                        len(header) + len(data),
                        header,
                        data,
                    )
                await client._send_command(command)
            await client.flush()
            for _ in messages:
                answer = await sub.next_msg(timeout=10)
                assert b'"seq"' in answer.data, answer.data
        finally:
            await client.close()

    async def messages(self, stream: str) -> list[Any]:
        """Every message the stream holds, in order (by sequence)."""

        async def read(client: Client) -> list[Any]:
            js = client.jetstream()
            info = await js.stream_info(stream)
            first, last = info.state.first_seq, info.state.last_seq
            if not info.state.messages:
                return []
            got = []
            for start in range(first, last + 1, 500):  # 500 requests in flight at once
                seqs = range(start, min(start + 500, last + 1))
                got += await asyncio.gather(*(js.get_msg(stream, seq) for seq in seqs))
            return got

        return await self._with_client(read)

    async def consumer_info(self, stream: str, consumer: str) -> Any:
        async def read(client: Client) -> Any:
            return await client.jetstream().consumer_info(stream, consumer)

        return await self._with_client(read)

    async def has_stream(self, stream: str) -> bool:
        async def look(client: Client) -> bool:
            try:
                await client.jetstream().stream_info(stream)
            except nats.js.errors.NotFoundError:
                return False
            return True

        return await self._with_client(look)

    def run(self, coro: Awaitable[T], timeout: float = 60) -> T:
        if self._loop is None:
            self._loop = _Loop()
        return self._loop.run(coro, timeout)

    def close(self) -> None:
        if not self.proxy.running:
            self.proxy.start()
        if self.server.process is None:
            self.server.start()

        async def clean(client: Client) -> None:
            js = client.jetstream()
            for stream in self.streams:
                try:
                    await js.delete_stream(stream)
                except Exception:  # noqa: BLE001, S110 - best effort: the server is the worker's
                    pass

        try:
            self.run(self._with_client(clean), 30)
        finally:
            if self._loop is not None:
                self._loop.close()


@pytest.fixture
def nats_helper(nats_server: NatsServer) -> Iterator[Nats]:
    helper = Nats(nats_server)
    try:
        yield helper
    finally:
        helper.close()
