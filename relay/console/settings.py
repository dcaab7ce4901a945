"""What `relay console` is started with (relay.cli.console builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from relay.config import ClaimCheckURL, Source, redact_url
from relay.console import operators as operators_module
from relay.console.operators import Operator
from relay.errors import ConfigError


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

    def __post_init__(self) -> None:
        if not self.host.strip():
            raise ConfigError("invalid --host: empty")
        if self.token is not None and not self.token.strip():
            raise ConfigError("RELAY_CONSOLE_TOKEN is blank: unset it (read only) or give one")
        found = operators_module.load(self.tokens_file, self.token)
        object.__setattr__(self, "operators", found)

    def __repr__(self) -> str:
        token = "set" if self.token else "unset"
        return (
            f"ConsoleSettings(database_url={redact_url(self.database_url)!r}, "
            f"sources={len(self.sources)}, host={self.host!r}, port={self.port}, token={token}, "
            f"operators={len(self.operators)})"
        )
