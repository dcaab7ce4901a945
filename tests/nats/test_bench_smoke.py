"""The NATS benchmark scenario (bench/nats.py, run only with --only) at
smoke size, so it cannot rot: it delivers every message. Figures are not
judged here (no timed assertions)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(420)
def test_the_nats_benchmark_runs_at_smoke_size(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--only", "nats", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "error" not in report["scenarios"]["nats"], report["scenarios"]["nats"]
    figures = {f["figure"] for f in report["figures"] if f["scenario"] == "nats"}
    assert {"publisher_bare", "outbox", "outbox_over_bare", "inbox_batch_over_drain"} <= figures
