"""The console's web app: the pages (relay.console.pages) assembled under
the guard (relay.console.guard), and served by uvicorn.

Safe by default:
- it binds 127.0.0.1 unless told otherwise;
- without RELAY_CONSOLE_TOKEN or --console-tokens it is read only; with
  them, who may act and how a browser proves it is relay.console.guard's;
- every action, and every refusal of a person it knows, is in the audit
  trail (relay.audit) under the operator's name;
- every action asks for confirmation first (a second POST with confirm=yes)
  and then says what it did;
- Jinja2 autoescapes everything: payloads, headers and errors are text;
- the pages load nothing from elsewhere (one stylesheet of its own, no
  JavaScript; the Content-Security-Policy says so to the browser).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp

from relay.console.guard import Guarded
from relay.console.pages import actions, audit, dead, keys, message, overview, replay, signin
from relay.console.settings import ConsoleSettings
from relay.console.site import HERE, Site, UnknownSource
from relay.errors import DatabaseUnavailable, SchemaError

__all__ = ["ConsoleSettings", "create_app", "serve"]

log = logging.getLogger("relay.console")

_LOOPBACK = {"127.0.0.1", "::1", "localhost"}

Page = Callable[[Site, Request], Awaitable[Response]]


def create_app(settings: ConsoleSettings) -> ASGIApp:
    """The console as an ASGI app (for tests, or another ASGI server)."""
    site = Site(settings)

    def at(path: str, page: Page, methods: list[str] | None = None) -> Route:
        async def endpoint(request: Request) -> Response:
            return await page(site, request)

        return Route(path, endpoint, methods=methods)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await site.close()

    async def not_ready(request: Request, exc: Exception) -> Response:
        return site.problem(request, 503, "Schema not ready", str(exc))

    async def unknown(request: Request, exc: Exception) -> Response:
        return site.problem(
            request, 404, "No such source", f"The console has no source {str(exc)!r}."
        )

    async def unavailable(request: Request, exc: Exception) -> Response:
        return site.problem(
            request,
            503,
            "Database unavailable",
            "The console cannot reach PostgreSQL right now; reload in a moment.",
        )

    app = Starlette(
        routes=[
            at("/", overview.page),
            at("/dead", dead.page),
            at("/message", message.page),
            at("/edit", message.page),
            at("/keys", keys.page),
            at("/replay", replay.page),
            at("/audit", audit.page),
            at("/login", signin.login, methods=["POST"]),
            at("/logout", signin.logout, methods=["POST"]),
            at("/action", actions.action, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ],
        lifespan=lifespan,
        exception_handlers={
            DatabaseUnavailable: unavailable,
            SchemaError: not_ready,
            UnknownSource: unknown,
        },
    )
    return Guarded(app, site.guard)


async def serve(settings: ConsoleSettings) -> int:
    """Serve the console until SIGTERM or SIGINT; returns the exit status."""
    import uvicorn

    acting = [op.name for op in settings.operators if op.may_act]
    mode = (
        f"{len(settings.operators)} operator(s); changes need the token of one of: "
        + ", ".join(acting)
        if acting
        else ("read only (viewers only)" if settings.operators else "read only")
    )
    if settings.host not in _LOOPBACK:
        log.warning("console: serving on %s, not only on this machine", settings.host)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_config=None,
        log_level="warning",
        access_log=False,
        # X-Forwarded-Proto is believed only with --console-trust-proxy (relay.console.guard)
        proxy_headers=False,
        lifespan="on",
    )

    class Server(uvicorn.Server):
        # uvicorn re-raises SIGTERM after its shutdown, which would end the
        # process by the signal; relay's commands exit 0 after a clean stop.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, self.handle_exit, signum, None)
            try:
                yield
            finally:
                for signum in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(signum)

    server = Server(config)
    log.info(
        "console serving on http://%s:%d (%s)",
        settings.host,
        settings.port,
        mode,
        extra={"action": "console started"},
    )
    await server.serve()
    return 0 if server.started else 1
