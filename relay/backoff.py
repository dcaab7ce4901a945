"""Retry delays, from tenacity's wait strategies, and the reconnect wait.

Failed publishes and handler runs wait a delay that grows exponentially
with full jitter between --backoff-min and --backoff-max, so a crowd of
failures spreads out; reconnects use the same shape with shorter bounds.
Every loop (the outbox's workers, the dispatchers, the receiver) waits out
an unreachable server here, with the same log line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import tenacity
from tenacity.wait import wait_base

from relay.errors import Unavailable

# A server that is away is tried again after 0.5 s, then waits growing to
# 5 s: a managed database's failover or a broker's restart lasts seconds to
# a minute, and a longer wait would hold delivery up after it is back (an
# attempt every 5 s per loop costs the server nothing).
RECONNECT_MIN = 0.5
RECONNECT_MAX = 5.0


@dataclass
class _Attempt:
    # The one field tenacity's wait strategies read from a RetryCallState.
    attempt_number: int


class Backoff:
    """delay(n): seconds to wait before try n+1, after n failures (n >= 1)."""

    def __init__(self, minimum: float, maximum: float) -> None:
        self.strategy: wait_base = tenacity.wait_random_exponential(
            multiplier=max(minimum, 0.001), min=minimum, max=maximum
        )

    def delay(self, failures: int) -> float:
        return float(self.strategy(_Attempt(max(failures, 1))))  # type: ignore[arg-type]


async def sleep_unless(event: asyncio.Event, seconds: float) -> None:
    """Sleep `seconds`, or until `event` is set if that comes first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass


def reconnect_backoff() -> Backoff:
    """The waits between attempts to reach a server that is away (every loop's)."""
    return Backoff(RECONNECT_MIN, RECONNECT_MAX)


async def wait_to_reconnect(
    exc: Exception,
    failures: int,
    backoff: Backoff,
    stopping: asyncio.Event,
    log: logging.Logger,
) -> None:
    """After the `failures`-th outage in a row: log it and wait out its
    backoff, or until `stopping` is set."""
    delay = backoff.delay(failures)
    level = logging.WARNING if _first_to_say(log.name, str(exc), delay) else logging.DEBUG
    log.log(level, "%s; retrying in %.1fs", exc, delay, extra={"action": "reconnect_wait"})
    await sleep_unless(stopping, delay)


# When each outage was last logged, by logger and text: the outbox's
# workers and the inbox's dispatchers all meet the same outage at once, and
# one line says it (the others go to DEBUG).
_said: dict[tuple[str, str], float] = {}


def _first_to_say(logger: str, text: str, delay: float) -> bool:
    now = time.monotonic()
    key = (logger, text)
    if now < _said.get(key, 0.0):
        return False
    if len(_said) > 256:
        _said.clear()
    # Quiet for the wait just announced: the next line comes with the next wait.
    _said[key] = now + max(delay, 0.2) * 0.9
    return True


async def until_available(
    attempt: Callable[[], Awaitable[object]],
    stopping: asyncio.Event,
    backoff: Backoff,
    log: logging.Logger,
) -> bool:
    """Run `attempt` until it does not raise Unavailable, logging each outage
    and waiting `backoff` in between; False if `stopping` is set first."""
    failures = 0
    while not stopping.is_set():
        try:
            await attempt()
            return True
        except Unavailable as exc:
            failures += 1
            await wait_to_reconnect(exc, failures, backoff, stopping, log)
    return False
