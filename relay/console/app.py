"""The console's web app: pages over relay.dead and relay.console.overview.

Safe by default:
- it binds 127.0.0.1 unless told otherwise;
- without RELAY_CONSOLE_TOKEN or --console-tokens it is read only: every
  action answers 403; with them, a person signs in with their token (kept
  as an HttpOnly, SameSite=Strict cookie holding their name and an HMAC
  keyed by the token's hash, never the token) or a client sends
  `Authorization: Bearer TOKEN`; a `viewer` reads only, an `operator` may
  act (relay.console.operators);
- every action, and every refusal of a person it knows, is in the audit
  trail (relay.audit) under the operator's name;
- actions are POSTs only, and a cookie-signed POST must carry the form's
  CSRF field (an HMAC of the token) and come from this origin (Origin or
  Referer, when the browser sends them);
- every action asks for confirmation first (a second POST with confirm=yes)
  and then says what it did;
- Jinja2 autoescapes everything: payloads, headers and errors are text;
- the pages load nothing from elsewhere (one stylesheet of its own, no
  JavaScript; the Content-Security-Policy says so to the browser).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import signal
import urllib.parse
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from starlette.applications import Starlette
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from relay import audit, replay
from relay.api import sources_status
from relay.audit import Actor
from relay.claimcheck.retry import fetch_from
from relay.config import ClaimCheckURL, Source, labelled, parse_duration, redact_url
from relay.console import operators as operators_module
from relay.console import overview as overview_module
from relay.console.operators import Operator
from relay.console.views import age, entry_what, pretty_json
from relay.db import Store
from relay.dead import (
    DeadError,
    DeadFilter,
    DeadMessages,
    NotFound,
    parse_cursor,
    summarize,
)
from relay.errors import (
    ConfigError,
    DatabaseUnavailable,
    RelayError,
    ReplayBusy,
    ReplayError,
    SchemaError,
    Unavailable,
)

log = logging.getLogger("relay.console")

HERE = Path(__file__).parent
COOKIE = "relay_console"
PAGE_SIZE = 50
COUNT_CAP = 10_000
GROUP_NEWEST = 5_000
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
READ_ONLY = (
    "The console is read only: start it with RELAY_CONSOLE_TOKEN or --console-tokens "
    "set to allow changes."
)

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


@dataclass(frozen=True)
class ConsoleSettings:
    database_url: str
    schema: str | None = None
    # Several sources (--database-url and --schema repeated, or --sources):
    # the overview lists them all and every other page works on the one its
    # `source` query parameter names. Empty: the one above, as before.
    sources: tuple[Source, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8089
    token: str | None = None  # RELAY_CONSOLE_TOKEN: one operator named `operator`
    tokens_file: str | None = None  # --console-tokens
    operators: tuple[Operator, ...] = field(init=False, default=())  # none: read only
    # Where a retried inbox row kept as a claim check pointer finds its body.
    claim_check: ClaimCheckURL | None = None

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("invalid --host: empty")
        if self.token is not None and not self.token.strip():
            raise ConfigError("RELAY_CONSOLE_TOKEN is blank: unset it (read only) or give one")
        found = operators_module.load(self.tokens_file, self.token)
        object.__setattr__(self, "operators", found)

    def __repr__(self) -> str:
        token = "set" if self.token else "unset"
        return (
            f"ConsoleSettings(database_url={redact_url(self.database_url)!r}, "
            f"sources={len(self.sources)}, host={self.host!r}, port={self.port}, token={token}, "
            f"operators={len(self.operators)})"
        )


class Guard:
    """Who may change things: the operators, their session cookies and CSRF fields."""

    def __init__(self, operators: tuple[Operator, ...]) -> None:
        self.operators = operators
        self.by_name = {op.name: op for op in operators}

    @staticmethod
    def _mac(op: Operator, purpose: str) -> str:
        # Keyed by the token's hash, which only the server holds: a cookie or
        # CSRF field cannot be made without it, and a new token ends them.
        return hmac.new(
            op.digest.encode(), f"relay-console:{purpose}:{op.name}".encode(), hashlib.sha256
        ).hexdigest()

    @property
    def writable(self) -> bool:
        """Someone may sign in (whether they may act depends on their role)."""
        return bool(self.operators)

    def session_value(self, op: Operator) -> str:
        return urllib.parse.quote(op.name, safe="") + "." + self._mac(op, "session")

    def csrf(self, op: Operator | None) -> str:
        return self._mac(op, "csrf") if op is not None else ""

    def find(self, token: str) -> Operator | None:
        return operators_module.find(self.operators, token) if token else None

    def bearer(self, request: Request) -> Operator | None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.find(given.strip())

    def who(self, request: Request) -> Operator | None:
        """The operator this request comes from (bearer token or session cookie)."""
        if not self.writable:
            return None
        op = self.bearer(request)
        if op is not None:
            return op
        quoted, _, mac = request.cookies.get(COOKIE, "").rpartition(".")
        op = self.by_name.get(urllib.parse.unquote(quoted))
        if op is None or not hmac.compare_digest(mac.encode(), self._mac(op, "session").encode()):
            return None
        return op

    def refusal(self, request: Request, form: FormData) -> tuple[str | None, Operator | None]:
        """Why this POST may not change anything (None when it may), and who sent it."""
        if not self.writable:
            return READ_ONLY, None
        op = self.bearer(request)
        if op is not None:
            return (None if op.may_act else self._viewer(op)), op
        op = self.who(request)
        if op is None:
            return "Sign in with your console token to change anything.", None
        if not same_origin(request):
            return "Refused: the request came from another site.", op
        if not op.may_act:
            return self._viewer(op), op
        given = form.get("csrf")
        if not isinstance(given, str) or not hmac.compare_digest(
            given.encode(), self.csrf(op).encode()
        ):
            return "Refused: the form's CSRF field is missing or wrong; reload the page.", op
        return None, op

    @staticmethod
    def _viewer(op: Operator) -> str:
        return f"Refused: {op.name} is a viewer, who may only read."


def same_origin(request: Request) -> bool:
    """False when the browser says the request came from another origin."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if origin is not None:
        return origin != "null" and urllib.parse.urlsplit(origin).netloc == host
    referer = request.headers.get("referer")
    if referer is not None:
        return urllib.parse.urlsplit(referer).netloc == host
    return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                present = {k.lower() for k, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
            await send(message)

        await self.app(scope, receive, with_headers)


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,  # every template: payloads and errors are text, never HTML
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["age"] = age
    env.filters["pretty"] = pretty_json
    env.globals["chart"] = overview_module.chart
    env.filters["what"] = entry_what
    return env


_FILTER_FIELDS = (
    "table",
    "consumer",
    "topic",
    "type",
    "key",
    "error",
    "group",
    "older_than",
    "newer_than",
)


class UnknownSource(Exception):
    """A `source` query parameter that names none of the console's sources."""


@dataclass
class Place:
    """One source the console works on: its label, store and dead messages."""

    label: str
    store: Store
    dead: DeadMessages
    schema_ok: bool = False  # its tables were there at this relay's version


class Console:
    def __init__(self, settings: ConsoleSettings, store: Store | None = None) -> None:
        self.settings = settings
        self.guard = Guard(settings.operators)
        self.several = bool(settings.sources)
        self.sources = labelled(
            settings.sources or (Source(settings.database_url, settings.schema),)
        )
        self._objects = None
        if settings.claim_check is not None:
            from relay.claimcheck.s3 import ObjectStore

            self._objects = ObjectStore(settings.claim_check)
        # Each source's pool is opened when a page first asks for it: a
        # console over a hundred tenants holds connections only to those
        # someone looks at (the overview's counts take one of their own).
        self._places: dict[str, Place] = {}
        if store is not None:
            self._place_of(next(iter(self.sources)), store)
        self.env = _environment()

    def _place_of(self, label: str, store: Store | None = None) -> Place:
        place = self._places.get(label)
        if place is None:
            source = self.sources[label]
            store = store or Store(source.database_url, pool_size=2, schema=source.schema)
            place = self._places[label] = Place(
                label, store, DeadMessages(store, fetch_from(self._objects))
            )
        return place

    @property
    def store(self) -> Store:
        """The first source's store (the only one, without several sources)."""
        return self._place_of(next(iter(self.sources))).store

    def place(self, request: Request) -> Place:
        """The source a page works on: its `source` query parameter (a label
        from the overview's Sources table), else the first; UnknownSource
        (a 404) for any other."""
        label = request.query_params.get("source") or next(iter(self.sources))
        if label not in self.sources:
            raise UnknownSource(label)
        request.state.source = label
        return self._place_of(label)

    async def close(self) -> None:
        for place in self._places.values():
            await place.store.close()
        if self._objects is not None:
            await self._objects.close()

    # -- rendering ---------------------------------------------------------------

    def render(
        self, request: Request, name: str, status: int = 200, **context: Any
    ) -> HTMLResponse:
        who = self.guard.who(request)
        label = getattr(request.state, "source", None) if self.several else None

        def at(url: str) -> str:
            """A link or form action on this page's source."""
            if label is None:
                return url
            return url + ("&" if "?" in url else "?") + urllib.parse.urlencode({"source": label})

        context.update(
            source=label,
            at=at,
            request_path=request.url.path,
            here=request.url.path + (f"?{request.url.query}" if request.url.query else ""),
            writable=self.guard.writable,
            who=who,
            # signed in with the right to act: the pages show their actions
            signed_in=who is not None and who.may_act,
            csrf=self.guard.csrf(who) if who is not None and who.may_act else "",
        )
        return HTMLResponse(self.env.get_template(name).render(**context), status_code=status)

    def problem(self, request: Request, status: int, title: str, text: str) -> HTMLResponse:
        return self.render(request, "problem.html", status=status, title=title, text=text)

    # -- pages -------------------------------------------------------------------

    async def ensure_schema(self, request: Request) -> Place:
        """The page's source; SchemaError until its tables are there at this
        relay's version (then no more checks)."""
        place = self.place(request)
        if not place.schema_ok:
            await place.store.check_schema()
            place.schema_ok = True
        return place

    async def index(self, request: Request) -> Response:
        place = self.place(request)
        sources = None
        if self.several:
            # relay status's report of each source: one that is down or has
            # no tables shows its error in its row, the page still answers.
            report = await sources_status(self.sources, _source_error)
            sources = list(report["sources"].items())
        problem: str | None = None
        scopes: list[overview_module.Scope] = []
        try:
            await self.ensure_schema(request)
            scopes = await overview_module.overview(place.store)
        except SchemaError as exc:  # the console is up: say what is missing
            problem = str(exc)
        except Unavailable:
            if not self.several:
                raise  # the 503 page, as ever
            problem = f"The console cannot reach {place.label}'s database right now."
        return self.render(
            request,
            "overview.html",
            title="Overview",
            scopes=scopes,
            schema_problem=problem,
            sources=sources,
        )

    async def dead_list(self, request: Request) -> Response:
        place = await self.ensure_schema(request)
        values = {f: (request.query_params.get(f) or None) for f in _FILTER_FIELDS}
        after = request.query_params.get("after") or None
        try:
            where = _filter(values)
            parse_cursor(after)
        except DeadError as exc:
            return self.problem(request, 400, "Bad filter", str(exc))
        page = await place.dead.page(where, limit=PAGE_SIZE, after=after)
        if after is None and page.next_cursor is None:
            # Every match is on this page: count and group them here.
            counts = {t: sum(r.table == t for r in page.rows) for t in where.tables()}
            groups = summarize(page.rows)
        else:
            # Beside a million dead rows, counting and grouping them all takes
            # seconds: the page counts up to COUNT_CAP and groups the newest
            # GROUP_NEWEST of each table (`relay dead groups` takes them all),
            # both at once, on connections of their own.
            groups, counts = await asyncio.gather(
                place.dead.groups(where, limit=20, newest=GROUP_NEWEST),
                place.dead.count(where, cap=COUNT_CAP + 1),
            )
        shown = {k: v for k, v in values.items() if v is not None}
        next_url = None
        if page.next_cursor:
            next_url = "/dead?" + urllib.parse.urlencode({**shown, "after": page.next_cursor})
        return self.render(
            request,
            "dead.html",
            title="Dead messages",
            page=page,
            groups=groups,
            counts=counts,
            filters=shown,
            next_url=next_url,
            count_cap=COUNT_CAP,
            group_newest=GROUP_NEWEST,
            first_url="/dead?" + urllib.parse.urlencode(shown) if after else None,
            group_url=lambda g: (
                "/dead?" + urllib.parse.urlencode({**shown, "table": g.table, "group": g.error})
            ),
            message_url=_message_url,
        )

    async def message(self, request: Request) -> Response:
        place = await self.ensure_schema(request)
        q = request.query_params
        try:
            row = await place.dead.get(
                q.get("id", ""), table=q.get("table") or None, consumer=q.get("consumer") or None
            )
        except NotFound as exc:
            return self.problem(
                request, 404, "Not found", f"{exc}: it may have been retried or discarded."
            )
        except DeadError as exc:
            return self.problem(request, 400, "Which message?", str(exc))
        edit = request.url.path == "/edit"
        return self.render(
            request,
            "edit.html" if edit else "message.html",
            title="Edit and retry" if edit else "Dead message",
            row=row,
            payload_text=(pretty_json(row.payload) if row.payload_text is not None else ""),
        )

    async def keys(self, request: Request) -> Response:
        place = await self.ensure_schema(request)
        held = await place.store.dead_keys(200)
        return self.render(
            request,
            "keys.html",
            title="Blocked keys",
            held=held,
            dead_url=lambda table, consumer, key: (
                "/dead?"
                + urllib.parse.urlencode(
                    {
                        k: v
                        for k, v in (("table", table), ("consumer", consumer), ("key", key))
                        if v is not None
                    }
                )
            ),
        )

    # -- sign in -------------------------------------------------------------------

    async def login(self, request: Request) -> Response:
        form = await request.form()
        if not self.guard.writable:
            return self.problem(
                request,
                403,
                "Read only",
                READ_ONLY,
            )
        if not same_origin(request):
            return self.problem(request, 403, "Refused", "The request came from another site.")
        given = form.get("token")
        op = self.guard.find(given) if isinstance(given, str) else None
        if op is None:
            log.warning("console: a sign-in with a wrong token")
            return self.problem(request, 403, "Wrong token", "That is not a console token.")
        log.info("console: %s signed in (%s)", op.name, op.role)
        back = form.get("next")
        target = (
            back
            if isinstance(back, str) and back.startswith("/") and not back.startswith("//")
            else "/"
        )
        response = RedirectResponse(target, status_code=303)
        response.set_cookie(
            COOKIE, self.guard.session_value(op), httponly=True, samesite="strict", path="/"
        )
        return response

    async def logout(self, request: Request) -> Response:
        response = RedirectResponse("/", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # -- actions -------------------------------------------------------------------

    async def action(self, request: Request) -> Response:
        place = await self.ensure_schema(request)
        form = await request.form()
        fields = {k: v for k, v in form.items() if isinstance(v, str)}
        what = fields.get("action", "")
        why, op = self.guard.refusal(request, form)
        if why is not None:
            log.warning("console: refused an action: %s", why)
            if op is not None:  # a person it knows: the trail says who tried what
                await audit.refused(place.store, Actor(op.name, "console"), what or "?", why)
            return self.problem(request, 403, "Not allowed", why)
        assert op is not None
        by = Actor(op.name, "console")
        try:
            if what in ("retry", "discard", "edit") and fields.get("id"):
                return await self._one(request, place, what, fields, by)
            if what in ("retry-all", "discard-all"):
                return await self._many(request, place, what, fields, by)
            if what == "replay":
                return await self._replay(request, place, fields, by)
        except NotFound as exc:
            return self.problem(
                request,
                404,
                "Not found",
                f"{exc}: it may have been retried or discarded meanwhile.",
            )
        except (DeadError, ReplayError) as exc:
            return self.problem(request, 400, "Not done", str(exc))
        except ReplayBusy as exc:
            return self.problem(request, 409, "Not done", str(exc))
        return self.problem(request, 400, "Unknown action", f"Unknown action {what!r}.")

    async def _one(
        self, request: Request, place: Place, what: str, f: dict[str, str], by: Actor
    ) -> Response:
        table, row_id = f.get("table") or None, f["id"]
        consumer = f.get("consumer") or None
        row = await place.dead.get(row_id, table=table, consumer=consumer)
        if f.get("confirm") != "yes":
            return self.render(
                request,
                "confirm.html",
                title="Confirm",
                action=what,
                row=row,
                fields=f,
                count=None,
                filters={},
            )
        s = row.summary
        name = f"{s.table} row {s.id}" + (f" of consumer {s.consumer}" if s.consumer else "")
        if what == "retry":
            await place.dead.retry(
                DeadFilter(table=s.table, consumer=s.consumer), ids=[s.id], by=by
            )
            done = f"Retried {name}: it is pending again, with attempts reset."
        elif what == "discard":
            await place.dead.discard(
                DeadFilter(table=s.table, consumer=s.consumer),
                ids=[s.id],
                reason=f.get("reason") or "discarded in the console",
                by=by,
            )
            done = f"Discarded {name}; a copy is kept in relay_discarded."
        else:
            payload = f.get("payload")
            headers = f.get("headers")
            if s.table == "inbox" and row.payload_text is None and not payload:
                payload = None  # a non-JSON body left as it was
            await place.dead.edit(
                s.id,
                table=s.table,
                consumer=s.consumer,
                payload=payload or None,
                headers=headers or None,
                by=by,
            )
            done = f"Edited and retried {name}: it is pending again, with attempts reset."
        log.info("console: %s", done)
        return self.render(
            request,
            "done.html",
            title="Done",
            text=done,
            back_url="/dead?" + urllib.parse.urlencode({"table": s.table}),
        )

    async def _many(
        self, request: Request, place: Place, what: str, f: dict[str, str], by: Actor
    ) -> Response:
        values = {k: (f.get(k) or None) for k in _FILTER_FIELDS}
        where = _filter(values)
        counts = await place.dead.count(where)  # exact: the person confirms this number
        if f.get("confirm") != "yes":
            return self.render(
                request,
                "confirm.html",
                title="Confirm",
                action=what,
                row=None,
                fields=f,
                count=sum(counts.values()),
                filters={k: v for k, v in values.items() if v is not None},
            )
        if what == "retry-all":
            done_counts = await place.dead.retry(where, by=by)
            verb = "Retried"
        else:
            done_counts = await place.dead.discard(
                where, reason=f.get("reason") or "discarded in the console", by=by
            )
            verb = "Discarded"
        parts = [f"{n} {t} row{'s' if n != 1 else ''}" for t, n in done_counts.items()]
        done = f"{verb} {' and '.join(parts)}."
        if verb == "Discarded":
            done += " Copies are kept in relay_discarded."
        log.info("console: %s", done)
        return self.render(request, "done.html", title="Done", text=done, back_url="/dead")

    async def _replay(
        self, request: Request, place: Place, f: dict[str, str], by: Actor
    ) -> Response:
        where = _replay_filter(f)
        count = await replay.count(place.store, where)  # the person confirms this number
        shown = {k: v for k, v in where.describe().items() if k != "table"}
        if f.get("confirm") != "yes":
            return self.render(
                request,
                "confirm.html",
                title="Confirm",
                action="replay",
                row=None,
                fields=f,
                count=count,
                filters=shown,
                table=where.table,
            )
        moved = await replay.replay(place.store, where, by=by)
        again = "published" if where.table == "outbox" else "handled"
        done = (
            f"Replayed {moved} {where.table} row{'s' if moved != 1 else ''}: pending again, "
            f"to be {again} again in their key's order."
        )
        log.info("console: %s (%s)", done, by.name)
        return self.render(request, "done.html", title="Done", text=done, back_url="/replay")

    async def replay_page(self, request: Request) -> Response:
        await self.ensure_schema(request)
        return self.render(request, "replay.html", title="Replay")

    async def audit_page(self, request: Request) -> Response:
        place = await self.ensure_schema(request)
        before = request.query_params.get("before") or None
        if before is not None and not before.isdigit():
            return self.problem(request, 400, "Bad cursor", f"invalid cursor {before!r}")
        entries = await audit.entries(
            place.store, limit=PAGE_SIZE, before_id=int(before) if before else None
        )
        next_url = f"/audit?before={entries[-1].id}" if len(entries) == PAGE_SIZE else None
        return self.render(
            request,
            "audit.html",
            title="Audit trail",
            entries=entries,
            next_url=next_url,
            first_url="/audit" if before else None,
        )

    # -- the app -----------------------------------------------------------------------

    def app(self) -> ASGIApp:
        @contextlib.asynccontextmanager
        async def lifespan(_: Starlette) -> AsyncIterator[None]:
            try:
                yield
            finally:
                await self.close()

        async def not_ready(request: Request, exc: Exception) -> Response:
            return self.problem(request, 503, "Schema not ready", str(exc))

        async def unknown(request: Request, exc: Exception) -> Response:
            return self.problem(
                request, 404, "No such source", f"The console has no source {str(exc)!r}."
            )

        async def unavailable(request: Request, exc: Exception) -> Response:
            return self.problem(
                request,
                503,
                "Database unavailable",
                "The console cannot reach PostgreSQL right now; reload in a moment.",
            )

        app = Starlette(
            routes=[
                Route("/", self.index),
                Route("/dead", self.dead_list),
                Route("/message", self.message),
                Route("/edit", self.message),
                Route("/keys", self.keys),
                Route("/replay", self.replay_page),
                Route("/audit", self.audit_page),
                Route("/login", self.login, methods=["POST"]),
                Route("/logout", self.logout, methods=["POST"]),
                Route("/action", self.action, methods=["POST"]),
                Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
            ],
            lifespan=lifespan,
            exception_handlers={
                DatabaseUnavailable: unavailable,
                SchemaError: not_ready,
                UnknownSource: unknown,
            },
        )
        return SecurityHeaders(app)


def _source_error(label: str, exc: RelayError) -> str:
    """A source's error in the Sources table: what is missing in its tables,
    or (as the one-source console's 503 page) that its database cannot be
    reached, without libpq's words, which name the server; the log has them."""
    if isinstance(exc, SchemaError):
        return str(exc)
    log.warning("console: source %s: %s", label, exc)
    return "The console cannot reach this source's database right now."


def _filter(values: dict[str, str | None]) -> DeadFilter:
    """The filter a form gave; DeadError for a bad table or age."""
    ages: dict[str, float | None] = {}
    for name in ("older_than", "newer_than"):
        text = values[name]
        try:
            ages[name] = parse_duration(text) if text else None
        except ConfigError as exc:
            raise DeadError(f"{name.replace('_', ' ')}: {exc}") from None
    return DeadFilter(
        table=values["table"],
        consumer=values["consumer"],
        topic=values["topic"],
        type=values["type"],
        key=values["key"],
        error=values["error"],
        group=values["group"],
        **ages,
    )


def _replay_filter(f: dict[str, str]) -> replay.ReplayFilter:
    """The replay a form asked for; ReplayError for bad input."""
    when = {k: replay.parse_when(f[k]) if f.get(k) else None for k in ("since", "until")}
    return replay.ReplayFilter(
        table=f.get("table") or "",
        topic=f.get("topic") or None,
        type=f.get("type") or None,
        key=f.get("key") or None,
        consumer=f.get("consumer") or None,
        **when,
    )


def _message_url(row: Any) -> str:
    params = {"table": row.table, "id": row.id}
    if row.consumer is not None:
        params["consumer"] = row.consumer
    return "/message?" + urllib.parse.urlencode(params)


def create_app(settings: ConsoleSettings) -> ASGIApp:
    """The console as an ASGI app (for tests, or another ASGI server)."""
    return Console(settings).app()


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
