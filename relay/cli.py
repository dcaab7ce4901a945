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

from relay import config, logs
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


class Duration(click.ParamType):
    name = "duration"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            return config.parse_duration(value)
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


def _common(f: F) -> F:
    for decorator in reversed([
        option("--database-url", required=True, help="postgresql://user:pass@host:port/db"),
        option("--log-level", default="INFO", show_default=True,
               type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)),
        option("--log-format", default="text", show_default=True,
               type=click.Choice(["text", "json"])),
    ]):
        f = decorator(f)
    return f


def _daemon_options(f: F) -> F:
    for decorator in reversed([
        option("--broker-url", required=True,
               help="amqp://user:pass@host:port/vhost (several RabbitMQ nodes: comma-separated) "
                    "or sqs://[?region=..&endpoint_url=..]"),
        option("--batch-size", type=click.IntRange(min=1), default=500, show_default=True,
               help="rows claimed per batch"),
        option("--poll-interval", type=click.FloatRange(min=0, min_open=True), default=1.0,
               show_default=True, help="seconds between polls when no notification arrives"),
        option("--max-attempts", type=click.IntRange(min=1), default=10, show_default=True,
               help="a row whose attempts reach this is dead"),
        option("--backoff-min", type=click.FloatRange(min=0), default=1.0, show_default=True,
               help="seconds: shortest retry delay"),
        option("--backoff-max", type=click.FloatRange(min=0), default=300.0, show_default=True,
               help="seconds: longest retry delay"),
        option("--exchange", default="relay", show_default=True,
               help="RabbitMQ topic exchange (declared durable if missing)"),
        option("--http-port", type=click.IntRange(0, 65535), default=0, show_default=True,
               help="port for /healthz, /readyz and /metrics (0: none)"),
        option("--shutdown-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0,
               show_default=True, help="seconds to finish the batch in hand on SIGTERM"),
        option("--retention", type=Duration(), default=None,
               help="keep finished rows this long: 90s, 30m, 24h, 7d or seconds "
                    "[default: outbox 1d, inbox 7d]"),
        option("--on-dead", type=click.Choice(["skip", "block"]), default="skip",
               show_default=True, help="skip: later rows of a dead row's key go on; "
                                       "block: the key waits until the row is retried"),
        option("--listen-url", default=None,
               help="direct postgresql:// URL for LISTEN, when --database-url goes "
                    "through a pooler such as PgBouncer [default: --database-url]"),
    ]):
        f = decorator(f)
    return _common(f)


