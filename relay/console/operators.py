"""The console's operators: who may sign in, under what name, with what right.

`--console-tokens FILE` lists them, one a line: `NAME ROLE SHA256-HEX`,
ROLE `viewer` (reads only) or `operator` (every action), the token kept as
the hex SHA-256 of its text, never in clear; `#` starts a comment.
RELAY_CONSOLE_TOKEN alone is one operator named `operator`. A file that
cannot be read as such is bad configuration (relay.errors.ConfigError, one
line).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from relay.errors import ConfigError

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
