"""Prometheus metrics: one registry per daemon, so several can share a process.

Names (the Prometheus text format adds `_total` to counters):

| metric | kind | meaning |
|---|---|---|
| relay_outbox_published_total | counter | rows confirmed by the broker |
| relay_outbox_failed_total | counter | failed publish attempts (retried or dead) |
| relay_outbox_dead_total | counter | rows that became dead |
| relay_outbox_unroutable_total{topic} | counter | rows RabbitMQ confirmed but no queue was bound for (published under --on-unroutable publish) |
| relay_outbox_deleted_total | counter | published rows deleted by retention |
| relay_outbox_pending | gauge | pending rows in the table |
| relay_outbox_oldest_pending_seconds | gauge | age of the oldest pending row (0: none) |
| relay_outbox_publish_seconds | histogram | claim of a batch to the broker's last confirm |
| relay_outbox_broker_blocked | gauge | 1 while the broker blocks publishing (a RabbitMQ resource alarm), else 0 |
| relay_outbox_claimed_bytes | gauge | bytes of payloads in the rows the workers hold claimed, together (bounded by --batch-bytes) |
| relay_outbox_claim_checked_total | counter | rows published by claim check (body stored in S3, pointer published) |
| relay_outbox_claim_check_uploaded_bytes_total | counter | bytes of bodies stored in S3 by the claim check |
| relay_inbox_received_total | counter | messages received from the broker |
| relay_inbox_duplicates_total | counter | received messages already in the inbox |
| relay_inbox_processed_total | counter | rows handled successfully |
| relay_inbox_failed_total | counter | failed handler runs (retried or dead) |
| relay_inbox_dead_total | counter | rows that became dead (handler, unknown type, bad body) |
| relay_inbox_handler_reruns_total | counter | handler runs rolled back, to run again, when a later one of their batch failed |
| relay_inbox_deleted_total | counter | processed rows deleted by retention |
| relay_inbox_pending | gauge | pending rows in the table |
| relay_inbox_oldest_pending_seconds | gauge | age of the oldest pending row (0: none) |
| relay_inbox_handler_seconds | histogram | one handler run |
| relay_inbox_held_bytes | gauge | bytes of payloads in the rows the dispatchers hold claimed, together (bounded by --batch-bytes) |
| relay_inbox_claim_checked_total | counter | received pointers whose body was fetched from S3 (claim check) |
| relay_inbox_claim_check_downloaded_bytes_total | counter | bytes of bodies fetched from S3 by the claim check |
| relay_table_dead_tuples{table} | gauge | the table's dead row versions (n_dead_tup) |
| relay_table_last_vacuum_timestamp_seconds{table} | gauge | its last (auto)vacuum, Unix time |
| relay_table_vacuums_total{table} | counter | VACUUMs relay itself ran of the table (churn) |
| relay_ready | gauge | 1 when /readyz would answer 200, else 0 (looked at on each scrape) |
| relay_source_ready{source} | gauge | an outbox of several sources: 1 when the source's database and broker answer |

An outbox of several sources (relay.sources) has one registry whose
outbox and table metrics carry a first label `source` (`database/schema`);
each source's loop counts on its own view of it (OutboxMetrics.for_source).
One source alone has no such label: the names and series stay as they were.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class _ClockedHistogram(Histogram):
    """A histogram that remembers when it last observed, as a progress clock:
    the inbox's health counts each finished handler run, not only whole
    batches, so a batch of slow handlers is not mistaken for a stuck loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.last_observed = 0.0
        super().__init__(*args, **kwargs)

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self.last_observed = time.monotonic()
        super().observe(amount, exemplar)

    def observe_all(self, amounts: Sequence[float]) -> None:
        """observe() each of `amounts`, taking each bucket's lock once (a
        dispatcher's batch of handler runs; it keeps the clock itself)."""
        if not amounts:
            return
        self._sum.inc(sum(amounts))
        # The first bucket whose upper bound is at least the amount, as observe().
        for bucket, n in collections.Counter(
            bisect.bisect_left(self._upper_bounds, a) for a in amounts
        ).items():
            self._buckets[bucket].inc(n)


def _table_metrics(
    r: CollectorRegistry, labels: Sequence[str] = ()
) -> tuple[Gauge, Gauge, Counter]:
    """The daemon's table as autovacuum sees it, and relay's own vacuums of
    it (relay.maintenance.Vacuums; docs/backlog.md)."""
    return (
        Gauge(
            "relay_table_dead_tuples",
            "Dead row versions of the table (pg_stat_user_tables.n_dead_tup)",
            [*labels, "table"],
            registry=r,
        ),
        Gauge(
            "relay_table_last_vacuum_timestamp_seconds",
            "Unix time of the table's last vacuum or autovacuum (0: never)",
            [*labels, "table"],
            registry=r,
        ),
        Counter(
            "relay_table_vacuums",
            "VACUUMs relay ran of its table under churn (autovacuum's not counted)",
            [*labels, "table"],
            registry=r,
        ),
    )


