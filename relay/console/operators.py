"""The console's operators: who may sign in, under what name, with what right.

`--console-tokens FILE` lists them, one a line: `NAME ROLE SHA256-HEX`,
ROLE `viewer` (reads only) or `operator` (every action), the token kept as
the hex SHA-256 of its text, never in clear; `#` starts a comment.
RELAY_CONSOLE_TOKEN alone is one operator named `operator`. A file that
cannot be read as such is bad configuration at start (relay.errors.ConfigError,
one line); the console reads it again when it changes (Roster).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relay.errors import ConfigError

log = logging.getLogger("relay.console")

ROLES = ("viewer", "operator")
_HEX = re.compile(r"[0-9a-fA-F]{64}")
_NAME = re.compile(r"[^\s#]+")


@dataclass(frozen=True)
class Operator:
    name: str
    role: str  # viewer or operator
    digest: str  # the hex SHA-256 of the token, lower case

    @property
    def may_act(self) -> bool:
        return self.role == "operator"

    def __repr__(self) -> str:  # the digest stays out of logs
        return f"Operator(name={self.name!r}, role={self.role!r})"


def digest(token: str) -> str:
    """The hex SHA-256 of a token, as the tokens file holds it."""
    return hashlib.sha256(token.encode()).hexdigest()


def parse(text: str, source: str) -> list[Operator]:
    """The operators of a tokens file's text; ConfigError naming the line."""
    found: list[Operator] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        fields = line.split()
        if len(fields) != 3:
            raise ConfigError(f"{where}: expected NAME ROLE SHA256-HEX-OF-TOKEN")
        name, role, hexed = fields
        if not _NAME.fullmatch(name):
            raise ConfigError(f"{where}: invalid name {name!r}")
        if role not in ROLES:
            raise ConfigError(f"{where}: unknown role {role!r}: use viewer or operator")
        if not _HEX.fullmatch(hexed):
            raise ConfigError(f"{where}: the token must be given as 64 hex digits (its SHA-256)")
        found.append(Operator(name, role, hexed.lower()))
    return check(found, source)


def check(operators: Sequence[Operator], source: str) -> list[Operator]:
    """No name and no token twice (a token must say who signs in)."""
    names: set[str] = set()
    digests: set[str] = set()
    for op in operators:
        if op.name in names:
            raise ConfigError(f"{source}: the name {op.name!r} is given twice")
        if op.digest in digests:
            raise ConfigError(f"{source}: two operators have the same token")
        names.add(op.name)
        digests.add(op.digest)
    return list(operators)


def load(path: str | None, token: str | None) -> tuple[Operator, ...]:
    """The operators of the tokens file at `path` and of RELAY_CONSOLE_TOKEN
    (one operator named `operator`); none: the console is read only."""
    found: list[Operator] = []
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise ConfigError(f"--console-tokens: cannot read {path!r}: {reason}") from None
        found = parse(text, path)
        if not found:
            raise ConfigError(f"--console-tokens: {path!r} lists no operator")
    if token is not None:
        found.append(Operator("operator", "operator", digest(token)))
    return tuple(check(found, "--console-tokens and RELAY_CONSOLE_TOKEN"))


def find(operators: Iterable[Operator], token: str) -> Operator | None:
    """The operator whose token this is (compared in constant time), or None."""
    given = digest(token)
    match = None
    for op in operators:
        if hmac.compare_digest(given, op.digest):
            match = op
    return match


class Roster:
    """The operators as the tokens file says now: the file is read again when
    it changes (its inode, size or modification time), so a new token or a
    removed line takes effect on the next request, and that person's sessions
    end (relay.console.sessions binds each to its token). A file that cannot
    be read as a tokens file then lets nobody in until it can, and says why
    once in the log (ConfigError only at start, where it exits 2)."""

    def __init__(self, path: str | None, token: str | None, operators: tuple[Operator, ...]):
        self.path = path
        self.token = token
        self._stat = self._stat_of()
        self._set(operators)

    def _stat_of(self) -> tuple[int, ...] | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return ()
        return (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def _set(self, operators: tuple[Operator, ...]) -> None:
        self.operators = operators
        self.by_name = {op.name: op for op in operators}

    def current(self) -> Roster:
        """Itself, with the file read again first if it changed."""
        if self.path is None:
            return self
        stat = self._stat_of()
        if stat == self._stat:
            return self
        self._stat = stat
        try:
            found = load(self.path, self.token)
        except ConfigError as exc:
            log.error("console: nobody may sign in until the tokens file is fixed: %s", exc)
            self._set(())
        else:
            log.info("console: read %s again: %d operator(s)", self.path, len(found))
            self._set(found)
        return self
