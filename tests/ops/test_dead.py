"""`relay dead …`: list, show, groups, retry, edit and discard dead rows, run as
a user runs them (subprocesses) against the real PostgreSQL; and the raw body
of a non-JSON inbox message reaching its handler after a retry."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from relay.db import schema
from tests.conftest import rows, wait_until

TRACEBACK = """Traceback (most recent call last):
  File "app/handlers.py", line 12, in on_order
    raise ValueError("order 7 has no lines")
ValueError: order 7 has no lines"""


def dead_outbox(
    engine: sa.Engine,
    n: int = 1,
    *,
    topic: str = "orders.placed",
    key: str | None = "order-1",
    error: str = "NOT_FOUND - no exchange 'x'",
    payload: str = '{"order_id": 1}',
) -> list[str]:
    found = rows(
        engine,
        """
        INSERT INTO outbox (topic, key, type, payload, status, attempts, last_error)
        SELECT :topic, :key, 'OrderPlaced', CAST(:payload AS jsonb), 'dead', 10, :error
        FROM generate_series(1, :n) RETURNING id::text""",
        topic=topic,
        key=key,
        error=error,
        n=n,
        payload=payload,
    )
    return [r[0] for r in found]


def dead_inbox(
    engine: sa.Engine,
    message_id: str,
    *,
    consumer: str = "billing",
    payload: str | None = '{"a": 1}',
    body: bytes | None = None,
    error: str = TRACEBACK,
    type_: str = "OrderPlaced",
) -> None:
    rows(
        engine,
        """
        INSERT INTO inbox (consumer, message_id, topic, type, payload, body, headers,
                           status, attempts, last_error)
        VALUES (:c, :m, 'orders.placed', :t, CAST(:p AS jsonb), :b,
                '{"traceparent": "00-abc-def-01"}', 'dead', 10, :e)""",
        c=consumer,
        m=message_id,
        t=type_,
        p=payload,
        b=body,
        e=error,
    )


def statuses(engine: sa.Engine, table: str) -> dict[str, str]:
    ident = "id::text" if table == "outbox" else "consumer || '/' || message_id"
    return {r[0]: r[1] for r in rows(engine, f"SELECT {ident}, status FROM {table}")}


def test_list_json_holds_every_dead_row_of_both_tables(engine, run_relay):
    [outbox_id] = dead_outbox(engine)
    dead_inbox(engine, "m-1")
    rows(engine, "INSERT INTO outbox (topic, payload) VALUES ('live', '{}')")

    result = run_relay("dead", "list", "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)
    assert [r.get("id") or r["message_id"] for r in listed] == [outbox_id, "m-1"]
    outbox_row, inbox_row = listed
    assert outbox_row["table"] == "outbox" and outbox_row["topic"] == "orders.placed"
    assert outbox_row["attempts"] == 10 and outbox_row["key"] == "order-1"
    assert outbox_row["last_error"] == "NOT_FOUND - no exchange 'x'"
    assert inbox_row["consumer"] == "billing" and inbox_row["type"] == "OrderPlaced"
    # The error group of a traceback is its last line.
    assert inbox_row["last_error"] == "ValueError: order 7 has no lines"
    assert "received_at" in inbox_row and "created_at" in outbox_row


def test_list_filters_and_pages_by_keyset(engine, run_relay):
    ids = dead_outbox(engine, 5, topic="a")
    dead_outbox(engine, 2, topic="b", key=None, error="Timeout: no confirm")
    dead_inbox(engine, "m-1", consumer="billing")
    dead_inbox(engine, "m-2", consumer="shipping")

    def listed(*args: str) -> list[str]:
        result = run_relay("dead", "list", "--json", *args)
        assert result.returncode == 0, result.stderr
        return [r.get("id") or r["message_id"] for r in json.loads(result.stdout)]

    assert sorted(listed("--topic", "a")) == sorted(ids)
    assert len(listed("--error", "TIMEOUT")) == 2
    assert listed("--consumer", "shipping") == ["m-2"]
    assert listed("--table", "inbox", "--type", "OrderPlaced") == ["m-2", "m-1"]
    assert listed("--group", "ValueError: order 7 has no lines", "--consumer", "billing") == ["m-1"]
    assert listed("--older-than", "1h") == []
    assert len(listed("--newer-than", "1h")) == 9

    # Pages of 3 over the 9 rows: every row once, newest first, outbox first.
    first = run_relay("dead", "list", "--json", "--limit", "3")
    cursor = first.stderr.split("--after ")[1].split()[0]
    seen = [r.get("id") or r["message_id"] for r in json.loads(first.stdout)]
    while cursor:
        page = run_relay("dead", "list", "--json", "--limit", "3", "--after", cursor)
        seen += [r.get("id") or r["message_id"] for r in json.loads(page.stdout)]
        cursor = page.stderr.split("--after ")[1].split()[0] if "--after" in page.stderr else ""
    assert len(seen) == 9 and len(set(seen)) == 9
    assert seen[-2:] == ["m-2", "m-1"]
    assert listed("--limit", "0") == seen


def test_show_prints_payload_headers_raw_body_and_the_full_error(engine, run_relay):
    dead_inbox(engine, "not-json", payload=None, body=b"\xffnot json <b>\x00\x1b[2J")
    result = run_relay("dead", "show", "not-json")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "consumer:     billing" in out and "attempts:     10" in out
    assert "00-abc-def-01" in out  # headers
    # Undecodable bytes and control characters (a NUL, a terminal escape) as
    # \x escapes: shown, never acted on by the terminal.
    assert "raw body (18 bytes)" in out and "\\xffnot json <b>\\x00\\x1b[2J" in out
    assert "\x00" not in out and "\x1b" not in out
    assert TRACEBACK.splitlines()[1].strip() in out  # the whole traceback

    [outbox_id] = dead_outbox(engine, payload='{"order_id": 1, "note": "<script>x</script>"}')
    shown = json.loads(run_relay("dead", "show", outbox_id, "--json").stdout)
    assert shown["payload"] == {"order_id": 1, "note": "<script>x</script>"}
    assert shown["last_error"] == "NOT_FOUND - no exchange 'x'"


def test_show_says_which_when_an_id_is_dead_twice_and_when_none_is(engine, run_relay):
    dead_inbox(engine, "m-1", consumer="billing")
    dead_inbox(engine, "m-1", consumer="shipping")
    twice = run_relay("dead", "show", "m-1")
    assert twice.returncode == 2
    assert twice.stderr.count("\n") == 1 and "--consumer" in twice.stderr
    assert run_relay("dead", "show", "m-1", "--consumer", "shipping").returncode == 0

    missing = run_relay("dead", "show", "nope")
    assert missing.returncode == 1 and "no dead row" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_groups_count_rows_by_error(engine, run_relay):
    dead_outbox(engine, 3)
    dead_inbox(engine, "m-1")
    dead_inbox(engine, "m-2")
    dead_inbox(engine, "m-3", error="no handler for type 'X'\nsecond line")
    result = run_relay("dead", "groups", "--json")
    assert result.returncode == 0, result.stderr
    groups = [(g["count"], g["table"], g["error"]) for g in json.loads(result.stdout)]
    assert groups == [
        (3, "outbox", "NOT_FOUND - no exchange 'x'"),
        (2, "inbox", "ValueError: order 7 has no lines"),
        (1, "inbox", "no handler for type 'X'"),
    ]


def test_retry_by_filter_puts_only_matching_rows_back_to_pending(engine, run_relay):
    keep = dead_outbox(engine, 2, topic="keep")
    again = dead_outbox(engine, 3, topic="again")
    dead_inbox(engine, "m-1", consumer="billing")
    dead_inbox(engine, "m-1", consumer="shipping")

    assert run_relay("dead", "retry").returncode == 2  # no filter: refused, nothing done
    result = run_relay("dead", "retry", "--topic", "again")
    assert result.returncode == 0, result.stderr
    assert "retried 3 outbox rows" in result.stdout
    now = statuses(engine, "outbox")
    assert {now[i] for i in again} == {"pending"} and {now[i] for i in keep} == {"dead"}
    assert rows(engine, "SELECT DISTINCT attempts FROM outbox WHERE topic = 'again'") == [(0,)]

    result = run_relay("dead", "retry", "--consumer", "shipping", "--id", "m-1")
    assert result.returncode == 0 and "retried 1 inbox row" in result.stdout
    assert statuses(engine, "inbox") == {"billing/m-1": "dead", "shipping/m-1": "pending"}


def test_edit_replaces_the_payload_and_headers_then_retries(engine, run_relay, tmp_path):
    [row_id] = dead_outbox(engine)
    bad = run_relay("dead", "edit", row_id, "--payload", "{not json")
    assert bad.returncode == 2 and "not usable JSON" in bad.stderr
    assert run_relay("dead", "edit", row_id, "--headers", '{"a": 1}').returncode == 2
    assert statuses(engine, "outbox")[row_id] == "dead"  # bad input loses nothing

    (tmp_path / "p.json").write_text('{"order_id": 1, "fixed": true}')
    result = run_relay(
        "dead",
        "edit",
        row_id,
        "--payload",
        f"@{tmp_path / 'p.json'}",
        "--headers",
        '{"x-fixed-by": "ops"}',
    )
    assert result.returncode == 0, result.stderr
    assert "retried" in result.stdout
    [(payload, headers, status, attempts)] = rows(
        engine, "SELECT payload, headers, status, attempts FROM outbox"
    )
    assert payload == {"order_id": 1, "fixed": True} and headers == {"x-fixed-by": "ops"}
    assert (status, attempts) == ("pending", 0)


def test_discard_keeps_every_discarded_row_whole(engine, run_relay):
    [gone] = dead_outbox(engine, topic="gone")
    [kept] = dead_outbox(engine, topic="kept")
    dead_inbox(engine, "raw", payload=None, body=b"\x00\xffbytes")
    assert run_relay("dead", "discard").returncode == 2

    result = run_relay("dead", "discard", "--topic", "gone", "--reason", "ticket 42")
    assert result.returncode == 0, result.stderr
    assert "discarded 1 outbox row" in result.stdout
    assert set(statuses(engine, "outbox")) == {kept}
    result = run_relay("dead", "discard", "--table", "inbox", "--id", "raw")
    assert result.returncode == 0 and "discarded 1 inbox row" in result.stdout
    assert statuses(engine, "inbox") == {}

    copies = rows(
        engine,
        "SELECT source, message_id, consumer, row_data, reason FROM relay_discarded ORDER BY id",
    )
    assert [(c[0], c[1], c[2], c[4]) for c in copies] == [
        ("outbox", gone, None, "ticket 42"),
        ("inbox", "raw", "billing", None),
    ]
    assert copies[0][3]["payload"] == {"order_id": 1} and copies[0][3]["attempts"] == 10
    assert copies[1][3]["body"] == "\\x00ff6279746573"  # the raw bytes, as bytea hex


def test_bad_filters_and_cursors_exit_2_with_one_line(run_relay):
    for args in (
        ["--older-than", "soon"],
        ["--table", "outbox", "--consumer", "c"],
        ["--after", "outbox:x"],
        ["--limit", "-1"],
    ):
        result = run_relay("dead", "list", *args)
        assert result.returncode == 2, (args, result.stdout)
        assert "Traceback" not in result.stderr and result.stderr.strip(), args


def test_discarded_table_matches_its_core_description(engine):
    reflected = {c["name"]: c for c in sa.inspect(engine).get_columns("relay_discarded")}
    declared = {c.name: c for c in schema.discarded.columns}
    assert set(reflected) == set(declared)
    for name, column in declared.items():
        assert column.nullable == reflected[name]["nullable"], name


async def test_a_retried_non_json_body_reaches_its_handler_as_raw_bytes(
    effects, rabbit, inbox, run_relay
):
    daemon = inbox()
    await rabbit.publish("t", b"\xffnot json", message_id="raw-1", type="RawBody")
    await rabbit.publish("t", b"null", message_id="null-1", type="RawBody")
    wait_until(
        lambda: rows(effects, "SELECT 1 FROM inbox WHERE message_id = 'raw-1' AND status = 'dead'"),
        timeout=30,
    )
    wait_until(lambda: rows(effects, "SELECT 1 FROM effects WHERE message_id = 'null-1'"))

    result = run_relay("dead", "retry", "--id", "raw-1")
    assert result.returncode == 0, result.stderr
    seen = wait_until(
        lambda: (
            dict(rows(effects, "SELECT message_id, key FROM effects")).get("raw-1")
            and dict(rows(effects, "SELECT message_id, key FROM effects"))
        ),
        timeout=30,
    )
    assert seen["raw-1"] == "body:" + b"\xffnot json".hex()
    assert seen["null-1"] == "payload:None"  # a JSON null: no body
    assert daemon.proc.poll() is None


@pytest.mark.parametrize("flag", ["--port", "--host"])
def test_console_bad_options_exit_2(run_relay, flag):
    value = "http" if flag == "--port" else " "
    result = run_relay("console", flag, value)
    assert result.returncode == 2 and "Traceback" not in result.stderr


async def test_a_page_may_count_up_to_a_cap_and_group_only_the_newest_rows(engine, database):
    from relay.dead import DeadFilter, open_dead, summarize

    dead_outbox(engine, 3, error="older")
    dead_outbox(engine, 2, error="newer")
    dead_inbox(engine, "m-1")
    dead_inbox(
        engine,
        "m-2",
        error=TRACEBACK.replace("ValueError", "During handling:\nKeyError: 'x'\n\nValueError"),
    )
    async with open_dead(database) as dead:
        # A page that holds every match groups its rows as the database does.
        everything = DeadFilter()
        assert summarize((await dead.page(everything)).rows) == await dead.groups(everything)
        where = DeadFilter(table="outbox")
        assert await dead.count(where) == {"outbox": 5}
        assert await dead.count(where, cap=3) == {"outbox": 3}
        assert [(g.error, g.count) for g in await dead.groups(where)] == [
            ("older", 3),
            ("newer", 2),
        ]
        assert [(g.error, g.count) for g in await dead.groups(where, newest=2)] == [("newer", 2)]
