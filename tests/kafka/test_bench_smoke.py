"""The Kafka benchmark scenario (bench/kafka.py, run only with --only) at
smoke size, so it cannot rot: it delivers every message. Figures are not
judged here (no timed assertions)."""

from __future__ import annotations

import pytest

from tests.conftest import quick_bench


@pytest.mark.timeout(420)
def test_the_kafka_benchmark_runs_at_smoke_size(tmp_path):
    found = quick_bench(tmp_path, "kafka", "kafka_backlog")
    figures = found["kafka"]
    assert {"floor", "outbox", "outbox_over_floor", "inbox_batch_over_drain"} <= figures
    # The CPU a message of each daemon, on Kafka and on RabbitMQ.
    assert {
        f"{broker}{daemon}_{who}_us_per_msg"
        for broker in ("", "rabbitmq_")
        for daemon in ("outbox", "inbox")
        for who in ("relay", "pg")
    } <= figures
    assert {"outbox_last_over_first", "inbox_last_over_first"} <= found["kafka_backlog"]
