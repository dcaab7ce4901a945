"""Wiring: each daemon built from its parts, and run under one lifecycle.

The composition root: the daemons' settings (relay.config) are read here,
and the parts are given finished collaborators and the few values they
use. The loops (relay.outbox, relay.inbox, relay.receiving) know nothing of
one another, of the lifecycle, of the settings or of the broker in use;
here each daemon gets its store, broker adapter (behind the claim check,
relay.claimcheck, when --claim-check is given), listener, scheduled jobs,
pacing, metrics and probes, as a relay.lifecycle.Service. `relay outbox`
and `relay inbox` run one each (serve_outbox, serve_inbox); `relay demo`
runs both in one process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from relay import cloudevents, tracing
from relay.backoff import Backoff, reconnect_backoff, until_available
from relay.brokers import Consumer, Publisher, kind_of, make_consumer, make_publisher
from relay.budget import FETCHED_SHARE, RECEIVED_SHARE, Budget
from relay.capture import WalCapture
from relay.claimcheck.inbound import Inbound
from relay.config import DaemonSettings, InboxSettings, OutboxSettings
from relay.db import (
    NOTIFY_INBOX,
    NOTIFY_OUTBOX,
    Listener,
    SharedListeners,
    SlotReader,
    Store,
    slot_name,
)
from relay.db.connect import check_tls, libpq_url
from relay.db.writer import InboxWriter
from relay.handlers import HandlerRegistry, is_async
from relay.inbox import DISPATCHERS, HUNG_AFTER, Dispatcher, DispatcherThread, Handing
from relay.lifecycle import STALL_AFTER, Daemon, Service, Started, run_together
from relay.logs import with_log_context
from relay.maintenance import run_scheduler
from relay.metrics import InboxMetrics, OutboxMetrics
from relay.outbox import WORKERS, OutboxRelay
from relay.pacing import PACE_BATCHES, Pace
from relay.receiver_process import LocalReceiver, ReceiverParts, ReceiverProcess

# The loops' own loggers: a daemon's lines keep the name of its loop.
outbox_log = logging.getLogger("relay.outbox")
inbox_log = logging.getLogger("relay.inbox")


async def check_database_tls(settings: DaemonSettings) -> None:
    """ConfigError (exit 2) when the database's TLS cannot work: checked once
    at start, for --database-url and --listen-url."""
    await check_tls(settings.database_url)
    if settings.listen_url:
        await check_tls(settings.listen_url, "--listen-url")


def backoff(settings: DaemonSettings) -> Backoff:
    """The failed attempts' backoff (--backoff-min, --backoff-max)."""
    return Backoff(settings.backoff_min, settings.backoff_max)


def messaging_system(settings: DaemonSettings) -> str:
    """OpenTelemetry's messaging.system for the settings' broker ("" without one)."""
    return kind_of(settings.broker).system if settings.broker is not None else ""


def outbox_publisher(
    settings: OutboxSettings, on_claim_check: Callable[[int, int], None] | None = None
) -> Publisher:
    """The publisher for the settings' broker URL, behind the claim check
    (relay.claimcheck.publisher) with --claim-check and CloudEvents'
    envelope (relay.cloudevents) with --cloudevents-source; `on_claim_check` hears
    of each batch's claim checked messages and bytes."""
    assert settings.broker is not None
    made = make_publisher(
        settings.broker,
        exchange=settings.exchange,
        on_unroutable=settings.on_unroutable,
        workers=WORKERS,
        stream_maxlen=settings.stream_maxlen,
    )
    if settings.claim_check is not None:
        from relay.claimcheck.publisher import ClaimCheckPublisher  # boto3, only when asked for

        made = ClaimCheckPublisher(
            made, settings.claim_check, settings.claim_check_over, on_claim_check
        )
    # CloudEvents outside the claim check: a large structured event (SQS) is
    # offloaded whole, as the body it would have been.
    return cloudevents.wrap(made, settings.cloudevents_source, settings.broker.kind)


