"""One NATS connection as relay opens it, for the publisher and the consumer.

relay reconnects by itself (the loops' backoff, no attempt counted), so
nats-py's own reconnection is off: a connection that breaks is closed,
`lost` says why, and the next connect() opens a new one to any server of
the URL that answers. `Client` is nats-py's client reading what a hostile
producer may send (a subject or header that is not UTF-8) without dropping
the connection, and keeping each message's header block as received.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.protocol import command as prot_command

from relay.config import BrokerURL, redact_url
from relay.errors import BrokerUnavailable, ConfigError

log = logging.getLogger("relay.brokers.nats")

CONNECT_TIMEOUT = 3.0
# A connection that answers no PING for PING_INTERVAL * MAX_PINGS seconds is
# lost (a cut cable, a frozen server): nats-py's default takes 4 minutes.
PING_INTERVAL = 5
MAX_PINGS = 3
# What the JetStream API is given to answer (stream and consumer lookups).
API_TIMEOUT = 5.0


def where(broker: BrokerURL) -> str:
    return redact_url(broker.url)


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_PLAIN = b"NATS/1.0\r\n"  # a header block without a status


class RawHeaders(dict[str, str]):
    """nats-py's parsed headers, with the header block as received (`raw`)."""

    raw: bytes = b""


class Client(NatsClient):
    """nats-py's client, lenient where a producer can send what it refuses.

    nats-py decodes a subject strictly (one that is not UTF-8 would raise
    in its read loop and close the connection, again at every redelivery)
    and header values lossily; relay decodes both itself, from the bytes."""

    async def _process_headers(self, headers: Any) -> dict[str, str] | None:
        if not headers:
            return None
        if headers.startswith(_PLAIN):
            # No status: relay reads the block itself (NatsConsumer), so
            # nats-py's parse of every message's headers is skipped.
            found = RawHeaders()
        else:  # a status (no responders, a pull request's end): nats-py's own reading
            try:
                parsed = await super()._process_headers(headers)
            except Exception:  # noqa: BLE001 - relay parses the raw block itself
                parsed = None
            found = RawHeaders(parsed or {})
        found.raw = bytes(headers)
        return found

    def _build_message(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: Any
    ) -> Msg:
        return self.msg_class(
            subject=subject.decode("utf-8", "surrogateescape"),
            reply=reply.decode("utf-8", "surrogateescape"),
            data=data,
            headers=headers,
            _client=self,
            _sid=sid,
        )

    async def publish_block(self, subject: str, reply: str, header: bytes, payload: bytes) -> None:
        """publish() with a header block the caller built and checked
        (relay.brokers.nats.publishing.build_message): nothing parsed again,
        nothing changed on the way (nats-py strips values and replaces line
        breaks), and nothing buffered while the connection is away."""
        if self.is_closed or not self.is_connected:
            raise nats.errors.ConnectionClosedError
        if self.is_draining_pubs:
            raise nats.errors.ConnectionDrainingError
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += len(payload)
        await self._send_command(prot_command.hpub_cmd(subject, reply, header, payload))
        if self._flush_queue is not None and self._flush_queue.empty():
            await self._flush_pending()


def tls_context(broker: BrokerURL) -> ssl.SSLContext | None:
    options = dict(broker.nats)
    if "tls" not in options:
        return None
    return ssl.create_default_context(cafile=options.get("ca"))


async def connect(
    broker: BrokerURL, name: str, lost: Callable[[str], None], *, starting: bool = False
) -> Client:
    """A connection to the first server of `broker` that answers; `lost`
    hears why once it breaks. BrokerUnavailable when none answers;
    ConfigError when `starting` (no connection was made yet) and every
    server refused TLS: a certificate that does not verify is bad
    configuration, as for RabbitMQ."""
    options = dict(broker.nats)
    errors: list[BaseException] = []
    client = Client()

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)
        log.debug("NATS client: %s", describe(exc))

    async def closed_cb() -> None:
        why = describe(errors[-1]) if errors else "the connection was closed"
        lost(why)

    kwargs: dict[str, Any] = {
        "servers": list(broker.nodes),
        "name": name,
        "allow_reconnect": False,
        # Each server of the URL is tried (twice, nats-py's least), at once.
        "max_reconnect_attempts": 1,
        "reconnect_time_wait": 0,
        "connect_timeout": CONNECT_TIMEOUT,
        "ping_interval": PING_INTERVAL,
        "max_outstanding_pings": MAX_PINGS,
        "error_cb": error_cb,
        "closed_cb": closed_cb,
        "disconnected_cb": closed_cb,
    }
    context = tls_context(broker)
    if context is not None:
        kwargs["tls"] = context
    if "creds" in options:
        kwargs["user_credentials"] = options["creds"]
    try:
        await asyncio.wait_for(
            client.connect(**kwargs), CONNECT_TIMEOUT * 2 * max(1, len(broker.nodes)) + 1
        )
    except (OSError, TimeoutError, nats.errors.Error, ssl.SSLError) as exc:
        await close(client)
        why = errors[-1] if errors and isinstance(exc, nats.errors.NoServersError) else exc
        if starting and errors and all(isinstance(e, ssl.SSLError) for e in errors):
            reason = getattr(errors[-1], "verify_message", None) or describe(errors[-1])
            raise ConfigError(
                f"NATS at {where(broker)}: TLS failed: {reason} (check ?ca=, the server's "
                "certificate and the host name in the URL)"
            ) from None
        raise BrokerUnavailable(f"NATS at {where(broker)}: {describe(why)}") from None
    return client


async def close(client: NatsClient | None) -> None:
    """Close a connection, whatever state it is in."""
    if client is None or client.is_closed:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.close(), 5)
