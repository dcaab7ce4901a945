"""The console's pages and actions at the HTTP level, against the real PostgreSQL:
each action, each refusal (read only, no token, wrong token, cross-site,
no CSRF field), and payloads rendered as text. `relay console` itself runs
as a subprocess for the contract's `GET /` and its 127.0.0.1 default."""

from __future__ import annotations

import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from relay.console.app import ConsoleSettings, create_app
from relay.console.guard import COOKIE
from tests.conftest import free_port, rows, wait_until
from tests.ops.test_dead import dead_inbox, dead_outbox, statuses

TOKEN = "correct-horse-battery-staple"
ORIGIN = {"origin": "http://testserver"}


def client(database: str, token: str | None = TOKEN) -> TestClient:
    url = database.replace("postgresql+psycopg://", "postgresql://")
    from relay.config import normalize_database_url

    return TestClient(create_app(ConsoleSettings(normalize_database_url(url), token=token)))


@pytest.fixture
def console(database: str) -> Iterator[TestClient]:
    with client(database) as c:
        yield c


@pytest.fixture
def signed_in(console: TestClient) -> TestClient:
    response = console.post(
        "/login", data={"token": TOKEN, "next": "/dead"}, headers=ORIGIN, follow_redirects=False
    )
    assert response.status_code == 303 and response.headers["location"] == "/dead"
    assert COOKIE in console.cookies
    return console


def csrf_of(page: str) -> str:
    match = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert match, "no CSRF field on the page"
    return match.group(1)


def test_every_page_answers_html_with_a_strict_policy(engine, console):
    [row_id] = dead_outbox(engine)
    dead_inbox(engine, "m-1")
    for path in [
        "/",
        "/dead",
        "/keys",
        f"/message?table=outbox&id={row_id}",
        "/message?id=m-1&consumer=billing",
        f"/edit?id={row_id}",
        "/dead?table=inbox&group=ValueError%3A+order+7+has+no+lines",
        "/static/console.css",
    ]:
        response = console.get(path)
        assert response.status_code == 200, path
        assert "default-src 'none'" in response.headers["content-security-policy"]
    assert "<svg" in console.get("/").text  # the rate chart, drawn inline
    assert "ValueError: order 7 has no lines" in console.get("/dead").text


def test_pages_load_nothing_from_another_server(engine, console):
    dead_outbox(engine)
    for path in ["/", "/dead"]:
        page = console.get(path).text
        assert not re.search(r'(src|href)="(https?:)?//', page), path
        assert "<script" not in page


def test_a_payload_holding_a_script_tag_is_shown_as_text(engine, console):
    [row_id] = dead_outbox(
        engine,
        payload='{"note": "<script>alert(1)</script>", "x": "<img src=x onerror=a()>"}',
        error="<b>bold</b> error",
    )
    dead_inbox(engine, "evil", payload=None, body=b"<script>alert(2)</script>")
    page = console.get(f"/message?table=outbox&id={row_id}").text
    assert "<script>" not in page and "<img" not in page and "<b>bold" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&lt;b&gt;bold&lt;/b&gt; error" in page
    raw = console.get("/message?table=inbox&id=evil").text
    assert "&lt;script&gt;alert(2)&lt;/script&gt;" in raw and "<script>" not in raw
    assert "&lt;b&gt;bold" in console.get("/dead").text


