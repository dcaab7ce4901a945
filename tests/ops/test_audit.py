"""The audit trail from the CLI: every write command (`relay retry`, `relay
dead retry|edit|discard`, `relay replay`) records who (the OS user, or
--as), what, which rows or filter and how many, in the action's own
transaction; `relay audit` lists it newest first."""

from __future__ import annotations

import getpass
import json

from tests.conftest import rows
from tests.ops.test_dead import dead_inbox, dead_outbox
from tests.ops.test_replay import published


def trail(run_relay, *args: str) -> list[dict]:
    result = run_relay("audit", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def ok(result) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_each_cli_write_command_is_one_entry_newest_first(run_relay, engine):
    ids = dead_outbox(engine, 3)
    dead_inbox(engine, "m-1")
    dead_inbox(engine, "m-2")
    ok(run_relay("retry", "outbox", "--id", ids[0]))
    ok(run_relay("dead", "retry", "--id", ids[1], "--as", "bob"))
    ok(run_relay("dead", "edit", "m-1", "--payload", '{"a": 2}', "--as", "carol", "--no-retry"))
    ok(run_relay("dead", "discard", "--table", "inbox", "--all", "--reason", "junk"))
    ok(run_relay("replay", "outbox", "--topic", "orders.#", env={"RELAY_AS": "dave"}))
    entries = trail(run_relay)
    assert [(e["action"], e["actor"], e["via"], e["table"]) for e in entries] == [
        ("replay", "dave", "cli", "outbox"),
        ("discard", getpass.getuser(), "cli", "inbox"),
        ("edit", "carol", "cli", "inbox"),
        ("retry", "bob", "cli", "outbox"),
        ("retry", getpass.getuser(), "cli", "outbox"),
    ]
    replay, discard, edit, dead_retry, retry = entries
    # The two retried rows are pending, not published: the replay moved none.
    assert replay["filter"] == {"topic": "orders.#"} and replay["count"] == 0
    assert discard["count"] == 2 and discard["detail"] == "junk"
    assert discard["filter"] == {} or discard["filter"] is None
    assert edit["ids"] == ["m-1"] and edit["count"] == 1
    assert edit["before"] == {"payload": {"a": 1}, "headers": {"traceparent": "00-abc-def-01"}}
    assert edit["after"] == {"payload": {"a": 2}, "headers": {"traceparent": "00-abc-def-01"}}
    assert edit["filter"] == {"consumer": "billing"}
    assert dead_retry["ids"] == [ids[1]] and dead_retry["count"] == 1
    assert retry["ids"] == [ids[0]] and retry["count"] == 1
    assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), reverse=True)
    # The text form: one line each (and an edit's before and after), newest first.
    text = ok(run_relay("audit"))
    assert text.splitlines()[0].endswith("replay  outbox  0 rows  filter topic=orders.#")
    assert "carol (cli)" in text and '"a": 2' in text
    # Paging: the ones before an id.
    older = trail(run_relay, "--before", str(edit["id"]), "--limit", "1")
    assert [e["id"] for e in older] == [dead_retry["id"]]


def test_a_replay_records_its_filter_and_count_and_a_dry_run_nothing(run_relay, engine):
    published(engine, 12, keys=3)
    ok(run_relay("replay", "outbox", "--key", "k1", "--dry-run"))
    assert trail(run_relay) == []
    ok(run_relay("replay", "outbox", "--key", "k1", "--since", "2026-01-01T00:00:00Z", "--as", "x"))
    (entry,) = trail(run_relay)
    assert entry["count"] == 4
    assert entry["filter"] == {"since": "2026-01-01T00:00:00+00:00", "key": "k1"}


def test_an_action_that_fails_records_nothing(run_relay, engine):
    dead_inbox(engine, "m-1")
    result = run_relay("dead", "edit", "m-1", "--payload", "not json")
    assert result.returncode == 2
    assert trail(run_relay) == []
    assert rows(engine, "SELECT count(*) FROM relay_audit")[0][0] == 0
