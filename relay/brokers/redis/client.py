"""What the Redis publisher and consumer share: the client made from the
URL, and which of redis-py's errors mean "unreachable" (BrokerUnavailable,
retried without an attempt) rather than a refusal of one command."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis import exceptions as rex
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from relay.config import BrokerURL, redact_url

CONNECT_TIMEOUT = 5.0
# A reply slower than this is a broken connection (a cut that sent no RST):
# above the consumer's longest XREADGROUP BLOCK, which it waits for too.
SOCKET_TIMEOUT = 30.0

# The connection is gone, or never was: nothing known of what was sent.
UNREACHABLE: tuple[type[Exception], ...] = (
    rex.ConnectionError,  # with AuthenticationError, BusyLoadingError (LOADING)
    rex.TimeoutError,
    OSError,
)
# Unreachable, or a command refused (a stream key of another type, a group
# deleted under the consumer): what the consumer's connect and tasks end on.
FAILED: tuple[type[Exception], ...] = (*UNREACHABLE, rex.ResponseError)
# The server answers but cannot take writes now (a replica, out of memory,
# a failover in progress, a script running): as unreachable, for the
# server's state is no entry's fault. The first word of the error reply.
NOT_NOW = {"OOM", "READONLY", "MASTERDOWN", "LOADING", "BUSY", "TRYAGAIN", "CLUSTERDOWN"}


def where(broker: BrokerURL) -> str:
    return redact_url(broker.url)


def describe(exc: BaseException) -> str:
    """redis-py's error, as one line (they never hold the URL's password)."""
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if not isinstance(exc, rex.ResponseError) else text


def not_now(exc: BaseException) -> bool:
    """An error reply that says the server cannot take the command now."""
    return isinstance(exc, rex.ResponseError) and str(exc).split(" ", 1)[0] in NOT_NOW


def make_client(broker: BrokerURL, name: str, **options: Any) -> aioredis.Redis:
    """A client of the URL (as redis-py reads it) that gives bytes and
    never retries by itself: relay's own backoff does, with the reason
    logged and /readyz told."""
    return aioredis.Redis.from_url(
        broker.url,
        decode_responses=False,
        retry=Retry(NoBackoff(), 0),
        socket_connect_timeout=CONNECT_TIMEOUT,
        socket_timeout=SOCKET_TIMEOUT,
        client_name=name,
        **options,
    )
