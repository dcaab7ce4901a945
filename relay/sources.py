"""An outbox of several sources: one `relay outbox` draining many databases
and schemas (database-per-tenant, schema-per-tenant deployments).

Each source (a database URL and a schema) runs the whole single-source
outbox, relay.wiring.outbox_service, as a unit: its own store, worker
connections, publisher, retention, churn vacuum and metrics view, on tasks
of its own; the LISTEN connection is one per database, shared by its
sources (relay.db.listener.SharedListeners). So each keeps every guarantee it has alone (per-key
order, wake-ups, poison rules, failover handling), a source that is down
waits for its database without delaying any other, and a backlog in one
claims batches on its own connections while another's new row is claimed
by that source's idle worker at once. docs/multi-source.md says why.

`Sources` is one lifecycle Service holding the running sources; with
`--sources FILE` it reads the file again on SIGHUP and when it changes
(its modification time, looked at every SOURCES_CHECK seconds), starting
the sources added and stopping the sources dropped, the others untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import time
from collections.abc import Coroutine, Mapping
from typing import Any

from relay import logs
from relay.config import OutboxSettings, Source, labelled, read_sources, url_password
from relay.db import SharedListeners
from relay.errors import ConfigError
from relay.lifecycle import PROBE_TIMEOUT, STALL_AFTER, Daemon, Service, Started
from relay.metrics import OutboxMetrics
from relay.wiring import outbox_service

log = logging.getLogger("relay.outbox")

# How often the --sources file's modification time is looked at.
SOURCES_CHECK = 1.0
# The --batch-size of an outbox of several sources unless one is given. The
# sources share one event loop, so a row of a quiet source waits behind the
# Python work of the batches in hand of a busy one: 100 trickling sources
# beside a 200,000-row drain had a p99 of 677 ms with batches of 500, 52 ms
# with 100, and the drain lost almost nothing (docs/multi-source.md).
SOURCE_BATCH = 100
# Idle pooled connections a source keeps for its jobs and probes (a second
# one opens while two run at once): its workers' and LISTEN's are its own.
SOURCE_POOL = 1
# A source whose loop or background task ended unexpectedly (a bug, or a
# schema newer than this relay) starts again after this long; the others go on.
RESTART_AFTER = 10.0


class SourceRun:
    """One source's outbox service, running on tasks of its own whose log
    lines carry its label (relay.logs.set_source)."""

    def __init__(
        self, label: str, source: Source, service: Service, shutdown_timeout: float
    ) -> None:
        self.label = label
        self.source = source
        self.service = service
        self.shutdown_timeout = shutdown_timeout
        self.started = False
        self.stop_event = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        context = contextvars.copy_context()
        context.run(logs.set_source, self.label)

        def task(name: str, coro: Coroutine[Any, Any, None]) -> None:
            self.tasks[name] = asyncio.create_task(
                coro, name=f"{self.label}-{name}", context=context
            )

        task("main", self.service.main(self._started))
        for name, factory in self.service.background.items():
            task(name, factory(self.stop_event))

    def _started(self) -> None:
        self.started = True

    @property
    def main(self) -> asyncio.Task[None]:
        return self.tasks["main"]

    def failed(self) -> str | None:
        """Why this source's run ended while it was not asked to stop, or None."""
        if self.stop_event.is_set():
            return None
        for name, task in self.tasks.items():
            if not task.done() or (name == "main" and task.cancelled()):
                continue
            exc = None if task.cancelled() else task.exception()
            return f"its {name} task ended ({exc!r})"
        return None

    def stop(self) -> None:
        """Ask the source's loop to finish the batch in hand and return."""
        if not self.stop_event.is_set():
            self.stop_event.set()
            with contextlib.suppress(Exception):
                self.service.stop()

    async def finish(self) -> None:
        """After stop(): wait for the loop (at most the shutdown timeout, then
        cancel it: its batch is rolled back), end the background tasks, close."""
        self.stop()
        main = self.tasks.get("main")
        if main is not None and not main.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait({main}, timeout=self.shutdown_timeout)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for close in self.service.on_stop:
            try:
                await close()
            except Exception:
                log.exception("source %s: closing failed", self.label)

    async def ready(self) -> bool:
        if self.service.ready is None:
            return True
        try:
            # Within the probe's time: one source's slow connect must not
            # cost the others their answer.
            return bool(await asyncio.wait_for(self.service.ready(), PROBE_TIMEOUT * 0.75))
        except Exception:
            return False


