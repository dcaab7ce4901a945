"""`POST /login` and `POST /logout`: a person signs in with their token, and out."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from relay.console.guard import READ_ONLY, same_origin
from relay.console.site import Site

log = logging.getLogger("relay.console")


async def login(site: Site, request: Request) -> Response:
    form = await request.form()
    if not site.guard.writable:
        return site.problem(
            request,
            403,
            "Read only",
            READ_ONLY,
        )
    if not same_origin(request):
        return site.problem(request, 403, "Refused", "The request came from another site.")
    given = form.get("token")
    op = site.guard.find(given) if isinstance(given, str) else None
    if op is None:
        log.warning("console: a sign-in with a wrong token")
        return site.problem(request, 403, "Wrong token", "That is not a console token.")
    log.info("console: %s signed in (%s)", op.name, op.role)
    back = form.get("next")
    target = (
        back
        if isinstance(back, str) and back.startswith("/") and not back.startswith("//")
        else "/"
    )
    response = RedirectResponse(target, status_code=303)
    site.guard.sign_in(request, op, response)
    return response


async def logout(site: Site, request: Request) -> Response:
    response = RedirectResponse("/", status_code=303)
    site.guard.sign_out(request, response)
    return response
