"""The benchmark's quick run, so it cannot rot: every scenario runs at smoke
size against the real servers and delivers every message. Figures are not
judged here (no timed assertions); bench/run.py prints them."""

from __future__ import annotations

import json
import subprocess
import sys

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


@pytest.mark.timeout(300)
def test_the_sources_benchmark_runs_at_smoke_size():
    """bench.sources (issue 36) at two sources, a short trickle beside a small
    backlog and a small drain: every row arrives (else it exits non-zero)."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.sources",
            *("--counts", "2", "--settle", "1", "--trickle-seconds", "2", "--rate", "20"),
            *("--backlog", "500", "--drain", "500", "--drain-rounds", "1"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # Six a source; a seventh while two of a source's jobs overlap.
    assert 12 <= figures[0]["pg_connections"] <= 14
    assert figures[1]["rows"] == 40 and figures[1]["backlog_published_meanwhile"] == 500
    assert figures[2]["rows"] == 500
