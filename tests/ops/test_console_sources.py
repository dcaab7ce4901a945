"""The console over several sources, on the real PostgreSQL: two schemas in
one database and a second database, plus one whose database does not exist.
The overview's Sources table counts each; every other page and action works
on the source its `source` query parameter names, and nothing else."""

from __future__ import annotations

import asyncio
import html
import re
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from starlette.testclient import TestClient

from relay.api import apply_schema
from relay.config import Source, normalize_database_url
from relay.console.app import ConsoleSettings, create_app
from relay.db import namespace
from tests.conftest import rows
from tests.ops.test_console import TOKEN
from tests.ops.test_console_browser import serve_console

BEARER = {"authorization": f"Bearer {TOKEN}"}


def libpq(url: str) -> str:
    return normalize_database_url("postgresql://" + url.partition("://")[2])


@dataclass
class Places:
    shared: str  # the database holding schemas t1 and t2
    other: str  # a second database, its tables in public
    missing: str  # a database that does not exist (its name holds markup)
    shared_name: str
    other_name: str
    missing_name: str

    def sources(self) -> tuple[Source, ...]:
        return (
            Source(self.shared, "t1"),
            Source(self.shared, "t2"),
            Source(self.other, None),
            Source(self.missing, None),
        )


def _name(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlsplit(url).path.lstrip("/"))


@pytest.fixture
def places(empty_database: str, database: str) -> Places:
    shared, other = libpq(empty_database), libpq(database)
    for schema in ("t1", "t2"):
        asyncio.run(apply_schema(shared, schema))
    missing = (
        shared.rsplit("/", 1)[0] + "/" + urllib.parse.quote(f"nowhere<b>{uuid.uuid4().hex[:8]}")
    )
    return Places(shared, other, missing, _name(shared), _name(other), _name(missing))


