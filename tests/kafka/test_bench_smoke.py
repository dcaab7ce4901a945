"""The Kafka benchmark scenario (bench/kafka.py, run only with --only) at
smoke size, so it cannot rot: it delivers every message. Figures are not
judged here (no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(420)
def test_the_kafka_benchmark_runs_at_smoke_size(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.run",
            "--quick",
            "--only",
            "kafka,kafka_backlog",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    for scenario in ("kafka", "kafka_backlog"):
        assert "error" not in report["scenarios"][scenario], report["scenarios"][scenario]
    figures = {f["figure"] for f in report["figures"] if f["scenario"] == "kafka"}
    assert {"floor", "outbox", "outbox_over_floor", "inbox_batch_over_drain"} <= figures
    # The CPU a message of each daemon, on Kafka and on RabbitMQ.
    assert {
        f"{broker}{daemon}_{who}_us_per_msg"
        for broker in ("", "rabbitmq_")
        for daemon in ("outbox", "inbox")
        for who in ("relay", "pg")
    } <= figures
    backlog = {f["figure"] for f in report["figures"] if f["scenario"] == "kafka_backlog"}
    assert {"outbox_last_over_first", "inbox_last_over_first"} <= backlog
