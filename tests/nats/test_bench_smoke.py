"""The NATS benchmark scenario (bench/nats.py, run only with --only) at
smoke size, so it cannot rot: it delivers every message. Figures are not
judged here (no timed assertions)."""

from __future__ import annotations

import pytest

from tests.conftest import quick_bench


@pytest.mark.timeout(420)
def test_the_nats_benchmark_runs_at_smoke_size(tmp_path):
    figures = quick_bench(tmp_path, "nats")["nats"]
    assert {"publisher_bare", "outbox", "outbox_over_bare", "inbox_batch_over_drain"} <= figures
