"""`/keys`: the keys held by dead rows (under --on-dead block)."""

from __future__ import annotations

import urllib.parse

from starlette.requests import Request
from starlette.responses import Response

from relay.console.site import Site


async def page(site: Site, request: Request) -> Response:
    place = await site.ensure_schema(request)
    held = await place.store.dead_keys(200)
    return site.render(
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
