"""What `relay console` is started with (relay.cli.console builds it)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from relay.config import ClaimCheckURL, Source, redact_url
from relay.console import operators as operators_module
from relay.console.operators import Operator
from relay.errors import ConfigError

SESSION_IDLE = 30 * 60.0
SESSION_LIFETIME = 12 * 3600.0
SECRET_BYTES = 32


@dataclass(frozen=True)
class ConsoleSettings:
    database_url: str
    schema: str | None = None
    # Several sources (--database-url and --schema repeated, or --sources):
    # the overview lists them all and every other page works on the one its
    # `source` query parameter names. Empty: the one above, as before.
    sources: tuple[Source, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8089
    token: str | None = None  # RELAY_CONSOLE_TOKEN: one operator named `operator`
    tokens_file: str | None = None  # --console-tokens
    operators: tuple[Operator, ...] = field(init=False, default=())  # none: read only
    # Where a retried inbox row kept as a claim check pointer finds its body.
    claim_check: ClaimCheckURL | None = None
    # The sessions' key: read from this file, else made at start (os.urandom).
    secret_file: str | None = None  # --console-secret-file
    session_idle: float = SESSION_IDLE  # seconds unused before a session ends
    session_lifetime: float = SESSION_LIFETIME  # seconds after sign-in it ends anyway
    # X-Forwarded-Proto https (from a proxy in front that terminates TLS)
    # marks the session cookie Secure; without this, only https itself does.
    trust_proxy: bool = False
    key: bytes = field(init=False, default=b"")

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("invalid --host: empty")
        if self.token is not None and not self.token.strip():
            raise ConfigError("RELAY_CONSOLE_TOKEN is blank: unset it (read only) or give one")
        found = operators_module.load(self.tokens_file, self.token)
        object.__setattr__(self, "operators", found)
        for flag, seconds in (
            ("--console-session-idle", self.session_idle),
            ("--console-session-max", self.session_lifetime),
        ):
            if not seconds > 0:
                raise ConfigError(f"invalid {flag}: must be greater than zero")
        object.__setattr__(self, "key", _key(self.secret_file, self.tokens_file))

    def __repr__(self) -> str:
        token = "set" if self.token else "unset"
        return (
            f"ConsoleSettings(database_url={redact_url(self.database_url)!r}, "
            f"sources={len(self.sources)}, host={self.host!r}, port={self.port}, token={token}, "
            f"operators={len(self.operators)}, "
            f"secret={'file' if self.secret_file else 'made at start'})"
        )


def _key(path: str | None, tokens_file: str | None) -> bytes:
    """The sessions' key: --console-secret-file's content (at least 32 bytes
    once trimmed; a file of its own, never the tokens file), else 32 bytes
    from os.urandom, which a restart replaces (ending every session)."""
    if path is None:
        return os.urandom(SECRET_BYTES)
    try:
        with open(path, "rb") as f:
            secret = f.read().strip()
        same = tokens_file is not None and os.path.samefile(path, tokens_file)
    except OSError as exc:
        raise ConfigError(
            f"--console-secret-file: cannot read {path!r}: {exc.strerror or exc}"
        ) from None
    if same:
        raise ConfigError(
            "--console-secret-file: give a file of its own, not the tokens file "
            "(whoever reads that one could sign in)"
        )
    if len(secret) < SECRET_BYTES:
        raise ConfigError(
            f"--console-secret-file: {path!r} holds {len(secret)} bytes; give at least "
            f"{SECRET_BYTES} random ones (openssl rand -hex 32)"
        )
    return secret
