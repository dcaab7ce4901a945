"""Wiring: each daemon built from its parts, and run under one lifecycle.

The loops (relay.outbox, relay.inbox, relay.receiving) know nothing of one
another, of the lifecycle or of the broker in use; here each daemon gets
its store, broker adapter, listener, scheduled jobs, pacing, metrics and
probes, as a relay.lifecycle.Service. `relay outbox` and `relay inbox` run
one each (serve_outbox, serve_inbox); `relay demo` runs both in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from relay import tracing
from relay.backoff import reconnect_backoff, until_available
from relay.brokers import Consumer, make_publisher
from relay.budget import Budget
from relay.config import DaemonSettings, InboxSettings, OutboxSettings
from relay.db import NOTIFY_INBOX, NOTIFY_OUTBOX, Listener, Store
from relay.db.connect import check_tls
from relay.errors import Unavailable
from relay.handlers import HandlerRegistry, is_async
from relay.inbox import DISPATCHERS, HUNG_AFTER, Dispatcher, DispatcherThread
from relay.lifecycle import STALL_AFTER, Daemon, Service, Started, run_together
from relay.logs import with_log_context
from relay.maintenance import run_scheduler
from relay.metrics import InboxMetrics, OutboxMetrics
from relay.outbox import WORKERS, OutboxRelay
from relay.pacing import PACE_BATCHES, Pace
from relay.receiver_process import LocalReceiver, ReceiverProcess

# The loops' own loggers: a daemon's lines keep the name of its loop.
outbox_log = logging.getLogger("relay.outbox")
inbox_log = logging.getLogger("relay.inbox")


async def check_database_tls(settings: DaemonSettings) -> None:
    """ConfigError (exit 2) when the database's TLS cannot work: checked once
    at start, for --database-url and --listen-url."""
    await check_tls(settings.database_url)
    if settings.listen_url:
        await check_tls(settings.listen_url, "--listen-url")


def outbox_service(
    settings: OutboxSettings,
    *,
    once: bool = False,
    metrics: OutboxMetrics | None = None,
    pool_size: int = 2,
    stagger: bool = False,
    one_poll: bool = False,
) -> Service:
    """The outbox relay's parts for a lifecycle Daemon: the main loop, the
    listener, the scheduled jobs, probes and metrics (not running yet).
    `metrics`: one source's view of an outbox of several (relay.sources),
    which keeps fewer idle connections for its jobs (`pool_size`), spreads
    their runs (`stagger`: relay.maintenance.run_scheduler) and polls once
    per --poll-interval rather than once per worker (`one_poll`)."""
    broker = settings.broker
    assert broker is not None
    tracing.setup("relay-outbox")
    store = Store(settings.database_url, pool_size=pool_size, schema=settings.schema)
    if metrics is None:
        metrics = OutboxMetrics()
    publisher = make_publisher(
        broker,
        exchange=settings.exchange,
        on_unroutable=settings.on_unroutable,
        workers=WORKERS,
        claim_check=settings.claim_check,
        claim_check_over=settings.claim_check_over,
        on_claim_check=metrics.claim_check_sent,
    )
    loop_settings = settings
    if one_poll and not once:
        # Each idle worker's own poll comes seldom; a poller wakes the relay
        # every --poll-interval as a notification does, and one idle worker
        # (a scout) claims the due rows of every key: one claim where the
        # four workers made four, the same rows found as soon.
        loop_settings = dataclasses.replace(
            settings, poll_interval=max(settings.poll_interval, WORKER_POLL)
        )
    relay = OutboxRelay(loop_settings, store, publisher, metrics)
    probe_lock = asyncio.Lock()

    async def main(started: Started) -> None:
        await relay.wait_ready()
        if relay.stopping.is_set():
            return
        started()
        outbox_log.info(
            "outbox relay started%s", " (--once)" if once else "", extra={"action": "started"}
        )
        await relay.run(once=once)

    async def broker_answers() -> bool:
        # An idle relay reconnects only when it has rows to publish, so after
        # a broker outage its own connection stays down until the next row:
        # ask the broker with a connection of the probe's own.
        async with probe_lock:
            if publisher.connected:
                return True
            probe = make_publisher(
                broker,
                exchange=settings.exchange,
                workers=WORKERS,
                claim_check=settings.claim_check,
            )
            try:
                await probe.connect()
                return True
            except Unavailable:
                return False
            finally:
                await probe.close()

    async def ready() -> bool:
        await store.ping()
        return publisher.connected or await broker_answers()

    # --once drains what is due and exits: no listener and no retention,
    # but the gauges and the churn vacuum, which a catch-up needs most.
    background = {
        "scheduler": lambda stop: run_scheduler(
            store,
            "outbox",
            None if once else settings.retention,
            relay.metrics,
            stop,
            stagger=stagger,
        ),
    }
    if not once:
        listener = Listener.for_store(store, NOTIFY_OUTBOX, relay.wake, settings.listen_url)
        background["listener"] = lambda stop: listener.run()
    if loop_settings is not settings:
        background["poller"] = lambda stop: _poll(relay, settings.poll_interval)
    return Service(
        name="outbox",
        main=main,
        stop=relay.stop,
        background=background,
        ready=ready,
        unready=lambda: (
            f"the broker blocks publishing ({publisher.blocked}): a RabbitMQ resource alarm"
            if publisher.blocked is not None
            else None
        ),
        metrics=relay.metrics.render,
        # Waiting out a broker's resource alarm is not a stall.
        progress=lambda: time.monotonic() if publisher.blocked else relay.last_progress,
        stall_after=STALL_AFTER + settings.poll_interval,
        on_stop=[publisher.close, relay.close, store.close, tracing.flush],
    )


# An idle worker's own poll under `one_poll` (outbox_service).
WORKER_POLL = 60.0


async def _poll(relay: OutboxRelay, interval: float) -> None:
    """Wake the relay every `interval` seconds, as a notification would."""
    while True:
        await asyncio.sleep(interval)
        relay.wake()


async def serve_outbox(settings: OutboxSettings, *, once: bool = False) -> int:
    """`relay outbox`: run the relay with its listener, jobs and probes; returns the exit code."""
    await check_database_tls(settings)
    daemon = Daemon(
        name="outbox",
        services=[outbox_service(settings, once=once)],
        shutdown_timeout=settings.shutdown_timeout,
        http_port=settings.http_port,
        own_process=True,
    )
    return await daemon.run()


def inbox_service(
    settings: InboxSettings,
    registry: HandlerRegistry,
    *,
    receiver_process: bool = False,
    consumer: Consumer | None = None,
) -> Service:
    """The inbox's parts for a lifecycle Daemon: receiver and dispatchers, the
    listener, the scheduled jobs, probes and metrics (not running yet).

    With `receiver_process` the receiver runs in a child process of its own
    (relay.receiver_process.ReceiverProcess); else on the daemon's event loop,
    receiving from `consumer` if one is given (a consumer built here, such as
    the tests' memory broker's, cannot go to another process), else from the
    one for the settings' broker URL."""
    assert consumer is None or not receiver_process, "a consumer cannot go to another process"
    assert consumer is not None or settings.broker is not None
    tracing.setup("relay-inbox")
    types = registry.types
    # Log lines a handler emits carry the message's id, type and traceparent.
    registry = with_log_context(registry)
    metrics = InboxMetrics()
    store = Store(settings.database_url, pool_size=2, schema=settings.schema)
    pace = Pace(PACE_BATCHES * DISPATCHERS * settings.batch_size, DISPATCHERS)

    def wake_dispatcher() -> None:
        # Once a dispatcher has stopped, its event loop is closed and there
        # is nothing to wake; a batch stored while stopping still is.
        for dispatcher in dispatchers:
            with contextlib.suppress(RuntimeError):
                dispatcher.wake()

    def stored(received: int, new: int, dead: int, fetched: int, fetched_bytes: int) -> None:
        """The receiver's report of one batch, stored and acknowledged."""
        metrics.received.inc(received)
        metrics.duplicates.inc(received - new)
        metrics.dead.inc(dead)
        if fetched:
            metrics.claim_checked.inc(fetched)
            metrics.claim_check_bytes.inc(fetched_bytes)
        if new:
            pace.stored(new)
            wake_dispatcher()

    receiver = (
        ReceiverProcess(settings, pace, stored)
        if receiver_process
        else LocalReceiver(settings, pace, stored, consumer)
    )
    # The dispatcher's batches run on psycopg's blocking connection unless a
    # handler is async (see Dispatcher.dispatch_batch).
    all_sync = not any(is_async(fn) for fn in registry.functions())
    # The dispatchers' claims share the daemon's byte budget (--batch-bytes).
    budget = Budget(settings.batch_bytes, DISPATCHERS, metrics.held_bytes.set)

    def make_dispatcher(worker: int) -> DispatcherThread:
        return DispatcherThread(
            lambda: (
                dispatch_store := Store(
                    settings.database_url, pool_size=2, sync=all_sync, schema=settings.schema
                ),
                Dispatcher(
                    settings,
                    dispatch_store,
                    registry,
                    metrics,
                    pace=pace,
                    worker=worker,
                    workers=DISPATCHERS,
                    budget=budget,
                ),
            )
        )

    dispatchers = [make_dispatcher(worker) for worker in range(DISPATCHERS)]
    if not types:
        inbox_log.warning(
            "no handlers registered: every message will be stored as dead "
            "(give --handlers or install a package with relay.handlers entry points)"
        )

    async def main(started: Started) -> None:
        if not await until_available(
            store.check_schema, receiver.stopping, reconnect_backoff(), inbox_log
        ):
            return
        if not await receiver.start():
            return
        started()
        inbox_log.info(
            "inbox started: queue %r, consumer %r, handlers for %s",
            settings.queue,
            settings.consumer_name,
            ", ".join(types) or "no types",
            extra={"action": "started"},
        )
        pace.attach()  # before any dispatcher can report a batch
        await run_together(receiver.run(), *(dispatcher.run() for dispatcher in dispatchers))

    def stop() -> None:
        receiver.stop()
        for dispatcher in dispatchers:
            dispatcher.stop()

    async def ready() -> bool:
        await store.ping()
        return receiver.connected

    def progress() -> float:
        # A batch of slow handlers is progress too: each finished handler run
        # counts. A receiver process that stopped saying it is alive is not.
        batches = [d.dispatcher.last_progress for d in dispatchers if d.dispatcher is not None]
        handled = max([*batches, 0.0, metrics.handler_seconds.last_observed])
        return min(handled, receiver.last_alive)

    listener = Listener.for_store(store, NOTIFY_INBOX, wake_dispatcher, settings.listen_url)
    return Service(
        name="inbox",
        main=main,
        stop=stop,
        background={
            "listener": lambda stop: listener.run(),
            "scheduler": lambda stop: run_scheduler(
                store, "inbox", settings.retention, metrics, stop
            ),
        },
        ready=ready,
        metrics=metrics.render,
        progress=progress,
        # Above the dispatcher's own hung-handler detection (HUNG_AFTER).
        stall_after=max(STALL_AFTER, (HUNG_AFTER + 1) * settings.handler_timeout)
        + settings.poll_interval,
        on_stop=[receiver.close, store.close, tracing.flush],
    )


async def serve_inbox(settings: InboxSettings, registry: HandlerRegistry) -> int:
    """`relay inbox`: receiver process, dispatchers, listener, jobs and probes;
    returns the exit code."""
    await check_database_tls(settings)
    daemon = Daemon(
        name="inbox",
        services=[inbox_service(settings, registry, receiver_process=True)],
        shutdown_timeout=settings.shutdown_timeout,
        http_port=settings.http_port,
        own_process=True,
    )
    return await daemon.run()
