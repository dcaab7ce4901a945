"""`relay`: a thin layer that parses options, builds settings and calls the library.

Every option is a flag and a RELAY_<FLAG> variable (a flag beats the
variable). Bad configuration exits 2 with one line on stderr; see
relay.lifecycle for the other exit codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import uuid
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import click

from relay import __version__, config, logs
from relay.errors import ConfigError, DatabaseUnavailable, SchemaError, SchemaNotReady
from relay.lifecycle import EXIT_CONFIG, EXIT_FAILURE

log = logging.getLogger("relay")

F = TypeVar("F", bound=Callable[..., Any])


def _envvar(flag: str) -> str:
    return "RELAY_" + flag.lstrip("-").upper().replace("-", "_")


def option(flag: str, *names: str, **kwargs: Any) -> Callable[[F], F]:
    """A click option that also reads RELAY_<FLAG>."""
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
        _fail_config(exc)
    return None


_SCHEMA_OPTION = option(
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
        _fail_config(exc)
    return []


# `relay outbox`, `relay status` and `relay console` take several sources (relay.sources).
_SOURCES_OPTIONS = [
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


def _common(f: F) -> F:
    return _with_common(f, several=False)


def _with_common(f: F, *, several: bool) -> F:
    database = (
        _SOURCES_OPTIONS
        if several
        else [
            option(
                "--database-url",
                required=True,
                help="postgresql://user:pass@host:port/db (several hosts: "
                "postgresql://user@db1:5432,db2:5432/db; libpq's sslmode, sslrootcert, ...)",
            ),
            _SCHEMA_OPTION,
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


_claim_check_option = option(
    "--claim-check",
    default=None,
    metavar="s3://BUCKET[/PREFIX]",
    help="large messages through S3 in the SQS Extended Client's format "
    "(?region=..&endpoint_url=.. optional)",
)


def _claim_check(url: str | None) -> config.ClaimCheckURL | None:
    return _build(config.ClaimCheckURL.parse, url=url) if url else None


def _daemon_options(f: F, *, several: bool = False) -> F:
    for decorator in reversed(
        [
            option(
                "--broker-url",
                required=True,
                help="amqp://user:pass@host:port/vhost (several RabbitMQ nodes: comma-separated) "
                "or sqs://[?region=..&endpoint_url=..]",
            ),
            option(
                "--batch-size",
                type=click.IntRange(min=1),
                default=500,
                show_default=True,
                help="rows claimed per batch",
            ),
            option(
                "--batch-bytes",
                default="16MiB",
                show_default=True,
                metavar="SIZE",
                help="bytes of payloads the daemon holds at once, its batches together "
                "(a larger row is taken alone; 16MiB, 1GiB or bytes)",
            ),
            option(
                "--poll-interval",
                type=click.FloatRange(min=0, min_open=True),
                default=1.0,
                show_default=True,
                help="seconds between polls when no notification arrives",
            ),
            option(
                "--max-attempts",
                type=click.IntRange(min=1),
                default=10,
                show_default=True,
                help="a row whose attempts reach this is dead",
            ),
            option(
                "--backoff-min",
                type=click.FloatRange(min=0),
                default=1.0,
                show_default=True,
                help="seconds: shortest retry delay",
            ),
            option(
                "--backoff-max",
                type=click.FloatRange(min=0),
                default=300.0,
                show_default=True,
                help="seconds: longest retry delay",
            ),
            option(
                "--exchange",
                default="relay",
                show_default=True,
                help="RabbitMQ topic exchange (declared durable if missing)",
            ),
            option(
                "--http-port",
                type=click.IntRange(0, 65535),
                default=0,
                show_default=True,
                help="port for /healthz, /readyz and /metrics (0: none)",
            ),
            option(
                "--shutdown-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=30.0,
                show_default=True,
                help="seconds to finish the batch in hand on SIGTERM",
            ),
            option(
                "--retention",
                type=Duration(),
                default=None,
                help="keep finished rows this long: 90s, 30m, 24h, 7d or seconds "
                "[default: outbox 1d, inbox 7d]",
            ),
            option(
                "--on-dead",
                type=click.Choice(["skip", "block"]),
                default="skip",
                show_default=True,
                help="skip: later rows of a dead row's key go on; "
                "block: the key waits until the row is retried",
            ),
            option(
                "--listen-url",
                default=None,
                help="direct postgresql:// URL for LISTEN, when --database-url goes "
                "through a pooler such as PgBouncer [default: --database-url]",
            ),
            _claim_check_option,
            option(
                "--claim-check-over",
                default="256KiB",
                show_default=True,
                metavar="SIZE",
                help="with --claim-check: bodies larger than this go to S3 (256KiB, 1MiB or bytes)",
            ),
        ]
    ):
        f = decorator(f)
    return _with_common(f, several=several)


def _outbox_options(f: F) -> F:
    return _daemon_options(f, several=True)


def _sources_common(f: F) -> F:
    return _with_common(f, several=True)


def _sources(kwargs: dict[str, Any]) -> tuple[list[config.Source], str | None]:
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
            _fail_config(ConfigError(f"give --sources or {' and '.join(given)}, not both"))
        found = _build(config.read_sources, path=path)
        if not found:
            _fail_config(ConfigError(f"--sources {path!r} names no source"))
    else:
        found = _build(config.combine_sources, urls=urls, schemas=schemas)
    logs.add_secrets(p for p in (config.url_password(s.database_url) for s in found) if p)
    return found, path


def _as_option(f: F) -> F:
    """`--as NAME`: who the audit trail records for a write command."""
    return option(
        "--as",
        "as_name",
        default=None,
        metavar="NAME",
        help="the name the audit trail records [default: the OS user]",
    )(f)


def _actor(kwargs: dict[str, Any]) -> Any:
    from relay.audit import cli_actor

    return cli_actor(kwargs.pop("as_name", None))


def _setup_logs(kwargs: dict[str, Any]) -> None:
    """Logging as asked, with every secret masked; the password command
    installed for every connection this process opens."""
    command = kwargs.pop("database_password_command", None)
    if command is not None and not command.strip():
        _fail_config(ConfigError("--database-password-command is blank: unset it or give one"))
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


def _fail_config(exc: Exception) -> None:
    click.echo(f"relay: error: {exc}", err=True)
    sys.exit(EXIT_CONFIG)


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a library coroutine, mapping relay's errors to exit codes."""
    try:
        return asyncio.run(coro)
    except ConfigError as exc:
        _fail_config(exc)
    except SchemaNotReady as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    except SchemaError as exc:
        _fail_config(exc)
    except DatabaseUnavailable as exc:
        click.echo(f"relay: error: database unavailable: {exc}", err=True)
        sys.exit(EXIT_FAILURE)


