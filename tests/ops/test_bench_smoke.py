"""The benchmark's quick run, so it cannot rot: every scenario runs at smoke
size against the real servers and delivers every message. Figures are not
judged here (no timed assertions); bench/run.py prints them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.conftest import quick_bench, run_bench


# The quick run took about 90 s on this shared machine under load before issue
# 21's four scenarios (about 70 s more); pytest's global 120 s would kill it
# (and with it the run's clean-up) before its own 600 s limit below.
@pytest.mark.timeout(660)
def test_quick_benchmark_runs_every_scenario(tmp_path):
    out = tmp_path / "bench.json"
    run_bench("bench.run", "--quick", "--out", str(out), timeout=600)
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
    result = run_bench("bench.sources", *args, timeout=280)
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


@pytest.mark.timeout(300)
def test_the_wal_benchmark_runs_at_smoke_size_to_kafka(tmp_path):
    """bench.wal (issue 52) to Kafka, small: polling and --capture wal each
    publish every row (it waits for the daemon's count of published rows and
    checks the table), with their idle commits and the cluster's CPU, then
    a backlog committed while each was stopped."""
    out = tmp_path / "wal.json"
    run_bench(
        *("bench.wal", "--broker", "kafka", "--rows", "2000", "--txn", "100", "--idle", "2"),
        *("--backlog", "2000", "--out", str(out)),
        timeout=280,
    )
    report = json.loads(out.read_text())
    assert report["broker"] == "kafka"
    assert [r["mode"] for r in report["runs"]] == ["poll", "wal"]
    for run in report["runs"]:
        assert run["broker"] == "kafka" and run["drain_rate"] > 0
        assert run["idle_commits"] >= 0 and run["cluster_cpu_seconds"] > 0
    assert "walsender" in report["runs"][1]["cpu_by_kind"]
    # The backlog committed while each daemon was stopped, all drained.
    assert [b["mode"] for b in report["backlogs"]] == ["poll", "wal"]
    assert all(b["backlog"] == 2000 and b["whole"] > 0 for b in report["backlogs"])


@pytest.mark.timeout(300)
def test_the_wal_latency_scenario_runs_at_smoke_size(tmp_path):
    """bench.run's wal_latency (issue 52) at smoke size, on a cluster of its
    own with wal_level = logical: every row the producer processes commit
    arrives through polling and through --capture wal, and both modes'
    percentiles are recorded."""
    found = quick_bench(tmp_path, "wal_latency")["wal_latency"]
    for mode in ("poll", "wal"):
        assert {f"{mode}_p50", f"{mode}_p99", f"{mode}_achieved"} <= found
    assert "wal_over_poll_p99" in found


def test_the_mark_benchmark_measures_each_fillfactor(tmp_path):
    """bench.mark at smoke size: each fillfactor's marks done, none of them
    HOT (status is in the partial indexes' predicates), and the table at
    fillfactor 50 not grown by them (every new version on its own page)."""
    out = tmp_path / "mark.json"
    run_bench(
        "bench.mark",
        *("--rows", "3000", "--batch", "500", "--rounds", "1", "--fillfactors", "100,50"),
        *("--out", str(out)),
        timeout=180,
    )
    results = {r["fillfactor"]: r for r in json.loads(out.read_text())}
    assert set(results) == {100, 50}
    assert all(r["hot_updates"] == 0 and r["heap_blocks"] > 0 for r in results.values())
    assert results[100]["table_mb_after"] > results[100]["table_mb_before"]
    assert results[50]["table_mb_after"] == results[50]["table_mb_before"]
