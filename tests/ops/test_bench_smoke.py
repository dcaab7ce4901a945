"""The benchmark's quick run, so it cannot rot: every scenario runs at smoke
size against the real servers and delivers every message. Figures are not
judged here (no timed assertions); bench/run.py prints them."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.conftest import REPO


# The quick run took about 90 s on this shared machine under load before issue
# 21's four scenarios (about 70 s more); pytest's global 120 s would kill it
# (and with it the run's clean-up) before its own 600 s limit below.
@pytest.mark.timeout(660)
def test_quick_benchmark_runs_every_scenario(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "quick"
    for name, state in report["scenarios"].items():
        assert "error" not in state, (name, state.get("error"))
    assert set(report["scenarios"]) >= {
        "limit_pg",
        "limit_amqp",
        "naive",
        "drain",
        "latency",
        "inbox",
        "sqs",
        "memory",
        "scale",
    }
    assert report["figures"], "no figures recorded"


def bench_sources(*args: str) -> list[dict[str, Any]]:
    """`python -m bench.sources ARGS`, which must exit 0; the figures it printed."""
    result = subprocess.run(
        [sys.executable, "-m", "bench.sources", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(300)
def test_the_sources_benchmark_runs_at_smoke_size():
    """bench.sources (issue 36) at two sources, a short trickle beside a small
    backlog and a small drain: every row arrives (else it exits non-zero)."""
    figures = bench_sources(
        *("--counts", "2", "--settle", "1", "--trickle-seconds", "2", "--rate", "20"),
        *("--backlog", "500", "--drain", "500", "--drain-rounds", "1"),
    )
    # Five a source and one LISTEN for the database; a sixth a source
    # while two of its jobs overlap.
    assert 11 <= figures[0]["pg_connections"] <= 13
    # Every row the trickle committed arrived (20 a second for 2 s: one late
    # commit on a loaded machine leaves 39).
    trickle = figures[1]
    assert 30 <= trickle["committed"] == trickle["rows"]
    assert trickle["not_arrived_in_60s"] == 0 and trickle["backlog_published_meanwhile"] == 500
    assert figures[2]["rows"] == 500


@pytest.mark.timeout(300)
def test_the_issue45_scenario_runs_at_smoke_size():
    """bench.sources' issue 45 scenario, small: keyed trickles, the backlog
    committed during the trickle, its drain beside them and alone, the CPU
    of the relay and of PostgreSQL, relay's sessions sampled."""
    figures = bench_sources(
        *("--counts", "2", "--trickle-sources", "3", "--keyed", "--settle", "1"),
        *("--trickle-seconds", "3", "--rate", "20", "--backlog", "2000"),
        *("--backlog-after", "0.5", "--drain-alone", "--drain", "0"),
    )
    trickle = figures[-1]
    assert trickle["sources"] == 4 and trickle["keyed"]
    assert 45 <= trickle["committed"] == trickle["rows"]  # 20 a second for 3 s
    assert trickle["not_arrived_in_60s"] == 0
    assert trickle["backlog_left_undrained"] == 0
    assert trickle["backlog_msgs_s"] > 0 and trickle["backlog_alone_msgs_s"] > 0
    assert trickle["backlog_ratio"] > 0
    assert set(trickle["cpu_pct"]) == {"relay", "postgresql"}
    assert trickle["activity"]["samples"] > 0 and trickle["activity"]["sessions"]
    assert trickle["p50_ms"] <= trickle["p99_ms"]
