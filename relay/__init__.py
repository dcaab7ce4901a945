"""relay: the transactional outbox and inbox patterns for PostgreSQL, RabbitMQ, SQS and Kafka.

Producers call `enqueue` (or `enqueue_async`) inside their own transaction;
consumers register handlers on a `HandlerRegistry`. The daemons are
`relay outbox` and `relay inbox`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.handlers import HandlerRegistry, Message
    from relay.producer import enqueue, enqueue_async

__all__ = ["HandlerRegistry", "Message", "__version__", "enqueue", "enqueue_async"]

# The one place the version is written: the build reads it from here
# (pyproject.toml, [tool.hatch.version]) and `relay --version` prints it, so
# it holds whatever the distribution is named on the index.
__version__ = "0.2.0"

# The public names load on first use (PEP 562): they bring SQLAlchemy, which
# the inbox's receiver process, importing only relay's light modules, does
# not need (a large share of its memory; docs/inbox.md).
_LAZY = {
    "HandlerRegistry": "relay.handlers",
    "Message": "relay.handlers",
    "enqueue": "relay.producer",
    "enqueue_async": "relay.producer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'relay' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
