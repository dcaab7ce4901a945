"""Issue 19's newcomer path, checked from outside: a malformed URL of either
server (or of --listen-url) exits 2 with one line; a command run before
`relay schema apply` says so in one line; while a server is down, each wait
is one log line."""

from __future__ import annotations

import re
import uuid

import pytest

from tests.conftest import drop_database, pg_url, wait_until

SECRET = "pw-n3wc0mer"


@pytest.mark.parametrize("command", [["outbox", "--once"], ["inbox", "--queue", "q"]])
@pytest.mark.parametrize(
    ("flag", "url", "expected"),
    [
        ("--broker-url", "amqp://h:notaport/", "invalid broker URL"),
        ("--broker-url", f"amqp://guest:{SECRET}@:5672/", "no host"),
        ("--broker-url", "amqp:///", "no host"),
        ("--broker-url", "sqs://?bogus=1", "unknown parameter(s) bogus"),
        ("--database-url", f"postgresql://app:{SECRET}@h:notaport/db", "invalid database URL"),
        ("--database-url", f"postgresql://app:{SECRET}@h/db?bogus=1", "invalid database URL"),
        ("--listen-url", f"postgresql://app:{SECRET}@h:notaport/db", "invalid listen URL"),
        ("--listen-url", f"mysql://app:{SECRET}@h/db", "unsupported listen URL scheme"),
    ],
)
def test_a_malformed_url_exits_2_with_one_line(run_relay, command, flag, url, expected):
    result = run_relay(*command, flag, url)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert expected in result.stderr and SECRET not in result.stderr


def test_the_listen_url_is_read_from_its_variable(run_relay):
    result = run_relay("outbox", "--once", env={"RELAY_LISTEN_URL": "postgresql://h:x/db"})
    assert result.returncode == 2 and "invalid listen URL" in result.stderr


@pytest.mark.parametrize("command", [["status"], ["retry", "outbox", "--all-dead"]])
def test_a_command_before_schema_apply_says_so_in_one_line(run_relay, empty_database, command):
    result = run_relay(*command, "--database-url", empty_database)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "relay: error: the relay tables do not exist yet: run `relay schema apply`"
    ]


def _warnings(log: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if " WARNING " in line and "no handlers registered" not in line
    ]


@pytest.mark.parametrize("daemon", [["outbox"], ["inbox", "--queue", "newcomer-q"]])
@pytest.mark.parametrize("down", ["database", "broker"])
def test_one_log_line_per_wait_while_a_server_is_down(start_relay, daemon, down):
    env = (
        {"RELAY_DATABASE_URL": f"postgresql://u:{SECRET}@127.0.0.1:1/db"}
        if down == "database"
        else {"RELAY_BROKER_URL": f"amqp://guest:{SECRET}@127.0.0.1:1/"}
    )
    proc = start_relay(*daemon, env=env)
    wait_until(lambda: proc.log.count("retrying in") >= 4, timeout=30, message="four waits")
    proc.stop()
    warnings = _warnings(proc.log)
    waits = [line for line in warnings if re.search(r"retrying in [\d.]+s", line)]
    # Each wait is one line; the LISTEN connection, which retries on its own,
    # says once that it is lost, not at each of its attempts.
    others = [line for line in warnings if line not in waits]
    assert len(others) <= (1 if down == "database" else 0), "\n".join(others)
    assert all("LISTEN" in line for line in others)
    assert SECRET not in proc.log


async def test_demo_creates_its_database_when_missing(rabbit, run_relay):
    name = f"relay_demo_{uuid.uuid4().hex[:10]}"
    queue = f"{rabbit.exchange}.demo"
    rabbit.queues.append(queue)
    try:
        result = run_relay(
            "demo",
            "--duration",
            "1",
            "--rate",
            "20",
            "--exchange",
            rabbit.exchange,
            "--queue",
            queue,
            "--database-url",
            pg_url(name, "postgresql"),
        )
        assert result.returncode == 0, result.stderr
        assert f"relay demo: created database '{name}'" in result.stdout
        again = run_relay(
            "demo",
            "--duration",
            "1",
            "--rate",
            "20",
            "--exchange",
            rabbit.exchange,
            "--queue",
            queue,
            "--database-url",
            pg_url(name, "postgresql"),
        )
        assert again.returncode == 0, again.stderr
        assert "created database" not in again.stdout
    finally:
        drop_database(name)
