"""Handlers: the registry apps fill, the message they receive, and loading
registries from `--handlers` or the `relay.handlers` entry point group."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib import metadata
from typing import Any

from sqlalchemy.util import await_only

from relay.cloudevents import CloudEvent
from relay.errors import ConfigError

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "relay.handlers"


@dataclass(frozen=True)
class Message:
    """An inbox row as a handler sees it."""

    id: str
    type: str | None
    topic: str | None
    key: str | None
    payload: Any
    headers: Mapping[str, Any] = field(default_factory=dict)
    attempts: int = 0  # failed runs before this one
    consumer: str = ""
    # The raw bytes of a body that was not JSON (payload is then None); None
    # for a JSON body, so a handler tells a non-JSON body from a JSON null.
    body: bytes | None = None

    @cached_property
    def cloudevent(self) -> CloudEvent | None:
        """The CloudEvent this message came as (its attributes, read from the
        row's `ce_` headers: `message.cloudevent.source`, `["traceparent"]`),
        or None when it came as no event."""
        return CloudEvent.from_headers(self.headers)


Handler = Callable[[Message, Any], Any]
# A batch handler: the due messages of its type, in seq order, and the connection.
BatchHandler = Callable[[list[Message], Any], Any]
# What a handler or a batch handler is called with.
Messages = Message | list[Message]
# Either, as the code that calls them sees them.
AnyHandler = Callable[[Any, Any], Any]

DEFAULT_MAX_SIZE = 500


def _describe(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class HandlerRegistry:
    """Maps message types to handlers or batch handlers.

    >>> registry = HandlerRegistry()
    >>> @registry.handler("OrderPlaced")
    ... def on_order_placed(message, conn): ...
    >>> @registry.batch_handler("ReadingTaken", max_size=500)
    ... def on_readings(messages, conn): ...
    """

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._batch_handlers: dict[str, tuple[BatchHandler, int]] = {}

    def handler(self, type: str) -> Callable[[Handler], Handler]:
        """Decorator: register the function as the handler of `type`."""
        _check_type(type)

        def register(fn: Handler) -> Handler:
            self.add(type, fn)
            return fn

        return register

    def batch_handler(
        self, type: str, *, max_size: int = DEFAULT_MAX_SIZE
    ) -> Callable[[BatchHandler], BatchHandler]:
        """Decorator: register the function as the batch handler of `type`: it
        gets a list of up to `max_size` due messages of the type, in seq order
        (fewer when a claimed batch, --batch-size rows, holds fewer)."""
        _check_type(type)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
            raise ValueError(f"a batch handler's max_size must be a positive integer: {max_size!r}")

        def register(fn: BatchHandler) -> BatchHandler:
            self.add_batch(type, fn, max_size)
            return fn

        return register

    def add(self, type: str, fn: Handler) -> None:
        existing = self._handlers.get(type)
        if existing is not None and existing is not fn:
            raise ConfigError(
                f"two handlers for message type {type!r}: {_describe(existing)} and {_describe(fn)}"
            )
        if type in self._batch_handlers:
            raise ConfigError(_both(type, fn, self._batch_handlers[type][0]))
        self._handlers[type] = fn

    def add_batch(self, type: str, fn: BatchHandler, max_size: int) -> None:
        existing = self._batch_handlers.get(type)
        if existing is not None and existing != (fn, max_size):
            raise ConfigError(
                f"two batch handlers for message type {type!r}: "
                f"{_describe(existing[0])} and {_describe(fn)}"
            )
        if type in self._handlers:
            raise ConfigError(_both(type, self._handlers[type], fn))
        self._batch_handlers[type] = (fn, max_size)

    def get(self, type: str | None) -> Handler | None:
        return self._handlers.get(type) if type is not None else None

    def get_batch(self, type: str | None) -> tuple[BatchHandler, int] | None:
        """The batch handler of `type` and its max_size, if it has one."""
        return self._batch_handlers.get(type) if type is not None else None

    def include(self, other: HandlerRegistry) -> None:
        """Add every handler of `other`; a type handled twice is a ConfigError."""
        for type, fn in other._handlers.items():
            self.add(type, fn)
        for type, (batch_fn, max_size) in other._batch_handlers.items():
            self.add_batch(type, batch_fn, max_size)

    @property
    def types(self) -> list[str]:
        """Every type with a handler or a batch handler."""
        return sorted({*self._handlers, *self._batch_handlers})

    def functions(self) -> list[Handler | BatchHandler]:
        """Every registered function, handlers and batch handlers."""
        return [*self._handlers.values(), *(fn for fn, _ in self._batch_handlers.values())]

    def __len__(self) -> int:
        return len(self._handlers) + len(self._batch_handlers)


def _check_type(type: str) -> None:
    if not isinstance(type, str) or not type:
        raise ValueError("a handler's message type must be a non-empty string")


def _both(type: str, fn: Handler, batch_fn: BatchHandler) -> str:
    return (
        f"message type {type!r} has a handler ({_describe(fn)}) and a batch handler "
        f"({_describe(batch_fn)}): a type has one or the other"
    )


def is_async(fn: Handler | BatchHandler | None) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


async def invoke(fn: AnyHandler, message: Messages, conn: Any, timeout: float | None) -> None:
    """Run one handler inside a savepoint of `conn` (an AsyncConnection): if it
    raises, its writes are rolled back and the rest of the transaction stands."""
    async with conn.begin_nested():
        await call(fn, message, conn, timeout)


async def call(fn: AnyHandler, message: Messages, conn: Any, timeout: float | None) -> None:
    """Run one handler (or a batch handler, on a list of messages) on `conn`
    (an AsyncConnection), in no savepoint of its own.

    Async handlers get the AsyncConnection and are cancelled after `timeout`;
    sync handlers get its sync Connection. A sync handler cannot be
    interrupted, so one that returns after `timeout` fails that attempt.
    """
    if is_async(fn):
        await _call_async(fn, message, conn, timeout)
    else:
        await conn.run_sync(lambda sync_conn: _call_sync(fn, message, sync_conn, timeout))


def call_from_sync(
    fn: AnyHandler,
    message: Messages,
    conn: Any,
    async_conn: Any,
    timeout: float | None,
    asynchronous: bool | None = None,
) -> None:
    """call() from sync code on `conn` (a sync Connection): a sync handler
    runs here; an async one runs on `async_conn`, the AsyncConnection whose
    run_sync this code runs in (None on a sync engine, where there is no
    async handler to run). `asynchronous`: is_async(fn), if known already."""
    if is_async(fn) if asynchronous is None else asynchronous:
        if async_conn is None:
            raise TypeError("an async handler needs the AsyncConnection of its batch")
        await_only(_call_async(fn, message, async_conn, timeout))
    else:
        _call_sync(fn, message, conn, timeout)


async def _call_async(fn: AnyHandler, message: Messages, conn: Any, timeout: float | None) -> None:
    async with asyncio.timeout(timeout):
        await fn(message, conn)


def _call_sync(fn: AnyHandler, message: Messages, conn: Any, timeout: float | None) -> None:
    started = time.monotonic()
    fn(message, conn)
    ran = time.monotonic() - started
    if timeout is not None and ran > timeout:
        raise TimeoutError(f"handler ran {ran:.1f}s, over --handler-timeout {timeout:g}s")


def load(specs: Iterable[str]) -> HandlerRegistry:
    """One registry from `module:attribute` / `module` specs, or from entry points if none."""
    specs = list(specs)
    merged = HandlerRegistry()
    if specs:
        # The working directory first, as Celery, Dramatiq and uvicorn look
        # for an app's modules: `relay inbox --handlers app.handlers` run
        # from the app's checkout finds it without PYTHONPATH.
        cwd = os.getcwd()
        if cwd not in sys.path:
            sys.path.insert(0, cwd)
        for spec in specs:
            merged.include(_load_spec(spec))
        return merged
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            registry = entry_point.load()
        except Exception as exc:
            raise ConfigError(
                f"cannot load handler entry point {entry_point.name!r} "
                f"({entry_point.value}): {type(exc).__name__}: {exc}"
            ) from None
        merged.include(_check(registry, f"entry point {entry_point.value}"))
    return merged


def _load_spec(spec: str) -> HandlerRegistry:
    module_name, _, attribute = spec.partition(":")
    attribute = attribute or "registry"
    if not module_name:
        raise ConfigError(f"invalid --handlers {spec!r}: expected module:attribute or module")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"cannot import handler module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    try:
        registry = getattr(module, attribute)
    except AttributeError:
        raise ConfigError(
            f"handler module {module_name!r} has no attribute {attribute!r}"
        ) from None
    return _check(registry, spec)


def _check(registry: Any, where: str) -> HandlerRegistry:
    if not isinstance(registry, HandlerRegistry):
        raise ConfigError(f"{where} is a {type(registry).__name__}, not a relay.HandlerRegistry")
    return registry
