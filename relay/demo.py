"""`relay demo`: the whole system in one process, against the configured servers.

A producer inserts `DemoEvent` rows into the outbox at --rate per second
(`relay.enqueue_async`, each with its own W3C traceparent and one of 16
ordering keys). The outbox relay publishes them to --exchange with routing
key `demo.event`; the inbox consumes --queue, bound to `demo.#`, and the
handler below writes each event into `relay_demo_events` inside the
transaction that marks its inbox row processed. Once a second a line shows
the rates and the backlogs, read from the database.

`relay inbox --handlers relay.demo:registry` runs the same handler in a
daemon of its own; `relay demo --producer-only` then only produces and
reports (docker-compose.yml does this).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

import relay
from relay.backoff import Backoff, sleep_unless
from relay.brokers import kind_of, prepare_demo
from relay.config import (
    PUBLISH_ONLY,
    BrokerURL,
    InboxSettings,
    OutboxSettings,
    check_schema_name,
    normalize_database_url,
)
from relay.db import Connection, Store, create_database_if_missing, named
from relay.errors import ConfigError, Unavailable
from relay.handlers import HandlerRegistry, Message
from relay.lifecycle import Daemon, Service, Started, run_together
from relay.wiring import inbox_service, outbox_service

log = logging.getLogger(__name__)

TOPIC = "demo.event"
BIND = "demo.#"
TYPE = "DemoEvent"
KEYS = 16
# Rows per producer transaction, at most; and how often the producer wakes.
MAX_BATCH = 1000
TICK = 0.05
SHUTDOWN_TIMEOUT = 10.0
INBOX_BATCH = 100

# The demo's own table and queries (an app's, not relay's).
_DEMO_LOCK = 0x72656C64  # serializes concurrent `relay demo` start-ups
_DDL = (named("demo_create_table"), named("demo_create_index"))
_INSERT_EVENT = named("demo_insert_event")
_NOW = named("demo_now")
_STATS = named("demo_stats")

registry = HandlerRegistry()


@registry.handler(TYPE)
def on_demo_event(message: Message, conn: Connection) -> None:
    """Record the event, in the transaction that marks its inbox row processed."""
    payload = message.payload if isinstance(message.payload, dict) else {}
    conn.execute(
        _INSERT_EVENT,
        {
            "consumer": message.consumer,
            "message_id": message.id,
            "key": message.key,
            "n": payload.get("n"),
            "traceparent": message.headers.get("traceparent"),
        },
    )
    log.debug("demo event handled", extra={"action": "demo_handled"})


@dataclass(frozen=True)
class DemoSettings:
    """`relay demo`."""

    database_url: str
    broker: BrokerURL | None = None
    rate: float = 200.0
    duration: float = 0.0  # seconds; 0: until stopped
    exchange: str = "relay"
    queue: str = "relay-demo"
    http_port: int = 0
    producer_only: bool = False
    schema: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "database_url", normalize_database_url(self.database_url))
        check_schema_name(self.schema)
        if self.rate <= 0:
            raise ConfigError(f"invalid --rate {self.rate}: must be greater than zero")
        if self.duration < 0:
            raise ConfigError(f"invalid --duration {self.duration}: must be 0 or more")
        if self.broker is None and not self.producer_only:
            raise ConfigError("no broker URL: set --broker-url or RELAY_BROKER_URL")
        if self.broker is not None and not self.producer_only and self.broker.kind in PUBLISH_ONLY:
            raise ConfigError(
                f"relay demo runs the inbox on its broker URL too, and "
                f"{PUBLISH_ONLY[self.broker.kind]}; run the demo on sqs:// instead"
            )

    @property
    def topic(self) -> str:
        # A broker without an exchange (SQS): the topic is the queue the inbox reads.
        return self.queue if self._topic_is_queue else TOPIC

    @property
    def _topic_is_queue(self) -> bool:
        return self.broker is not None and kind_of(self.broker).topic_is_queue

    def outbox(self) -> OutboxSettings:
        return OutboxSettings(
            database_url=self.database_url,
            broker=self.broker,
            exchange=self.exchange,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            schema=self.schema,
        )

    def inbox(self) -> InboxSettings:
        binds = (BIND,) if self.broker is not None and not self._topic_is_queue else ()
        return InboxSettings(
            database_url=self.database_url,
            broker=self.broker,
            exchange=self.exchange,
            queue=self.queue,
            binds=binds,
            shutdown_timeout=SHUTDOWN_TIMEOUT,
            # Smaller batches than the default commit more often: smoother rates.
            batch_size=INBOX_BATCH,
            schema=self.schema,
        )


@dataclass
class _Counts:
    produced: int = 0


def _traceparent() -> str:
    return f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"


async def produce(
    store: Store, rate: float, topic: str, stop: asyncio.Event, counts: _Counts
) -> None:
    """Enqueue DemoEvent rows at `rate` per second until `stop`."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    reconnect = Backoff(0.5, 10.0)
    failures = 0
    while not stop.is_set():
        now = loop.time()
        behind = (now - start) * rate - counts.produced
        if behind > rate:  # over a second behind (the database was away): no burst
            start = now - (counts.produced + rate) / rate
            behind = rate
        due = min(int(behind), MAX_BATCH)
        if due >= 1:
            try:
                async with store.transaction() as conn:
                    for n in range(counts.produced, counts.produced + due):
                        await relay.enqueue_async(
                            conn,
                            topic,
                            {"n": n, "produced_at": time.time()},
                            key=f"customer-{n % KEYS}",
                            type=TYPE,
                            headers={"traceparent": _traceparent()},
                        )
                counts.produced += due
                failures = 0
            except Unavailable as exc:
                failures += 1
                delay = reconnect.delay(failures)
                log.warning(
                    "producer: %s; retrying in %.1fs",
                    exc,
                    delay,
                    extra={"action": "reconnect_wait"},
                )
                await sleep_unless(stop, delay)
                continue
        await sleep_unless(stop, max(TICK, 1 / rate) if due < 1 else TICK)


