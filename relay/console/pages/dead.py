"""`/dead`: the dead messages, filtered, a page at a time, with their error groups."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from relay.config import parse_duration
from relay.console.site import PAGE_SIZE, Site
from relay.dead import DeadError, DeadFilter, parse_cursor, summarize
from relay.errors import ConfigError

COUNT_CAP = 10_000
GROUP_NEWEST = 5_000

FILTER_FIELDS = (
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


async def page(site: Site, request: Request) -> Response:
    place = await site.ensure_schema(request)
    values = {f: (request.query_params.get(f) or None) for f in FILTER_FIELDS}
    after = request.query_params.get("after") or None
    try:
        where = dead_filter(values)
        parse_cursor(after)
    except DeadError as exc:
        return site.problem(request, 400, "Bad filter", str(exc))
    rows = await place.dead.page(where, limit=PAGE_SIZE, after=after)
    if after is None and rows.next_cursor is None:
        # Every match is on this page: count and group them here.
        counts = {t: sum(r.table == t for r in rows.rows) for t in where.tables()}
        groups = summarize(rows.rows)
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
    if rows.next_cursor:
        next_url = "/dead?" + urllib.parse.urlencode({**shown, "after": rows.next_cursor})
    return site.render(
        request,
        "dead.html",
        title="Dead messages",
        page=rows,
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


def dead_filter(values: dict[str, str | None]) -> DeadFilter:
    """The filter a form or a query gave; DeadError for a bad table or age."""
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


def _message_url(row: Any) -> str:
    params = {"table": row.table, "id": row.id}
    if row.consumer is not None:
        params["consumer"] = row.consumer
    return "/message?" + urllib.parse.urlencode(params)