def _build(factory: Callable[..., Any], **kwargs: Any) -> Any:
    try:
        return factory(**kwargs)
    except ConfigError as exc:
        _fail_config(exc)


def _daemon_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    broker_url = kwargs.pop("broker_url")
    try:
        kwargs["broker"] = config.BrokerURL.parse(broker_url)
    except ConfigError as exc:
        _fail_config(exc)
    if kwargs.get("retention") is None:
        kwargs.pop("retention", None)
    return kwargs


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
# The version relay carries (relay.__version__), not a distribution's metadata
# looked up by name: the distribution is not named `relay` on the index.
@click.version_option(version=__version__, prog_name="relay")
def cli() -> None:
    """relay: transactional outbox and inbox daemons for PostgreSQL, RabbitMQ and SQS."""


# -- schema ------------------------------------------------------------------


@cli.group()
def schema() -> None:
    """Create, upgrade or print the relay tables."""


@schema.command("apply")
@_common
def schema_apply(**kwargs: Any) -> None:
    """Create or upgrade the tables, indexes and triggers (idempotent, concurrency-safe)."""
    _setup_logs(kwargs)
    from relay.api import apply_schema

    url = _build(config.normalize_database_url, url=kwargs["database_url"])
    applied = _run(apply_schema(url, schema=kwargs["schema"]))
    if applied:
        click.echo(f"applied: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


@schema.command("sql")
@_SCHEMA_OPTION
def schema_sql(schema: str | None) -> None:
    """Print the DDL that `relay schema apply` runs (needs no database)."""
    from relay.db import schema as schema_module

    click.echo(schema_module.sql_script(schema), nl=False)


# -- daemons -------------------------------------------------------------------


@cli.command()
@_outbox_options
@click.option("--once", is_flag=True, help="publish every row due now, then exit 0")
# Checked by the settings (one line on stderr), not by click (a usage block).
@option(
    "--on-unroutable",
    metavar="publish|fail",
    default="publish",
    show_default=True,
    help="RabbitMQ: a message no queue is bound for is published (and counted) or a failed attempt",
)
def outbox(once: bool, **kwargs: Any) -> None:
    """The outbox relay: publish committed outbox rows to the broker (of one
    source, or of several: every --schema in every --database-url, or --sources)."""
    _setup_logs(kwargs)
    from relay.wiring import serve_outbox

    sources, path = _sources(kwargs)
    first = sources[0]
    settings = _build(
        config.OutboxSettings,
        database_url=first.database_url,
        schema=first.schema,
        **_daemon_settings(kwargs),
    )
    if len(sources) == 1 and path is None:
        sys.exit(_run(serve_outbox(settings, once=once)))
    if settings.listen_url and len({s.database_url for s in sources}) > 1:
        _fail_config(
            ConfigError(
                "--listen-url names one database: give it only when every source is a "
                "schema of that one --database-url"
            )
        )
    from relay.sources import SOURCE_BATCH, serve_sources

    ctx = click.get_current_context()
    if ctx.get_parameter_source("batch_size") == click.core.ParameterSource.DEFAULT:
        settings = _build(settings.replace, batch_size=SOURCE_BATCH)
    sys.exit(_run(serve_sources(settings, config.labelled(sources), path=path, once=once)))


@cli.command()
@_daemon_options
@option("--queue", required=True, help="queue to consume (RabbitMQ: declared durable if missing)")
@option(
    "--bind",
    "binds",
    multiple=True,
    help="bind the queue to the exchange with this pattern (repeatable; RabbitMQ only)",
)
@option(
    "--handlers",
    multiple=True,
    help="module:attribute or module (its `registry`), repeatable "
    "[default: the relay.handlers entry points]",
)
@option("--consumer-name", default=None, help="dedup scope [default: the queue name]")
@option(
    "--prefetch",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="unacknowledged messages the broker may send ahead",
)
@option(
    "--handler-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="seconds; a handler running longer fails that attempt",
)
@option(
    "--queue-type",
    metavar="classic|quorum",
    default=None,
    help="RabbitMQ queue type when relay declares the queue [default: classic]",
)
@option(
    "--queue-arg",
    "queue_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="RabbitMQ queue argument when relay declares the queue (repeatable; "
    "an integer value is sent as one), e.g. x-max-length=100000",
)
def inbox(**kwargs: Any) -> None:
    """The inbox daemon: consume a queue into the inbox table and dispatch rows to handlers."""
    _setup_logs(kwargs)
    from relay.handlers import load
    from relay.wiring import serve_inbox

    kwargs["binds"] = tuple(kwargs["binds"])
    kwargs["queue_args"] = tuple(kwargs["queue_args"])
    kwargs["consumer_name"] = kwargs["consumer_name"] or ""
    specs = tuple(kwargs.pop("handlers"))
    settings = _build(config.InboxSettings, **_daemon_settings(kwargs))
    registry = _build(load, specs=specs)
    sys.exit(_run(serve_inbox(settings, registry)))


# -- demo ----------------------------------------------------------------------------


@cli.command()
@option("--database-url", required=True, help="postgresql://user:pass@host:port/db")
@_SCHEMA_OPTION
@option(
    "--broker-url",
    default=None,
    help="amqp://user:pass@host:port/vhost or sqs://… (not needed with --producer-only)",
)
@option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=200.0,
    show_default=True,
    help="messages per second the producer offers",
)
@option(
    "--duration",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="seconds to run, then stop and exit 0 (0: until Ctrl-C)",
)
@option("--exchange", default="relay", show_default=True, help="RabbitMQ topic exchange")
@option(
    "--queue",
    default="relay-demo",
    show_default=True,
    help="the demo inbox's queue, bound to demo.#",
)
@option(
    "--http-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="port for /healthz, /readyz and /metrics (0: none)",
)
@option(
    "--producer-only",
    is_flag=True,
    help="only produce and report; the daemons run elsewhere "
    "(relay inbox --handlers relay.demo:registry)",
)
@option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]))
def demo(producer_only: bool, **kwargs: Any) -> None:
    """Apply the schema, then run a producer, both daemons and a sample handler
    in one process, printing live rates (use a scratch database and vhost)."""
    _setup_logs(kwargs)
    from relay.demo import DemoSettings, run_demo

    broker_url = kwargs.pop("broker_url")
    broker = None
    if broker_url or not producer_only:
        broker = _build(config.BrokerURL.parse, url=broker_url)
    settings = _build(DemoSettings, broker=broker, producer_only=producer_only, **kwargs)
    sys.exit(_run(run_demo(settings)))


