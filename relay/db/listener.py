"""LISTEN for the daemons' wake-ups, on a plain psycopg connection of its own
(one per database in an outbox of several sources: SharedListeners, which
also polls each database once for all its sources)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import psycopg
from psycopg import sql

from relay.config import redact_url
from relay.db import connect as pg
from relay.db import namespace
from relay.db.errors import describe, unavailable
from relay.errors import DatabaseUnavailable

if TYPE_CHECKING:
    from relay.db.store import Store

# The name it always logged under (relay.store, before relay.db).
log = logging.getLogger("relay.store")


class _Runs(Protocol):
    """What SharedListeners runs once per database."""

    async def run(self) -> None: ...


# A database's shared part: its Listener or its _DatabasePoll.
_Part = TypeVar("_Part", bound=_Runs)

# How long the listener's self-check waits for its own notification.
SELF_CHECK_SECONDS = 5.0
# A database's shared poll looks for sources to poll this many times per
# --poll-interval, so a due row waits at most 1 + 1/POLL_TICKS intervals.
POLL_TICKS = 4


def _command(command: str, channel: str) -> str | sql.Composed:
    """LISTEN or UNLISTEN `channel`: quoted when it must be (a schema's
    channel, such as relay_outbox.T2); the plain names as they always were sent."""
    if re.fullmatch(r"[a-z_][a-z0-9_]*", channel):
        return f"{command} {channel}"  # checked just above: a plain name
    return sql.SQL(command + " {}").format(sql.Identifier(channel))


class Subscription:
    """One relay's wake-ups on a Listener: its channel's base name
    (NOTIFY_OUTBOX), found in its tables' schema by `locate` on each connect
    (Store.channel; relay.db.namespace), `wake` called on each notification
    there, and `notify`, which sends one the way producers' commits do."""

    def __init__(
        self,
        base: str,
        wake: Callable[[], None],
        notify: Callable[[str, str], Awaitable[None]] | None = None,
        locate: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.base = self.channel = base
        self.wake = wake
        self.notify = notify
        self.locate = locate

    async def find_channel(self) -> str:
        if self.locate is not None:
            self.channel = await self.locate(self.base)
        return self.channel


class Listener:
    """LISTEN on its own autocommit connection; calls each subscription's
    `wake` on a notification on its channel.

    A relay of one source has a Listener of its own (one subscription, for
    its life); an outbox of several sources one per database, shared by its
    schemas (SharedListeners): PostgreSQL wakes every listening backend of a
    database for each NOTIFY, so a LISTEN connection per schema cost each
    row's notification one backend woken per source (docs/multi-source.md).

    Reconnects in a loop with backoff; while it is down the daemons still
    poll, so a lost notification costs at most one --poll-interval.

    A subscription's `notify(channel, payload)` sends a notification the way
    producers' commits do (through the --database-url, which may be a
    pooler's): on each connect the listener sends one to itself and waits
    for it. When it does not arrive (a PgBouncer in transaction mode
    between: the LISTEN was lost with the server connection it ran on), the
    listener logs one warning, lets go and leaves the daemons to poll.
    """

    def __init__(
        self,
        conninfo: str,
        channel: str | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.conninfo = conninfo
        self.connected = asyncio.Event()
        self._subscriptions: dict[int, Subscription] = {}
        self._by_channel: dict[str, list[Subscription]] = {}
        self._listening: set[str] = set()
        self._changed = asyncio.Event()
        if channel is not None and wake is not None:
            # `wake` on `channel`, without a self-check.
            self.subscribe(Subscription(channel, wake))

    @classmethod
    def for_store(
        cls, store: Store, channel: str, wake: Callable[[], None], listen_url: str | None = None
    ) -> Listener:
        """A Listener on `listen_url` (else the store's database URL) that
        checks itself with a notification sent through the store."""
        listener = cls(conninfo(store, listen_url))
        listener.subscribe(subscription(store, channel, wake))
        return listener

    @property
    def channel(self) -> str:
        """The channel of its first subscription (a relay of one source: its own)."""
        first = next(iter(self._subscriptions.values()), None)
        return first.channel if first is not None else ""

    def subscribe(self, subscription: Subscription) -> int:
        """Add a subscription (LISTEN on its channel, now if connected);
        returns its id for unsubscribe()."""
        key = id(subscription)
        self._subscriptions[key] = subscription
        self._changed.set()
        return key

    def unsubscribe(self, key: int) -> None:
        """Drop a subscription: its wake is not called again (UNLISTEN
        follows when no other subscription has its channel)."""
        subscription = self._subscriptions.pop(key, None)
        if subscription is not None:
            others = self._by_channel.get(subscription.channel, [])
            if subscription in others:
                others.remove(subscription)
            self._changed.set()

    @property
    def subscribed(self) -> int:
        return len(self._subscriptions)

    def _describe(self) -> str:
        if len(self._subscriptions) == 1:
            return self.channel
        return f"{len(self._subscriptions)} channels on {redact_url(self.conninfo)}"

    async def run(self) -> None:
        delay = 0.5
        said = False  # one line per outage: the daemon's loop logs each of its waits
        while True:
            try:
                for subscription in list(self._subscriptions.values()):
                    await subscription.find_channel()
                async with await pg.connect(self.conninfo) as conn:
                    self._listening = set()
                    self._changed.clear()
                    await self._sync(conn, wake_new=False)
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
                    for subscription in list(self._subscriptions.values()):
                        subscription.wake()
                    await self._serve(conn)
            except Exception as exc:
                # The server went away (relay.db.errors), or the self-check's
                # notification could not be sent: poll until it is back.
                if not isinstance(exc, DatabaseUnavailable) and unavailable(exc) is None:
                    raise
                log.log(
                    logging.DEBUG if said else logging.WARNING,
                    "LISTEN %s connection lost (%s); polling until it is back",
                    self._describe(),
                    describe(exc),
                )
                said = True
            finally:
                self.connected.clear()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 30.0)
        # A background task of the daemon's, which must not end: poll only.
        await asyncio.Event().wait()

    async def _serve(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Dispatch notifications until the connection breaks; LISTEN and
        UNLISTEN as subscriptions come and go (between two reads: psycopg
        reads notifications under the connection's lock)."""
        while True:
            reader = asyncio.ensure_future(self._read(conn))
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({reader, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (reader, changed):
                    task.cancel()
                await asyncio.gather(reader, changed, return_exceptions=True)
            if not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            self._changed.clear()
            await self._sync(conn, wake_new=True)

    async def _read(self, conn: psycopg.AsyncConnection[Any]) -> None:
        async for notification in conn.notifies():
            self._dispatch(notification.channel)

    def _dispatch(self, channel: str) -> None:
        for subscription in self._by_channel.get(channel, ()):
            subscription.wake()

    async def _sync(self, conn: psycopg.AsyncConnection[Any], *, wake_new: bool) -> None:
        """LISTEN on the channels of the subscriptions, UNLISTEN the rest;
        with wake_new, wake each new subscription once (rows committed
        before it listened)."""
        by_channel: dict[str, list[Subscription]] = {}
        known = {id(s) for subs in self._by_channel.values() for s in subs}
        for subscription in list(self._subscriptions.values()):
            if id(subscription) not in known:
                await subscription.find_channel()
            by_channel.setdefault(subscription.channel, []).append(subscription)
        for channel in by_channel.keys() - self._listening:
            await conn.execute(_command("LISTEN", channel))
            self._listening.add(channel)
        for channel in self._listening - by_channel.keys():
            await conn.execute(_command("UNLISTEN", channel))
            self._listening.discard(channel)
        self._by_channel = by_channel
        if wake_new:
            for subscription in (s for subs in by_channel.values() for s in subs):
                if id(subscription) not in known:
                    subscription.wake()

    async def _self_check(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Send a notification through a subscription's `notify` and wait for it here."""
        sender = next((s for s in self._subscriptions.values() if s.notify), None)
        if sender is None or sender.notify is None:
            return True
        token = f"relay-self-check-{uuid.uuid4().hex}"
        await sender.notify(sender.channel, token)
        async for notification in conn.notifies(timeout=SELF_CHECK_SECONDS):
            if notification.payload == token:
                return True
            self._dispatch(notification.channel)  # a producer's: a wake-up like any other
        return False


def conninfo(store: Store, listen_url: str | None = None) -> str:
    """The URL a Listener for `store` connects to: `listen_url`, else the store's."""
    return pg.libpq_url(listen_url) if listen_url else store.conninfo


def subscription(store: Store, base: str, wake: Callable[[], None]) -> Subscription:
    """`wake` on notifications on `base` in `store`'s schema, checked with a
    notification sent through the store."""
    return Subscription(base, wake, notify=store.notify, locate=store.channel)


class SharedListeners:
    """One Listener per database for an outbox of several sources: a
    source's relay subscribes while it runs (serve()); a database's
    listener connects with its first subscription and closes with its last.
    The listeners' tasks run in the context this was made in (an outbox of
    several sources: no source's log label)."""

    def __init__(self) -> None:
        self.listeners: dict[str, tuple[Listener, asyncio.Task[None]]] = {}
        self.polls: dict[str, tuple[_DatabasePoll, asyncio.Task[None]]] = {}
        self._context = contextvars.copy_context()

    async def serve(
        self, store: Store, base: str, wake: Callable[[], None], listen_url: str | None = None
    ) -> None:
        """Until cancelled: `wake` on each notification on `base` in
        `store`'s schema, through the listener of its database."""
        url = conninfo(store, listen_url)
        listener, task = self._running(self.listeners, url, lambda: Listener(url), "listener")
        key = listener.subscribe(subscription(store, base, wake))
        try:
            # Runs until cancelled; re-raises a bug's exception. Shielded:
            # this subscriber's cancellation must not cancel the others' listener.
            await asyncio.shield(task)
        finally:
            listener.unsubscribe(key)
            self._end_unused(self.listeners, url, listener, task, not listener.subscribed)

    async def poll(
        self,
        store: Store,
        wake: Callable[[], None],
        swept: Callable[[], float],
        interval: float,
    ) -> None:
        """Until cancelled: `wake` when `store`'s outbox has due rows and
        `swept()` (the monotonic time its relay last claimed every key) is
        older than `interval`, found by its database's one poll a tick for
        all its sources: a hundred sources cost one query a --poll-interval,
        not a hundred claims (docs/multi-source.md)."""
        url = store.conninfo
        database, task = self._running(self.polls, url, lambda: _DatabasePoll(interval), "poll")
        polled = _Polled(store, wake, swept)
        database.polled[id(polled)] = polled
        try:
            await asyncio.shield(task)
        finally:
            database.polled.pop(id(polled), None)
            self._end_unused(self.polls, url, database, task, not database.polled)

    def _running(
        self,
        parts: dict[str, tuple[_Part, asyncio.Task[None]]],
        url: str,
        make: Callable[[], _Part],
        name: str,
    ) -> tuple[_Part, asyncio.Task[None]]:
        """`url`'s part in `parts` and the task running it (its run()),
        started in this object's context if there is none or it ended."""
        if url not in parts or parts[url][1].done():
            part = make()
            task = asyncio.get_running_loop().create_task(
                part.run(), name=name, context=self._context
            )
            parts[url] = (part, task)
        return parts[url]

    @staticmethod
    def _end_unused(
        parts: dict[str, tuple[_Part, asyncio.Task[None]]],
        url: str,
        part: _Part,
        task: asyncio.Task[None],
        unused: bool,
    ) -> None:
        """Stop `url`'s part once its last user left (unless another replaced it)."""
        if unused and parts.get(url, (None,))[0] is part:
            del parts[url]
            task.cancel()

    async def close(self) -> None:
        tasks = [task for _, task in [*self.listeners.values(), *self.polls.values()]]
        self.listeners.clear()
        self.polls.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(eq=False)
class _Polled:
    """A source polled by its database's shared poll."""

    store: Store
    wake: Callable[[], None]
    swept: Callable[[], float]
    probed: float = -float("inf")


class _DatabasePoll:
    """Every --poll-interval, one query asks which of a database's sources
    have due rows (a pending row whose available_at has come), and wakes
    those; a source whose own claim of every key came within the interval
    (`swept`: a notification woke it) is not asked about at all."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.polled: dict[int, _Polled] = {}

    async def run(self) -> None:
        # At a random point of the interval: databases started together do
        # not poll in the same instant.
        await asyncio.sleep(random.uniform(0, self.interval / POLL_TICKS))
        while True:
            now = time.monotonic()
            stale = [
                p for p in self.polled.values() if max(p.swept(), p.probed) + self.interval <= now
            ]
            if stale:
                for polled in stale:
                    polled.probed = now
                for polled in await self._due(stale):
                    polled.wake()
            await asyncio.sleep(self.interval / POLL_TICKS)

    @staticmethod
    async def _due(stale: list[_Polled]) -> list[_Polled]:
        """The sources of `stale` with due rows, asked in one query; every
        one of them when the query fails (each then claims, and meets the
        failure, on its own)."""
        if any(p.store.located is None for p in stale):
            return stale  # a source not started yet: its own claim finds out
        query = " UNION ALL ".join(
            f"(SELECT {i} FROM {namespace.qualified('outbox', p.store.located)} "
            "WHERE status = 'pending' AND available_at <= now() LIMIT 1)"
            for i, p in enumerate(stale)
        )
        try:
            async with stale[0].store.connection() as conn:
                found = await conn.exec_driver_sql(query)
                return [stale[i] for (i,) in found.all()]
        except Exception as exc:  # whatever it was, each source's own claim meets it
            log.debug("the shared poll failed (%s); waking its sources", exc)
            return stale
