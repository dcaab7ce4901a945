"""What the console's overview shows, read from the tables alone.

Every figure comes from an index: counts of pending and dead rows from the
partial indexes on those statuses, the oldest pending row from the lowest
`seq` still pending, and the rates of the last hour from published_at and
processed_at (the retention indexes), so the page stays fast beside a
million finished rows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from relay.db import AsyncConnection, Store, named

MINUTES = 60

_OUTBOX = named("overview_outbox")
_OUTBOX_RATE = named("overview_outbox_rate")
_INBOX_COUNTS = {
    "pending": named("overview_inbox_pending"),
    "dead": named("overview_inbox_dead"),
}
_INBOX_OLDEST = named("overview_inbox_oldest")
_INBOX_RATE = named("overview_inbox_rate")


@dataclass
class Scope:
    """The outbox, or one inbox consumer."""

    name: str
    consumer: str | None
    pending: int = 0
    dead: int = 0
    oldest_pending_seconds: float | None = None
    # Rows finished per minute, oldest minute first: [0] is 59-60 minutes ago.
    per_minute: list[int] = field(default_factory=lambda: [0] * MINUTES)

    @property
    def last_hour(self) -> int:
        return sum(self.per_minute)


async def overview(store: Store) -> list[Scope]:
    """The outbox, then each inbox consumer that has pending, dead or recent rows.

    Its four parts run at once, each on a connection of its own: the page
    takes as long as the slowest (the rates, which read the last hour's
    index entries), not as long as all of them."""
    outbox = Scope("outbox", None)
    consumers: dict[str, Scope] = {}

    def scope(name: str) -> Scope:
        return consumers.setdefault(name, Scope("inbox", name))

    async def outbox_counts(conn: AsyncConnection) -> None:
        outbox.pending, outbox.dead, outbox.oldest_pending_seconds = (
            await conn.execute(_OUTBOX)
        ).one()

    async def outbox_rate(conn: AsyncConnection) -> None:
        for ago, count in await conn.execute(_OUTBOX_RATE):
            _add(outbox, ago, count)

    async def inbox_counts(conn: AsyncConnection) -> None:
        for status, query in _INBOX_COUNTS.items():
            for consumer, count in await conn.execute(query):
                setattr(scope(consumer), status, count)
        for s in list(consumers.values()):
            if s.pending:
                s.oldest_pending_seconds = await conn.scalar(
                    _INBOX_OLDEST, {"consumer": s.consumer}
                )

    async def inbox_rate(conn: AsyncConnection) -> None:
        rates = [tuple(r) for r in await conn.execute(_INBOX_RATE)]
        for consumer, ago, count in rates:
            _add(scope(consumer), ago, count)

    async def run(part: Callable[[AsyncConnection], Awaitable[None]]) -> None:
        async with store.connection() as conn:
            await part(conn)

    await asyncio.gather(*(run(p) for p in (outbox_counts, outbox_rate, inbox_counts, inbox_rate)))
    return [outbox, *(consumers[c] for c in sorted(consumers))]


def _add(scope: Scope, ago: Any, count: int) -> None:
    if ago is not None and 0 <= ago < MINUTES:
        scope.per_minute[MINUTES - 1 - ago] += count


def chart(scope: Scope, width: int = 600, height: int = 120) -> dict[str, Any]:
    """Bars of a scope's per-minute rate as SVG rectangles (drawn by the template)."""
    top = max(scope.per_minute) or 1
    bar = width / MINUTES
    bars = []
    for i, count in enumerate(scope.per_minute):
        h = round(count / top * (height - 4), 1)
        bars.append(
            {
                "x": round(i * bar, 1),
                "y": round(height - h, 1),
                "w": round(bar * 0.8, 1),
                "h": h,
                "count": count,
                "ago": MINUTES - i,
            }
        )
    return {"width": width, "height": height, "bars": bars, "top": max(scope.per_minute)}
