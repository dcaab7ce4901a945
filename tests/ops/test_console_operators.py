"""Named operators in the console (--console-tokens) and the audit trail of
its actions, at the HTTP level against the real PostgreSQL: a viewer reads
and is refused every change (the refusal audited, nothing changed); an
operator's retry, edit, discard and replay are audited under their name;
RELAY_CONSOLE_TOKEN alone is one operator named `operator`; a bad tokens
file stops `relay console` with one line."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.testclient import TestClient

from relay.console.app import ConsoleSettings, create_app
from relay.console.operators import parse
from relay.errors import ConfigError
from tests.conftest import rows
from tests.ops.test_audit import trail
from tests.ops.test_console import ORIGIN, csrf_of
from tests.ops.test_dead import dead_inbox, dead_outbox, statuses

ALICE, VICTOR = "alice-token-1", "victor-token-2"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens"
    path.write_text(text)
    return str(path)


@pytest.fixture
def tokens(tmp_path: Path) -> str:
    return tokens_file(
        tmp_path,
        "# the team\n"
        f"alice operator {sha(ALICE)}\n"
        "\n"
        f"victor viewer {sha(VICTOR).upper()}  # reads only\n",
    )


def client(database: str, **settings) -> TestClient:
    from relay.config import normalize_database_url

    url = normalize_database_url(database.replace("postgresql+psycopg://", "postgresql://"))
    return TestClient(create_app(ConsoleSettings(url, **settings)))


@pytest.fixture
def team(database: str, tokens: str) -> Iterator[TestClient]:
    with client(database, tokens_file=tokens) as c:
        yield c


def sign_in(c: TestClient, token: str) -> TestClient:
    response = c.post("/login", data={"token": token}, headers=ORIGIN, follow_redirects=False)
    assert response.status_code == 303, response.text
    return c


def test_a_viewers_post_is_refused_audited_and_changes_nothing(engine, team):
    [row_id] = dead_outbox(engine)
    sign_in(team, VICTOR)
    page = team.get(f"/message?table=outbox&id={row_id}").text
    assert "victor" in page and "viewer" in page and 'value="retry"' not in page
    data = {"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes", "csrf": "x"}
    refused = team.post("/action", data=data, headers=ORIGIN)
    assert refused.status_code == 403 and "victor is a viewer" in refused.text
    bearer = team.post("/action", data=data, headers={"authorization": f"Bearer {VICTOR}"})
    assert bearer.status_code == 403
    assert statuses(engine, "outbox")[row_id] == "dead"
    entries = [(e["actor"], e["via"], e["action"]) for e in _trail(engine)]
    assert entries == [("victor", "console", "refused")] * 2
    assert "retry: Refused: victor is a viewer" in _trail(engine)[0]["detail"]
    # A person it does not know is refused and not written down: anyone who can
    # reach the port could fill the table.
    team.cookies.clear()
    assert team.post("/action", data=data, headers=ORIGIN).status_code == 403
    assert len(_trail(engine)) == 2


def _trail(engine) -> list[dict]:
    return [
        {"actor": a, "via": v, "action": act, "detail": d, "table": t, "count": n, "filter": f}
        for a, v, act, d, t, n, f in rows(
            engine,
            "SELECT actor, via, action, detail, target, count, filter FROM relay_audit "
            "ORDER BY id DESC",
        )
    ]


def test_an_operators_actions_are_audited_under_their_name(engine, team, run_relay):
    [row_id, other] = dead_outbox(engine, 2)
    dead_inbox(engine, "m-1")
    rows(
        engine,
        "INSERT INTO outbox (topic, key, payload, status, published_at) "
        "SELECT 'orders.placed', 'k' || (i % 2), '{}', 'published', now() "
        "FROM generate_series(1, 6) i",
    )
    sign_in(team, ALICE)
    csrf = csrf_of(team.get(f"/message?table=outbox&id={row_id}").text)
    retry = {"action": "retry", "table": "outbox", "id": row_id, "csrf": csrf, "confirm": "yes"}
    assert team.post("/action", data=retry, headers=ORIGIN).status_code == 200
    edit = {
        "action": "edit",
        "table": "inbox",
        "id": "m-1",
        "consumer": "billing",
        "payload": '{"a": 3}',
        "csrf": csrf,
        "confirm": "yes",
    }
    assert team.post("/action", data=edit, headers=ORIGIN).status_code == 200
    discard = {"action": "discard", "table": "outbox", "id": other, "csrf": csrf, "confirm": "yes"}
    assert team.post("/action", data=discard, headers=ORIGIN).status_code == 200
    replay = {"action": "replay", "table": "outbox", "key": "k1", "csrf": csrf}
    asked = team.post("/action", data=replay, headers=ORIGIN)
    assert asked.status_code == 200 and "Replay 3 outbox rows" in asked.text
    assert list(statuses(engine, "outbox").values()).count("pending") == 1  # the retried
    done = team.post("/action", data={**replay, "confirm": "yes"}, headers=ORIGIN)
    assert done.status_code == 200 and "Replayed 3 outbox rows" in done.text
    assert list(statuses(engine, "outbox").values()).count("pending") == 4  # 3 + the retried
    bad = team.post("/action", data={**replay, "key": "", "confirm": "yes"}, headers=ORIGIN)
    assert bad.status_code == 400 and "at least one filter" in bad.text

    entries = trail(run_relay)
    assert [(e["actor"], e["via"], e["action"], e["table"], e["count"]) for e in entries] == [
        ("alice", "console", "replay", "outbox", 3),
        ("alice", "console", "discard", "outbox", 1),
        ("alice", "console", "edit", "inbox", 1),
        ("alice", "console", "retry", "outbox", 1),
    ]
    assert entries[0]["filter"] == {"key": "k1"}
    assert entries[2]["before"]["payload"] == {"a": 1}
    assert entries[2]["after"]["payload"] == {"a": 3}
    page = team.get("/audit").text
    assert page.count('class="actor">alice<') == 4 and "replay" in page


def test_the_single_token_is_an_operator_named_operator(engine, database):
    [row_id] = dead_outbox(engine)
    with client(database, token="just-one") as c:
        response = c.post(
            "/action",
            data={"action": "retry", "table": "outbox", "id": row_id, "confirm": "yes"},
            headers={"authorization": "Bearer just-one"},
        )
        assert response.status_code == 200
    assert [(e["actor"], e["action"]) for e in _trail(engine)] == [("operator", "retry")]


def test_the_audit_page_shows_payloads_as_text(engine, team):
    dead_inbox(engine, "m-1")
    sign_in(team, ALICE)
    csrf = csrf_of(team.get("/message?table=inbox&id=m-1&consumer=billing").text)
    edit = {
        "action": "edit",
        "table": "inbox",
        "id": "m-1",
        "consumer": "billing",
        "payload": '{"x": "<script>alert(1)</script>"}',
        "csrf": csrf,
        "confirm": "yes",
    }
    assert team.post("/action", data=edit, headers=ORIGIN).status_code == 200
    page = team.get("/audit").text
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert team.get("/audit?before=abc").status_code == 400


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("alice operator\n", "line 1: expected NAME ROLE SHA256-HEX-OF-TOKEN"),
        (f"alice admin {'a' * 64}\n", "line 1: unknown role 'admin'"),
        ("# c\nalice operator secret\n", "line 2: the token must be given as 64 hex digits"),
        (f"a viewer {'a' * 64}\na operator {'b' * 64}\n", "the name 'a' is given twice"),
        (f"a viewer {'a' * 64}\nb operator {'A' * 64}\n", "two operators have the same token"),
        ("# nobody\n", "lists no operator"),
    ],
)
def test_a_bad_tokens_file_exits_2_with_one_line(run_relay, tmp_path, text, expected):
    path = tokens_file(tmp_path, text)
    result = run_relay("console", "--port", "1", "--console-tokens", path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and expected in result.stderr
    assert "a" * 64 not in result.stderr


def test_a_missing_tokens_file_exits_2_from_the_variable(run_relay, tmp_path):
    result = run_relay("console", env={"RELAY_CONSOLE_TOKENS": str(tmp_path / "none")})
    assert result.returncode == 2
    missing = tmp_path / "none"
    assert result.stderr.strip().splitlines() == [
        f"relay: error: --console-tokens: cannot read '{missing}': No such file or directory"
    ]


@given(st.text(max_size=200))
def test_any_tokens_text_is_operators_or_a_config_error(text):
    try:
        found = parse(text, "tokens")
    except ConfigError as exc:
        assert "\n" not in str(exc)
    else:
        assert all(op.role in ("viewer", "operator") and len(op.digest) == 64 for op in found)