@pytest.fixture
def shared_engine(empty_database: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(empty_database)
    yield engine
    engine.dispose()


def q(table: str, schema: str | None) -> str:
    return namespace.qualified(table, schema)


def fill(shared: sa.Engine, other: sa.Engine) -> dict[str, list[str]]:
    """t1: 3 pending and 2 dead outbox rows; t2: one dead inbox row and one
    dead outbox row; the other database: 4 published outbox rows."""
    ids: dict[str, list[str]] = {}
    rows(
        shared,
        f"INSERT INTO {q('outbox', 't1')} (topic, payload) "
        "SELECT 'p', '{}' FROM generate_series(1, 3)",
    )
    ids["t1"] = [
        r[0]
        for r in rows(
            shared,
            f"INSERT INTO {q('outbox', 't1')} (topic, payload, status, attempts, last_error) "
            "SELECT 't1.topic', '{}', 'dead', 10, 'boom' FROM generate_series(1, 2) "
            "RETURNING id::text",
        )
    ]
    ids["t2"] = [
        r[0]
        for r in rows(
            shared,
            f"INSERT INTO {q('outbox', 't2')} (topic, payload, status, attempts, last_error) "
            "VALUES ('t2.topic', '{}', 'dead', 10, 'bang') RETURNING id::text",
        )
    ]
    rows(
        shared,
        f"INSERT INTO {q('inbox', 't2')} (consumer, message_id, topic, payload, status, "
        "attempts, last_error) VALUES ('billing', 'm-t2', 'x', '{}', 'dead', 10, 'bang')",
    )
    rows(
        other,
        "INSERT INTO outbox (topic, payload, status, published_at) "
        "SELECT 'o', '{}', 'published', now() FROM generate_series(1, 4)",
    )
    return ids


@pytest.fixture
def console(places: Places) -> Iterator[TestClient]:
    settings = ConsoleSettings(places.shared, sources=places.sources(), token=TOKEN)
    with TestClient(create_app(settings)) as client:
        yield client


def source_rows(page: str) -> dict[str, str]:
    """The Sources table: each row's label and the text of its cells."""
    table = re.search(r'<table class="sources">(.*?)</table>', page, re.DOTALL)
    assert table, "no Sources table"
    found = {}
    for row in re.findall(r"<tr>\s*<th scope=\"row\">(.*?)</tr>", table.group(1), re.DOTALL):
        label = html.unescape(re.sub(r"<[^>]+>", "", row.split("</th>")[0])).strip()
        found[label] = " ".join(html.unescape(re.sub(r"<[^>]+>", " ", row)).split())
    return found


def test_the_overview_lists_every_source_with_its_counts_or_its_error(
    places, console, shared_engine, engine
):
    fill(shared_engine, engine)
    page = console.get("/")
    assert page.status_code == 200
    shown = source_rows(page.text)
    s, o, m = places.shared_name, places.other_name, places.missing_name
    assert list(shown) == [f"{s}/t1", f"{s}/t2", f"{o}/public", f"{m}/public"]
    t1, t2, other, missing = shown.values()
    assert "3 pending · 0 published · 2 dead · oldest" in t1
    assert "0 pending · 0 processed · 0 dead" in t1
    assert "0 pending · 0 published · 1 dead" in t2 and "0 pending · 0 processed · 1 dead" in t2
    assert "0 pending · 4 published · 0 dead" in other
    # A database away: said without libpq's words, which name the server.
    assert "cannot reach this source's database" in missing, missing
    assert "pending" not in missing
    # Labels and errors are text: the markup in the database's name is escaped.
    assert "<b>" not in page.text and "nowhere&lt;b&gt;" in page.text
    assert "127.0.0.1" not in page.text and "postgres@" not in page.text
    # Each label links to that source's dead messages.
    links = re.findall(r'<th scope="row"><a href="([^"]+)">', page.text)
    assert [
        urllib.parse.parse_qs(urllib.parse.urlsplit(html.unescape(u)).query)["source"]
        for u in links
    ] == [[label] for label in shown]
    # The cards below are the first source's, until another is chosen.
    assert re.search(r"pending</dt><dd>3<", page.text)
    chosen = console.get("/", params={"source": f"{o}/public"})
    assert chosen.status_code == 200 and re.search(r"published, last hour</dt><dd>4<", chosen.text)
    down = console.get("/", params={"source": f"{m}/public"})
    assert down.status_code == 200 and "cannot reach" in down.text


def test_source_picks_the_dead_list_and_the_row_a_retry_changes(
    places, console, shared_engine, engine
):
    ids = fill(shared_engine, engine)
    t1, t2 = f"{places.shared_name}/t1", f"{places.shared_name}/t2"
    first = console.get("/dead").text  # no source: the first
    assert "t1.topic" in first and "t2.topic" not in first
    second = console.get("/dead", params={"source": t2}).text
    assert "t2.topic" in second and "t1.topic" not in second and "m-t2" in second
    assert f"source <strong>{t2}</strong>" in second  # the page says which
    # Links and forms on the page stay on that source.
    assert f"source={urllib.parse.quote(t2, safe='')}" in second
    assert f'name="source" value="{t2}"' in second
    [t2_id] = ids["t2"]
    message = console.get("/message", params={"source": t2, "table": "outbox", "id": t2_id})
    assert message.status_code == 200 and "bang" in message.text
    # Each schema numbers its own rows: that id in t1 is no dead row.
    assert (
        console.get("/message", params={"source": t1, "table": "outbox", "id": t2_id}).status_code
        == 404
    )

    done = console.post(
        "/action?" + urllib.parse.urlencode({"source": t2}),
        data={"action": "retry", "table": "outbox", "id": t2_id, "confirm": "yes"},
        headers=BEARER,
    )
    assert done.status_code == 200 and "Retried" in done.text
    t1_status = [
        r[0]
        for r in rows(
            shared_engine, f"SELECT status FROM {q('outbox', 't1')} WHERE status <> 'pending'"
        )
    ]
    t2_status = [r[0] for r in rows(shared_engine, f"SELECT status FROM {q('outbox', 't2')}")]
    assert t1_status == ["dead", "dead"] and t2_status == ["pending"]
    # The audit row is in t2's relay_audit, and the audit page of t2 shows it.
    audit_t1 = rows(shared_engine, f"SELECT count(*) FROM {q('relay_audit', 't1')}")[0][0]
    audit_t2 = rows(shared_engine, f"SELECT action FROM {q('relay_audit', 't2')}")
    assert audit_t1 == 0 and [a[0] for a in audit_t2] == ["retry"]
    assert "retry" in console.get("/audit", params={"source": t2}).text
    assert "retry" not in console.get("/audit", params={"source": t1}).text.split("<main>")[1]


def test_an_unknown_source_is_a_404_on_every_page(console):
    for path in ("/", "/dead", "/keys", "/replay", "/audit", "/message?table=outbox&id=1"):
        page = console.get(path, params={"source": "nope/<i>x</i>"})
        assert page.status_code == 404, path
        assert "no source" in page.text and "<i>x</i>" not in page.text
    refused = console.post(
        "/action?source=nope/public",
        data={"action": "retry-all", "table": "outbox", "confirm": "yes"},
        headers=BEARER,
    )
    assert refused.status_code == 404


def test_a_source_that_is_down_is_a_503_on_its_own_pages(places, console):
    page = console.get("/dead", params={"source": f"{places.missing_name}/public"})
    assert page.status_code == 503
    assert console.get("/dead", params={"source": f"{places.other_name}/public"}).status_code == 200


def test_relay_console_takes_a_file_of_sources(places, start_relay, run_relay, tmp_path: Path):
    listed = tmp_path / "sources"
    listed.write_text(f"{places.shared} t1\n# a comment\n{places.other}\n")
    url = serve_console(start_relay, "--sources", str(listed))
    with urllib.request.urlopen(url + "/", timeout=5) as r:
        page = r.read().decode()
    assert list(source_rows(page)) == [f"{places.shared_name}/t1", f"{places.other_name}/public"]
    both = run_relay("console", "--sources", str(listed), "--schema", "t1")
    assert both.returncode == 2 and "not both" in both.stderr


def test_relay_console_takes_database_url_and_schema_repeated(places, start_relay):
    url = serve_console(
        start_relay,
        "--database-url", places.shared,
        "--database-url", places.other,
        "--schema", "t1",
        "--schema", "t2",
    )  # fmt: skip
    with urllib.request.urlopen(url + "/", timeout=5) as r:
        page = r.read().decode()
    # Every schema in every database: the other one has neither, so its rows say so.
    shown = source_rows(page)
    s, o = places.shared_name, places.other_name
    assert list(shown) == [f"{s}/t1", f"{s}/t2", f"{o}/t1", f"{o}/t2"]
    assert "relay schema apply" in shown[f"{o}/t1"]
