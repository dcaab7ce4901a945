"""What the outbox's workers and the inbox's dispatchers share: the retry of
keys held elsewhere and the report of failed attempts.

Both loops claim rows of their share of the keys (the hash ranges are in
the claim's SQL, relay/db/queries/), handle them, and mark them in one
transaction; they differ in what handling is (publishing, running
handlers). The reconnect wait they also share is relay.backoff's.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from prometheus_client import Counter

# How long a worker waits when every row it locked waits on another worker
# (which commits in milliseconds, and nothing notifies when it does).
BLOCKED_RETRY = 0.005


class FailureCounters(Protocol):
    """The metrics a failed attempt counts (OutboxMetrics, InboxMetrics)."""

    @property
    def failed(self) -> Counter: ...

    @property
    def dead(self) -> Counter: ...


def report_failure(
    log: logging.Logger,
    metrics: FailureCounters,
    what: str,
    error: str,
    *,
    dead: bool,
    delay: float,
    extra: dict[str, Any],
) -> None:
    """Count one failed attempt (and the row's death) and log it at WARNING:
    `<what> failed (retry in 1.5s): <error>`, or `(dead)`."""
    metrics.failed.inc()
    if dead:
        metrics.dead.inc()
    log.warning(
        "%s failed%s: %s",
        what,
        " (dead)" if dead else f" (retry in {delay:.1f}s)",
        error,
        extra=extra,
    )
