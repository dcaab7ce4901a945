"""redis:// and rediss:// broker URLs and the Redis options (--stream-maxlen,
--claim-idle): pure unit tests, and the CLI's exit 2, no servers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from relay.config import BrokerURL, ConfigError, InboxSettings, OutboxSettings, redact_url
from tests.conftest import REPO

SECRET = "s3cr3t-Pa55"
DB = "postgresql://x@db/app"


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379",
        "redis://redis.internal:6380/3",
        f"redis://:{SECRET}@h:6379/0",
        f"redis://app:{SECRET}@h:6379",
        "rediss://cache.example.com:6380/0",
        "rediss://cache.example.com:6380/0?ssl_cert_reqs=required",
    ],
)
def test_redis_urls_are_redis_py_s_own(url: str):
    parsed = BrokerURL.parse(url)
    assert (parsed.kind, parsed.url) == ("redis", url)
    assert SECRET not in repr(parsed) and SECRET not in redact_url(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis:///0", "no host"),
        ("redis://h:99999", "(?i)port"),
        ("redis://h:6379/notadb", "database number"),
        ("redis://a:6379,b:6379", "6379,b:6379"),
    ],
)
def test_a_bad_redis_url_is_bad_configuration(url: str, why: str):
    with pytest.raises(ConfigError, match=why):
        BrokerURL.parse(url)


def test_the_group_defaults_to_the_first_stream_and_rabbitmq_flags_are_refused():
    broker = BrokerURL.parse("redis://h:6379")
    settings = InboxSettings(DB, broker=broker, queue="orders, payments")
    assert (settings.consumer_name, settings.claim_idle) == ("orders", 30.0)
    named = InboxSettings(DB, broker=broker, queue="orders", consumer_name="billing", claim_idle=2)
    assert (named.consumer_name, named.claim_idle) == ("billing", 2)
    for extra in ({"binds": ("#",)}, {"queue_type": "quorum"}, {"queue_args": ("x-a=1",)}):
        with pytest.raises(ConfigError, match="RabbitMQ only"):
            InboxSettings(DB, broker=broker, queue="orders", **extra)
    with pytest.raises(ConfigError, match="STREAM,STREAM"):
        InboxSettings(DB, broker=broker, queue="orders,,payments")
    with pytest.raises(ConfigError, match="claim-idle"):
        InboxSettings(DB, broker=broker, queue="orders", claim_idle=0)


def test_stream_maxlen_is_for_redis_only():
    redis = BrokerURL.parse("redis://h:6379")
    assert OutboxSettings(DB, broker=redis, stream_maxlen=1000).stream_maxlen == 1000
    with pytest.raises(ConfigError, match="Redis Streams"):
        OutboxSettings(DB, broker=BrokerURL.parse("sqs://"), stream_maxlen=1000)
    with pytest.raises(ConfigError, match="stream-maxlen"):
        OutboxSettings(DB, broker=redis, stream_maxlen=0)


def relay_cli(*args: str, hide_redis: bool = False) -> subprocess.CompletedProcess[str]:
    code = (
        ("import sys; sys.modules['redis'] = None; " if hide_redis else "import sys; ")
        + f"sys.argv = ['relay', *{list(args)!r}]; "
        + "from relay.cli import main; main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )


def test_without_the_redis_extra_a_redis_url_exits_2_naming_it():
    done = relay_cli(
        "outbox",
        "--database-url",
        "postgresql://x@127.0.0.1:1/x",
        "--broker-url",
        f"redis://:{SECRET}@127.0.0.1:6379",
        hide_redis=True,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "relay-outbox[redis]" in lines[0], done.stderr
    assert SECRET not in done.stderr


def test_stream_maxlen_on_another_broker_exits_2_in_one_line():
    done = relay_cli(
        "outbox",
        "--database-url",
        "postgresql://x@127.0.0.1:1/x",
        "--broker-url",
        "amqp://guest:guest@127.0.0.1:1/",
        "--stream-maxlen",
        "100",
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--stream-maxlen" in lines[0], done.stderr