class Sources:
    """The sources of one `relay outbox`, as one lifecycle Service."""

    def __init__(
        self,
        settings: OutboxSettings,
        sources: Mapping[str, Source],
        *,
        path: str | None = None,
        once: bool = False,
    ) -> None:
        self.settings = settings
        self.initial = dict(sources)
        self.path = path
        self.once = once
        self.metrics = OutboxMetrics(by_source=True)
        # One LISTEN connection per database, for all its sources.
        self.listeners = SharedListeners()
        self.runs: dict[str, SourceRun] = {}
        self.stopping = asyncio.Event()
        self._reload = asyncio.Event()
        self._file_state = self._stat()
        self._unready: list[str] = []
        # Sources whose run ended unexpectedly: when each starts again.
        self._restart_at: dict[str, float] = {}

    # -- the Service -----------------------------------------------------------

    def service(self) -> Service:
        return Service(
            name="outbox",
            main=self.main,
            stop=self.stop,
            ready=self.ready,
            unready=self.unready,
            metrics=self.metrics.render,
            progress=self.progress,
            stall_after=STALL_AFTER + self.settings.poll_interval,
            on_stop=[self.close],
        )

    async def main(self, started: Started) -> None:
        for label, source in self.initial.items():
            self._start(label, source)
        started()
        log.info(
            "outbox of %d sources started: %s",
            len(self.runs),
            ", ".join(self.runs),
            extra={"action": "sources_started"},
        )
        loop = asyncio.get_running_loop()
        if self.path is not None and not self.once:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(signal.SIGHUP, self._reload.set)
        try:
            await self._watch()
            # Stopping: each source finishes its batch in hand (cancelled,
            # and so released, if the lifecycle's shutdown timeout ends this).
            await asyncio.gather(*(run.main for run in self.runs.values()), return_exceptions=True)
        finally:
            if self.path is not None and not self.once:
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.remove_signal_handler(signal.SIGHUP)

    def stop(self) -> None:
        self.stopping.set()
        for run in self.runs.values():
            run.stop()

    async def close(self) -> None:
        runs, self.runs = list(self.runs.values()), {}
        await asyncio.gather(*(run.finish() for run in runs))
        await self.listeners.close()

    async def ready(self) -> bool:
        """Every source's database and broker answer (/readyz)."""
        runs = list(self.runs.values())
        answers = await asyncio.gather(*(run.ready() for run in runs))
        self._unready = [run.label for run, ready in zip(runs, answers, strict=True) if not ready]
        if self.metrics.source_ready is not None:
            for run, ready in zip(runs, answers, strict=True):
                self.metrics.source_ready.labels(run.label).set(1 if ready else 0)
        return all(answers)

    def unready(self) -> str | None:
        """The sources not ready at the last look, and why a ready one is not
        (a broker's resource alarm)."""
        reasons = [f"source {label} does not answer" for label in self._unready]
        reasons += [
            f"source {run.label}: {reason}"
            for run in self.runs.values()
            if run.service.unready is not None and (reason := run.service.unready())
        ]
        return "; ".join(reasons) or None

    def progress(self) -> float:
        """The least recent progress of any source (a source waiting for its
        database is excused by the lifecycle: not ready)."""
        clocks = [run.service.progress() for run in self.runs.values() if run.service.progress]
        return min(clocks, default=time.monotonic())

    # -- running the sources ---------------------------------------------------------

    def _start(self, label: str, source: Source) -> None:
        settings = self.settings.replace(database_url=source.database_url, schema=source.schema)
        assert isinstance(settings, OutboxSettings)
        service = outbox_service(
            settings,
            once=self.once,
            metrics=self.metrics.for_source(label),
            pool_size=SOURCE_POOL,
            stagger=True,
            listeners=self.listeners,
        )
        run = SourceRun(label, source, service, self.settings.shutdown_timeout)
        self.runs[label] = run
        run.start()

    async def _drop(self, label: str) -> None:
        self._restart_at.pop(label, None)
        run = self.runs.pop(label)
        await run.finish()
        self.metrics.forget(label)

    async def _watch(self) -> None:
        """Until stopped (or, --once, until every source is drained): the
        file's changes, and sources whose run ended unexpectedly."""
        if self.once:
            # As one source's --once: done when every source is drained; a
            # source's error is the command's (after the others are done).
            await asyncio.gather(*(run.main for run in self.runs.values()))
            return
        restart_at = self._restart_at
        while not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reload.wait(), SOURCES_CHECK)
            if self.stopping.is_set():
                return
            if self.path is not None:
                state = self._stat()
                if self._reload.is_set() or state != self._file_state:
                    self._reload.clear()
                    self._file_state = state
                    await self._read_again()
            now = time.monotonic()
            for label, run in list(self.runs.items()):
                reason = run.failed()
                if reason is None:
                    continue
                if label not in restart_at:
                    log.error(
                        "source %s: %s; starting it again in %gs (the others go on)",
                        label,
                        reason,
                        RESTART_AFTER,
                        extra={"action": "source_failed", "source": label},
                    )
                    restart_at[label] = now + RESTART_AFTER
                elif now >= restart_at[label]:
                    await self._drop(label)
                    self._start(label, run.source)

    def _stat(self) -> tuple[int, int] | None:
        if self.path is None:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    async def _read_again(self) -> None:
        """Start the sources the file adds, stop those it drops; a file that
        cannot be read or has a bad line changes nothing (logged)."""
        assert self.path is not None
        try:
            wanted = labelled(read_sources(self.path))
        except ConfigError as exc:
            log.error("sources not changed: %s", exc, extra={"action": "sources_refused"})
            return
        logs.add_secrets(p for p in (url_password(s.database_url) for s in wanted.values()) if p)
        dropped = [label for label, run in self.runs.items() if wanted.get(label) != run.source]
        added = [
            label
            for label, source in wanted.items()
            if label not in self.runs or self.runs[label].source != source
        ]
        await asyncio.gather(*(self._drop(label) for label in dropped))
        for label in added:
            self._start(label, wanted[label])
        if added or dropped:
            log.info(
                "sources read again: %d running; added %s; dropped %s",
                len(self.runs),
                ", ".join(added) or "none",
                ", ".join(dropped) or "none",
                extra={"action": "sources_changed"},
            )


async def serve_sources(
    settings: OutboxSettings,
    sources: Mapping[str, Source],
    *,
    path: str | None = None,
    once: bool = False,
) -> int:
    """`relay outbox` of several sources (or of a --sources file); returns
    the exit code."""
    daemon = Daemon(
        name="outbox",
        services=[Sources(settings, sources, path=path, once=once).service()],
        shutdown_timeout=settings.shutdown_timeout,
        http_port=settings.http_port,
        own_process=True,
    )
    return await daemon.run()