# -- status and retry ------------------------------------------------------------


@cli.command()
@_sources_common
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def status(as_json: bool, **kwargs: Any) -> None:
    """Counts per table and status, and the age of the oldest pending row (of
    each source, and in all, when given several)."""
    _setup_logs(kwargs)
    from relay.api import dead_keys, sources_status, table_status

    sources, path = _sources(kwargs)
    if len(sources) > 1 or path is not None:
        labelled = config.labelled(sources)
        report = _run(sources_status(labelled))
        failed = [label for label, r in report["sources"].items() if "error" in r]
        if as_json:
            click.echo(json.dumps(report))
        else:
            _print_status({t: report[t] for t in ("outbox", "inbox")}, {})
            for label, source in labelled.items():
                click.echo(f"source {label}:")
                if label in failed:
                    click.echo(f"  error: {report['sources'][label]['error']}")
                    continue
                held = _run(dead_keys(source.database_url, schema=source.schema))
                _print_status(report["sources"][label], held, indent="  ")
        if failed:
            click.echo(f"relay: error: sources not read: {', '.join(failed)}", err=True)
            sys.exit(EXIT_FAILURE)
        return
    [source] = sources
    report = _run(table_status(source.database_url, schema=source.schema))
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_status(report, _run(dead_keys(source.database_url, schema=source.schema)))


