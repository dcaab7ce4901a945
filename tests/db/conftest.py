"""A PgBouncer crash told apart from a relay failure (tests/db/test_pgbouncer.py).

PgBouncer 1.18 has been seen to exit by itself mid-test on a loaded machine
("bad client state"). A test through it that fails while its PgBouncer has
exited fails saying so first, with PgBouncer's log: that is PgBouncer's
failure, not relay's. (The next test starts it again: the `pooled` fixture.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.pgbouncer import PgBouncer


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    outcome = yield
    report = outcome.get_result()
    bouncer = getattr(item, "funcargs", {}).get("pgbouncer")
    if not (report.failed and isinstance(bouncer, PgBouncer)):
        return
    if bouncer.proc.poll() is None:
        return
    log = bouncer.read_log()
    report.longrepr = (
        f"PgBouncer ({bouncer.pool_mode} mode) exited with status {bouncer.proc.returncode} "
        "during this test: the failure below is PgBouncer's crash, not relay's. "
        f"PgBouncer's log:\n{log[-4000:]}\n\n{report.longrepr}"
    )
