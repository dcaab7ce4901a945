"""Batch handlers: which claimed rows go to one call, and the runs in parts
that isolate the messages that fail on their own.

Free of SQLAlchemy and of the database: the dispatcher (relay.inbox) and
relay.testing give run_in_parts the way to run one part in a savepoint of
their own transaction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar


class Keyed(Protocol):
    @property
    def key(self) -> str | None: ...

    @property
    def type(self) -> str | None: ...


T = TypeVar("T")
F = TypeVar("F")


def plan(rows: Sequence[Keyed], max_sizes: Mapping[str, int]) -> list[tuple[int, ...]]:
    """The claimed rows (in seq order) as units of work, by position: one row
    for a handler, or the rows of one call of a batch handler (its type is in
    `max_sizes`), run in the order of their first row.

    A batch takes the rows of its type from its first row on, up to the
    type's max_size, but never a row of a key that has a row of another type
    between: that row runs before it (per-key order), so from there on the
    key's rows go to later units."""
    taken = [False] * len(rows)
    units: list[tuple[int, ...]] = []
    for start, first in enumerate(rows):
        if taken[start]:
            continue
        taken[start] = True
        limit = max_sizes.get(first.type) if first.type is not None else None
        if limit is None:
            units.append((start,))
            continue
        unit = [start]
        passed: set[str] = set()  # keys with a row of another unit since start
        for position in range(start + 1, len(rows)):
            if len(unit) >= limit:
                break
            if taken[position]:
                continue
            row = rows[position]
            if row.type == first.type and (row.key is None or row.key not in passed):
                unit.append(position)
                taken[position] = True
            elif row.key is not None:
                passed.add(row.key)
        units.append(tuple(unit))
    return units


@dataclass
class Outcome(Generic[T, F]):
    """What run_in_parts made of a batch."""

    done: list[T] = field(default_factory=list)  # in savepoints that were kept
    failed: list[tuple[T, F]] = field(default_factory=list)  # failed alone
    held: list[T] = field(default_factory=list)  # behind a failure of their key: not run
    rolled_back: int = 0  # runs of messages in parts that failed, to run again


def run_in_parts(
    items: Sequence[T],
    attempt: Callable[[list[T]], F | None],
    key: Callable[[T], str | None],
    failed_keys: set[str],
    *,
    alone: Callable[[T], bool] = lambda item: False,
    split: bool = False,
) -> Outcome[T, F]:
    """Run `items` (one batch, in seq order) through `attempt`, which runs a
    part in a savepoint of its own, rolls it back if it fails and returns the
    failure (None: kept). A part that fails runs again as two halves, down to
    single items: only an item that fails alone is failed. Parts run in seq
    order, so once an item fails, later items of its key (recorded in
    `failed_keys`, which also holds the keys failed before the batch) are
    held, not run.

    Items for which `alone` is true (those that failed before: likely to
    fail again) run alone from the start; `split` starts from halves (the
    whole batch is known to fail)."""
    outcome: Outcome[T, F] = Outcome()
    todo: deque[list[T]] = deque()
    stretch: list[T] = []
    for item in items:
        if alone(item):
            if stretch:
                todo.append(stretch)
                stretch = []
            todo.append([item])
        else:
            stretch.append(item)
    if stretch:
        todo.append(stretch)
    if split and len(todo) == 1 and len(todo[0]) > 1:
        todo.extend(_halves(todo.pop()))
    while todo:
        part: list[T] = []
        for item in todo.popleft():
            item_key = key(item)
            if item_key is not None and item_key in failed_keys:
                outcome.held.append(item)
            else:
                part.append(item)
        if not part:
            continue
        failure = attempt(part)
        if failure is None:
            outcome.done.extend(part)
        elif len(part) == 1:
            outcome.failed.append((part[0], failure))
            item_key = key(part[0])
            if item_key is not None:
                failed_keys.add(item_key)
        else:
            outcome.rolled_back += len(part)
            todo.extendleft(reversed(_halves(part)))
    return outcome


def _halves(part: list[T]) -> list[list[T]]:
    middle = len(part) // 2
    return [part[:middle], part[middle:]]
