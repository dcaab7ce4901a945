"""The console's sessions: signed by a key only the server holds, bound to
the signed-in person's token, ended by time.

A session cookie is `v1.PAYLOAD.MAC`: PAYLOAD the base64url JSON of the
operator's name, when the session began and when it was last used (in
milliseconds) and a random nonce; MAC an HMAC-SHA256 over the payload and
the token's hash in the tokens file, keyed by the console's key (os.urandom
at start, or --console-secret-file). What the tokens file holds (names and
hashes) is not enough to make one: the key is not in it. A session ends
when it has been unused for `idle` seconds, `lifetime` seconds after it
began, when its person's line leaves the file or their token changes (the
MAC no longer matches), or when its person signs out. Each use renews the
cookie (a new last-used time, the same nonce); the form's CSRF field is an
HMAC of the nonce, so it belongs to that one session.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from relay.console.operators import Operator

VERSION = "v1"
# Ours are about 160 characters and the name; one longer than a browser
# keeps (4 KiB) is not ours, and is not parsed.
MAX_COOKIE = 4096


@dataclass(frozen=True)
class Session:
    name: str
    began: int  # ms since the epoch
    used: int  # ms since the epoch: the last request it came with
    nonce: str

    def __repr__(self) -> str:  # the nonce stays out of logs
        return f"Session(name={self.name!r})"


class Expired(Exception):
    """A session that verifies but is over; its text says why (for the log)."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Sessions:
    def __init__(
        self,
        key: bytes,
        *,
        idle: float,
        lifetime: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if len(key) < 32:
            raise ValueError("a session key needs at least 32 bytes")
        self._key = key
        self.idle = idle
        self.lifetime = lifetime
        self._clock = clock
        self._ended: dict[str, int] = {}  # signed-out nonces, until their session's end

    def __repr__(self) -> str:  # the key stays out of logs
        return f"Sessions(idle={self.idle}, lifetime={self.lifetime})"

    def _now(self) -> int:
        return int(self._clock() * 1000)

    def _mac(self, payload: str, op: Operator) -> str:
        message = f"relay-console-session\0{payload}\0{op.name}\0{op.digest}".encode()
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest())

    def begin(self, op: Operator) -> Session:
        now = self._now()
        return Session(op.name, now, now, secrets.token_urlsafe(16))

    def renewed(self, session: Session) -> Session:
        return replace(session, used=self._now())

    def cookie(self, session: Session, op: Operator) -> str:
        payload = _b64(
            json.dumps(
                [session.name, session.began, session.used, session.nonce], separators=(",", ":")
            ).encode()
        )
        return f"{VERSION}.{payload}.{self._mac(payload, op)}"

    def max_age(self, session: Session) -> int:
        """Seconds the browser may keep the cookie: until the session's absolute end."""
        left = session.began / 1000 + self.lifetime - self._now() / 1000
        return max(1, int(left))

    def read(
        self, value: str, operators: Mapping[str, Operator]
    ) -> tuple[Session, Operator] | None:
        """The session a cookie holds and its person, or None when it does not
        verify (made without the key, or its person's line or token changed);
        Expired when it verifies but is over."""
        version, _, rest = value.partition(".")
        payload, _, mac = rest.partition(".")
        if version != VERSION or not payload or not mac or len(value) > MAX_COOKIE:
            return None
        try:
            name, began, used, nonce = json.loads(_unb64(payload))
        except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError):
            return None
        if not (
            isinstance(name, str)
            and isinstance(nonce, str)
            and type(began) is int
            and type(used) is int
        ):
            return None
        op = operators.get(name)
        if op is None or not hmac.compare_digest(mac.encode(), self._mac(payload, op).encode()):
            return None
        session = Session(name, began, used, nonce)
        now = self._now()
        self._forget_ended(now)
        if nonce in self._ended:
            raise Expired(f"{name} signed out of this session")
        if now - began > self.lifetime * 1000:
            raise Expired(f"{name}'s session reached its end ({self.lifetime:g} s after sign-in)")
        if now - used > self.idle * 1000:
            raise Expired(f"{name}'s session was unused for over {self.idle:g} s")
        return session, op

    def end(self, session: Session) -> None:
        """Sign out: this session's cookie, wherever it was copied, is refused from now."""
        self._ended[session.nonce] = session.began + int(self.lifetime * 1000)

    def _forget_ended(self, now: int) -> None:
        for nonce in [n for n, until in self._ended.items() if until < now]:
            del self._ended[nonce]

    def csrf(self, session: Session) -> str:
        """The form field that proves a POST comes from this session's pages."""
        message = f"relay-console-csrf\0{session.name}\0{session.nonce}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()
