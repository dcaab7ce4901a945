"""`relay status`: counts per table and status, of one source or several."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from relay import config
from relay.cli.base import given_sources, option, run_coro, setup_logs, shown, sources_common
from relay.lifecycle import EXIT_FAILURE


@click.command()
@sources_common
@option("--json", "as_json", is_flag=True, help="print one JSON object")
def status(as_json: bool, **kwargs: Any) -> None:
    """Counts per table and status, and the age of the oldest pending row (of
    each source, and in all, when given several)."""
    setup_logs(kwargs)
    from relay.api import dead_keys, sources_status, table_status

    sources, path = given_sources(kwargs)
    if len(sources) > 1 or path is not None:
        labelled = config.labelled(sources)
        report = run_coro(sources_status(labelled))
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
                held = run_coro(dead_keys(source.database_url, schema=source.schema))
                _print_status(report["sources"][label], held, indent="  ")
        if failed:
            click.echo(f"relay: error: sources not read: {', '.join(failed)}", err=True)
            sys.exit(EXIT_FAILURE)
        return
    [source] = sources
    report = run_coro(table_status(source.database_url, schema=source.schema))
    if as_json:
        click.echo(json.dumps(report))
        return
    _print_status(report, run_coro(dead_keys(source.database_url, schema=source.schema)))


def _print_status(
    report: dict[str, dict[str, Any]], held: dict[str, list[Any]], indent: str = ""
) -> None:
    for table, row in report.items():
        counts = ", ".join(f"{k} {v}" for k, v in row.items() if k != "oldest_pending_seconds")
        age = row["oldest_pending_seconds"]
        oldest = "none pending" if age is None else f"oldest pending {age:.1f}s"
        click.echo(f"{indent}{table}: {counts}; {oldest}")
        for consumer, keys, total in held.get(table, []):
            scope = table if consumer is None else f"{table} (consumer {shown(consumer)})"
            more = f" and {total - len(keys)} more" if total > len(keys) else ""
            click.echo(
                f"{indent}{scope}: keys held by dead rows (under --on-dead block): "
                f"{', '.join(shown(k) for k in keys)}{more}"
            )
