"""The inbox's tests run under both --dispatch paths: `received` (handlers in
the transaction that stores the message) and `stored` (stored first, then
claimed by the dispatchers)."""

import pytest


@pytest.fixture(params=["received", "stored"])
def dispatch(request: pytest.FixtureRequest) -> str:
    return str(request.param)
