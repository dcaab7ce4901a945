"""`POST /action`: every change the console makes (retry, discard, edit one
dead row or every match; replay), each confirmed first, refused unless the
guard allows it, and audited under the operator's name."""

from __future__ import annotations

import logging
import urllib.parse

from starlette.requests import Request
from starlette.responses import Response

from relay import audit
from relay.audit import Actor
from relay.console.pages import replay as replay_page
from relay.console.pages.dead import FILTER_FIELDS, dead_filter
from relay.console.site import Place, Site
from relay.dead import DeadError, DeadFilter, NotFound
from relay.errors import ReplayBusy, ReplayError

log = logging.getLogger("relay.console")


async def action(site: Site, request: Request) -> Response:
    place = await site.ensure_schema(request)
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    what = fields.get("action", "")
    why, op = site.guard.refusal(request, form)
    if why is not None:
        log.warning("console: refused an action: %s", why)
        if op is not None:  # a person it knows: the trail says who tried what
            await audit.refused(place.store, Actor(op.name, "console"), what or "?", why)
        return site.problem(request, 403, "Not allowed", why)
    assert op is not None
    by = Actor(op.name, "console")
    try:
        if what in ("retry", "discard", "edit") and fields.get("id"):
            return await _one(site, request, place, what, fields, by)
        if what in ("retry-all", "discard-all"):
            return await _many(site, request, place, what, fields, by)
        if what == "replay":
            return await replay_page.act(site, request, place, fields, by)
    except NotFound as exc:
        return site.problem(
            request,
            404,
            "Not found",
            f"{exc}: it may have been retried or discarded meanwhile.",
        )
    except (DeadError, ReplayError) as exc:
        return site.problem(request, 400, "Not done", str(exc))
    except ReplayBusy as exc:
        return site.problem(request, 409, "Not done", str(exc))
    return site.problem(request, 400, "Unknown action", f"Unknown action {what!r}.")


async def _one(
    site: Site, request: Request, place: Place, what: str, f: dict[str, str], by: Actor
) -> Response:
    table, row_id = f.get("table") or None, f["id"]
    consumer = f.get("consumer") or None
    row = await place.dead.get(row_id, table=table, consumer=consumer)
    if f.get("confirm") != "yes":
        return site.render(
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
        await place.dead.retry(DeadFilter(table=s.table, consumer=s.consumer), ids=[s.id], by=by)
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
    return site.render(
        request,
        "done.html",
        title="Done",
        text=done,
        back_url="/dead?" + urllib.parse.urlencode({"table": s.table}),
    )


async def _many(
    site: Site, request: Request, place: Place, what: str, f: dict[str, str], by: Actor
) -> Response:
    values = {k: (f.get(k) or None) for k in FILTER_FIELDS}
    where = dead_filter(values)
    counts = await place.dead.count(where)  # exact: the person confirms this number
    if f.get("confirm") != "yes":
        return site.render(
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
    return site.render(request, "done.html", title="Done", text=done, back_url="/dead")
