"""Retry delays, from tenacity's wait strategies.

Failed publishes and handler runs wait a delay that grows exponentially
with full jitter between --backoff-min and --backoff-max, so a crowd of
failures spreads out; reconnects use the same shape with shorter bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import tenacity
from tenacity.wait import wait_base


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
