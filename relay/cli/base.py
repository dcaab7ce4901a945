"""What every `relay` command shares (as Celery's celery/bin/base.py): the
option decorator that also reads RELAY_<FLAG>, the database, source and
logging options, bad configuration as exit 2 with one line on stderr, relay's
errors mapped to exit codes (relay.lifecycle) and how names are printed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from relay import config, logs
from relay.errors import ConfigError, DatabaseUnavailable, SchemaError, SchemaNotReady
from relay.lifecycle import EXIT_CONFIG, EXIT_FAILURE

F = TypeVar("F", bound=Callable[..., Any])


def _envvar(flag: str) -> str:
    """RELAY_<FLAG_IN_CAPS>; an on/off pair (`--retry/--no-retry`) by its first
    name, read as click reads a flag's variable (1/0, true/false, yes/no)."""
    return "RELAY_" + flag.split("/")[0].lstrip("-").upper().replace("-", "_")


def option(flag: str, *names: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads RELAY_<FLAG>: every option of every
    command, as the contract says (a flag beats the variable)."""
    kwargs.setdefault("show_envvar", True)
    return click.option(flag, *names, envvar=_envvar(flag), **kwargs)


class Duration(click.ParamType):  # type: ignore[type-arg]
    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            return config.parse_duration(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _schema(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    try:
        return config.check_schema_name(value)
    except ConfigError as exc:
        fail_config(exc)
    return None


SCHEMA_OPTION = option(
    "--schema",
    default=None,
    callback=_schema,
    help="the schema of relay's tables, triggers and notifications "
    "[default: the connection's search_path]",
)


def _schemas(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    try:
        return [str(config.check_schema_name(name)) for name in value]
    except ConfigError as exc:
        fail_config(exc)
    return []


# `relay outbox`, `relay status` and `relay console` take several sources (relay.sources).
SOURCES_OPTIONS = [
    option(
        "--database-url",
        multiple=True,
        help="postgresql://user:pass@host:port/db; repeatable (several in the "
        "variable: separated by whitespace)",
    ),
    option(
        "--schema",
        "schemas",
        multiple=True,
        callback=_schemas,
        help="the schema of relay's tables, triggers and notifications; repeatable: "
        "every schema in every database [default: the connection's search_path]",
    ),
    option(
        "--sources",
        default=None,
        metavar="FILE",
        help="a file of sources, one `URL [SCHEMA]` a line (# comments); relay outbox "
        "reads it again on SIGHUP and when it changes (instead of --database-url and --schema)",
    ),
]


def common(f: F) -> F:
    return with_common(f, several=False)


def with_common(f: F, *, several: bool) -> F:
    database = (
        SOURCES_OPTIONS
        if several
        else [
            option(
                "--database-url",
                required=True,
                help="postgresql://user:pass@host:port/db (several hosts: "
                "postgresql://user@db1:5432,db2:5432/db; libpq's sslmode, sslrootcert, ...)",
            ),
            SCHEMA_OPTION,
        ]
    )
    for decorator in reversed(
        [
            *database,
            option(
                "--database-password-command",
                default=None,
                help="shell command printing the database password, run when relay opens "
                "a connection (output reused up to 60 s): RDS IAM tokens, Vault",
            ),
            option(
                "--log-level",
                default="INFO",
                show_default=True,
                type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
            ),
            option(
                "--log-format",
                default="text",
                show_default=True,
                type=click.Choice(["text", "json"]),
            ),
        ]
    ):
        f = decorator(f)
    return f


claim_check_option = option(
    "--claim-check",
    default=None,
    metavar="s3://BUCKET[/PREFIX]",
    help="large messages through S3 in the SQS Extended Client's format "
    "(?region=..&endpoint_url=.. optional)",
)


def claim_check_url(url: str | None) -> config.ClaimCheckURL | None:
    return build(config.ClaimCheckURL.parse, url=url) if url else None


def sources_common(f: F) -> F:
    return with_common(f, several=True)


def given_sources(kwargs: dict[str, Any]) -> tuple[list[config.Source], str | None]:
    """The sources of `relay outbox`, `status` or `console`: --sources FILE, else
    every --schema in every --database-url (popped from kwargs)."""
    urls, schemas, path = kwargs.pop("database_url"), kwargs.pop("schemas"), kwargs.pop("sources")
    if path:
        ctx = click.get_current_context()
        given = [
            flag
            for flag, name in (("--database-url", "database_url"), ("--schema", "schemas"))
            if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        ]
        if given:
            fail_config(ConfigError(f"give --sources or {' and '.join(given)}, not both"))
        found = build(config.read_sources, path=path)
        if not found:
            fail_config(ConfigError(f"--sources {path!r} names no source"))
    else:
        found = build(config.combine_sources, urls=urls, schemas=schemas)
    logs.add_secrets(p for p in (config.url_password(s.database_url) for s in found) if p)
    return found, path


def as_option(f: F) -> F:
    """`--as NAME`: who the audit trail records for a write command."""
    return option(
        "--as",
        "as_name",
        default=None,
        metavar="NAME",
        help="the name the audit trail records [default: the OS user]",
    )(f)


def actor(kwargs: dict[str, Any]) -> Any:
    from relay.audit import cli_actor

    return cli_actor(kwargs.pop("as_name", None))


def setup_logs(kwargs: dict[str, Any]) -> None:
    """Logging as asked, with every secret masked; the password command
    installed for every connection this process opens."""
    command = kwargs.pop("database_password_command", None)
    if command is not None and not command.strip():
        fail_config(ConfigError("--database-password-command is blank: unset it or give one"))
    from relay.db import connect

    connect.use_password_command(command)
    # One URL, or (outbox, status) several, each of which may list several.
    urls = kwargs.get("database_url") or ()
    given = " ".join([urls] if isinstance(urls, str) else urls).split()
    secrets = [
        *(config.url_password(url) for url in given),
        *config.url_passwords(kwargs.get("broker_url")),
        config.url_password(kwargs.get("listen_url")),
    ]
    logs.setup(
        kwargs.pop("log_level", "INFO"), kwargs.pop("log_format", "text"), [s for s in secrets if s]
    )


def fail_config(exc: Exception) -> None:
    click.echo(f"relay: error: {exc}", err=True)
    sys.exit(EXIT_CONFIG)


def run_coro(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a library coroutine, mapping relay's errors to exit codes."""
    try:
        return asyncio.run(coro)
    except ConfigError as exc:
        fail_config(exc)
    except SchemaNotReady as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    except SchemaError as exc:
        fail_config(exc)
    except DatabaseUnavailable as exc:
        click.echo(f"relay: error: database unavailable: {exc}", err=True)
        sys.exit(EXIT_FAILURE)


def build(factory: Callable[..., Any], **kwargs: Any) -> Any:
    try:
        return factory(**kwargs)
    except ConfigError as exc:
        fail_config(exc)


def shown(value: str) -> str:
    """A key or name from the tables, quoted unless plainly printable."""
    if value and value.isprintable() and "," not in value and value.strip() == value:
        return value
    return json.dumps(value)
