"""`/replay`: the form of `relay replay`, and the replay it confirms."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from relay import replay
from relay.audit import Actor
from relay.console.site import Place, Site

log = logging.getLogger("relay.console")


async def page(site: Site, request: Request) -> Response:
    await site.ensure_schema(request)
    return site.render(request, "replay.html", title="Replay")


async def act(site: Site, request: Request, place: Place, f: dict[str, str], by: Actor) -> Response:
    """The replay a form asked for: the count to confirm first, then the replay."""
    where = _replay_filter(f)
    count = await replay.count(place.store, where)  # the person confirms this number
    shown = {k: v for k, v in where.describe().items() if k != "table"}
    if f.get("confirm") != "yes":
        return site.render(
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
    return site.render(request, "done.html", title="Done", text=done, back_url="/replay")


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
