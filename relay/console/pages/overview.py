"""`/`: the overview (counts, rates and, with several sources, each one's row)."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from relay.api import sources_status
from relay.console import overview as overview_module
from relay.console.site import Site
from relay.errors import RelayError, SchemaError, Unavailable

log = logging.getLogger("relay.console")


async def page(site: Site, request: Request) -> Response:
    place = site.place(request)
    sources = None
    if site.several:
        # relay status's report of each source: one that is down or has
        # no tables shows its error in its row, the page still answers.
        report = await sources_status(site.sources, _source_error)
        sources = list(report["sources"].items())
    problem: str | None = None
    scopes: list[overview_module.Scope] = []
    try:
        await site.ensure_schema(request)
        scopes = await overview_module.overview(place.store)
    except SchemaError as exc:  # the console is up: say what is missing
        problem = str(exc)
    except Unavailable:
        if not site.several:
            raise  # the 503 page, as ever
        problem = f"The console cannot reach {place.label}'s database right now."
    return site.render(
        request,
        "overview.html",
        title="Overview",
        scopes=scopes,
        schema_problem=problem,
        sources=sources,
    )


def _source_error(label: str, exc: RelayError) -> str:
    """A source's error in the Sources table: what is missing in its tables,
    or (as the one-source console's 503 page) that its database cannot be
    reached, without libpq's words, which name the server; the log has them."""
    if isinstance(exc, SchemaError):
        return str(exc)
    log.warning("console: source %s: %s", label, exc)
    return "The console cannot reach this source's database right now."
