"""RabbitMQ: connecting to the first node that answers, and what a broken
connection or a refused login looks like (aio-pika/aiormq); the client both
the publisher and the consumer are."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection

from relay.config import redact_url
from relay.errors import BrokerUnavailable, ConfigError

log = logging.getLogger("relay.brokers.amqp")  # the name its log lines have always had

CONNECT_TIMEOUT = 10.0

# What a broken connection or channel looks like from aiormq and the OS.
CONNECTION_ERRORS = (
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelInvalidStateError,
    aiormq.exceptions.AMQPChannelError,
    ConnectionError,
    OSError,
    asyncio.TimeoutError,
    RuntimeError,  # aiormq: "writer is None" / closed transport
)


def unavailable(exc: BaseException, url: str) -> BrokerUnavailable:
    return BrokerUnavailable(f"RabbitMQ at {redact_url(url)}: {type(exc).__name__}: {exc}")


class _TLSRefused(BrokerUnavailable):
    """The node's certificate did not verify (CA or host name), or TLS
    could not be set up with the given files: no retry mends it at start."""


async def _connect_one(url: str) -> AbstractConnection:
    try:
        return await aio_pika.connect(url, timeout=CONNECT_TIMEOUT)
    except aiormq.exceptions.ProbableAuthenticationError as exc:
        raise BrokerUnavailable(f"RabbitMQ at {redact_url(url)} refused the login: {exc}") from exc
    except (ssl.SSLError, *CONNECTION_ERRORS) as exc:
        refusal = _tls_error(exc)
        if refusal is not None:
            reason = getattr(refusal, "verify_message", None) or refusal.reason or str(refusal)
            raise _TLSRefused(
                f"RabbitMQ at {redact_url(url)}: TLS failed: {reason} (check ?cafile=, the "
                "server's certificate and the host name in the URL)"
            ) from exc
        raise unavailable(exc, url) from exc


def _tls_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind `exc` (aiormq raises its own error from it)."""
    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return None
        if isinstance(seen, ssl.SSLError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


async def _connect(
    nodes: Sequence[str], first: int, *, starting: bool = False
) -> tuple[AbstractConnection, int]:
    """A connection to the first node that answers, trying them in order from
    `first` round the list; and that node's index. BrokerUnavailable naming
    each node's failure when none answers; ConfigError when `starting` (no
    connection was made yet) and every node refused TLS: a certificate that
    does not verify is bad configuration."""
    failures: list[BrokerUnavailable] = []
    for step in range(len(nodes)):
        index = (first + step) % len(nodes)
        try:
            return await _connect_one(nodes[index]), index
        except BrokerUnavailable as exc:
            failures.append(exc)
    if starting and all(isinstance(exc, _TLSRefused) for exc in failures):
        raise ConfigError("; ".join(map(str, failures)))
    if len(failures) == 1:
        raise BrokerUnavailable(str(failures[0]))
    raise BrokerUnavailable("no RabbitMQ node answered: " + "; ".join(map(str, failures)))


async def declare_exchange(channel: AbstractChannel, name: str) -> aio_pika.abc.AbstractExchange:
    try:
        return await channel.declare_exchange(name, aio_pika.ExchangeType.TOPIC, durable=True)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        raise ConfigError(
            f"exchange {name!r} exists with other settings than a durable topic exchange: {exc}"
        ) from None


class Client:
    """A connection and a channel of aio-pika/aiormq, and whether both are open;
    the broker's nodes, and which one the connection goes (or last went) to."""

    _connection: AbstractConnection | None = None
    _channel: Any = None  # aiormq's channel for the publisher, aio-pika's for the consumer
    nodes: tuple[str, ...] = ()
    _node = 0  # index in nodes of the node connected to, or last connected to
    _was_connected = False

    def _init_nodes(self, url: str | Sequence[str]) -> None:
        self.nodes = (url,) if isinstance(url, str) else tuple(url)
        if not self.nodes:
            raise ConfigError("no RabbitMQ node given")

    @property
    def url(self) -> str:
        """The node connected to (or to try first)."""
        return self.nodes[self._node]

    async def _connect_node(self) -> AbstractConnection:
        """Connect to the first node that answers; after a lost connection,
        the nodes after the one lost come first."""
        first = (self._node + 1) % len(self.nodes) if self._was_connected else self._node
        connection, self._node = await _connect(self.nodes, first, starting=not self._was_connected)
        if self._was_connected and len(self.nodes) > 1:
            log.info(
                "RabbitMQ: now on node %d of %d (%s)",
                self._node + 1,
                len(self.nodes),
                redact_url(self.url),
            )
        self._was_connected = True
        return connection

    @property
    def connected(self) -> bool:
        return (
            self._connection is not None
            and not self._connection.is_closed
            and self._channel is not None
            and not self._channel.is_closed
        )

    async def close(self) -> None:
        connection, self._connection, self._channel = self._connection, None, None
        if connection is not None and not connection.is_closed:
            try:
                await connection.close()
            except CONNECTION_ERRORS:
                pass
