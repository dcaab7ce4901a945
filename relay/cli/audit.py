"""`relay audit`: the audit trail, newest first."""

from __future__ import annotations

import json
from typing import Any

import click

from relay import config
from relay.cli.base import build, common, option, run_coro, setup_logs


@click.command()
@common
@option("--json", "as_json", is_flag=True, help="print one JSON array")
@option(
    "--limit",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="entries to print, newest first",
)
@option(
    "--before", "before_id", type=click.IntRange(min=1), default=None, help="entries before this id"
)
def audit(as_json: bool, limit: int, before_id: int | None, **kwargs: Any) -> None:
    """The audit trail, newest first: every write action of the console and the
    CLI (retry, edit, discard, replay) and the console's refusals."""
    setup_logs(kwargs)
    from relay.audit import run_list
    from relay.console.views import describe_entry

    url = build(config.normalize_database_url, url=kwargs["database_url"])
    entries = run_coro(run_list(url, limit=limit, before_id=before_id, schema=kwargs["schema"]))
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries]))
        return
    for entry in entries:
        click.echo(describe_entry(entry))
    if not entries:
        click.echo("the audit trail is empty", err=True)
    elif len(entries) == limit:
        click.echo(f"more entries: add --before {entries[-1].id}", err=True)