async def _totals(store: Store, since: Any, consumer: str | None) -> tuple[int, int, int, int]:
    async with store.transaction() as conn:
        published, handled, outbox_backlog, inbox_backlog = (
            await conn.execute(_STATS, {"since": since, "consumer": consumer})
        ).one()
    return int(published), int(handled), int(outbox_backlog), int(inbox_backlog)


async def report(
    store: Store,
    since: Any,
    consumer: str | None,
    counts: _Counts,
    stop: asyncio.Event,
    out: TextIO,
) -> None:
    """Print one line a second: rates over the last second and the backlogs."""
    tty = out.isatty()
    began = last_time = time.monotonic()
    last: tuple[int, int, int] | None = None
    while not stop.is_set():
        await sleep_unless(stop, 1.0)
        if stop.is_set():
            break
        now = time.monotonic()
        try:
            published, handled, outbox_backlog, inbox_backlog = await _totals(
                store, since, consumer
            )
        except Unavailable as exc:
            line = f"{now - began:5.0f}s  database unavailable: {exc}"
        else:
            current = (counts.produced, published, handled)
            previous = last or (0, 0, 0)
            span = max(now - last_time, 1e-3)
            produced_rate, published_rate, handled_rate = (
                (c - p) / span for c, p in zip(current, previous, strict=True)
            )
            line = (
                f"{now - began:5.0f}s  produced {produced_rate:6.0f}/s  "
                f"published {published_rate:6.0f}/s  handled {handled_rate:6.0f}/s  "
                f"backlog: outbox {outbox_backlog}, inbox {inbox_backlog}"
            )
            last, last_time = current, now
        if tty:  # redraw in place
            out.write("\r\x1b[K" + line)
        else:
            out.write(line + "\n")
        out.flush()
    if tty:
        out.write("\n")
        out.flush()


async def prepare(database_url: str, schema: str | None = None) -> list[str]:
    """Apply relay's schema and create the demo's table (in `schema`);
    returns the files applied."""
    from relay.api import apply_schema

    applied = await apply_schema(database_url, schema)
    store = Store(database_url, pool_size=1, schema=schema)
    try:
        async with store.transaction() as conn:
            await conn.execute(named("demo_lock"), {"id": _DEMO_LOCK})
            for statement in _DDL:
                await conn.execute(statement)
    finally:
        await store.close()
    return applied


async def run_demo(settings: DemoSettings, out: TextIO = sys.stdout) -> int:
    """`relay demo`: schema, producer, both daemons and the handler; returns the exit code."""
    created = await create_database_if_missing(settings.database_url)
    if created:
        out.write(f"relay demo: created database {created!r}\n")
    applied = await prepare(settings.database_url, settings.schema)
    if settings.broker is not None and not settings.producer_only:
        try:
            await prepare_demo(settings.broker, settings.queue, settings.topic)
        except Unavailable as exc:  # the daemons wait for the broker, and say so
            out.write(f"relay demo: {exc}\n")
    out.write(
        f"relay demo: schema {'applied: ' + ', '.join(applied) if applied else 'up to date'}"
        f"; producing {settings.rate:g} messages/s to topic {settings.topic!r}"
        + (
            ""
            if settings.producer_only
            else f", exchange {settings.exchange!r}, queue {settings.queue!r}"
        )
        + (f" for {settings.duration:g}s" if settings.duration else "; Ctrl-C to stop")
        + "\n"
    )
    out.flush()

    store = Store(settings.database_url, pool_size=2, schema=settings.schema)
    stop = asyncio.Event()
    counts = _Counts()
    consumer = None if settings.producer_only else settings.inbox().consumer_name

    async def main(started: Started) -> None:
        started()
        # Produce once everything is connected and the queue is bound, so
        # that the first messages are not returned as unroutable.
        waiters = {
            asyncio.ensure_future(daemon.started_event.wait()),
            asyncio.ensure_future(stop.wait()),
        }
        _, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for waiter in pending:
            waiter.cancel()
        if stop.is_set():
            return
        async with store.transaction() as conn:
            since = await conn.scalar(_NOW)

        async def timer() -> None:
            if settings.duration:
                await sleep_unless(stop, settings.duration)
                if not stop.is_set():
                    daemon.request_stop(f"--duration {settings.duration:g}s is over")

        await run_together(
            produce(store, settings.rate, settings.topic, stop, counts),
            report(store, since, consumer, counts, stop, out),
            timer(),
        )

    demo = Service(name="demo", main=main, stop=stop.set, on_stop=[store.close])
    services = [demo]
    if not settings.producer_only:
        services = [
            outbox_service(settings.outbox()),
            inbox_service(settings.inbox(), registry),
            demo,
        ]
    daemon = Daemon(
        name="demo",
        services=services,
        shutdown_timeout=SHUTDOWN_TIMEOUT,
        http_port=settings.http_port,
        own_process=True,
    )
    code = await daemon.run()
    out.write(f"relay demo: produced {counts.produced} messages; exit status {code}\n")
    out.flush()
    return code
