"""The inbox's backpressure: the receiver stays at most a few batches ahead
of the daemon's own dispatchers (why: Pace's docstring, docs/inbox.md).

Two sides, one idea. `Pace` lives beside the dispatchers (the daemon's
process): it counts what was stored and what was dispatched. A receiver
on the daemon's own event loop waits on it directly. A receiver in a child
process (relay.receiver_process) waits on a `LeadGate` instead, which the
parent keeps up to date with a `Lead` after every change. Both are a
`Gate` to the receiver.

The receiver's process imports this module: it loads no SQLAlchemy.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NamedTuple, Protocol

from relay.backoff import sleep_unless

# How many batches per dispatcher the receiver may store ahead (Pace): the
# batch in hand and the next, so that no dispatcher waits for the broker.
PACE_BATCHES = 2


class Gate(Protocol):
    """Holds the receiver back while the rows it stored wait for the
    dispatchers (Pace in the daemon's process; LeadGate in the receiver's)."""

    async def wait(self, stopping: asyncio.Event) -> None: ...

    def release(self) -> None:
        """Wake a wait() (the receiver is stopping)."""


class Lead(NamedTuple):
    """What the parent's Pace tells the child's LeadGate after each change."""

    lead: int  # rows stored and not yet dispatched, as the parent counts them
    seen: int  # the parent's count of every row stored, when it counted `lead`


class Pace:
    """Keeps the receiver at most `limit` stored rows ahead of this daemon's dispatchers.

    Storing a message costs less than handling it: a receiver left to run
    ahead takes CPU the dispatchers need (a core, or the interpreter lock
    when it runs in their process), only to move the backlog from the
    broker (where other daemons could take it) into the table. Rows that
    other daemons handle are not seen here, so once the last claim of every
    dispatcher found less than a full batch of its share due, the lead is at
    most what was stored since the earliest of those claims began."""

    def __init__(self, limit: int, workers: int = 1) -> None:
        self.limit = limit
        self.lead = 0
        self.stored_total = 0  # read by the dispatchers' threads before each claim
        # Per dispatcher worker: stored_total when its last claim began, if
        # that claim found its share of the keys caught up, else None.
        self._caught_up_since: list[int | None] = [None] * workers
        self.changed = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def stored(self, rows: int) -> None:
        self.lead += rows
        self.stored_total += rows

    def dispatched(self, worker: int, rows: int, caught_up: bool, stored_before_claim: int) -> None:
        """Called from a dispatcher's thread after each batch."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the main loop is closed: exiting
                self._loop.call_soon_threadsafe(
                    self._dispatched, worker, rows, caught_up, stored_before_claim
                )

    def _dispatched(
        self, worker: int, rows: int, caught_up: bool, stored_before_claim: int
    ) -> None:
        self.lead = max(0, self.lead - rows)
        self._caught_up_since[worker] = stored_before_claim if caught_up else None
        since = [s for s in self._caught_up_since if s is not None]
        if len(since) == len(self._caught_up_since):
            # Every share was caught up: at most what was stored since the
            # earliest of those claims began is still to handle.
            self.lead = min(self.lead, self.stored_total - min(since))
        self.changed.set()

    def attach(self) -> None:
        """Take the dispatchers' reports on the running loop (the daemon's);
        until then they are dropped."""
        self._loop = asyncio.get_running_loop()

    async def wait(self, stopping: asyncio.Event) -> None:
        """Return once the lead is under the limit (or when stopping)."""
        self.attach()
        await _under_limit(self, stopping)

    def release(self) -> None:
        self.changed.set()

    async def next_lead(self) -> Lead:
        """The lead once it has changed, for a LeadGate in another process."""
        await self.changed.wait()
        self.changed.clear()
        return Lead(self.lead, self.stored_total)


class LeadGate:
    """The receiver process's Gate: how far its stored rows are ahead of the
    parent's dispatchers, from the Lead the parent sends after each change
    plus what was stored since the parent counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.stored_total = 0
        self._lead = 0
        self._seen = 0  # the parent's count of stored rows when it sent _lead
        self.changed = asyncio.Event()

    @property
    def lead(self) -> int:
        return self._lead + self.stored_total - self._seen

    def stored(self, rows: int) -> None:
        self.stored_total += rows

    def update(self, lead: Lead) -> None:
        self._lead, self._seen = lead
        self.changed.set()

    async def wait(self, stopping: asyncio.Event) -> None:
        await _under_limit(self, stopping)

    def release(self) -> None:
        self.changed.set()


async def _under_limit(gate: Pace | LeadGate, stopping: asyncio.Event) -> None:
    """Return once the gate's lead is under its limit (or when stopping)."""
    while gate.lead > gate.limit and not stopping.is_set():
        gate.changed.clear()
        await sleep_unless(gate.changed, 1.0)
