"""The named queries: relay/db/queries/*.sql, read once, looked up by name.

Each file holds several queries, each under a `-- name: <name>` line; the
comment lines right after it document the query and are not sent. Names
are unique across the files. Every query writes its parameters one way,
`:name` (as SQLAlchemy's text() reads them); the plain psycopg connections
get them as `%(name)s` (pyformat) and prepared statements as `$1…`
(numbered), converted here.

The files ship inside the package (relay/db/queries/), found through
importlib.resources from a source checkout and an installed wheel alike.
This module imports neither SQLAlchemy nor psycopg: the receiver's process
uses it.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from importlib import resources

_NAME = re.compile(r"--\s*name:\s*([a-z_][a-z0-9_]*)\s*$")
# A parameter as SQLAlchemy's text() finds one: `:name`, not after a colon,
# a word character or a backslash, and not before a colon (`x::text` is a cast).
_PARAM = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")


class UnknownQuery(KeyError):
    """No query of that name in relay/db/queries/."""


def _parse(text: str, source: str, into: dict[str, str]) -> None:
    name: str | None = None
    body: list[str] = []

    def close() -> None:
        if name is None:
            return
        if name in into:
            raise ValueError(f"query {name!r} is named twice ({source})")
        into[name] = "\n".join(body).strip()

    for line in text.splitlines():
        match = _NAME.match(line.strip())
        if match:
            close()
            name, body = match.group(1), []
        elif name is not None and not body and line.lstrip().startswith("--"):
            continue  # the query's documentation
        elif name is not None and (body or line.strip()):
            body.append(line)
    close()


@functools.cache
def _queries() -> dict[str, str]:
    found: dict[str, str] = {}
    folder = resources.files("relay.db").joinpath("queries")
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".sql"):
            _parse(entry.read_text(encoding="utf-8"), entry.name, found)
    return found


def query(name: str) -> str:
    """The text of the named query, with its `:name` parameters."""
    try:
        return _queries()[name]
    except KeyError:
        raise UnknownQuery(name) from None


# A payload's size in the claims (the `{size}` slot): the bytes of its text,
# as the daemon will hold it, never less than what PostgreSQL stores. A
# value stored uncompressed (pg_column_compression NULL) is measured by
# pg_column_size, from the row or its TOAST pointer, without reading it; a
# compressed one has to be rendered as text to be measured. PostgreSQL 13
# has no pg_column_compression: there every payload is rendered.
_SIZE = (
    "CASE WHEN pg_column_compression(t.payload) IS NULL THEN pg_column_size(t.payload) "
    "ELSE greatest(pg_column_size(t.payload), octet_length(t.payload::text)) END"
)
_SIZE_13 = "greatest(pg_column_size(t.payload), octet_length(t.payload::text))"
# The first server version with pg_column_compression (libpq's numbering).
COMPRESSION_KNOWN = 140000


def claim(
    table: str,
    on_dead: str,
    server_version: int = COMPRESSION_KNOWN,
    *,
    which: str = "",
    before: bool = False,
) -> str:
    """The claim of `table` (outbox, inbox) under the --on-dead policy (skip,
    block): the query with its `{dead}` slot filled from a fixed choice, and
    its `{size}` slot with the payload's size for that server version. The
    outbox's claims share their end (`{tail}`: outbox_claim_tail); `which`
    names another of them (`_ids`: outbox_claim_ids, the WAL capture's),
    and `before` gives that one the `:before` rows that hold nothing back
    (outbox_claim_before_ids)."""
    size = _SIZE if server_version >= COMPRESSION_KNOWN else _SIZE_13
    text = query(f"{table}_claim{which}")
    if "{tail}" in text:
        text = text.replace("{tail}", query(f"{table}_claim_tail"))
    if "{before}" in text:
        ours = query(f"{table}_claim_before_{'ids' if before else 'none'}")
        text = text.replace("{before}", f"\n             {ours}" if ours else "")
    return text.replace("{dead}", query(f"{table}_claim_dead_{on_dead}")).replace("{size}", size)


def names() -> list[str]:
    """Every query's name."""
    return sorted(_queries())


def parameters(sql: str) -> list[str]:
    """The names of a query's parameters, each once, in order of first use."""
    return list(dict.fromkeys(_PARAM.findall(sql)))


def pyformat(sql: str) -> str:
    """The query for psycopg's own execute(): `%(name)s`, and `%` doubled."""
    return _PARAM.sub(r"%(\1)s", sql.replace("%", "%%"))


def numbered(sql: str, order: Sequence[str]) -> str:
    """The query for PREPARE: each `:name` as `$n`, n its place in `order`."""
    places = {name: n for n, name in enumerate(order, 1)}

    def place(match: re.Match[str]) -> str:
        if match.group(1) not in places:
            raise ValueError(f"parameter :{match.group(1)} is not in {list(order)}")
        return f"${places[match.group(1)]}"

    return _PARAM.sub(place, sql)
