"""`relay schema apply` and `relay schema sql`: create, upgrade or print the tables."""

from __future__ import annotations

from typing import Any

import click

from relay import config
from relay.cli.base import SCHEMA_OPTION, build, common, run_coro, setup_logs


@click.group()
def schema() -> None:
    """Create, upgrade or print the relay tables."""


@schema.command("apply")
@common
def schema_apply(**kwargs: Any) -> None:
    """Create or upgrade the tables, indexes and triggers (idempotent, concurrency-safe)."""
    setup_logs(kwargs)
    from relay.api import apply_schema

    url = build(config.normalize_database_url, url=kwargs["database_url"])
    applied = run_coro(apply_schema(url, schema=kwargs["schema"]))
    if applied:
        click.echo(f"applied: {', '.join(applied)}")
    else:
        click.echo("schema is up to date")


@schema.command("sql")
@SCHEMA_OPTION
def schema_sql(schema: str | None) -> None:
    """Print the DDL that `relay schema apply` runs (needs no database)."""
    from relay.db import schema as schema_module

    click.echo(schema_module.sql_script(schema), nl=False)
