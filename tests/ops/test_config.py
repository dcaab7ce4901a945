"""Settings parsing and log redaction: pure unit tests, no servers."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator

import click
import pytest

from relay import config, logs
from relay.config import (
    BrokerURL,
    ConfigError,
    normalize_database_url,
    parse_duration,
    redact_url,
    url_password,
)
from tests.conftest import RELAY, REPO

SECRET = "s3cr3t-Pa55"


# --------------------------------------------------------------------------
# parse_duration
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90s", 90),
        ("30m", 1800),
        ("24h", 86400),
        ("7d", 604800),
        ("15", 15),
        ("1.5h", 5400),
        (" 10m ", 600),
        ("0.5", 0.5),
        (15, 15),
        (2.5, 2.5),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text",
    ["", "abc", "10x", "1w", "-5", "-5s", "0", "0s", "m", "5 5s", "1e3", 0, -1],
)
def test_parse_duration_rejects_bad_values(text):
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration(text)


# --------------------------------------------------------------------------
# Database URLs
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://app:pw@db.example:5432/shop",
        "postgresql+psycopg://app:pw@db.example:5432/shop",
        "postgres://app:pw@db.example:5432/shop",
    ],
)
def test_normalize_database_url_accepts_postgres(url):
    assert normalize_database_url(url) == "postgresql+psycopg://app:pw@db.example:5432/shop"


@pytest.mark.parametrize(
    "url",
    [
        "mysql://app:pw@db/shop",
        "postgresql+asyncpg://app@db/shop",
        "sqlite:///relay.db",
        "db.example/shop",
        "postgresql://app@db:54x2/shop",
        "postgresql://app@db:99999/shop",
        "",
    ],
)
def test_normalize_database_url_rejects_others(url):
    with pytest.raises(ConfigError):
        normalize_database_url(url)


@pytest.mark.parametrize(
    "url",
    [
        f"mysql://app:{SECRET}@db/shop",
        f"postgresql:/app:{SECRET}@db/shop",  # a typo: one slash
        f"app:{SECRET}@db/shop",  # no scheme at all
        f"postgresql://app:{SECRET}@db:port/shop",  # a port that is no number
    ],
)
def test_database_url_errors_hide_the_password(url):
    with pytest.raises(ConfigError) as caught:
        normalize_database_url(url)
    assert SECRET not in str(caught.value)


# --------------------------------------------------------------------------
# Broker URLs
# --------------------------------------------------------------------------


def test_broker_url_amqp():
    parsed = BrokerURL.parse(f"amqp://guest:{SECRET}@rabbit:5672/vhost")
    assert parsed.kind == "amqp"
    assert parsed.url == f"amqp://guest:{SECRET}@rabbit:5672/vhost"
    assert SECRET not in repr(parsed)
    assert BrokerURL.parse("amqps://u:p@rabbit.example/").kind == "amqp"


def test_broker_url_sqs():
    plain = BrokerURL.parse("sqs://")
    assert (plain.kind, plain.aws_region, plain.aws_endpoint_url) == ("sqs", None, None)
    full = BrokerURL.parse("sqs://?region=eu-west-1&endpoint_url=http://localhost:9324")
    assert (full.kind, full.aws_region, full.aws_endpoint_url) == (
        "sqs",
        "eu-west-1",
        "http://localhost:9324",
    )
    assert BrokerURL.parse("sqs://?region=us-east-1").aws_region == "us-east-1"


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mqtt://h:1883", "unsupported broker URL scheme"),
        ("sqs://?region=eu-west-1&queue=x", "unknown parameter"),
        ("sqs://?endpoint_url=ftp://x", "endpoint_url"),
        ("amqp://guest:guest@rabbit:notaport/", "invalid broker URL"),
        ("amqp:///vhost", "no host"),
        ("", "no broker URL"),
        (None, "no broker URL"),
    ],
)
def test_broker_url_rejects_bad_urls(url, message):
    with pytest.raises(ConfigError, match=message):
        BrokerURL.parse(url)


@pytest.mark.parametrize(
    "url",
    [
        f"amqp://guest:{SECRET}@rabbit:notaport/",
        f"amqp://guest:{SECRET}@/vhost",
        f"kafka://guest:{SECRET}@broker:9092?acks=0",
        f"//guest:{SECRET}@broker:5672/",
        f"guest:{SECRET}@broker/",
        f"sqs://?endpoint_url=ftp://key:{SECRET}@host",
    ],
)
def test_broker_url_errors_hide_the_password(url):
    with pytest.raises(ConfigError) as caught:
        BrokerURL.parse(url)
    assert SECRET not in str(caught.value)


# --------------------------------------------------------------------------
# redact_url
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "redacted"),
    [
        (f"postgresql://app:{SECRET}@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        (f"amqp://guest:{SECRET}@rabbit/vh?heartbeat=5", "amqp://guest:***@rabbit/vh?heartbeat=5"),
        (f"amqp://:{SECRET}@rabbit/", "amqp://:***@rabbit/"),
        ("amqp://guest:p%40ss%2Fw@rabbit/", "amqp://guest:***@rabbit/"),
        (f"amqp://guest:{SECRET}@with@rabbit/", "amqp://guest:***@rabbit/"),
        ("postgresql://app@db/shop", "postgresql://app@db/shop"),
        ("postgresql://db/shop", "postgresql://db/shop"),
        ("sqs://?region=eu-west-1", "sqs://?region=eu-west-1"),
    ],
)
def test_redact_url(url, redacted):
    assert redact_url(url) == redacted


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql:/app:{SECRET}@db/shop",
        f"app:{SECRET}@db/shop",
        f"postgresql:app:{SECRET}@db/shop",
    ],
)
def test_redact_url_hides_the_password_of_a_malformed_url(url):
    assert SECRET not in redact_url(url)
    assert "db/shop" in redact_url(url)


def test_url_password_is_decoded():
    assert url_password("amqp://guest:p%40ss@rabbit/") == "p@ss"
    assert url_password("amqp://guest@rabbit/") is None
    assert url_password(None) is None


# --------------------------------------------------------------------------
# RedactingFilter
# --------------------------------------------------------------------------


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    """A logger whose only handler writes to a StringIO through the redacting filter."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.TextFormatter())
    handler.addFilter(logs.RedactingFilter([SECRET, ""]))
    logger = logging.getLogger(f"relay.test_config.{id(stream)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield logger, stream, handler
    logger.removeHandler(handler)


def test_filter_masks_the_message_and_its_args(captured):
    logger, stream, _ = captured
    logger.warning(f"connecting with {SECRET} now")
    logger.warning("connecting to %s (%d)", f"postgresql://app:{SECRET}@db/shop", 3)
    text = stream.getvalue()
    assert SECRET not in text
    assert "connecting with *** now" in text
    assert "connecting to postgresql://app:***@db/shop (3)" in text


def test_filter_masks_an_exception_text(captured):
    logger, stream, _ = captured
    try:
        raise RuntimeError(f"could not connect to postgresql://app:{SECRET}@db/shop")
    except RuntimeError:
        logger.exception("database unavailable")
    text = stream.getvalue()
    assert SECRET not in text
    assert "RuntimeError: could not connect to postgresql://app:***@db/shop" in text
    assert "Traceback" in text  # the traceback is kept, only masked


def test_filter_masks_extras(captured):
    logger, stream, _ = captured
    logger.info("reconnecting", extra={"url": f"amqp://guest:{SECRET}@rabbit/"})
    text = stream.getvalue()
    assert SECRET not in text
    assert "url=amqp://guest:***@rabbit/" in text


def test_filter_with_json_formatter(captured):
    logger, stream, handler = captured
    handler.setFormatter(logs.JSONFormatter())
    try:
        raise ValueError(SECRET)
    except ValueError:
        logger.exception("failed for %s", SECRET, extra={"detail": SECRET, "n": 3})
    entry = json.loads(stream.getvalue())
    assert SECRET not in stream.getvalue()
    assert entry["message"] == "failed for ***"
    assert entry["detail"] == "***"
    assert entry["n"] == 3
    assert "ValueError: ***" in entry["error"]


def test_filter_without_secrets_changes_nothing():
    record = logging.makeLogRecord({"msg": "a %s", "args": ("b",)})
    assert logs.RedactingFilter([]).filter(record)
    assert (record.msg, record.args) == ("a %s", ("b",))


def test_setup_masks_secrets_on_stderr(monkeypatch):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    try:
        logs.setup("INFO", "text", [SECRET])
        logs.setup("INFO", "text", [SECRET])  # safe to call twice: one handler
        assert len(root.handlers) == 1
        logging.getLogger("relay.test").info("password is %s", SECRET)
        logging.getLogger("relay.test").debug("not shown")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    text = stream.getvalue()
    assert "password is ***" in text
    assert SECRET not in text
    assert "not shown" not in text
    assert text.count("password is") == 1


def test_a_database_url_with_a_bad_port_exits_2_with_one_line():
    result = subprocess.run(
        [*RELAY, "status", "--database-url", f"postgresql://app:{SECRET}@127.0.0.1:abc/x"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "bad port 'abc'" in result.stderr and SECRET not in result.stderr


def _commands(group: click.Group, path: str = "relay") -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def test_every_option_of_every_command_reads_its_relay_variable():
    """The contract: every option is a flag and RELAY_<FLAG_IN_CAPS>."""
    from relay.cli import cli

    seen = 0
    for path, command in _commands(cli):
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden or param.name == "help":
                continue
            flag = param.opts[0]
            wanted = "RELAY_" + flag.lstrip("-").upper().replace("-", "_")
            assert param.envvar == wanted, f"{path} {flag}: {param.envvar!r}"
            seen += 1
    assert seen > 100  # every command's options were looked at


def test_flags_of_one_invocation_read_their_variables_too(engine, run_relay):
    """`--json` and `--once` as RELAY_JSON and RELAY_ONCE (read as click reads a flag)."""
    as_json = run_relay("status", env={"RELAY_JSON": "true"})
    assert as_json.returncode == 0, as_json.stderr
    assert set(json.loads(as_json.stdout)) == {"outbox", "inbox"}
    text = run_relay("status", env={"RELAY_JSON": "false"})
    assert text.stdout.startswith("outbox: pending 0"), text.stdout
    once = run_relay("outbox", env={"RELAY_ONCE": "1"}, timeout=60)  # ends, or times out
    assert once.returncode == 0, once.stderr


def test_the_inbox_prefetch_defaults_to_what_its_receiver_may_run_ahead():
    from relay.inbox import DISPATCHERS
    from relay.pacing import PACE_BATCHES
    from relay.wiring import receiver_parts

    # The window the pace lets the receiver run ahead of the dispatchers:
    # a smaller one would cut each dispatcher's part of a batch short.
    assert config.RECEIVED_AHEAD == PACE_BATCHES * DISPATCHERS
    broker = config.BrokerURL.parse("amqp://guest:guest@localhost/")
    url = "postgresql://u@h/d"
    default = config.InboxSettings(database_url=url, broker=broker, queue="q", batch_size=200)
    assert default.prefetch == config.RECEIVED_AHEAD * 200
    # Handled as received, the receiver reads a batch for every dispatcher,
    # each one's part about --batch-size; stored, a batch as they claim.
    assert receiver_parts(default).batch_size == 200 * DISPATCHERS
    assert receiver_parts(default.replace(dispatch="stored")).batch_size == 200
    large = config.InboxSettings(database_url=url, broker=broker, queue="q", batch_size=20_000)
    assert large.prefetch == 65535  # RabbitMQ's basic.qos takes a 16-bit count
    given = config.InboxSettings(database_url=url, broker=broker, queue="q", prefetch=10)
    assert given.prefetch == 10