def _print_status(
    report: dict[str, dict[str, Any]], held: dict[str, list[Any]], indent: str = ""
) -> None:
    for table, row in report.items():
        counts = ", ".join(f"{k} {v}" for k, v in row.items() if k != "oldest_pending_seconds")
        age = row["oldest_pending_seconds"]
        oldest = "none pending" if age is None else f"oldest pending {age:.1f}s"
        click.echo(f"{indent}{table}: {counts}; {oldest}")
        for consumer, keys, total in held.get(table, []):
            scope = table if consumer is None else f"{table} (consumer {_shown(consumer)})"
            more = f" and {total - len(keys)} more" if total > len(keys) else ""
            click.echo(
                f"{indent}{scope}: keys held by dead rows (under --on-dead block): "
                f"{', '.join(_shown(k) for k in keys)}{more}"
            )


def _shown(value: str) -> str:
    """A key or name from the tables, quoted unless plainly printable."""
    if value and value.isprintable() and "," not in value and value.strip() == value:
        return value
    return json.dumps(value)


@cli.command()
@click.argument("table", type=click.Choice(["outbox", "inbox"]))
@click.option(
    "--id",
    "ids",
    multiple=True,
    help="a row to retry (outbox: its id; inbox: its message_id); repeatable",
)
@click.option("--all-dead", is_flag=True, help="every dead row")
@click.option("--consumer", default=None, help="inbox only: only this consumer's rows")
@_claim_check_option
@_as_option
@_common
def retry(
    table: str,
    ids: tuple[str, ...],
    all_dead: bool,
    consumer: str | None,
    claim_check: str | None,
    **kwargs: Any,
) -> None:
    """Put dead (or the given) rows back to pending with attempts reset
    (inbox rows kept as claim check pointers: their S3 object fetched first)."""
    by = _actor(kwargs)
    _setup_logs(kwargs)
    from relay.api import retry as retry_rows

    if not ids and not all_dead:
        _fail_config(ConfigError("nothing to retry: give --id ID (repeatable) or --all-dead"))
    if consumer is not None and table == "outbox":
        _fail_config(ConfigError("--consumer applies to the inbox only"))
    if table == "outbox":
        for row_id in ids:
            try:
                uuid.UUID(row_id)
            except ValueError:
                _fail_config(ConfigError(f"invalid outbox id {row_id!r}: expected a UUID"))
    url = _build(config.normalize_database_url, url=kwargs["database_url"])
    count = _run(
        retry_rows(
            url,
            table,
            ids=ids,
            all_dead=all_dead,
            consumer=consumer,
            claim_check=_claim_check(claim_check),
            by=by,
            schema=kwargs["schema"],
        )
    )
    click.echo(f"retried {count} {table} row{'s' if count != 1 else ''}")


