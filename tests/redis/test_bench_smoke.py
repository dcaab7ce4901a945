"""The Redis Streams benchmark scenario (bench/redis_streams.py, run only with --only) at
smoke size, so it cannot rot: it delivers every message. Figures are not
judged here (no timed assertions)."""

from __future__ import annotations

import pytest

from tests.conftest import quick_bench


@pytest.mark.timeout(420)
def test_the_redis_benchmark_runs_at_smoke_size(tmp_path):
    figures = quick_bench(tmp_path, "redis")["redis"]
    assert {"pg", "redis", "floor", "outbox", "outbox_over_floor", "inbox_batch_over_drain"} <= (
        figures
    )
    assert {f"{d}_{who}_us_per_msg" for d in ("outbox", "inbox") for who in ("relay", "pg")} <= (
        figures
    )
