"""Retry delays, from tenacity's wait strategies.

Failed publishes and handler runs wait a delay that grows exponentially
with full jitter between --backoff-min and --backoff-max, so a crowd of
failures spreads out; reconnects use the same shape with shorter bounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import tenacity
from tenacity.wait import wait_base

from relay.errors import Unavailable


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
            delay = backoff.delay(failures)
            log.warning("%s; retrying in %.1fs", exc, delay, extra={"action": "reconnect_wait"})
            await sleep_unless(stopping, delay)
    return False