# -- dead messages and the console ------------------------------------------------


def _dead_filter(f: F) -> F:
    for decorator in reversed(
        [
            click.option(
                "--table",
                type=click.Choice(["outbox", "inbox"]),
                default=None,
                help="only this table [default: both]",
            ),
            click.option("--consumer", default=None, help="inbox only: this consumer's rows"),
            click.option("--topic", default=None, help="rows of this topic"),
            click.option("--type", "type_", default=None, help="rows of this message type"),
            click.option("--key", default=None, help="rows of this key"),
            click.option(
                "--error", default=None, help="rows whose last_error contains this text (any case)"
            ),
            click.option(
                "--group",
                default=None,
                help="rows of this error group, as `relay dead groups` prints it",
            ),
            click.option(
                "--older-than",
                type=Duration(),
                default=None,
                help="rows written longer ago than this (90s, 30m, 24h, 7d)",
            ),
            click.option(
                "--newer-than",
                type=Duration(),
                default=None,
                help="rows written more recently than this",
            ),
        ]
    ):
        f = decorator(f)
    return _common(f)


def _filter_from(kwargs: dict[str, Any]) -> Any:
    from relay.dead import DeadError, DeadFilter

    try:
        return DeadFilter(
            table=kwargs.pop("table"),
            consumer=kwargs.pop("consumer"),
            topic=kwargs.pop("topic"),
            type=kwargs.pop("type_"),
            key=kwargs.pop("key"),
            error=kwargs.pop("error"),
            group=kwargs.pop("group"),
            older_than=kwargs.pop("older_than"),
            newer_than=kwargs.pop("newer_than"),
        )
    except DeadError as exc:
        _fail_config(exc)