class _Bound:
    """A metric of several labels with its first (`source`) given: the
    per-source view's `.labels(topic)` or `.labels(table=...)`."""

    def __init__(self, metric: Any, source: str) -> None:
        self._metric = metric
        self._source = source

    def labels(self, *values: str, **named: str) -> Any:
        if named:
            return self._metric.labels(source=self._source, **named)
        return self._metric.labels(self._source, *values)

    def remove(self) -> None:
        """Forget every series of this source (a source dropped at run time)."""
        for key in list(self._metric._metrics):
            if key[0] == self._source:
                self._metric.remove(*key)


class OutboxMetrics:
    """The outbox's metrics; with `by_source`, each has a first label
    `source`, and the loops count on a view of one source (for_source)."""

    # --capture wal's (slot_gauges()).
    slot_lag_bytes: Gauge
    slot_active: Gauge
    # Counted on by the loops: a metric, or for a view a source's series.
    unroutable: Counter | _Bound
    dead_tuples: Gauge | _Bound
    last_vacuum: Gauge | _Bound
    vacuums: Counter | _Bound

    def __init__(self, *, by_source: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["source"] if by_source else []
        self.published = Counter(
            "relay_outbox_published",
            "Outbox rows confirmed by the broker",
            labels,
            registry=r,
        )
        self.failed = Counter(
            "relay_outbox_failed",
            "Failed publish attempts (rows retried or dead)",
            labels,
            registry=r,
        )
        self.dead = Counter("relay_outbox_dead", "Outbox rows that became dead", labels, registry=r)
        self.unroutable = Counter(
            "relay_outbox_unroutable",
            "Outbox rows the broker confirmed but could route to no queue, by topic",
            [*labels, "topic"],
            registry=r,
        )
        self.deleted = Counter(
            "relay_outbox_deleted",
            "Published outbox rows deleted by retention",
            labels,
            registry=r,
        )
        self.pending = Gauge("relay_outbox_pending", "Pending outbox rows", labels, registry=r)
        self.oldest_pending = Gauge(
            "relay_outbox_oldest_pending_seconds",
            "Age of the oldest pending outbox row (0 when none)",
            labels,
            registry=r,
        )
        self.publish_seconds = Histogram(
            "relay_outbox_publish_seconds",
            "Time from claiming a batch to the broker's last confirm",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.claim_checked = Counter(
            "relay_outbox_claim_checked",
            "Outbox rows published by claim check (body stored in S3, pointer published)",
            labels,
            registry=r,
        )
        self.claim_check_bytes = Counter(
            "relay_outbox_claim_check_uploaded_bytes",
            "Bytes of message bodies stored in S3 by the claim check",
            labels,
            registry=r,
        )
        # Set to a function of its publisher by relay.wiring.outbox_service.
        self.broker_blocked = Gauge(
            "relay_outbox_broker_blocked",
            "1 while the broker blocks publishing (a RabbitMQ resource alarm), else 0",
            labels,
            registry=r,
        )
        self.claimed_bytes = Gauge(
            "relay_outbox_claimed_bytes",
            "Bytes of payloads in the outbox rows the workers hold claimed (--batch-bytes)",
            labels,
            registry=r,
        )
        self.dead_tuples, self.last_vacuum, self.vacuums = _table_metrics(r, labels)
        # Set by relay.sources.Sources.ready (each /readyz and /metrics).
        self.source_ready = (
            Gauge(
                "relay_source_ready",
                "1 when the source's database and broker answered at the last look, else 0",
                ["source"],
                registry=r,
            )
            if by_source
            else None
        )

    def slot_gauges(self) -> None:
        """The replication slot's gauges (relay outbox --capture wal, one
        source): slot_lag_bytes, slot_active."""
        self.slot_lag_bytes = Gauge(
            "relay_outbox_slot_lag_bytes",
            "WAL the outbox's replication slot holds back: the server's position "
            "less the slot's confirmed one (--capture wal)",
            registry=self.registry,
        )
        self.slot_active = Gauge(
            "relay_outbox_slot_active",
            "1 while this relay reads the outbox's replication slot, 0 while it stands "
            "by or the slot is being made again (--capture wal)",
            registry=self.registry,
        )

    _PLAIN = (
        "published",
        "failed",
        "dead",
        "deleted",
        "pending",
        "oldest_pending",
        "publish_seconds",
        "claim_checked",
        "claim_check_bytes",
        "broker_blocked",
        "claimed_bytes",
    )
    _LABELED = ("unroutable", "dead_tuples", "last_vacuum", "vacuums")

    def for_source(self, source: str) -> OutboxMetrics:
        """The metrics one source's loop counts on: this registry's series
        of `source` (the metrics made with by_source)."""
        view = object.__new__(OutboxMetrics)
        view.registry = self.registry
        view.source_ready = None
        for name in self._PLAIN:
            setattr(view, name, getattr(self, name).labels(source))
        for name in self._LABELED:
            setattr(view, name, _Bound(getattr(self, name), source))
        return view

    def forget(self, source: str) -> None:
        """Drop a source's series (the source was dropped at run time)."""
        for name in self._PLAIN:
            with contextlib.suppress(KeyError):  # never counted
                getattr(self, name).remove(source)
        for name in self._LABELED:
            _Bound(getattr(self, name), source).remove()
        if self.source_ready is not None:
            with contextlib.suppress(KeyError):  # never looked at
                self.source_ready.remove(source)

    def claim_check_sent(self, messages: int, uploaded: int) -> None:
        """relay.s3.ClaimCheckPublisher's report of one batch."""
        self.claim_checked.inc(messages)
        self.claim_check_bytes.inc(uploaded)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ReadyMetric:
    """relay_ready: the daemon's /readyz answer as a gauge (1 ready, 0 not),
    set when /metrics is scraped (relay.lifecycle), so that an alert rule can
    see what a Kubernetes probe sees."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauge = Gauge(
            "relay_ready",
            "1 when /readyz answers 200 (database and broker answer, not blocked), else 0",
            registry=self.registry,
        )

    def render(self, ready: bool) -> bytes:
        self.gauge.set(1 if ready else 0)
        return generate_latest(self.registry)


class InboxMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.received = Counter(
            "relay_inbox_received", "Messages received from the broker", registry=r
        )
        self.duplicates = Counter(
            "relay_inbox_duplicates", "Received messages already in the inbox", registry=r
        )
        self.processed = Counter("relay_inbox_processed", "Inbox rows handled", registry=r)
        self.failed = Counter("relay_inbox_failed", "Failed handler runs", registry=r)
        self.dead = Counter("relay_inbox_dead", "Inbox rows that became dead", registry=r)
        self.reruns = Counter(
            "relay_inbox_handler_reruns",
            "Handler runs rolled back, to run again, when a later one of their batch failed",
            registry=r,
        )
        self.deleted = Counter(
            "relay_inbox_deleted", "Processed inbox rows deleted by retention", registry=r
        )
        self.pending = Gauge("relay_inbox_pending", "Pending inbox rows", registry=r)
        self.oldest_pending = Gauge(
            "relay_inbox_oldest_pending_seconds",
            "Age of the oldest pending inbox row (0 when none)",
            registry=r,
        )
        self.handler_seconds = _ClockedHistogram(
            "relay_inbox_handler_seconds",
            "Handler run time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.claim_checked = Counter(
            "relay_inbox_claim_checked",
            "Received claim check pointers whose body was fetched from S3",
            registry=r,
        )
        self.claim_check_bytes = Counter(
            "relay_inbox_claim_check_downloaded_bytes",
            "Bytes of message bodies fetched from S3 by the claim check",
            registry=r,
        )
        self.held_bytes = Gauge(
            "relay_inbox_held_bytes",
            "Bytes of payloads in the inbox rows the dispatchers hold claimed (--batch-bytes)",
            registry=r,
        )
        self.dead_tuples, self.last_vacuum, self.vacuums = _table_metrics(r)

    def watch(self, receiver: Any) -> None:
        """Show the receiver's `readings` (relay.brokers.Reading: figures its
        consumer measures on the broker, such as relay_inbox_kafka_lag) as
        gauges or counters, as they are at each scrape."""
        self.registry.register(_Readings(receiver))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Readings:
    """A collector of a receiver's broker readings (InboxMetrics.watch)."""

    def __init__(self, receiver: Any) -> None:
        self.receiver = receiver

    def describe(self) -> list[Any]:
        return []  # known only at a scrape: never checked for clashes up front

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for reading in getattr(self.receiver, "readings", None) or ():
            kind = CounterMetricFamily if reading.kind == "counter" else GaugeMetricFamily
            family = kind(reading.name, reading.help, labels=list(reading.labels))
            for labels, value in reading.values:
                family.add_metric(list(labels), value)
            yield family
