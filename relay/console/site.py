"""What every page of the console shares: its sources (each one's store and
dead messages, opened when a page first asks for it), the templates, and
how a page is rendered for the person who asked."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import HTMLResponse

from relay.claimcheck.retry import fetch_from
from relay.config import Source, labelled
from relay.console import overview as overview_module
from relay.console.guard import Guard
from relay.console.operators import Roster
from relay.console.sessions import Sessions
from relay.console.settings import ConsoleSettings
from relay.console.views import age, entry_what, pretty_json
from relay.db import Store
from relay.dead import DeadMessages

HERE = Path(__file__).parent
PAGE_SIZE = 50


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


class UnknownSource(Exception):
    """A `source` query parameter that names none of the console's sources."""


@dataclass
class Place:
    """One source the console works on: its label, store and dead messages."""

    label: str
    store: Store
    dead: DeadMessages
    schema_ok: bool = False  # its tables were there at this relay's version


class Site:
    def __init__(self, settings: ConsoleSettings, store: Store | None = None) -> None:
        self.settings = settings
        self.guard = Guard(
            Roster(settings.tokens_file, settings.token, settings.operators),
            Sessions(settings.key, idle=settings.session_idle, lifetime=settings.session_lifetime),
            trust_proxy=settings.trust_proxy,
        )
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

    async def ensure_schema(self, request: Request) -> Place:
        """The page's source; SchemaError until its tables are there at this
        relay's version (then no more checks)."""
        place = self.place(request)
        if not place.schema_ok:
            await place.store.check_schema()
            place.schema_ok = True
        return place

    async def close(self) -> None:
        for place in self._places.values():
            await place.store.close()
        if self._objects is not None:
            await self._objects.close()

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
            csrf=self.guard.csrf(request) if who is not None and who.may_act else "",
        )
        return HTMLResponse(self.env.get_template(name).render(**context), status_code=status)

    def problem(self, request: Request, status: int, title: str, text: str) -> HTMLResponse:
        return self.render(request, "problem.html", status=status, title=title, text=text)