def _dead_run(
    work: Callable[[Any], Coroutine[Any, Any, Any]],
    database_url: str,
    schema: str | None,
    claim_check: config.ClaimCheckURL | None = None,
) -> Any:
    """Run `work(DeadMessages)`: bad input exits 2, a row not found exits 1."""
    from relay.dead import DeadError, NotFound, open_dead

    url = _build(config.normalize_database_url, url=database_url)

    async def body() -> Any:
        async with open_dead(url, claim_check, schema=schema) as dead:
            return await work(dead)

    try:
        return _run(body())
    except NotFound as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    except DeadError as exc:
        _fail_config(exc)


@cli.group()
def dead() -> None:
    """Dead messages: list, show, group by error, edit, retry, discard."""


@dead.command("list")
@_dead_filter
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="rows per page (0: every row, page after page)",
)
@click.option("--after", default=None, help="the cursor a previous page printed")
@click.option("--json", "as_json", is_flag=True, help="print one JSON array")
def dead_list(limit: int, after: str | None, as_json: bool, **kwargs: Any) -> None:
    """List dead rows of both tables, newest first (outbox, then inbox)."""
    where = _filter_from(kwargs)
    _setup_logs(kwargs)

    async def work(dead_rows: Any) -> tuple[list[Any], str | None]:
        rows: list[Any] = []
        cursor = after
        while True:
            page = await dead_rows.page(where, limit=limit or 500, after=cursor)
            rows.extend(page.rows)
            cursor = page.next_cursor
            if limit or cursor is None:
                return rows, cursor

    rows, cursor = _dead_run(work, kwargs["database_url"], kwargs["schema"])
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows]))
    else:
        for r in rows:
            scope = r.table if r.consumer is None else f"inbox/{_shown(r.consumer)}"
            click.echo(
                f"{scope}\t{r.id}\t{r.written_at:%Y-%m-%d %H:%M:%S}\t"
                f"topic={_maybe(r.topic)} type={_maybe(r.type)} key={_maybe(r.key)} "
                f"attempts={r.attempts}\t{r.error}"
            )
        if not rows:
            click.echo("no dead rows", err=True)
    if cursor is not None:
        click.echo(f"more rows: add --after {cursor}", err=True)


def _maybe(value: str | None) -> str:
    return "-" if value is None else _shown(value)


@dead.command("show")
@click.argument("row_id", metavar="ID")
@click.option(
    "--table",
    type=click.Choice(["outbox", "inbox"]),
    default=None,
    help="the row's table, when the id is dead in both",
)
@click.option("--consumer", default=None, help="inbox: the row's consumer")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@_common
def dead_show(
    row_id: str, table: str | None, consumer: str | None, as_json: bool, **kwargs: Any
) -> None:
    """Print one dead row: payload, headers, raw body, attempts and the full last_error."""
    _setup_logs(kwargs)
    row = _dead_run(
        lambda d: d.get(row_id, table=table, consumer=consumer),
        kwargs["database_url"],
        kwargs["schema"],
    )
    if as_json:
        click.echo(json.dumps(row.to_json()))
        return
    from relay.console.views import describe_row

    click.echo(describe_row(row))


@dead.command("groups")
@_dead_filter
@click.option("--json", "as_json", is_flag=True, help="print one JSON array")
def dead_groups(as_json: bool, **kwargs: Any) -> None:
    """Dead rows grouped by error (exception type and first line), with counts."""
    where = _filter_from(kwargs)
    _setup_logs(kwargs)
    groups = _dead_run(lambda d: d.groups(where), kwargs["database_url"], kwargs["schema"])
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "table": g.table,
                        "error": g.error,
                        "count": g.count,
                        "newest": g.newest.isoformat(),
                    }
                    for g in groups
                ]
            )
        )
        return
    for g in groups:
        click.echo(f"{g.count}\t{g.table}\t{g.error}")
    if not groups:
        click.echo("no dead rows", err=True)


