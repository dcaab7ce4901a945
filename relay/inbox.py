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
import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from relay import storable, tracing
from relay.backoff import Backoff, reconnect_backoff, sleep_unless, wait_to_reconnect
from relay.config import InboxSettings
from relay.db import Store, connection_invalidated
from relay.errors import HandlerHung, Unavailable
from relay.handlers import Handler, HandlerRegistry, Message, call_from_sync, is_async
from relay.metrics import InboxMetrics
from relay.pacing import Pace
from relay.rows import Failure, InboxRow
from relay.workers import BLOCKED_RETRY, report_failure

log = logging.getLogger(__name__)

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
    """Pending inbox rows → handlers, in per-key order, exactly once per commit."""

    def __init__(
        self,
        settings: InboxSettings,
        store: Store,
        registry: HandlerRegistry,
        metrics: InboxMetrics,
        pace: Pace | None = None,
        worker: int = 0,
        workers: int = 1,
    ) -> None:
        self.settings = settings
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
        self.metrics = metrics
        self.pace = pace
        broker = settings.broker.kind if settings.broker is not None else ""
        self.messaging_system = tracing.SYSTEMS.get(broker, broker)
        self.backoff = Backoff(settings.backoff_min, settings.backoff_max)
        self.reconnect = reconnect_backoff()
        self.wakeup = asyncio.Event()
        self.stopping = asyncio.Event()
        self.last_progress = time.monotonic()
        # The row whose handler runs now, since when (monotonic), and the
        # backend pid of the batch's connection: read by the watchdog in
        # DispatcherThread, from another thread (one tuple, set atomically).
        self.in_hand: tuple[InboxRow, float, int | None] | None = None

    def wake(self) -> None:
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
        on the async engine, where async handlers are awaited."""
        if self.store.sync_engine is not None:
            with self.store.sync_transaction() as conn:
                outcome = self._batch(conn, None)
        else:
            async with self.store.transaction() as async_conn:
                outcome = await async_conn.run_sync(self._batch, async_conn)
        return self._report(*outcome)

    def _batch(
        self, conn: Any, async_conn: Any
    ) -> tuple[list[str], list[tuple[InboxRow, Failure, float]], dict[str, str], int]:
        s = self.settings
        consumer = s.consumer_name
        rows, blocked = self.store.claim_inbox(
            conn, consumer, s.batch_size, s.on_dead, self.worker, self.workers
        )
        if not rows:
            return [], [], {}, blocked
        processed, failed = self._run_handlers(conn, async_conn, rows)
        self.store.mark_processed(conn, consumer, processed)
        statuses = self.store.mark_inbox_failed(conn, consumer, failed, s.max_attempts)
        return processed, failed, statuses, blocked

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
        self, conn: Any, async_conn: Any, rows: Sequence[InboxRow]
    ) -> tuple[list[str], list[tuple[InboxRow, Failure, float]]]:
        """Run the handlers of a claimed batch on its transaction; returns the
        ids of the rows handled and the failures.

        Careful: each handler runs in a savepoint of its own, so that a
        failure rolls back only its own writes. But a savepoint costs a round
        trip, as dear as a one-INSERT handler, and handlers seldom fail: a
        batch of rows that never failed runs with one savepoint for many
        handlers (moved on every CHECKPOINT_EVERY seconds). When a handler
        fails there, the batch rolls back to that savepoint and runs on,
        carefully, from it: the handlers since then run again, the failed row
        does not, its failure is recorded. Rows that failed before run
        carefully from the start."""
        savepoints = self.store.handler_savepoints(conn)
        pid = self.store.backend_pid(conn)
        careful = any(row.attempts for row in rows)
        processed: list[str] = []
        failed: list[tuple[InboxRow, Failure, float]] = []
        failed_keys: set[str] = set()
        known: dict[int, Failure] = {}  # failures rolled back, by position in rows
        if not careful:
            savepoints.batch.set()
            checkpoint: tuple[int, int, int, set[str]] = (0, 0, 0, set())
            since = time.monotonic()
        at = 0
        while at < len(rows):
            position, row = at, rows[at]
            at += 1
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
                now = time.monotonic()
                if careful:
                    savepoints.handler.set()
                elif now - since > CHECKPOINT_EVERY:
                    savepoints.batch.set()
                    checkpoint = (position, len(processed), len(failed), set(failed_keys))
                    since = now
                self.in_hand = (row, now, pid)
                try:
                    failure = self._handle(conn, async_conn, row, *handler)
                finally:
                    self.in_hand = None
                if failure is None and savepoints.aborted():
                    failure = Failure(ABORTED_BY_HANDLER)
                if failure is not None:
                    if not careful:  # back to the checkpoint, and on from there carefully
                        known[position] = failure
                        savepoints.batch.undo()
                        careful = True
                        at, kept_processed, kept_failed, failed_keys = checkpoint
                        self.metrics.reruns.inc(len(processed) - kept_processed)
                        del processed[kept_processed:], failed[kept_failed:]
                        continue
                    savepoints.handler.undo()
            if failure is None:
                processed.append(row.message_id)
                continue
            failed.append((row, failure, self.backoff.delay(row.attempts + 1)))
            if row.key is not None:
                failed_keys.add(row.key)
        savepoints.before_marks()
        return processed, failed

    def _handle(
        self, conn: Any, async_conn: Any, row: InboxRow, handler: Handler, asynchronous: bool
    ) -> Failure | None:
        try:
            headers = storable.loads(row.headers) if row.headers else {}
            payload = storable.loads(row.payload) if row.payload is not None else None
        except ValueError as exc:  # stored by hand, or by an older relay
            return Failure(
                f"the row cannot be given to a handler: its JSON is {exc}", permanent=True
            )
        # A body that was not JSON (dead on arrival, then retried): its raw bytes.
        body = (
            self.store.inbox_body(conn, self.settings.consumer_name, row.message_id)
            if row.payload is None
            else None
        )
        message = Message(
            id=row.message_id,
            type=row.type,
            topic=row.topic,
            key=row.key,
            payload=payload,
            headers=headers if isinstance(headers, dict) else {},
            attempts=row.attempts,
            consumer=self.settings.consumer_name,
            body=body,
        )
        started = time.perf_counter()
        try:
            if tracing.enabled:
                with tracing.process(
                    self.messaging_system,
                    message.consumer,
                    row.message_id,
                    row.topic,
                    row.type,
                    message.headers,
                    row.attempts,
                ) as span:
                    failure = self._call(handler, message, conn, async_conn, asynchronous)
                    if failure is not None:
                        tracing.failed(span, failure.error)
            else:
                failure = self._call(handler, message, conn, async_conn, asynchronous)
        finally:
            self.metrics.handler_seconds.observe(time.perf_counter() - started)
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
        self, handler: Handler, message: Message, conn: Any, async_conn: Any, asynchronous: bool
    ) -> Failure | None:
        """Run one handler; its exception as a Failure (a lost database raises)."""
        try:
            call_from_sync(
                handler, message, conn, async_conn, self.settings.handler_timeout, asynchronous
            )
        except Unavailable:
            raise
        except Exception as exc:
            if connection_invalidated(exc):
                raise  # the database went away: not the handler's failure
            if isinstance(exc, TimeoutError) and not str(exc):  # asyncio.timeout's
                return Failure(
                    f"handler did not finish within --handler-timeout "
                    f"{self.settings.handler_timeout:g}s and was cancelled\n{_error_text(exc)}"
                )
            return Failure(_error_text(exc))
        return None

    async def run(self) -> None:
        failures = 0
        while not self.stopping.is_set():
            self.wakeup.clear()
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
                caught_up = done + blocked < self.settings.batch_size
                self.pace.dispatched(self.worker, done, caught_up, stored_before_claim)
            if done:
                continue
            if blocked:
                await asyncio.sleep(BLOCKED_RETRY)
                continue
            await sleep_unless(self.wakeup, self.settings.poll_interval)


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

    def _call(self, method: str) -> None:
        with self._lock:
            if self._loop is not None and self.dispatcher is not None:
                self._loop.call_soon_threadsafe(getattr(self.dispatcher, method))

    def wake(self) -> None:
        self._call("wake")

    def stop(self) -> None:
        with self._lock:
            self._stop_requested = True
        self._call("stop")

    def _main(self) -> None:
        async def body() -> None:
            store, dispatcher = self._make()
            with self._lock:
                self._loop, self.dispatcher = asyncio.get_running_loop(), dispatcher
                if self._stop_requested:
                    dispatcher.stop()
            try:
                await dispatcher.run()
            finally:
                await store.close()

        asyncio.run(body())

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
            if dispatcher is None or in_hand is None:
                continue
            row, started, pid = in_hand
            settings = dispatcher.settings
            ran = time.monotonic() - started
            if ran < settings.handler_timeout * HUNG_AFTER or dispatcher.in_hand is not in_hand:
                continue
            error = (
                f"handler hung: still running after {ran:.1f}s (--handler-timeout "
                f"{settings.handler_timeout:g}s) and could not be interrupted; its "
                "transaction was ended and the inbox daemon exited so that its "
                "supervisor restarts it"
            )
            log.error(
                "%s (message %s, type %r)",
                error,
                row.message_id,
                row.type,
                extra={
                    "action": "handler_hung",
                    "message_id": row.message_id,
                    "type": row.type,
                    "attempts": row.attempts + 1,
                },
            )
            store = Store(settings.database_url, pool_size=1, schema=settings.schema)
            try:
                status = await store.fail_hung_handler(
                    pid,
                    settings.consumer_name,
                    row,
                    error,
                    dispatcher.backoff.delay(row.attempts + 1),
                    settings.max_attempts,
                )
            except Exception as exc:  # the restart is what matters; the count is best effort
                log.error("could not record the hung handler's attempt: %r", exc)
                status = None
            finally:
                await store.close()
            if status is not None:
                dispatcher.metrics.failed.inc()
                if status == "dead":
                    dispatcher.metrics.dead.inc()
            raise HandlerHung(error)