def _setup_logs(kwargs: dict[str, Any]) -> None:
    secrets = [
        config.url_password(kwargs.get("database_url")),
        *config.url_passwords(kwargs.get("broker_url")),
        config.url_password(kwargs.get("listen_url")),
    ]
    logs.setup(kwargs.pop("log_level", "INFO"), kwargs.pop("log_format", "text"),
               [s for s in secrets if s])


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
@click.version_option(package_name="relay")
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

    applied = _run(apply_schema(_build(config.normalize_database_url, url=kwargs["database_url"])))
    if applied:
        click.echo(f"applied: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


@schema.command("sql")
def schema_sql() -> None:
    """Print the DDL that `relay schema apply` runs (needs no database)."""
    from relay import schema as schema_module

    click.echo(schema_module.sql_script(), nl=False)


# -- daemons -------------------------------------------------------------------


@cli.command()
@_daemon_options
@click.option("--once", is_flag=True, help="publish every row due now, then exit 0")
# Checked by the settings (one line on stderr), not by click (a usage block).
@option("--on-unroutable", metavar="publish|fail", default="publish", show_default=True,
        help="RabbitMQ: a message no queue is bound for is published (and counted) "
             "or a failed attempt")
def outbox(once: bool, **kwargs: Any) -> None:
    """The outbox relay: publish committed outbox rows to the broker."""
    _setup_logs(kwargs)
    from relay.outbox import serve_outbox

    settings = _build(config.OutboxSettings, **_daemon_settings(kwargs))
    sys.exit(_run(serve_outbox(settings, once=once)))


@cli.command()
@_daemon_options
@option("--queue", required=True, help="queue to consume (RabbitMQ: declared durable if missing)")
@option("--bind", "binds", multiple=True,
        help="bind the queue to the exchange with this pattern (repeatable; RabbitMQ only)")
@option("--handlers", multiple=True,
        help="module:attribute or module (its `registry`), repeatable "
             "[default: the relay.handlers entry points]")
@option("--consumer-name", default=None, help="dedup scope [default: the queue name]")
@option("--prefetch", type=click.IntRange(min=1), default=1000, show_default=True,
        help="unacknowledged messages the broker may send ahead")
@option("--handler-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0,
        show_default=True, help="seconds; a handler running longer fails that attempt")
@option("--queue-type", metavar="classic|quorum", default=None,
        help="RabbitMQ queue type when relay declares the queue [default: classic]")
@option("--queue-arg", "queue_args", multiple=True, metavar="NAME=VALUE",
        help="RabbitMQ queue argument when relay declares the queue (repeatable; "
             "an integer value is sent as one), e.g. x-max-length=100000")
def inbox(**kwargs: Any) -> None:
    """The inbox daemon: consume a queue into the inbox table and dispatch rows to handlers."""
    _setup_logs(kwargs)
    from relay.handlers import load
    from relay.inbox import serve_inbox

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
@option("--broker-url", default=None,
        help="amqp://user:pass@host:port/vhost or sqs://… (not needed with --producer-only)")
@option("--rate", type=click.FloatRange(min=0, min_open=True), default=200.0, show_default=True,
        help="messages per second the producer offers")
@option("--duration", type=click.FloatRange(min=0), default=0.0, show_default=True,
        help="seconds to run, then stop and exit 0 (0: until Ctrl-C)")
@option("--exchange", default="relay", show_default=True, help="RabbitMQ topic exchange")
@option("--queue", default="relay-demo", show_default=True,
        help="the demo inbox's queue, bound to demo.#")
@option("--http-port", type=click.IntRange(0, 65535), default=0, show_default=True,
        help="port for /healthz, /readyz and /metrics (0: none)")
@option("--producer-only", is_flag=True,
        help="only produce and report; the daemons run elsewhere "
             "(relay inbox --handlers relay.demo:registry)")
@option("--log-level", default="INFO", show_default=True,
        type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
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
@_common
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def status(as_json: bool, **kwargs: Any) -> None:
    """Counts per table and status, and the age of the oldest pending row."""
    _setup_logs(kwargs)
    from relay.api import dead_keys, table_status

    url = _build(config.normalize_database_url, url=kwargs["database_url"])
    report = _run(table_status(url))
    if as_json:
        click.echo(json.dumps(report))
        return
    held = _run(dead_keys(url))
    for table, row in report.items():
        counts = ", ".join(f"{k} {v}" for k, v in row.items() if k != "oldest_pending_seconds")
        age = row["oldest_pending_seconds"]
        oldest = "none pending" if age is None else f"oldest pending {age:.1f}s"
        click.echo(f"{table}: {counts}; {oldest}")
        for consumer, keys, total in held.get(table, []):
            scope = table if consumer is None else f"{table} (consumer {_shown(consumer)})"
            more = f" and {total - len(keys)} more" if total > len(keys) else ""
            click.echo(f"{scope}: keys held by dead rows (under --on-dead block): "
                       f"{', '.join(_shown(k) for k in keys)}{more}")


def _shown(value: str) -> str:
    """A key or name from the tables, quoted unless plainly printable."""
    if value and value.isprintable() and "," not in value and value.strip() == value:
        return value
    return json.dumps(value)


@cli.command()
@click.argument("table", type=click.Choice(["outbox", "inbox"]))
@click.option("--id", "ids", multiple=True,
              help="a row to retry (outbox: its id; inbox: its message_id); repeatable")
@click.option("--all-dead", is_flag=True, help="every dead row")
@click.option("--consumer", default=None, help="inbox only: only this consumer's rows")
@_common
def retry(table: str, ids: tuple[str, ...], all_dead: bool, consumer: str | None,
          **kwargs: Any) -> None:
    """Put dead (or the given) rows back to pending with attempts reset."""
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
    count = _run(retry_rows(url, table, ids=ids, all_dead=all_dead, consumer=consumer))
    click.echo(f"retried {count} {table} row{'s' if count != 1 else ''}")


def main() -> None:
    cli(prog_name="relay")


if __name__ == "__main__":
    main()