@dead.command("retry")
@click.option("--id", "ids", multiple=True, help="only this row (repeatable)")
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="every dead row that matches (needed when no filter and no --id is given)",
)
@_claim_check_option
@_dead_filter
@_as_option
def dead_retry(ids: tuple[str, ...], every: bool, claim_check: str | None, **kwargs: Any) -> None:
    """Put the dead rows that match back to pending with attempts reset
    (inbox rows kept as claim check pointers: their S3 object fetched first)."""
    where = _filter_from(kwargs)
    by = _actor(kwargs)
    _setup_logs(kwargs)
    if not ids and where.is_empty() and not every:
        _fail_config(ConfigError("retry which rows? give a filter, --id ID or --all"))
    done = _dead_run(
        lambda d: d.retry(where, ids=ids, by=by),
        kwargs["database_url"],
        kwargs["schema"],
        _claim_check(claim_check),
    )
    click.echo(", ".join(f"retried {n} {t} row{'s' if n != 1 else ''}" for t, n in done.items()))


@dead.command("edit")
@click.argument("row_id", metavar="ID")
@click.option(
    "--table",
    type=click.Choice(["outbox", "inbox"]),
    default=None,
    help="the row's table, when the id is dead in both",
)
@click.option("--consumer", default=None, help="inbox: the row's consumer")
@click.option("--payload", default=None, help="the new payload: JSON text, or @FILE")
@click.option("--headers", default=None, help="the new headers: a JSON object, or @FILE")
@click.option(
    "--retry/--no-retry", default=True, show_default=True, help="retry the row once edited"
)
@_as_option
@_common
def dead_edit(
    row_id: str,
    table: str | None,
    consumer: str | None,
    payload: str | None,
    headers: str | None,
    retry: bool,
    **kwargs: Any,
) -> None:
    """Replace a dead row's payload or headers, then retry it."""
    by = _actor(kwargs)
    _setup_logs(kwargs)
    payload, headers = _text_or_file(payload, "--payload"), _text_or_file(headers, "--headers")
    before = _dead_run(
        lambda d: d.edit(
            row_id,
            table=table,
            consumer=consumer,
            payload=payload,
            headers=headers,
            retry=retry,
            by=by,
        ),
        kwargs["database_url"],
        kwargs["schema"],
    )
    what = " and ".join(n for n, v in (("payload", payload), ("headers", headers)) if v)
    click.echo(
        f"edited the {what} of {before.summary.table} row {row_id}"
        + (" and retried it" if retry else "")
    )


