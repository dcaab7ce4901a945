"""The inbox: store received messages, acknowledge them, dispatch them to handlers.

Two parts. The receiver (relay.receiving) takes batches from the broker,
inserts them with ON CONFLICT DO NOTHING (the producer's id is the dedup
key), commits, and only then acknowledges them; `relay inbox` runs it in a
child process of its own. Three dispatchers, splitting the keys by hash,
claim pending rows with FOR UPDATE SKIP LOCKED and run the handlers in the
transaction that marks the rows processed, so a handler's database effects
happen exactly once; a savepoint rolls back a failed handler's writes.
Each dispatcher runs in a thread of its own with its own event loop and
connection: a sync handler blocks only its dispatcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import traceback
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from relay import batches, storable, tracing
from relay.backoff import Backoff, reconnect_backoff, sleep_unless, wait_to_reconnect
from relay.budget import Budget
from relay.config import DEFAULT_BATCH_BYTES
from relay.db import Store, connection_invalidated
from relay.errors import DatabaseUnavailable, HandlerHung, Refused, Unavailable
from relay.handlers import (
    AnyHandler,
    BatchHandler,
    Handler,
    HandlerRegistry,
    Message,
    Messages,
    call_from_sync,
    is_async,
)
from relay.metrics import InboxMetrics
from relay.pacing import Pace
from relay.rows import Failure, InboxRow, NewInboxRow, Reserved
from relay.workers import BLOCKED_RETRY, report_failure

if TYPE_CHECKING:
    from relay.db.store import HandlerSavepoints

log = logging.getLogger(__name__)

_T = TypeVar("_T")

# A received batch handed to a dispatcher: its rows, their reserved `seq`
# values, and the future of the ids that were new (DispatcherThread.submit).
Received = tuple[Sequence[NewInboxRow], Reserved, concurrent.futures.Future[set[str]]]

# Dispatchers per daemon, each in a thread of its own with its own
# connection and share of the keys (by hash, as the outbox's workers): a
# dispatcher waits on PostgreSQL much of its time, the others run.
DISPATCHERS = 3
# A handler still running at this many times --handler-timeout is hung.
HUNG_AFTER = 2
WATCH_INTERVAL = 0.25
# A batch's handlers share one savepoint, moved on this often (seconds): a
# failure runs again at most this much of the other handlers' work.
CHECKPOINT_EVERY = 0.1
ABORTED_BY_HANDLER = (
    "the handler returned, but left its transaction aborted by a failed "
    "statement (was a database error caught and not raised again?)"
)


class Dispatcher:
    """Pending inbox rows → handlers, in per-key order, exactly once per commit.

    Given what wiring read from the settings: the rows' `consumer_name`, the
    claim's `batch_size` and `on_dead`, `max_attempts` and the failed
    attempts' `backoff` for the marks, the `handler_timeout`, the idle
    `poll_interval`, and the spans' `messaging_system` (relay.brokers.Kind.system);
    the `budget` the daemon's dispatchers' claims share (--batch-bytes, relay.budget)."""

    def __init__(
        self,
        store: Store,
        registry: HandlerRegistry,
        metrics: InboxMetrics,
        pace: Pace | None = None,
        worker: int = 0,
        workers: int = 1,
        *,
        consumer_name: str,
        batch_size: int,
        on_dead: str,
        max_attempts: int,
        backoff: Backoff,
        handler_timeout: float,
        poll_interval: float,
        messaging_system: str = "",
        budget: Budget | None = None,
    ) -> None:
        self.consumer_name = consumer_name
        self.batch_size = batch_size
        self.on_dead = on_dead
        self.max_attempts = max_attempts
        self.handler_timeout = handler_timeout
        self.poll_interval = poll_interval
        # The bytes of claimed rows the daemon's dispatchers hold, shared by
        # them all (relay.budget: wiring's, of --batch-bytes); the size of a
        # row the last claim could not take, which the next one waits for.
        self.budget = budget or Budget(DEFAULT_BATCH_BYTES, 1, metrics.held_bytes.set)
        self._need: int | None = None
        self.worker = worker
        self.workers = workers
        self.store = store
        self.registry = registry
        # Each type's handler and whether it is a coroutine function, looked up once.
        self.handlers: dict[str | None, tuple[Handler, bool]] = {
            type_: (handler, is_async(handler))
            for type_ in registry.types
            if (handler := registry.get(type_)) is not None
        }
        # Each type's batch handler, whether it is async, and its max_size.
        self.batch_handlers: dict[str | None, tuple[BatchHandler, bool, int]] = {
            type_: (fn, is_async(fn), max_size)
            for type_ in registry.types
            if (batch := registry.get_batch(type_)) is not None
            for fn, max_size in [batch]
        }
        self.max_sizes = {
            type_: max_size
            for type_, (_, _, max_size) in self.batch_handlers.items()
            if type_ is not None
        }
        self.metrics = metrics
        self.pace = pace
        self.messaging_system = messaging_system
        self.backoff = backoff
        self.reconnect = reconnect_backoff()
        self.wakeup = asyncio.Event()
        self.stopping = asyncio.Event()
        self.last_progress = time.monotonic()
        # The rows whose handler (or batch handler) runs now, since when
        # (monotonic), and the backend pid of the batch's connection: read by
        # the watchdog in DispatcherThread, from another thread (one tuple,
        # set atomically).
        self.in_hand: tuple[tuple[InboxRow, ...], float, int | None] | None = None
        # The batch's handler runs' seconds, for relay_inbox_handler_seconds.
        self.handler_times: list[float] = []
        # --dispatch received: the receiver's batches of this dispatcher's
        # share, each with the future its new ids go to, handed over from
        # the daemon's event loop (DispatcherThread.submit), and handled
        # before any claim; the one in hand, for the watchdog.
        self.received: deque[Received] = deque()
        self.receiving: Sequence[NewInboxRow] | None = None
        # Whether wake() asked for a claim since the last one began.
        self._woken = False

    def wake(self) -> None:
        self._woken = True
        self.wakeup.set()

    def take(self) -> None:
        """A received batch was handed over (self.received)."""
        self.wakeup.set()

    def stop(self) -> None:
        self.stopping.set()
        self.wakeup.set()

    async def dispatch_batch(self) -> tuple[int, int]:
        """Claim and handle one batch; returns (rows handled or failed, rows blocked).

        The batch is sync code. With only sync handlers it runs on psycopg's
        blocking connection (a Store made with sync=True): a round trip costs
        less CPU than through asyncio (docs/inbox.md), and this thread
        lets go of the GIL while it waits. Otherwise it runs inside run_sync
        on the async engine, where async handlers are awaited.

        The claim takes rows up to the bytes the daemon's budget grants it
        (--batch-bytes, relay.budget), given back once the batch is done."""
        grant = await self.budget.take(self._need, self.stopping)
        if not grant:
            return 0, 0  # stopping
        held = [grant, 0]  # granted and not yet claimed; claimed
        try:
            outcome = await self._in_transaction(self._batch, held)
        finally:
            self.budget.claimed(held[0], 0)
            self.budget.release(held[1])
            self.metrics.handler_seconds.observe_all(self.handler_times)
            self.handler_times.clear()
        return self._report(*outcome)

    async def _in_transaction(self, work: Callable[..., _T], *args: Any) -> _T:
        """`work(conn, async_conn, *args)` in a transaction: on the sync
        engine's blocking connection when there is one (async_conn None),
        else inside run_sync on the async engine (see dispatch_batch)."""
        if self.store.sync_engine is not None:
            with self.store.sync_transaction() as conn:
                return work(conn, None, *args)
        async with self.store.transaction() as async_conn:
            return await async_conn.run_sync(work, async_conn, *args)

    @property
    def stopped_short(self) -> bool:
        """Whether the last claim stopped at a row its grant of the byte
        budget could not take: more rows wait, as after a full batch."""
        return self._need is not None

    def _batch(
        self, conn: Any, async_conn: Any, held: list[int]
    ) -> tuple[list[str], list[tuple[InboxRow, Failure, float]], dict[str, str], int]:
        consumer = self.consumer_name
        grant = held[0]
        # The claim's planner settings are turned off by the savepoints'
        # first round trip (Store.claim_inbox), before any handler runs.
        rows, blocked, used, self._need = self.store.claim_inbox(
            conn,
            consumer,
            self.batch_size,
            self.on_dead,
            self.worker,
            self.workers,
            unplan=False,
            budget=grant,
            alone=self.budget.alone(grant),
        )
        self.budget.claimed(grant, used)
        held[:] = [0, used]
        if not rows:
            return [], [], {}, blocked
        savepoints = self.store.handler_savepoints(conn, after_claim=True)
        processed, failed = self._run_handlers(conn, async_conn, rows, savepoints)
        savepoints.before_marks()
        self.store.mark_processed(conn, consumer, processed)
        statuses = self.store.mark_inbox_failed(conn, consumer, failed, self.max_attempts)
        return processed, failed, statuses, blocked

    async def receive_batch(self, rows: Sequence[NewInboxRow], reserved: Reserved) -> set[str]:
        """Store a received batch of this dispatcher's share and handle it in
        the same transaction (--dispatch received); returns the ids of the
        rows that were new. The rows whose key has a row waiting for the
        dispatchers wait behind it, stored `pending`, and a row whose
        handler fails is stored `pending` (or `dead`) with the attempt
        counted, every later row of its key in the batch `pending` after
        it: all are the dispatchers' from there, as on the stored path.
        The transaction runs as a claimed batch's (see dispatch_batch).

        The rows are held under the daemon's byte budget as a claim's are
        (their payloads, bodies and headers): the dispatchers' parts of a
        batch of large bodies go one after another, and a part larger
        than the whole budget goes alone, as the claims' rows do."""
        size = sum(_received_bytes(row) for row in rows)
        grant = await self.budget.take(size, self.stopping)
        if not grant:
            raise DatabaseUnavailable("the inbox is stopping")
        self.budget.claimed(grant, grant)
        try:
            outcome = await self._in_transaction(self._receive, rows, reserved)
        finally:
            self.budget.release(grant)
            self.receiving = None
            self.metrics.handler_seconds.observe_all(self.handler_times)
            self.handler_times.clear()
        new, processed, failed, statuses = outcome
        self._report(processed, failed, statuses, 0)
        return new

    def _receive(
        self,
        conn: Any,
        async_conn: Any,
        rows: Sequence[NewInboxRow],
        reserved: Reserved,
    ) -> tuple[set[str], list[str], list[tuple[InboxRow, Failure, float]], dict[str, str]]:
        consumer = self.consumer_name
        offered = self._statuses(rows)
        stored = self.store.store_received(conn, consumer, rows, offered, self.on_dead, reserved)
        handle: list[InboxRow] = []
        waiting = 0
        for row in rows:
            status = stored.get(row.message_id)
            if status == "processed":
                handle.append(
                    InboxRow(
                        row.message_id, 0, row.topic, row.key, row.type, row.payload, row.headers, 0
                    )
                )
            elif status == "pending":
                waiting += 1
        if not handle:
            processed: list[str] = []
            failed: list[tuple[InboxRow, Failure, float]] = []
        else:
            if len(handle) > len(stored):  # an id twice in the batch: its first row
                firsts = {row.message_id: row for row in reversed(handle)}
                handle = [row for row in handle if firsts[row.message_id] is row]
            self.receiving = rows
            savepoints = self.store.handler_savepoints(conn)
            processed, failed = self._run_handlers(conn, async_conn, handle, savepoints)
            if failed:
                done = {row.message_id for row, _, _ in failed}.union(processed)
                held = [row.message_id for row in handle if row.message_id not in done]
                savepoints.before_marks()
                self.store.hold_received(conn, consumer, held)
                waiting += len(held) + len(failed)
        statuses = self.store.mark_inbox_failed(conn, consumer, failed, self.max_attempts)
        if waiting:
            self.store.wake_dispatchers(conn)
        return set(stored), processed, failed, statuses

    def _statuses(self, rows: Sequence[NewInboxRow]) -> list[str]:
        """The statuses the receiving transaction's rows are offered as:
        `dead` as received, else `processed` (inbox_insert_received makes it
        `pending` behind a row of the key waiting for the dispatchers), or
        `pending` behind a row of the key stored dead earlier in the batch
        under --on-dead block."""
        if self.on_dead != "block":
            return ["dead" if row.status == "dead" else "processed" for row in rows]
        dead: set[str] = set()
        statuses = []
        for row in rows:
            if row.status == "dead":
                statuses.append("dead")
                if row.key is not None:
                    dead.add(row.key)
            else:
                statuses.append("pending" if row.key in dead else "processed")
        return statuses

    async def _receive_next(self) -> None:
        """Handle the oldest batch handed over; its outcome to its future."""
        rows, reserved, future = self.received.popleft()
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(await self.receive_batch(rows, reserved))
        except Exception as exc:
            if connection_invalidated(exc):
                exc = DatabaseUnavailable(f"the connection was lost: {exc}")
            future.set_exception(exc)
        except BaseException as exc:
            future.set_exception(DatabaseUnavailable("the inbox is stopping"))
            raise exc
        self.last_progress = time.monotonic()

    def _report(
        self,
        processed: list[str],
        failed: list[tuple[InboxRow, Failure, float]],
        statuses: dict[str, str],
        blocked: int,
    ) -> tuple[int, int]:
        self.metrics.processed.inc(len(processed))
        for row, failure, delay in failed:
            report_failure(
                log,
                self.metrics,
                "handler",
                failure.error.splitlines()[0] if failure.error else "",
                dead=statuses.get(row.message_id) == "dead",
                delay=delay,
                extra={
                    "action": "handler_failed",
                    "message_id": row.message_id,
                    "type": row.type,
                    "topic": row.topic,
                    "attempts": row.attempts + 1,
                },
            )
        return len(processed) + len(failed), blocked

    def _run_handlers(
        self,
        conn: Any,
        async_conn: Any,
        rows: Sequence[InboxRow],
        savepoints: HandlerSavepoints,
    ) -> tuple[list[str], list[tuple[InboxRow, Failure, float]]]:
        """Run the handlers of a batch on its transaction (rows claimed, or
        just stored by the receiving transaction), with `savepoints` of it;
        returns the ids of the rows handled and the failures. The rows of a
        key after one that failed are in neither: they did not run.

        Careful: each handler runs in a savepoint of its own, so that a
        failure rolls back only its own writes. But a savepoint costs a round
        trip, as dear as a one-INSERT handler, and handlers seldom fail: a
        batch of rows that never failed runs with one savepoint for many
        handlers (moved on every CHECKPOINT_EVERY seconds). When a handler
        fails there, the batch rolls back to that savepoint and runs on,
        carefully, from it: the handlers since then run again, the failed row
        does not, its failure is recorded. Rows that failed before run
        carefully from the start.

        The rows of a type with a batch handler go to it in units (see
        relay.batches.plan), run in the order of their first rows; a unit
        that fails runs again carefully, in parts (_run_in_parts)."""
        pid = self.store.backend_pid(conn)
        careful = any(row.attempts for row in rows)
        processed: list[str] = []
        failed: list[tuple[InboxRow, Failure, float]] = []
        failed_keys: set[str] = set()
        known: dict[int, Failure] = {}  # failures rolled back, by position in rows
        # Batch units that failed whole, by index in units: when their first
        # call started and its span (each message's span links to it too).
        split: dict[int, tuple[int, dict[str, list[Any]]]] = {}
        units = (
            batches.plan(rows, self.max_sizes)
            if self.max_sizes
            else [(position,) for position in range(len(rows))]
        )
        checkpoint: tuple[int, int, int, set[str]] = (0, 0, 0, set())
        since = time.monotonic()
        if not careful:
            savepoints.batch.set()

        def move_checkpoint(index: int) -> None:
            nonlocal checkpoint, since
            now = time.monotonic()
            if now - since > CHECKPOINT_EVERY:
                savepoints.batch.set()
                checkpoint = (index, len(processed), len(failed), set(failed_keys))
                since = now

        at = 0
        while at < len(units):
            index, unit = at, units[at]
            at += 1
            batch = self.batch_handlers.get(rows[unit[0]].type)
            if batch is not None:
                fast = not careful and index not in split
                if fast:
                    # Before the members: going back to a checkpoint taken
                    # after their failures would record them again.
                    move_checkpoint(index)
                # The unit's messages, but those held by a failure of their key.
                members: list[tuple[InboxRow, Message]] = []
                for position in unit:
                    row = rows[position]
                    if row.key is not None and row.key in failed_keys:
                        continue
                    message = self._message(conn, row)
                    if isinstance(message, Failure):
                        self._fail(row, message, failed, failed_keys)
                    else:
                        members.append((row, message))
                if not members:
                    continue
                if not fast:
                    done, failures = self._run_in_parts(
                        conn, async_conn, savepoints, pid, batch, members, failed_keys,
                        split.get(index),
                    )  # fmt: skip
                    processed.extend(done)
                    failed.extend(failures)
                    continue
                started = time.time_ns()
                links: dict[str, list[Any]] = {}
                failure = self._run_batch(conn, async_conn, pid, batch, members, links)
                if failure is None and savepoints.aborted():
                    failure = Failure(ABORTED_BY_HANDLER)
                if failure is None:
                    processed.extend(row.message_id for row, _ in members)
                    self._batch_spans(started, links, members, [])
                    continue
                split[index] = (started, links)  # on the careful run, it starts from halves
            else:
                position, row = unit[0], rows[unit[0]]
                fast_failure = False
                if row.key is not None and row.key in failed_keys:
                    continue  # a failed row holds its key: later rows wait, untouched
                handler = self.handlers.get(row.type)
                failure = known.get(position)
                if failure is not None:
                    pass  # failed before the roll back: recorded, not run again
                elif handler is None:
                    failure = Failure(
                        f"no handler registered for message type {row.type!r}", permanent=True
                    )
                else:
                    if careful:
                        savepoints.handler.set()
                    else:
                        move_checkpoint(index)
                    self.in_hand = ((row,), time.monotonic(), pid)
                    try:
                        failure = self._handle(conn, async_conn, row, *handler)
                    finally:
                        self.in_hand = None
                    if failure is None and savepoints.aborted():
                        failure = Failure(ABORTED_BY_HANDLER)
                    if failure is not None and not careful:
                        known[position] = failure  # recorded on the careful run
                        failure = None
                        fast_failure = True
                    elif failure is not None:
                        savepoints.handler.undo()
                if failure is not None:
                    self._fail(row, failure, failed, failed_keys)
                    continue
                if not fast_failure:
                    processed.append(row.message_id)
                    continue
            # A failure on the fast way: back to the checkpoint, and on from
            # there carefully.
            savepoints.batch.undo()
            careful = True
            at, kept_processed, kept_failed, failed_keys = checkpoint
            self.metrics.reruns.inc(len(processed) - kept_processed)
            del processed[kept_processed:], failed[kept_failed:]
        return processed, failed

    def _fail(
        self,
        row: InboxRow,
        failure: Failure,
        failed: list[tuple[InboxRow, Failure, float]],
        failed_keys: set[str],
    ) -> None:
        """Record a row's failure; it holds its key for the rest of the batch."""
        failed.append((row, failure, self.backoff.delay(row.attempts + 1)))
        if row.key is not None:
            failed_keys.add(row.key)

    def _run_in_parts(
        self,
        conn: Any,
        async_conn: Any,
        savepoints: HandlerSavepoints,
        pid: int | None,
        batch: tuple[BatchHandler, bool, int],
        members: list[tuple[InboxRow, Message]],
        failed_keys: set[str],
        split: tuple[int, dict[str, list[Any]]] | None,
    ) -> tuple[list[str], list[tuple[InboxRow, Failure, float]]]:
        """Run a batch handler's unit carefully: each part in a savepoint of
        its own, a part that fails again as halves, down to single messages
        (relay.batches.run_in_parts). Messages that failed before run alone
        from the start: they are likely to fail again. Returns the ids of
        the messages handled, and the failures. `split`: the unit failed
        whole on the fast way (when, and its span): start from halves."""
        started, links = split if split is not None else (time.time_ns(), {})

        def attempt(part: list[tuple[InboxRow, Message]]) -> Failure | None:
            savepoints.handler.set()
            failure = self._run_batch(conn, async_conn, pid, batch, part, links)
            if failure is None and savepoints.aborted():
                failure = Failure(ABORTED_BY_HANDLER)
            if failure is not None:
                savepoints.handler.undo()
            return failure

        outcome = batches.run_in_parts(
            members,
            attempt,
            key=lambda member: member[0].key,
            failed_keys=failed_keys,
            alone=lambda member: member[0].attempts > 0,
            split=split is not None,
        )
        self.metrics.reruns.inc(outcome.rolled_back)
        self._batch_spans(started, links, outcome.done, outcome.failed)
        return [row.message_id for row, _ in outcome.done], [
            (row, failure, self.backoff.delay(row.attempts + 1))
            for (row, _), failure in outcome.failed
        ]

    def _run_batch(
        self,
        conn: Any,
        async_conn: Any,
        pid: int | None,
        batch: tuple[BatchHandler, bool, int],
        part: list[tuple[InboxRow, Message]],
        links: dict[str, list[Any]],
    ) -> Failure | None:
        """One call of a batch handler, in no savepoint of its own; notes its
        span in `links` under each message's id."""
        handler, asynchronous, _ = batch
        messages = [message for _, message in part]
        self.in_hand = (tuple(row for row, _ in part), time.monotonic(), pid)
        started = time.perf_counter()
        try:
            if not tracing.enabled:
                return self._call(handler, messages, conn, async_conn, asynchronous)
            with tracing.process_batch(
                self.messaging_system, self.consumer_name, part[0][0].type, len(part)
            ) as span:
                failure = self._call(handler, messages, conn, async_conn, asynchronous)
                if failure is not None:
                    tracing.failed(span, failure.error)
            for message in messages:
                links.setdefault(message.id, []).append(span)
            return failure
        finally:
            self.in_hand = None
            self.metrics.handler_seconds.observe(time.perf_counter() - started)

    def _batch_spans(
        self,
        started: int,
        links: dict[str, list[Any]],
        done: Sequence[tuple[InboxRow, Message]],
        failed: Sequence[tuple[tuple[InboxRow, Message], Failure]],
    ) -> None:
        """One span per message of a batch unit, linked to its batch spans."""
        if not tracing.enabled:
            return
        outcomes: list[tuple[tuple[InboxRow, Message], str | None]]
        outcomes = [(member, None) for member in done]
        outcomes += [(member, failure.error) for member, failure in failed]
        for (row, message), error in outcomes:
            tracing.batch_message(
                self.messaging_system,
                message,
                batches=links.get(row.message_id, []),
                started=started,
                error=error,
            )

    def _message(self, conn: Any, row: InboxRow) -> Message | Failure:
        """The Message a handler gets for a row, or why it cannot get one."""
        try:
            headers = storable.loads(row.headers) if row.headers else {}
            # The parsed payload is the handler's; the row's text stays
            # with the claimed batch (its bytes are what the budget counts,
            # relay.budget), so a row in hand costs about twice its size.
            payload = storable.loads(row.payload) if row.payload is not None else None
        except ValueError as exc:  # stored by hand, or by an older relay
            return Failure(
                f"the row cannot be given to a handler: its JSON is {exc}", permanent=True
            )
        # A body that was not JSON (dead on arrival, then retried): its raw bytes.
        body = (
            self.store.inbox_body(conn, self.consumer_name, row.message_id)
            if row.payload is None
            else None
        )
        return Message(
            id=row.message_id,
            type=row.type,
            topic=row.topic,
            key=row.key,
            payload=payload,
            headers=headers if isinstance(headers, dict) else {},
            attempts=row.attempts,
            consumer=self.consumer_name,
            body=body,
        )

    def _handle(
        self, conn: Any, async_conn: Any, row: InboxRow, handler: Handler, asynchronous: bool
    ) -> Failure | None:
        message = self._message(conn, row)
        if isinstance(message, Failure):
            return message
        started = time.perf_counter()
        try:
            if tracing.enabled:
                with tracing.process(self.messaging_system, message) as span:
                    failure = self._call(handler, message, conn, async_conn, asynchronous)
                    if failure is not None:
                        tracing.failed(span, failure.error)
            else:
                failure = self._call(handler, message, conn, async_conn, asynchronous)
        finally:
            # Into the histogram at the batch's end (dispatch_batch); the
            # progress clock now.
            self.handler_times.append(time.perf_counter() - started)
            self.metrics.handler_seconds.last_observed = time.monotonic()
        if failure is not None:
            return failure
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "handled",
                extra={
                    "action": "handled",
                    "message_id": row.message_id,
                    "type": row.type,
                    "traceparent": message.headers.get("traceparent"),
                },
            )
        return None

    def _call(
        self, handler: AnyHandler, message: Messages, conn: Any, async_conn: Any, asynchronous: bool
    ) -> Failure | None:
        """Run one handler; its exception as a Failure (a lost database raises)."""
        try:
            call_from_sync(handler, message, conn, async_conn, self.handler_timeout, asynchronous)
        except Unavailable:
            raise
        except Exception as exc:
            if connection_invalidated(exc):
                raise  # the database went away: not the handler's failure
            if isinstance(exc, TimeoutError) and not str(exc):  # asyncio.timeout's
                return Failure(
                    f"handler did not finish within --handler-timeout "
                    f"{self.handler_timeout:g}s and was cancelled\n{_error_text(exc)}"
                )
            return Failure(_error_text(exc))
        return None

    async def run(self) -> None:
        """Claim and handle batches until stopped; a received batch handed
        over (--dispatch received) goes before the next claim. A claim
        runs again at once after a full one, after BLOCKED_RETRY when its
        rows waited on another dispatcher's, else when woken (a NOTIFY, the
        receiver) or after the poll interval."""
        failures = 0
        claim_at = 0.0  # monotonic: when the next claim is due
        try:
            while not self.stopping.is_set():
                if self.received:
                    await self._receive_next()
                    continue
                now = time.monotonic()
                if self._woken:
                    claim_at = now
                if now < claim_at:
                    self.wakeup.clear()
                    await sleep_unless(self.wakeup, claim_at - now)
                    continue
                self._woken = False
                stored_before_claim = self.pace.stored_total if self.pace is not None else 0
                try:
                    done, blocked = await self.dispatch_batch()
                    failures = 0
                except Unavailable as exc:
                    failures += 1
                    await wait_to_reconnect(exc, failures, self.reconnect, self.stopping, log)
                    continue
                except Exception as exc:
                    if not connection_invalidated(exc):
                        raise
                    failures += 1
                    await sleep_unless(self.stopping, self.reconnect.delay(failures))
                    continue
                self.last_progress = time.monotonic()
                if self.pace is not None:
                    caught_up = done + blocked < self.batch_size and not self.stopped_short
                    self.pace.dispatched(self.worker, done, caught_up, stored_before_claim)
                if done or self.stopped_short:
                    continue
                claim_at = time.monotonic() + (BLOCKED_RETRY if blocked else self.poll_interval)
        finally:
            refuse_received(self.received)


