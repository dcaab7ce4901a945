"""Redis for the tests: a redis-server of the tests' own on a free loopback
port, one per xdist worker, behind a TCP proxy (tests/proxy.py).

Every client (relay's and the tests') goes through the proxy:
`proxy.stop()` takes Redis away, `proxy.start()` brings it back. The
session's server keeps nothing on disk (`--save "" --appendonly no`); a test
that restarts the server makes one of its own with an append-only file
(`RedisServer(durable=True)`), whose entries and groups survive the restart.

Streams are named per test (`Redis.name`) and deleted afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import free_port
from tests.proxy import Proxy

REDIS_SERVER = shutil.which("redis-server")


class RedisServer:
    """redis-server on `port`, reached through `proxy`."""

    def __init__(self, workdir: Path, *, durable: bool = False) -> None:
        if REDIS_SERVER is None:
            if os.environ.get("CI"):
                pytest.fail("redis-server is not installed")
            pytest.skip("redis-server is not installed")
        self.workdir = workdir
        self.durable = durable
        self.port = free_port()
        self.proxy = Proxy(self.port)
        self.proxy.start()
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.durable else []
        self._log = (self.workdir / "redis.log").open("ab")
        self.process = subprocess.Popen(
            [
                str(REDIS_SERVER),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                *persistence,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                if redis.Redis(port=self.port, socket_timeout=1).ping():
                    return
            except redis.exceptions.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: see {self.workdir}/redis.log")
            time.sleep(0.05)

    def stop(self) -> None:
        """Stop the server (SIGTERM: an append-only file is flushed)."""
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
            self._log.close()

    def url(self, *, direct: bool = False) -> str:
        """relay's --broker-url: through the proxy (or straight to the server)."""
        return f"redis://127.0.0.1:{self.port if direct else self.proxy.port}/0"

    def client_entries(self, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Every entry of a stream, read straight from the server."""
        client = redis.Redis(port=self.port, socket_timeout=10)
        try:
            return [(entry_id, fields) for entry_id, fields in client.xrange(stream)]
        finally:
            client.close()

    def close(self) -> None:
        self.proxy.close()
        self.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.close()


class Redis:
    """One test's view of the server: its own streams, a raw client."""

    def __init__(self, server: RedisServer) -> None:
        self.server = server
        self.proxy = server.proxy
        # Straight to the server: the test sees it while relay's is cut.
        self.client = redis.Redis(port=server.port, socket_timeout=10)
        self.streams: list[str] = []

    def url(self) -> str:
        return self.server.url()

    def name(self, base: str = "s") -> str:
        name = f"{base}-{uuid.uuid4().hex[:10]}"
        self.streams.append(name)
        return name

    def add(self, stream: str, fields: Sequence[tuple[bytes | str, bytes | str]]) -> bytes:
        """XADD with the fields exactly as given (any bytes, repeated names)."""
        flat: list[Any] = [part for pair in fields for part in pair]
        return bytes(self.client.execute_command("XADD", stream, "*", *flat))

    def send(
        self,
        stream: str,
        body: bytes,
        *,
        message_id: str | None = None,
        type: str | None = None,
        key: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """An entry as a producer sets relay's fields."""
        fields: list[tuple[bytes | str, bytes | str]] = [("payload", body)]
        for name, value in (("id", message_id), ("type", type), ("key", key)):
            if value is not None:
                fields.append((name, value))
        if headers:
            fields.append(("headers", json.dumps(headers)))
        self.add(stream, fields)

    def read(self, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Every entry of the stream, in order."""
        return [(entry_id, fields) for entry_id, fields in self.client.xrange(stream)]

    def pending(self, stream: str, group: str) -> int:
        """Entries delivered to the group and not acknowledged."""
        return int(self.client.xpending(stream, group)["pending"])

    def lag(self, stream: str, group: str) -> int:
        """Entries not yet delivered to the group, plus those pending."""
        for info in self.client.xinfo_groups(stream):
            if info["name"].decode() == group:
                return int(info.get("lag") or 0) + int(info["pending"])
        return len(self.client.xrange(stream))

    def consumers(self, stream: str, group: str) -> dict[str, int]:
        """The group's consumers and how many entries each holds."""
        return {
            c["name"].decode(): int(c["pending"])
            for c in self.client.xinfo_consumers(stream, group)
        }

    def close(self) -> None:
        if not self.proxy.running:
            self.proxy.start()
        if self.streams:
            try:
                self.client.delete(*self.streams)
            except redis.exceptions.RedisError:
                pass  # a server of the test's own, gone already
        self.client.close()


@pytest.fixture
def redis_streams(redis_server: RedisServer) -> Iterator[Redis]:
    helper = Redis(redis_server)
    try:
        yield helper
    finally:
        helper.close()
