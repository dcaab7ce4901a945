"""The PostgreSQL connections relay opens outside SQLAlchemy's pool.

Each outbox worker's session (relay.store.OutboxSession), the inbox
receiver's writer (relay.receiving, in a process that loads no
SQLAlchemy, so neither does this module) and the LISTEN connection
(relay.store.Listener) are plain psycopg connections in autocommit. Like
the pooled ones, they give up connecting after CONNECT_TIMEOUT seconds and
show in pg_stat_activity as application_name 'relay'.
"""

from __future__ import annotations

from typing import Any

import psycopg

CONNECT_TIMEOUT = 10
APPLICATION_NAME = "relay"


async def connect(conninfo: str, **settings: Any) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection; `settings` go to psycopg's connect (options=...)."""
    return await psycopg.AsyncConnection.connect(
        conninfo, autocommit=True, connect_timeout=CONNECT_TIMEOUT,
        application_name=APPLICATION_NAME, **settings)


def libpq_url(database_url: str) -> str:
    """The libpq form of a database URL: relay's settings may spell the
    scheme postgresql+psycopg://, SQLAlchemy's form."""
    return "postgresql://" + database_url.partition("://")[2]
