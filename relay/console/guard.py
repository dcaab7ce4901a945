"""Who may change things, and what the browser is told to keep the pages safe.

- Without RELAY_CONSOLE_TOKEN or --console-tokens the console is read only:
  every action answers 403. With them, a person signs in with their token
  (kept as an HttpOnly, SameSite=Strict cookie holding their name and an
  HMAC keyed by the token's hash, never the token) or a client sends
  `Authorization: Bearer TOKEN`; a `viewer` reads only, an `operator` may
  act (relay.console.operators).
- Actions are POSTs only, and a cookie-signed POST must carry the form's
  CSRF field (an HMAC of the token) and come from this origin (Origin or
  Referer, when the browser sends them).
- Every response carries SECURITY_HEADERS: the pages load nothing from
  elsewhere (one stylesheet of its own, no JavaScript).
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.parse
from typing import Any

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from relay.console import operators as operators_module
from relay.console.operators import Operator

COOKIE = "relay_console"
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