# While a received part is stored and handled, each body is held about this
# many times over at once: as received, as the INSERT's JSON text of the rows
# and as the driver's bytes of it (a claimed row only as fetched). The budget
# counts a received row so: a part of 6 MiB bodies is larger than the default
# --batch-bytes and goes alone, where three at once took the inbox with 6 MiB
# Kafka records past 384 MiB (tests/ops/test_memory_limit.py).
RECEIVED_COPIES = 3


def _received_bytes(row: NewInboxRow) -> int:
    """A received row's size as the budget counts it (RECEIVED_COPIES)."""
    return RECEIVED_COPIES * (
        len(row.payload or "")
        + len(row.body or b"")
        + len(row.headers)
        + len(row.raw_properties or "")
        + 1
    )


def refuse_received(received: deque[Received]) -> None:
    """Stopping: the batches not begun wait for the broker to deliver them again."""
    while received:
        *_, future = received.popleft()
        if future.set_running_or_notify_cancel():
            future.set_exception(DatabaseUnavailable("the inbox is stopping"))


def _error_text(exc: BaseException) -> str:
    """Exception type, message and traceback, as last_error keeps them."""
    return "".join(traceback.format_exception(exc)).rstrip()


class DispatcherThread:
    """Runs a Dispatcher on its own event loop in a thread of its own."""

    def __init__(self, make: Callable[[], tuple[Store, Dispatcher]]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dispatcher: Dispatcher | None = None
        self._stop_requested = False
        self._closed = False  # the dispatcher has stopped: submit refuses
        # The received batches handed over (submit), the dispatcher's once it runs.
        self.received: deque[Received] = deque()

    def _call(self, method: str) -> None:
        with self._lock:
            if self._loop is not None and self.dispatcher is not None:
                self._loop.call_soon_threadsafe(getattr(self.dispatcher, method))

    def wake(self) -> None:
        self._call("wake")

    def submit(
        self, rows: Sequence[NewInboxRow], reserved: Reserved
    ) -> concurrent.futures.Future[set[str]]:
        """Hand a received batch to the dispatcher, to store (with the `seq`
        values reserved for it) and handle in one transaction
        (Dispatcher.receive_batch); its future gets the ids of the rows that
        were new, or the error."""
        future: concurrent.futures.Future[set[str]] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                # The receiver can still be storing a batch while the
                # dispatchers stop: it stays unacknowledged, for redelivery.
                future.set_exception(DatabaseUnavailable("the inbox is stopping"))
                return future
            self.received.append((rows, reserved, future))
        # Should the thread close meanwhile, _close has refused the batch and
        # this does nothing.
        self._call("take")
        return future

    def stop(self) -> None:
        with self._lock:
            self._stop_requested = True
        self._call("stop")

    def _main(self) -> None:
        async def body() -> None:
            store, dispatcher = self._make()
            dispatcher.received = self.received
            with self._lock:
                self._loop, self.dispatcher = asyncio.get_running_loop(), dispatcher
                if self._stop_requested:
                    dispatcher.stop()
            try:
                await dispatcher.run()
            finally:
                self._close()  # while the loop still runs: _call never meets it closed
                await store.close()

        try:
            asyncio.run(body())
        finally:
            self._close()  # also when _make failed

    def _close(self) -> None:
        """No call reaches the loop from here on, and a batch handed over
        after the dispatcher's last look is refused (it stays unacknowledged)."""
        with self._lock:
            self._closed, self._loop = True, None
            refuse_received(self.received)

    async def run(self) -> None:
        """Run the thread until the dispatcher stops; its crash propagates here.

        The thread is a daemon thread, so a handler that never returns cannot
        keep the process from exiting; the watchdog beside it turns such a
        hang into a failed attempt and raises HandlerHung."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if finished.done():
                return
            if exc is None:
                finished.set_result(None)
            else:
                finished.set_exception(exc)

        def target() -> None:
            outcome: BaseException | None = None
            try:
                self._main()
            except BaseException as exc:  # handed to the awaiting task
                outcome = exc
            try:
                loop.call_soon_threadsafe(settle, outcome)
            except RuntimeError:
                pass  # the main loop is gone: the process is exiting

        threading.Thread(target=target, name="relay-dispatcher", daemon=True).start()
        watchdog = asyncio.create_task(self._watch())
        try:
            await asyncio.wait({finished, watchdog}, return_when=asyncio.FIRST_COMPLETED)
            if watchdog.done():
                watchdog.result()  # raises HandlerHung
            await finished
        except asyncio.CancelledError:
            self.stop()  # the thread finishes its batch and exits on its own
            raise
        finally:
            watchdog.cancel()

    async def _watch(self) -> None:
        """Raise HandlerHung once a handler has run HUNG_AFTER times --handler-timeout.

        A sync handler cannot be interrupted, and an async one that blocks
        its event loop cannot be cancelled. Its batch's transaction is ended
        from here (which releases the row locks and rolls back the batch),
        the attempt is counted, and the daemon exits so that its supervisor
        starts a fresh process: the row is retried with backoff and is dead
        after --max-attempts hangs, instead of wedging every restart."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL)
            dispatcher = self.dispatcher
            in_hand = dispatcher.in_hand if dispatcher is not None else None
            receiving = dispatcher.receiving if dispatcher is not None else None
            if dispatcher is None or in_hand is None:
                continue
            held, started, pid = in_hand
            ran = time.monotonic() - started
            if ran < dispatcher.handler_timeout * HUNG_AFTER or dispatcher.in_hand is not in_hand:
                continue
            error = (
                f"handler hung: still running after {ran:.1f}s (--handler-timeout "
                f"{dispatcher.handler_timeout:g}s) and could not be interrupted; its "
                "transaction was ended and the inbox daemon exited so that its "
                "supervisor restarts it"
            )
            row = held[0]
            log.error(
                "%s (message %s, type %r%s)",
                error,
                row.message_id,
                row.type,
                f", and {len(held) - 1} more messages of its batch" if len(held) > 1 else "",
                extra={
                    "action": "handler_hung",
                    "message_id": row.message_id,
                    "type": row.type,
                    "attempts": row.attempts + 1,
                },
            )
            # A batch handler's call that hangs counts the attempt on every
            # message in it (which one hangs is not known); having failed,
            # each runs alone next time, and only the one that hangs again
            # fails again (relay.batches.run_in_parts).
            # A connection of its own: the batch's is held by the hung handler.
            batch_store = dispatcher.store
            store = Store(batch_store.database_url, pool_size=1, schema=batch_store.schema)
            try:
                statuses = await store.fail_hung_handler(
                    pid,
                    dispatcher.consumer_name,
                    [(row, dispatcher.backoff.delay(row.attempts + 1)) for row in held],
                    error,
                    dispatcher.max_attempts,
                    received=receiving or (),
                )
            except Exception as exc:  # the restart is what matters; the count is best effort
                log.error("could not record the hung handler's attempt: %r", exc)
                statuses = []
            finally:
                await store.close()
            dispatcher.metrics.failed.inc(len(statuses))
            dispatcher.metrics.dead.inc(statuses.count("dead"))
            raise HandlerHung(error)


class Handing:
    """The receiver's writer under --dispatch received: each batch split by
    key among the dispatchers, each part stored and handled in one
    transaction on its dispatcher's connection (Dispatcher.receive_batch),
    side by side; the receiver acknowledges the batch once every part is
    committed, as after its own INSERT.

    The split is by the key's CRC-32 (a keyless message's by its id), so
    a batch's rows of a key are handled in one transaction, in order; the
    keys' advisory locks (relay.db.store.key_lock) order the transactions
    of the daemons that receive from one queue. The batch's `seq` values
    are taken first, in one round trip, so that `seq` keeps the order of
    arrival across the parts, as one INSERT would; a part that another
    daemon's transaction on its keys overtook meanwhile is numbered anew
    (Store.store_received), so that a key's `seq` is the order its
    handlers ran in."""

    def __init__(
        self,
        threads: Sequence[DispatcherThread],
        reserve: Callable[[int], Awaitable[Reserved]],
    ) -> None:
        self.threads = threads
        self.reserve = reserve  # Store.reserve_seqs: `seq` in arrival order

    async def insert(self, consumer: str, batch: Sequence[NewInboxRow]) -> set[str]:
        """Store and handle `batch`; returns the ids that were new. Raises
        Refused when PostgreSQL refused a value of a part (with the ids the
        other parts stored), DatabaseUnavailable while it is away."""
        if not batch:
            return set()
        count = len(self.threads)
        reserved = await self.reserve(len(batch))
        parts: list[tuple[list[NewInboxRow], list[int]]] = [([], []) for _ in range(count)]
        for row, seq in zip(batch, reserved.seqs, strict=True):
            rows, numbers = parts[_share(row, count)]
            rows.append(row)
            numbers.append(seq)
        futures = [
            asyncio.wrap_future(thread.submit(rows, Reserved(numbers, reserved.at)))
            for thread, (rows, numbers) in zip(self.threads, parts, strict=True)
            if rows
        ]
        outcomes = await asyncio.gather(*futures, return_exceptions=True)
        new: set[str] = set()
        refused: Refused | None = None
        for outcome in outcomes:
            if isinstance(outcome, Refused):
                refused = outcome
            elif isinstance(outcome, BaseException):
                raise outcome
            else:
                new |= outcome
        if refused is not None:
            refused.stored = frozenset(new)
            raise refused
        return new

    async def close(self) -> None:
        pass


def _share(row: NewInboxRow, count: int) -> int:
    """The dispatcher a received row goes to (Handing)."""
    text = row.key if row.key is not None else row.message_id
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) % count
