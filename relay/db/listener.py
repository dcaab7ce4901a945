"""LISTEN for the daemons' wake-ups, on a plain psycopg connection of its own."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from relay.config import redact_url
from relay.db import connect as pg
from relay.db.errors import describe, unavailable
from relay.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from relay.db.store import Store

# The name it always logged under (relay.store, before relay.db).
log = logging.getLogger("relay.store")

# How long the listener's self-check waits for its own notification.
SELF_CHECK_SECONDS = 5.0


def _listen(channel: str) -> str | sql.Composed:
    """LISTEN on `channel`: quoted when it must be (a schema's channel, such
    as relay_outbox.T2); the plain names as they always were sent."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", channel):
        return "LISTEN " + channel  # checked just above: a plain name
    return sql.SQL("LISTEN {}").format(sql.Identifier(channel))


class Listener:
    """LISTEN on its own autocommit connection; calls `wake` on each notification.

    Reconnects in a loop with backoff; while it is down the daemons still
    poll, so a lost notification costs at most one --poll-interval.

    `notify(payload)` sends a notification on the channel the way producers'
    commits do (through the --database-url, which may be a pooler's): on
    each connect the listener sends one to itself and waits for it. When it
    does not arrive (a PgBouncer in transaction mode between: the LISTEN
    was lost with the server connection it ran on), the listener logs one
    warning, lets go and leaves the daemon to poll.
    """

    def __init__(
        self,
        conninfo: str,
        channel: str,
        wake: Callable[[], None],
        notify: Callable[[str], Awaitable[None]] | None = None,
        locate: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.base_channel = self.channel = channel
        self.wake = wake
        self.notify = notify
        # The channel of relay's tables' schema, asked on each connect
        # (Store.channel; relay.db.namespace): the trigger notifies that one.
        self.locate = locate
        self.connected = asyncio.Event()

    @classmethod
    def for_store(
        cls, store: Store, channel: str, wake: Callable[[], None], listen_url: str | None = None
    ) -> Listener:
        """A Listener on `listen_url` (else the store's database URL) that
        checks itself with a notification sent through the store."""
        conninfo = pg.libpq_url(listen_url) if listen_url else store.conninfo
        listener: Listener

        async def notify(payload: str) -> None:
            await store.notify(listener.channel, payload)

        listener = cls(conninfo, channel, wake, notify=notify, locate=store.channel)
        return listener

    async def run(self) -> None:
        delay = 0.5
        said = False  # one line per outage: the daemon's loop logs each of its waits
        while True:
            try:
                if self.locate is not None:
                    self.channel = await self.locate(self.base_channel)
                async with await pg.connect(self.conninfo) as conn:
                    await conn.execute(_listen(self.channel))
                    if not await self._self_check(conn):
                        log.warning(
                            "LISTEN/NOTIFY does not work on this connection (%s): a "
                            "notification sent to %s did not come back within %gs, as "
                            "behind PgBouncer in transaction mode; polling every "
                            "--poll-interval instead. Give --listen-url a direct "
                            "PostgreSQL URL for LISTEN to get wake-ups.",
                            redact_url(self.conninfo),
                            self.channel,
                            SELF_CHECK_SECONDS,
                        )
                        with contextlib.suppress(psycopg.Error, OSError):
                            await conn.execute("UNLISTEN *")
                        break
                    self.connected.set()
                    delay, said = 0.5, False
                    # Rows committed while we were away: look once now.
                    self.wake()
                    async for _ in conn.notifies():
                        self.wake()
            except Exception as exc:
                # The server went away (relay.db.errors), or the self-check's
                # notification could not be sent: poll until it is back.
                if not isinstance(exc, DatabaseUnavailable) and unavailable(exc) is None:
                    raise
                log.log(
                    logging.DEBUG if said else logging.WARNING,
                    "LISTEN %s connection lost (%s); polling until it is back",
                    self.channel,
                    describe(exc),
                )
                said = True
            finally:
                self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        # A background task of the daemon's, which must not end: poll only.
        await asyncio.Event().wait()

    async def _self_check(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Send a notification through `notify` and wait for it here."""
        if self.notify is None:
            return True
        token = f"relay-self-check-{uuid.uuid4().hex}"
        await self.notify(token)
        async for notification in conn.notifies(timeout=SELF_CHECK_SECONDS):
            if notification.payload == token:
                return True
            self.wake()  # a producer's: a wake-up like any other
        return False
