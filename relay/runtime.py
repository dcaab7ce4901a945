"""The daemons' process settings: the garbage collector."""

from __future__ import annotations

import gc

# The daemons' garbage collector (relay outbox, relay inbox and the
# receiver's process; never a library user's process): the youngest
# generation is collected every GC_THRESHOLDS[0] allocations, not 700. A
# batch allocates thousands of short-lived objects that reference counting
# frees anyway, and at 700 the collector walked the batches in hand over
# and over (the Redis consumer alone: 27-29 -> 20-22 µs of CPU a message).
GC_THRESHOLDS = (20_000, 50, 100)


def tune_gc() -> None:
    """Before a daemon's loop: what start-up loaded (modules, settings,
    handlers) frozen out of the collector's walks, and GC_THRESHOLDS set."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
