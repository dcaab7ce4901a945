"""Prometheus metrics: one registry per daemon, so several can share a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class OutboxMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.published = Counter(
            "relay_outbox_published", "Outbox rows confirmed by the broker", registry=r
        )
        self.failed = Counter(
            "relay_outbox_failed", "Failed publish attempts (rows retried or dead)", registry=r
        )
        self.dead = Counter("relay_outbox_dead", "Outbox rows that became dead", registry=r)
        self.pending = Gauge("relay_outbox_pending", "Pending outbox rows", registry=r)
        self.oldest_pending = Gauge(
            "relay_outbox_oldest_pending_seconds",
            "Age of the oldest pending outbox row (0 when none)",
            registry=r,
        )
        self.publish_seconds = Histogram(
            "relay_outbox_publish_seconds",
            "Time from claiming a batch to the broker's last confirm",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
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
        self.pending = Gauge("relay_inbox_pending", "Pending inbox rows", registry=r)
        self.oldest_pending = Gauge(
            "relay_inbox_oldest_pending_seconds",
            "Age of the oldest pending inbox row (0 when none)",
            registry=r,
        )
        self.handler_seconds = Histogram(
            "relay_inbox_handler_seconds",
            "Handler run time",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
