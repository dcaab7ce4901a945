"""`relay replay`: finished rows back to pending, published or handled again."""

from __future__ import annotations

import sys
from typing import Any

import click

from relay import config
from relay.cli.base import (
    actor,
    as_option,
    build,
    common,
    fail_config,
    option,
    run_coro,
    setup_logs,
)
from relay.errors import ConfigError
from relay.lifecycle import EXIT_FAILURE


@click.command()
@click.argument("table", type=click.Choice(["outbox", "inbox"]))
@option(
    "--since",
    default=None,
    help="rows written at or after this: an ISO time (UTC unless it says otherwise) "
    "or a duration back from now (90s, 30m, 2h, 7d)",
)
@option("--until", default=None, help="rows written before this (as --since)")
@option(
    "--topic",
    default=None,
    metavar="PATTERN",
    help="rows whose topic matches, as a RabbitMQ binding: `*` one word, `#` zero or more",
)
@option("--type", "type_", default=None, help="rows of this message type")
@option("--key", default=None, help="rows of this key")
@option("--consumer", default=None, help="inbox only: this consumer's rows")
@option("--dry-run", is_flag=True, help="print how many rows would move; change nothing")
@as_option
@common
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
    by = actor(kwargs)
    setup_logs(kwargs)
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
        fail_config(exc)
    url = build(config.normalize_database_url, url=kwargs["database_url"])
    try:
        count = run_coro(run(url, where, dry_run=dry_run, by=by, schema=kwargs["schema"]))
    except ReplayBusy as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    rows = f"{count} {table} row{'s' if count != 1 else ''}"
    click.echo(f"would replay {rows} (dry run: nothing changed)" if dry_run else f"replayed {rows}")