def outbox_relay(
    settings: OutboxSettings,
    store: Store,
    publisher: Publisher,
    metrics: OutboxMetrics | None = None,
    *,
    poll_interval: float | None = None,
) -> OutboxRelay:
    """The outbox loop on `store` and `publisher`, with the settings' values
    (`poll_interval` in place of --poll-interval's, if given) and its byte
    budget (--batch-bytes, shared by its workers: relay.budget)."""
    topic_is_queue = settings.broker is None or kind_of(settings.broker).topic_is_queue
    metrics = metrics or OutboxMetrics()
    return OutboxRelay(
        store,
        publisher,
        metrics,
        budget=Budget(settings.batch_bytes, WORKERS, metrics.claimed_bytes.set),
        batch_size=settings.batch_size,
        poll_interval=settings.poll_interval if poll_interval is None else poll_interval,
        max_attempts=settings.max_attempts,
        on_dead=settings.on_dead,
        backoff=backoff(settings),
        exchange=settings.exchange,
        messaging_system=messaging_system(settings),
        destination=None if topic_is_queue else settings.exchange,
    )


def outbox_service(
    settings: OutboxSettings,
    *,
    once: bool = False,
    metrics: OutboxMetrics | None = None,
    pool_size: int = 2,
    stagger: bool = False,
    listeners: SharedListeners | None = None,
) -> Service:
    """The outbox relay's parts for a lifecycle Daemon: the main loop, the
    listener, the scheduled jobs, probes and metrics (not running yet).
    `metrics`: one source's view of an outbox of several (relay.sources),
    which keeps fewer idle connections for its jobs (`pool_size`), spreads
    their runs (`stagger`: relay.maintenance.run_scheduler), and listens
    and is polled through its database's shared listener and poll
    (`listeners`: one LISTEN connection and one poll query a database, not
    one a source)."""
    broker = settings.broker
    assert broker is not None
    tracing.setup("relay-outbox")
    store = Store(settings.database_url, pool_size=pool_size, schema=settings.schema)
    if metrics is None:
        metrics = OutboxMetrics()
    publisher = outbox_publisher(settings, metrics.claim_check_sent)
    shared_poll = listeners is not None and not once
    # Each idle worker's own poll comes seldom under the shared poll, which
    # wakes the relay as a notification does when its database has due rows
    # for it, and one idle worker (a scout) claims the due rows of every key:
    # one claim where the four workers made four, the same rows found as soon.
    relay = outbox_relay(
        settings,
        store,
        publisher,
        metrics,
        poll_interval=max(settings.poll_interval, WORKER_POLL) if shared_poll else None,
    )
    metrics.broker_blocked.set_function(lambda: 0 if publisher.blocked is None else 1)
    probe_lock = asyncio.Lock()
    # --capture wal (relay.capture): a commit's notification wakes the
    # slot's reader instead of the claim. Not with --once, which claims.
    wal = settings.capture == "wal" and not once and listeners is None
    captures: list[WalCapture] = []
    if wal:
        metrics.slot_gauges()

    def wake() -> None:
        if captures:
            captures[0].wake()
        else:
            relay.wake()

    async def main(started: Started) -> None:
        await relay.wait_ready()
        if relay.stopping.is_set():
            return
        if wal:
            reader = SlotReader(
                # The reader's lock is a session's: a direct connection
                # (--listen-url's) where the --database-url is a pooler's.
                libpq_url(settings.listen_url) if settings.listen_url else store.conninfo,
                store.session_options,
                slot_name(settings.slot, settings.schema),
                await store.locate(),
            )
            capture = WalCapture(
                relay,
                reader,
                metrics,
                poll_interval=settings.poll_interval,
                batch_size=settings.batch_size,
            )
            try:
                # A server or role that cannot have a slot: exit 2 now.
                await until_available(reader.check, relay.stopping, reconnect_backoff(), outbox_log)
            except BaseException:
                await reader.close()
                raise
            captures.append(capture)
        started()
        outbox_log.info(
            "outbox relay started%s",
            " (--once)" if once else " (--capture wal)" if wal else "",
            extra={"action": "started"},
        )
        if not captures:
            await relay.run(once=once)
            return
        capture = captures[0]
        reading = asyncio.create_task(capture.run())
        publishing = asyncio.create_task(relay.run())
        try:
            await asyncio.wait({reading, publishing}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # Stopping (or one of them failed): a reader ends its round, a
            # stand-by its wait; the first error is the daemon's.
            relay.stop()
            capture.wake()
            if not capture.reading:
                reading.cancel()
            await asyncio.wait({reading, publishing})
        for task in (reading, publishing):
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]

    async def broker_answers() -> bool:
        # An idle relay reconnects only when it has rows to publish, so after
        # a broker outage its own connection stays down until the next row:
        # ask the broker with a connection of the probe's own.
        async with probe_lock:
            if publisher.connected:
                return True
            probe = outbox_publisher(settings)
            try:
                await probe.connect()  # Unavailable: /readyz says why
                return True
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
    if not once and listeners is not None:
        shared = listeners
        background["listener"] = lambda stop: shared.serve(
            store, NOTIFY_OUTBOX, relay.wake, settings.listen_url
        )
    elif not once:
        listener = Listener.for_store(store, NOTIFY_OUTBOX, wake, settings.listen_url)
        background["listener"] = lambda stop: listener.run()
    if shared_poll:
        assert listeners is not None
        polls = listeners
        background["poller"] = lambda stop: polls.poll(
            store, relay.wake, lambda: relay.swept_at, settings.poll_interval
        )
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


