"""`relay console`: serve the operator's web console (relay.console)."""

from __future__ import annotations

import sys
from typing import Any

import click

from relay.cli.base import (
    Duration,
    build,
    claim_check_option,
    claim_check_url,
    given_sources,
    option,
    run_coro,
    setup_logs,
    sources_common,
)


@click.command()
@sources_common
@option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="address to serve on (anything but loopback exposes the console)",
)
@option(
    "--port",
    type=click.IntRange(1, 65535),
    default=8089,
    show_default=True,
    help="port to serve on",
)
@option(
    "--console-token",
    default=None,
    show_envvar=True,
    help="a token that allows every action, as one operator named `operator` "
    "(prefer the variable); with neither this nor --console-tokens: read only",
)
@option(
    "--console-tokens",
    "tokens_file",
    default=None,
    metavar="FILE",
    help="named operators, one a line: NAME ROLE SHA256-HEX-OF-TOKEN, ROLE viewer "
    "(read only) or operator (every action); `#` starts a comment",
)
@option(
    "--console-secret-file",
    "secret_file",
    default=None,
    metavar="FILE",
    help="the key that signs the console's sessions (at least 32 bytes; a file of its own, "
    "never the tokens file) [default: made at start; a restart ends every session]",
)
@option(
    "--console-session-idle",
    "session_idle",
    type=Duration(),
    default="30m",
    show_default=True,
    help="a session unused this long ends (90s, 30m, 12h or seconds)",
)
@option(
    "--console-session-max",
    "session_lifetime",
    type=Duration(),
    default="12h",
    show_default=True,
    help="a session ends this long after sign-in, used or not",
)
@option(
    "--console-trust-proxy",
    "trust_proxy",
    is_flag=True,
    help="a proxy in front terminates TLS: believe its X-Forwarded-Proto (https marks "
    "the session cookie Secure)",
)
@claim_check_option
def console(claim_check: str | None, **kwargs: Any) -> None:
    """Serve the operator's web console: overview, dead messages, retry, edit,
    discard, replay and the audit trail."""
    token = kwargs.pop("console_token") or None
    tokens_file = kwargs.pop("tokens_file") or None
    setup_logs(kwargs)
    from relay.console.app import serve
    from relay.console.settings import ConsoleSettings

    sources, path = given_sources(kwargs)
    settings = build(
        ConsoleSettings,
        database_url=sources[0].database_url,
        schema=sources[0].schema,
        # several (or a file of them): the overview lists each one
        sources=tuple(sources) if len(sources) > 1 or path is not None else (),
        host=kwargs["host"],
        port=kwargs["port"],
        token=token,
        claim_check=claim_check_url(claim_check),
        tokens_file=tokens_file,
        secret_file=kwargs["secret_file"] or None,
        session_idle=kwargs["session_idle"],
        session_lifetime=kwargs["session_lifetime"],
        trust_proxy=kwargs["trust_proxy"],
    )
    sys.exit(run_coro(serve(settings)))
