"""The bytes of claimed rows a daemon holds at once (issue 43).

One Budget per daemon, shared by its workers (the outbox's four, the
inbox's three dispatchers): the bound is the daemon's, whatever the split
of the work. A worker asks for bytes before its claim, the claim takes rows
up to what it was granted (PostgreSQL measures them first: the claims in
relay/db/queries), the worker gives back at once what its rows did not use,
and the rest when its batch is done.

- An ordinary ask gets the worker's share (total / workers), or what is
  free if less, waiting only while nothing is free: small rows never wait.
- A claim that stopped at a row larger than its grant says how large: the
  worker asks for exactly that much and waits for it, first in line (no
  later ask is served before it, so it cannot starve).
- A row larger than the whole budget is taken alone: its worker waits until
  the daemon holds nothing, is granted everything, and its claim takes that
  first row whatever its size.

So the rows held never add up to more than the budget, but for one row
larger than it, held alone. The waits are polls of a few milliseconds,
from the event loop (the outbox) or the dispatcher threads (the inbox): the
ledger is thread-safe, and waiting happens only while the budget is spent.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable

# How often a waiting worker looks again (seconds).
POLL = 0.005
# The inbox's receiver has --batch-bytes of its own beside the dispatchers'
# claims (which hold as much again, Budget below): of it, wiring gives the
# bodies received and not yet acknowledged a half (RabbitMQ's consumer,
# relay.brokers.amqp; each costs about four times its size on its way into
# the INSERT: the bytes, the text, the JSON parameter, libpq's copy of it),
# and the claim check bodies fetched at once a quarter
# (relay.claimcheck.inbound; boto3's read and orjson's parse of each come
# on top). Measured in tests/ops/test_memory_limit.py.
RECEIVED_SHARE = 2
FETCHED_SHARE = 4


class Budget:
    """A daemon's byte budget for claimed rows, shared by `workers` workers."""

    def __init__(
        self, total: int, workers: int, report: Callable[[int], None] | None = None
    ) -> None:
        if total < 1:
            raise ValueError("a byte budget is at least 1 byte")
        self.total = total
        self.share = max(1, total // workers)
        self._lock = threading.Lock()
        self._reserved = 0  # granted to claims under way, not yet used or given back
        self._held = 0  # in rows claimed
        self._line: deque[object] = deque()  # workers waiting, first come first served
        self._report = report

    @property
    def held(self) -> int:
        """The bytes of the rows claimed and not yet released."""
        return self._held

    def _try(self, ticket: object, need: int | None) -> int | None:
        with self._lock:
            if self._line and self._line[0] is not ticket:
                if ticket not in self._line:
                    self._line.append(ticket)
                return None
            free = self.total - self._reserved - self._held
            if need is None:
                grant = min(self.share, free)
                ok = grant > 0
            else:
                grant = min(need, self.total)
                ok = free >= grant
            if not ok:
                if ticket not in self._line:
                    self._line.append(ticket)
                return None
            if self._line and self._line[0] is ticket:
                self._line.popleft()
            self._reserved += grant
            return grant

    def _leave(self, ticket: object) -> None:
        with self._lock:
            if ticket in self._line:
                self._line.remove(ticket)

    async def take(self, need: int | None = None, stopping: asyncio.Event | None = None) -> int:
        """Bytes for one claim: the worker's share, or (need) exactly that
        many, or everything when need exceeds the whole budget. Returns 0
        only when `stopping` was set while it waited."""
        ticket = object()
        try:
            while (grant := self._try(ticket, need)) is None:
                if stopping is not None and stopping.is_set():
                    return 0
                await asyncio.sleep(POLL)
        finally:
            self._leave(ticket)
        return grant

    def alone(self, grant: int) -> bool:
        """Whether a claim granted `grant` may take a first row larger than it:
        only when granted the whole budget (nothing else is held)."""
        return grant >= self.total

    def claimed(self, grant: int, used: int) -> None:
        """The claim granted `grant` took rows of `used` bytes: the rest goes back."""
        with self._lock:
            self._reserved -= grant
            self._held += used
            held = self._held
        if self._report is not None:
            self._report(held)

    def release(self, used: int) -> None:
        """The batch's rows (`used` bytes, as claimed()) are done with."""
        with self._lock:
            self._held -= used
            held = self._held
        if self._report is not None:
            self._report(held)