# An idle worker's own poll under the shared poll (outbox_service).
WORKER_POLL = 60.0


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


def inbox_dispatcher(
    settings: InboxSettings,
    store: Store,
    registry: HandlerRegistry,
    metrics: InboxMetrics,
    pace: Pace | None = None,
    worker: int = 0,
    workers: int = 1,
    budget: Budget | None = None,
) -> Dispatcher:
    """A dispatcher of `worker`'s share of the keys, with the settings'
    values; its claims take rows up to what `budget` grants (the one the
    daemon's dispatchers share), else up to --batch-bytes of its own."""
    return Dispatcher(
        store,
        registry,
        metrics,
        pace,
        worker,
        workers,
        budget=budget or Budget(settings.batch_bytes, 1, metrics.held_bytes.set),
        consumer_name=settings.consumer_name,
        batch_size=settings.batch_size,
        on_dead=settings.on_dead,
        max_attempts=settings.max_attempts,
        backoff=backoff(settings),
        handler_timeout=settings.handler_timeout,
        poll_interval=settings.poll_interval,
        messaging_system=messaging_system(settings),
    )


def receiver_parts(settings: InboxSettings, consumer: Consumer | None = None) -> ReceiverParts:
    """What the receiver is built from where it runs: the consumer for the
    settings' broker URL (or `consumer`, which cannot go to another process),
    the inbox writer, the claim check's stage (relay.claimcheck.inbound:
    pointers fetched from S3 with --claim-check, else kept and stored dead,
    saying why), whichever the broker. Picklable without `consumer`."""
    if consumer is None:
        assert settings.broker is not None
        consume: Callable[[], Consumer] = functools.partial(
            make_consumer,
            settings.broker,
            queue=settings.queue,
            exchange=settings.exchange,
            binds=settings.binds,
            prefetch=settings.prefetch,
            queue_type=settings.queue_type,
            queue_args=settings.queue_args,
            consumer_name=settings.consumer_name,
            # The bodies received and not yet acknowledged (relay.budget).
            max_bytes=settings.batch_bytes // RECEIVED_SHARE,
            claim_idle=settings.claim_idle,
        )
    else:
        given = consumer

        def consume() -> Consumer:
            return given

    return ReceiverParts(
        consumer=consume,
        writer=functools.partial(InboxWriter, settings.database_url, settings.schema),
        stage=functools.partial(
            Inbound, settings.claim_check, max_bytes=settings.batch_bytes // FETCHED_SHARE
        ),
        # CloudEvents are recognised from any producer, without a flag.
        envelope=functools.partial(
            cloudevents.received,
            binding=cloudevents.binding(settings.broker.kind if settings.broker else None),
        ),
        consumer_name=settings.consumer_name,
        # Handled as received: a batch for every dispatcher, each one's part
        # of it about --batch-size rows, its transaction's size (docs/inbox.md,
        # "Batches"). Stored: a batch of --batch-size, as the dispatchers
        # claim, so that the pace's bound stays one batch wide.
        batch_size=settings.batch_size * (DISPATCHERS if settings.dispatch == "received" else 1),
    )


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
        if new and not direct:
            pace.stored(new)
            wake_dispatcher()

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
                inbox_dispatcher(
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
    direct = settings.dispatch == "received"
    parts = receiver_parts(settings, consumer)
    # --dispatch received: the receiver hands its batches to the
    # dispatchers, which store and handle them (docs/inbox.md).
    handing = Handing(dispatchers, store.reserve_seqs) if direct else None
    receiver: ReceiverProcess | LocalReceiver
    if receiver_process:
        if handing is not None:
            parts = dataclasses.replace(parts, writer=None)
        receiver = ReceiverProcess(parts, pace, stored, handing)
    else:
        receiver = LocalReceiver(parts, pace, stored, handing)
    metrics.watch(receiver)  # the consumer's readings (relay_inbox_kafka_lag)
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
