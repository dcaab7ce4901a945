"""`/audit`: the audit trail, newest first, a page at a time."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from relay import audit
from relay.console.site import PAGE_SIZE, Site


async def page(site: Site, request: Request) -> Response:
    place = await site.ensure_schema(request)
    before = request.query_params.get("before") or None
    if before is not None and not before.isdigit():
        return site.problem(request, 400, "Bad cursor", f"invalid cursor {before!r}")
    entries = await audit.entries(
        place.store, limit=PAGE_SIZE, before_id=int(before) if before else None
    )
    next_url = f"/audit?before={entries[-1].id}" if len(entries) == PAGE_SIZE else None
    return site.render(
        request,
        "audit.html",
        title="Audit trail",
        entries=entries,
        next_url=next_url,
        first_url="/audit" if before else None,
    )
