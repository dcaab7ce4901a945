"""Who may change things, and what the browser is told to keep the pages safe.

- Without RELAY_CONSOLE_TOKEN or --console-tokens the console is read only:
  every action answers 403. With them, a person signs in with their token
  or a client sends `Authorization: Bearer TOKEN`; a `viewer` reads only,
  an `operator` may act (relay.console.operators, whose Roster reads the
  tokens file again when it changes).
- A signed-in browser holds a session cookie (relay.console.sessions:
  signed by a key the tokens file does not hold, ended by time, by a new
  token or by signing out), HttpOnly, SameSite=Strict, and Secure when the
  request came over https (itself, or by a proxy's X-Forwarded-Proto when
  told to trust it); each page renews it.
- Actions are POSTs only, and a cookie-signed POST must carry the form's
  CSRF field (bound to the session) and come from this origin (Origin or
  Referer, when the browser sends them).
- Every response carries SECURITY_HEADERS: the pages load nothing from
  elsewhere (one stylesheet of its own, no JavaScript).
"""

from __future__ import annotations

import hmac
import logging
import urllib.parse

from starlette.datastructures import FormData, Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from relay.console import operators as operators_module
from relay.console.operators import Operator, Roster
from relay.console.sessions import Expired, Session, Sessions

log = logging.getLogger("relay.console")

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
    """Who may change things: the operators, their sessions and CSRF fields."""

    def __init__(self, roster: Roster, sessions: Sessions, *, trust_proxy: bool = False) -> None:
        self.roster = roster
        self.sessions = sessions
        self.trust_proxy = trust_proxy

    @property
    def writable(self) -> bool:
        """Someone may sign in (whether they may act depends on their role)."""
        return self.roster.path is not None or self.roster.token is not None

    def find(self, token: str) -> Operator | None:
        operators = self.roster.current().operators
        return operators_module.find(operators, token) if token else None

    def bearer(self, request: Request) -> Operator | None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        return self.find(given.strip())

    def signed(self, request: Request) -> tuple[Session, Operator] | None:
        """The session this request's cookie holds and its person, if it is
        one of ours and not over (read once a request)."""
        state = request.scope.setdefault("state", {})
        if _SIGNED in state:
            known: tuple[Session, Operator] | None = state[_SIGNED]
            return known
        value = request.cookies.get(COOKIE)
        found = None
        if value:
            try:
                found = self.sessions.read(value, self.roster.current().by_name)
            except Expired as exc:
                log.info("console: a session ended: %s", exc)
            else:
                if found is None:
                    log.warning("console: refused a session cookie it did not make")
            state[_DROP] = found is None
        state[_SIGNED] = found
        return found

    def who(self, request: Request) -> Operator | None:
        """The operator this request comes from (bearer token or session cookie)."""
        if not self.writable:
            return None
        op = self.bearer(request)
        if op is not None:
            return op
        signed = self.signed(request)
        return signed[1] if signed is not None else None

    def csrf(self, request: Request) -> str:
        """The CSRF field for the forms of this request's session ('' without one)."""
        signed = self.signed(request) if self.writable else None
        return self.sessions.csrf(signed[0]) if signed is not None else ""

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
            given.encode(), self.csrf(request).encode()
        ):
            return "Refused: the form's CSRF field is missing or wrong; reload the page.", op
        return None, op

    @staticmethod
    def _viewer(op: Operator) -> str:
        return f"Refused: {op.name} is a viewer, who may only read."

    def secure(self, scope: Scope) -> bool:
        """The request came over https: to this server, or (trusted) to a proxy."""
        if scope.get("scheme") == "https":
            return True
        if not self.trust_proxy:
            return False
        said = Headers(scope=scope).get("x-forwarded-proto", "")
        # the first proxy's word: the scheme the browser used
        return said.split(",")[0].strip().lower() == "https"

    def sign_in(self, request: Request, op: Operator, response: Response) -> None:
        session = self.sessions.begin(op)
        self._set(response, request.scope, session, op)

    def sign_out(self, request: Request, response: Response) -> None:
        signed = self.signed(request)
        if signed is not None:
            self.sessions.end(signed[0])
        response.delete_cookie(
            COOKIE, path="/", httponly=True, samesite="strict", secure=self.secure(request.scope)
        )

    def _set(self, response: Response, scope: Scope, session: Session, op: Operator) -> None:
        response.set_cookie(
            COOKIE,
            self.sessions.cookie(session, op),
            max_age=self.sessions.max_age(session),
            path="/",
            httponly=True,
            samesite="strict",
            secure=self.secure(scope),
        )

    def renewal(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The Set-Cookie a response carries: the session renewed (a new
        last-used time), or the cookie dropped when it was refused."""
        state = scope.get("state", {})
        signed = state.get(_SIGNED)
        response = Response()
        if signed is not None:
            session, op = signed
            self._set(response, scope, self.sessions.renewed(session), op)
        elif state.get(_DROP):
            response.delete_cookie(
                COOKIE, path="/", httponly=True, samesite="strict", secure=self.secure(scope)
            )
        return [(k, v) for k, v in response.raw_headers if k == b"set-cookie"]


_SIGNED = "relay_console_signed"
_DROP = "relay_console_drop"


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


class Guarded:
    """Around the whole app: the security headers on every response, and the
    session cookie renewed (or dropped) unless the response sets it itself."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = message.setdefault("headers", [])
                present = {k.lower() for k, _ in headers}
                for name, value in SECURITY_HEADERS.items():
                    if name.encode() not in present:
                        headers.append((name.encode(), value.encode()))
                if not any(_sets_cookie(k, v) for k, v in headers):
                    headers.extend(self.guard.renewal(scope))
            await send(message)

        await self.app(scope, receive, guarded)


def _sets_cookie(name: bytes, value: bytes) -> bool:
    if name.lower() != b"set-cookie":
        return False
    return value.partition(b"=")[0].strip() == COOKIE.encode()