def test_read_only_without_a_token_refuses_every_action(engine, database):
    [row_id] = dead_outbox(engine)
    with client(database, token=None) as c:
        page = c.get(f"/message?table=outbox&id={row_id}").text
        assert "read only" in page and 'value="retry"' not in page
        for data in (
            {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes"},
            {"action": "discard-all", "confirm": "yes"},
        ):
            response = c.post("/action", data=data, headers=ORIGIN)
            assert response.status_code == 403 and "read only" in response.text
        assert c.post("/login", data={"token": ""}, headers=ORIGIN).status_code == 403
    assert statuses(engine, "outbox")[row_id] == "dead"


def test_without_signing_in_or_with_a_wrong_token_nothing_changes(engine, console):
    [row_id] = dead_outbox(engine)
    data = {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes"}
    refused = console.post("/action", data=data, headers=ORIGIN)
    assert refused.status_code == 403 and "Sign in" in refused.text
    wrong = console.post("/login", data={"token": "guess"}, headers=ORIGIN)
    assert wrong.status_code == 403 and COOKIE not in console.cookies
    bearer = console.post("/action", data=data, headers={"authorization": "Bearer guess"})
    assert bearer.status_code == 403
    console.cookies.set(COOKIE, "forged")
    assert console.post("/action", data=data, headers=ORIGIN).status_code == 403
    assert statuses(engine, "outbox")[row_id] == "dead"
    assert TOKEN not in refused.text + wrong.text


def test_a_cross_site_post_is_refused_even_when_signed_in(engine, signed_in):
    [row_id] = dead_outbox(engine)
    csrf = csrf_of(signed_in.get(f"/message?table=outbox&id={row_id}").text)
    data = {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes", "csrf": csrf}
    other = signed_in.post("/action", data=data, headers={"origin": "https://evil.example"})
    assert other.status_code == 403 and "another site" in other.text
    no_csrf = signed_in.post("/action", data={**data, "csrf": ""}, headers=ORIGIN)
    assert no_csrf.status_code == 403 and "CSRF" in no_csrf.text
    assert signed_in.get("/action").status_code == 405  # actions are POSTs only
    assert statuses(engine, "outbox")[row_id] == "dead"


def test_retry_asks_for_confirmation_then_says_what_it_did(engine, signed_in):
    [row_id] = dead_outbox(engine)
    csrf = csrf_of(signed_in.get(f"/message?table=outbox&id={row_id}").text)
    data = {"action": "retry", "table": "outbox", "id": row_id, "csrf": csrf}
    asked = signed_in.post("/action", data=data, headers=ORIGIN)
    assert asked.status_code == 200 and "Yes, retry" in asked.text
    assert statuses(engine, "outbox")[row_id] == "dead"
    done = signed_in.post("/action", data={**data, "confirm": "yes"}, headers=ORIGIN)
    assert done.status_code == 200 and f"Retried outbox row {row_id}" in done.text
    assert statuses(engine, "outbox")[row_id] == "pending"
    again = signed_in.post("/action", data={**data, "confirm": "yes"}, headers=ORIGIN)
    assert again.status_code == 404  # no longer dead: said, nothing done


def test_edit_and_retry_an_inbox_row(engine, signed_in):
    dead_inbox(engine, "m-1", consumer="billing")
    page = signed_in.get("/edit?table=inbox&id=m-1&consumer=billing").text
    data = {
        "action": "edit",
        "table": "inbox",
        "id": "m-1",
        "consumer": "billing",
        "csrf": csrf_of(page),
        "payload": '{"a": 2}',
        "headers": '{"h": "v"}',
    }
    bad = signed_in.post(
        "/action", data={**data, "payload": "{nope", "confirm": "yes"}, headers=ORIGIN
    )
    assert bad.status_code == 400 and "not usable JSON" in bad.text
    done = signed_in.post("/action", data={**data, "confirm": "yes"}, headers=ORIGIN)
    assert done.status_code == 200 and "Edited and retried" in done.text
    assert rows(engine, "SELECT payload, headers, status FROM inbox") == [
        ({"a": 2}, {"h": "v"}, "pending")
    ]


def test_discard_all_of_a_group_keeps_copies(engine, signed_in):
    dead_outbox(engine, 3, error="boom")
    [other] = dead_outbox(engine, error="other")
    csrf = csrf_of(signed_in.get("/dead?group=boom").text)
    data = {"action": "discard-all", "group": "boom", "table": "outbox", "csrf": csrf}
    asked = signed_in.post("/action", data=data, headers=ORIGIN)
    assert "Discard 3 dead rows" in asked.text
    done = signed_in.post(
        "/action", data={**data, "confirm": "yes", "reason": "dup"}, headers=ORIGIN
    )
    assert "Discarded 3 outbox rows" in done.text
    assert set(statuses(engine, "outbox")) == {other}
    assert rows(engine, "SELECT count(*), min(reason) FROM relay_discarded") == [(3, "dup")]


def test_a_bearer_token_client_needs_no_cookie(engine, console):
    [row_id] = dead_outbox(engine)
    done = console.post(
        "/action",
        data={"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes"},
        headers={"authorization": f"Bearer {TOKEN}"},
    )
    assert done.status_code == 200 and statuses(engine, "outbox")[row_id] == "pending"


def test_overview_counts_and_blocked_keys(engine, console):
    dead_outbox(engine, 2, key="order-9")
    rows(
        engine,
        "INSERT INTO outbox (topic, payload, status, published_at) "
        "SELECT 't', '{}', 'published', now() FROM generate_series(1, 7)",
    )
    dead_inbox(engine, "m-1", consumer="billing")
    page = console.get("/").text
    assert "inbox · billing" in page
    assert re.search(r"published, last hour</dt><dd>7<", page)
    assert "order-9" in console.get("/keys").text


def test_relay_console_serves_on_loopback_by_default(start_relay):
    port = free_port()
    proc = start_relay("console", "--port", str(port))

    def page() -> str | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as r:
                assert r.status == 200
                return r.read().decode()
        except OSError:
            assert proc.proc.poll() is None, proc.log
            return None

    assert "<html" in wait_until(page, timeout=30)
    listening = subprocess.run(
        ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    assert [line.split()[3] for line in listening.splitlines()] == [f"127.0.0.1:{port}"]
    proc.signal(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.log


def test_without_the_tables_the_overview_says_what_to_run(empty_database):
    with client(empty_database) as c:
        page = c.get("/")
        assert page.status_code == 200 and "relay schema apply" in page.text
        dead = c.get("/dead")
        assert dead.status_code == 503 and "relay schema apply" in dead.text


def test_an_unreachable_database_is_a_503_page_without_the_password():
    with client("postgresql+psycopg://relay:s3cret-pw@127.0.0.1:1/nowhere") as c:
        for path in ("/", "/dead"):
            page = c.get(path)
            assert page.status_code == 503 and "cannot reach PostgreSQL" in page.text
            assert "s3cret-pw" not in page.text


def test_the_dead_list_filters_by_age_and_says_what_is_wrong(engine, console):
    dead_outbox(engine, topic="recent")
    assert "recent" in console.get("/dead?newer_than=1h").text
    assert "1 dead outbox row" not in console.get("/dead?older_than=1h&table=outbox").text
    bad = console.get("/dead?older_than=soon")
    assert bad.status_code == 400 and "older than" in bad.text