def _text_or_file(value: str | None, flag: str) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        with open(value[1:], encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as exc:
        _fail_config(ConfigError(f"{flag}: cannot read {value[1:]!r}: {exc}"))
    return None


@dead.command("discard")
@click.option("--id", "ids", multiple=True, help="only this row (repeatable)")
@click.option(
    "--all",
    "every",
    is_flag=True,
    help="every dead row that matches (needed when no filter and no --id is given)",
)
@click.option("--reason", default=None, help="kept with the discarded rows")
@_dead_filter
@_as_option
def dead_discard(ids: tuple[str, ...], every: bool, reason: str | None, **kwargs: Any) -> None:
    """Delete the dead rows that match, each kept whole in relay_discarded."""
    where = _filter_from(kwargs)
    by = _actor(kwargs)
    _setup_logs(kwargs)
    if not ids and where.is_empty() and not every:
        _fail_config(ConfigError("discard which rows? give a filter, --id ID or --all"))
    done = _dead_run(
        lambda d: d.discard(where, ids=ids, reason=reason, by=by),
        kwargs["database_url"],
        kwargs["schema"],
    )
    click.echo(
        ", ".join(
            f"discarded {n} {t} row{'s' if n != 1 else ''} (kept in relay_discarded)"
            for t, n in done.items()
        )
    )


# -- replay --------------------------------------------------------------------------


@cli.command()
@click.argument("table", type=click.Choice(["outbox", "inbox"]))
@click.option(
    "--since",
    default=None,
    help="rows written at or after this: an ISO time (UTC unless it says otherwise) "
    "or a duration back from now (90s, 30m, 2h, 7d)",
)
@click.option("--until", default=None, help="rows written before this (as --since)")
@click.option(
    "--topic",
    default=None,
    metavar="PATTERN",
    help="rows whose topic matches, as a RabbitMQ binding: `*` one word, `#` zero or more",
)
@click.option("--type", "type_", default=None, help="rows of this message type")
@click.option("--key", default=None, help="rows of this key")
@click.option("--consumer", default=None, help="inbox only: this consumer's rows")
@click.option("--dry-run", is_flag=True, help="print how many rows would move; change nothing")
@_as_option
@_common
def replay(
    table: str,
    since: str | None,
    until: str | None,
    topic: str | None,
    type_: str | None,
    key: str | None,
    consumer: str | None,
    dry_run: bool,
    **kwargs: Any,
) -> None:
    """Put finished rows back to pending: published again (outbox, with their
    ids) or handled again (inbox), in key order. --since and --until look at
    created_at (outbox) or received_at (inbox); dead rows are not replayed
    (see `relay retry`)."""
    by = _actor(kwargs)
    _setup_logs(kwargs)
    from relay.replay import ReplayBusy, ReplayFilter, parse_when, run

    try:
        where = ReplayFilter(
            table=table,
            since=parse_when(since) if since is not None else None,
            until=parse_when(until) if until is not None else None,
            topic=topic,
            type=type_,
            key=key,
            consumer=consumer,
        )
    except ConfigError as exc:
        _fail_config(exc)
    url = _build(config.normalize_database_url, url=kwargs["database_url"])
    try:
        count = _run(run(url, where, dry_run=dry_run, by=by, schema=kwargs["schema"]))
    except ReplayBusy as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    rows = f"{count} {table} row{'s' if count != 1 else ''}"
    click.echo(f"would replay {rows} (dry run: nothing changed)" if dry_run else f"replayed {rows}")


# -- audit ---------------------------------------------------------------------------


@cli.command()
@_common
@click.option("--json", "as_json", is_flag=True, help="print one JSON array")
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="entries to print, newest first",
)
@click.option(
    "--before", "before_id", type=click.IntRange(min=1), default=None, help="entries before this id"
)
def audit(as_json: bool, limit: int, before_id: int | None, **kwargs: Any) -> None:
    """The audit trail, newest first: every write action of the console and the
    CLI (retry, edit, discard, replay) and the console's refusals."""
    _setup_logs(kwargs)
    from relay.audit import run_list
    from relay.console.views import describe_entry

    url = _build(config.normalize_database_url, url=kwargs["database_url"])
    entries = _run(run_list(url, limit=limit, before_id=before_id, schema=kwargs["schema"]))
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries]))
        return
    for entry in entries:
        click.echo(describe_entry(entry))
    if not entries:
        click.echo("the audit trail is empty", err=True)
    elif len(entries) == limit:
        click.echo(f"more entries: add --before {entries[-1].id}", err=True)


@cli.command()
@_sources_common
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
@_claim_check_option
def console(claim_check: str | None, **kwargs: Any) -> None:
    """Serve the operator's web console: overview, dead messages, retry, edit,
    discard, replay and the audit trail."""
    token = kwargs.pop("console_token") or None
    tokens_file = kwargs.pop("tokens_file") or None
    _setup_logs(kwargs)
    from relay.console.app import ConsoleSettings, serve

    sources, path = _sources(kwargs)
    settings = _build(
        ConsoleSettings,
        database_url=sources[0].database_url,
        schema=sources[0].schema,
        # several (or a file of them): the overview lists each one
        sources=tuple(sources) if len(sources) > 1 or path is not None else (),
        host=kwargs["host"],
        port=kwargs["port"],
        token=token,
        claim_check=_claim_check(claim_check),
        tokens_file=tokens_file,
    )
    sys.exit(_run(serve(settings)))


def main() -> None:
    cli(prog_name="relay")


if __name__ == "__main__":
    main()
