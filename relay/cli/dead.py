"""`relay dead …` and `relay retry`: dead messages listed, shown, grouped,
edited, retried and discarded.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

import click

from relay import config
from relay.cli.base import (
    Duration,
    F,
    actor,
    as_option,
    build,
    claim_check_option,
    claim_check_url,
    common,
    fail_config,
    option,
    run_coro,
    setup_logs,
    shown,
)
from relay.errors import ConfigError
from relay.lifecycle import EXIT_FAILURE


@click.command()
@click.argument("table", type=click.Choice(["outbox", "inbox"]))
@option(
    "--id",
    "ids",
    multiple=True,
    help="a row to retry (outbox: its id; inbox: its message_id); repeatable",
)
@option("--all-dead", is_flag=True, help="every dead row")
@option("--consumer", default=None, help="inbox only: only this consumer's rows")
@claim_check_option
@as_option
@common
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
    by = actor(kwargs)
    setup_logs(kwargs)
    from relay.api import retry as retry_rows

    if not ids and not all_dead:
        fail_config(ConfigError("nothing to retry: give --id ID (repeatable) or --all-dead"))
    if consumer is not None and table == "outbox":
        fail_config(ConfigError("--consumer applies to the inbox only"))
    if table == "outbox":
        for row_id in ids:
            try:
                uuid.UUID(row_id)
            except ValueError:
                fail_config(ConfigError(f"invalid outbox id {row_id!r}: expected a UUID"))
    url = build(config.normalize_database_url, url=kwargs["database_url"])
    count = run_coro(
        retry_rows(
            url,
            table,
            ids=ids,
            all_dead=all_dead,
            consumer=consumer,
            claim_check=claim_check_url(claim_check),
            by=by,
            schema=kwargs["schema"],
        )
    )
    click.echo(f"retried {count} {table} row{'s' if count != 1 else ''}")


def _dead_filter(f: F) -> F:
    for decorator in reversed(
        [
            option(
                "--table",
                type=click.Choice(["outbox", "inbox"]),
                default=None,
                help="only this table [default: both]",
            ),
            option("--consumer", default=None, help="inbox only: this consumer's rows"),
            option("--topic", default=None, help="rows of this topic"),
            option("--type", "type_", default=None, help="rows of this message type"),
            option("--key", default=None, help="rows of this key"),
            option(
                "--error", default=None, help="rows whose last_error contains this text (any case)"
            ),
            option(
                "--group",
                default=None,
                help="rows of this error group, as `relay dead groups` prints it",
            ),
            option(
                "--older-than",
                type=Duration(),
                default=None,
                help="rows written longer ago than this (90s, 30m, 24h, 7d)",
            ),
            option(
                "--newer-than",
                type=Duration(),
                default=None,
                help="rows written more recently than this",
            ),
        ]
    ):
        f = decorator(f)
    return common(f)


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
        fail_config(exc)


def _dead_run(
    work: Callable[[Any], Coroutine[Any, Any, Any]],
    database_url: str,
    schema: str | None,
    claim_check: config.ClaimCheckURL | None = None,
) -> Any:
    """Run `work(DeadMessages)`: bad input exits 2, a row not found exits 1."""
    from relay.dead import DeadError, NotFound, open_dead

    url = build(config.normalize_database_url, url=database_url)

    async def body() -> Any:
        async with open_dead(url, claim_check, schema=schema) as dead:
            return await work(dead)

    try:
        return run_coro(body())
    except NotFound as exc:
        click.echo(f"relay: error: {exc}", err=True)
        sys.exit(EXIT_FAILURE)
    except DeadError as exc:
        fail_config(exc)


@click.group()
def dead() -> None:
    """Dead messages: list, show, group by error, edit, retry, discard."""


@dead.command("list")
@_dead_filter
@option(
    "--limit",
    type=click.IntRange(min=0),
    default=100,
    show_default=True,
    help="rows per page (0: every row, page after page)",
)
@option("--after", default=None, help="the cursor a previous page printed")
@option("--json", "as_json", is_flag=True, help="print one JSON array")
def dead_list(limit: int, after: str | None, as_json: bool, **kwargs: Any) -> None:
    """List dead rows of both tables, newest first (outbox, then inbox)."""
    where = _filter_from(kwargs)
    setup_logs(kwargs)

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
            scope = r.table if r.consumer is None else f"inbox/{shown(r.consumer)}"
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
    return "-" if value is None else shown(value)


def _one_row(f: F) -> F:
    """The row ID argument, and --table and --consumer to say which when it is ambiguous."""
    for decorator in reversed(
        [
            click.argument("row_id", metavar="ID"),
            option(
                "--table",
                type=click.Choice(["outbox", "inbox"]),
                default=None,
                help="the row's table, when the id is dead in both",
            ),
            option("--consumer", default=None, help="inbox: the row's consumer"),
        ]
    ):
        f = decorator(f)
    return f


@dead.command("show")
@_one_row
@option("--json", "as_json", is_flag=True, help="print one JSON object")
@common
def dead_show(
    row_id: str, table: str | None, consumer: str | None, as_json: bool, **kwargs: Any
) -> None:
    """Print one dead row: payload, headers, raw body, attempts and the full last_error."""
    setup_logs(kwargs)
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
@option("--json", "as_json", is_flag=True, help="print one JSON array")
def dead_groups(as_json: bool, **kwargs: Any) -> None:
    """Dead rows grouped by error (exception type and first line), with counts."""
    where = _filter_from(kwargs)
    setup_logs(kwargs)
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
@option("--id", "ids", multiple=True, help="only this row (repeatable)")
@option(
    "--all",
    "every",
    is_flag=True,
    help="every dead row that matches (needed when no filter and no --id is given)",
)
@claim_check_option
@_dead_filter
@as_option
def dead_retry(ids: tuple[str, ...], every: bool, claim_check: str | None, **kwargs: Any) -> None:
    """Put the dead rows that match back to pending with attempts reset
    (inbox rows kept as claim check pointers: their S3 object fetched first)."""
    where = _filter_from(kwargs)
    by = actor(kwargs)
    setup_logs(kwargs)
    if not ids and where.is_empty() and not every:
        fail_config(ConfigError("retry which rows? give a filter, --id ID or --all"))
    done = _dead_run(
        lambda d: d.retry(where, ids=ids, by=by),
        kwargs["database_url"],
        kwargs["schema"],
        claim_check_url(claim_check),
    )
    click.echo(", ".join(f"retried {n} {t} row{'s' if n != 1 else ''}" for t, n in done.items()))


@dead.command("edit")
@_one_row
@option("--payload", default=None, help="the new payload: JSON text, or @FILE")
@option("--headers", default=None, help="the new headers: a JSON object, or @FILE")
@option("--retry/--no-retry", default=True, show_default=True, help="retry the row once edited")
@as_option
@common
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
    by = actor(kwargs)
    setup_logs(kwargs)
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
        fail_config(ConfigError(f"{flag}: cannot read {value[1:]!r}: {exc}"))
    return None


@dead.command("discard")
@option("--id", "ids", multiple=True, help="only this row (repeatable)")
@option(
    "--all",
    "every",
    is_flag=True,
    help="every dead row that matches (needed when no filter and no --id is given)",
)
@option("--reason", default=None, help="kept with the discarded rows")
@_dead_filter
@as_option
def dead_discard(ids: tuple[str, ...], every: bool, reason: str | None, **kwargs: Any) -> None:
    """Delete the dead rows that match, each kept whole in relay_discarded."""
    where = _filter_from(kwargs)
    by = actor(kwargs)
    setup_logs(kwargs)
    if not ids and where.is_empty() and not every:
        fail_config(ConfigError("discard which rows? give a filter, --id ID or --all"))
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
