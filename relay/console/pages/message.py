"""`/message` and `/edit`: one dead message, and the form that edits and retries it."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from relay.console.site import Site
from relay.console.views import pretty_json
from relay.dead import DeadError, NotFound


async def page(site: Site, request: Request) -> Response:
    place = await site.ensure_schema(request)
    q = request.query_params
    try:
        row = await place.dead.get(
            q.get("id", ""), table=q.get("table") or None, consumer=q.get("consumer") or None
        )
    except NotFound as exc:
        return site.problem(
            request, 404, "Not found", f"{exc}: it may have been retried or discarded."
        )
    except DeadError as exc:
        return site.problem(request, 400, "Which message?", str(exc))
    edit = request.url.path == "/edit"
    return site.render(
        request,
        "edit.html" if edit else "message.html",
        title="Edit and retry" if edit else "Dead message",
        row=row,
        payload_text=(pretty_json(row.payload) if row.payload_text is not None else ""),
    )
