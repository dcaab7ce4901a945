"""kafka:// and kafkas:// broker URLs (the contract's Configuration
paragraph): pure unit tests, and the CLI's exit 2, no servers."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.config import KAFKA_FIXED, BrokerURL, ConfigError, DaemonSettings, redact_url
from tests.conftest import REPO

SECRET = "s3cr3t-Pa55"


def props(url: str) -> dict[str, str]:
    parsed = BrokerURL.parse(url)
    assert parsed.kind == "kafka"
    return dict(parsed.kafka)


def test_hosts_tls_and_sasl_make_the_client_properties():
    assert props("kafka://b1:9092") == {
        "bootstrap.servers": "b1:9092",
        "security.protocol": "PLAINTEXT",
    }
    assert props("kafka://b1:9092,b2:9093,[::1]:9094/") == {
        "bootstrap.servers": "b1:9092,b2:9093,[::1]:9094",
        "security.protocol": "PLAINTEXT",
    }
    assert props("kafkas://b1:9093")["security.protocol"] == "SSL"
    assert props(f"kafka://app:{SECRET}@b1:9092") == {
        "bootstrap.servers": "b1:9092",
        "security.protocol": "SASL_PLAINTEXT",
        "sasl.mechanism": "PLAIN",
        "sasl.username": "app",
        "sasl.password": SECRET,
    }
    scram = props("kafkas://app:p%40ss%2Fw@b1:9093?sasl.mechanism=SCRAM-SHA-512")
    assert (scram["security.protocol"], scram["sasl.mechanism"], scram["sasl.password"]) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "p@ss/w",
    )
    assert props("kafka://u:p@b?sasl.mechanism=SCRAM-SHA-256")["sasl.mechanism"] == "SCRAM-SHA-256"


def test_other_query_parameters_pass_unchanged_and_relays_own_values_may_be_repeated():
    got = props(
        "kafka://b:9092?client.id=orders&compression.type=zstd&linger.ms=5"
        "&acks=all&enable.idempotence=true&session.timeout.ms=6000"
    )
    assert {k: got[k] for k in ("client.id", "compression.type", "linger.ms")} == {
        "client.id": "orders",
        "compression.type": "zstd",
        "linger.ms": "5",
    }
    assert got["session.timeout.ms"] == "6000" and got["acks"] == "all"


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("enable.idempotence=false", "enable.idempotence"),
        ("acks=1", "acks"),
        ("acks=0", "acks"),
        ("enable.auto.commit=true", "enable.auto.commit"),
        ("enable.auto.offset.store=true", "enable.auto.offset.store"),
        ("isolation.level=read_uncommitted", "isolation.level"),
        ("partitioner=consistent_random", "partitioner"),
        ("allow.auto.create.topics=true", "allow.auto.create.topics"),
        ("auto.offset.reset=latest", "auto.offset.reset"),
        ("partition.assignment.strategy=cooperative-sticky", "partition.assignment.strategy"),
        ("enable.ssl.certificate.verification=false", "enable.ssl.certificate.verification"),
        ("group.id=other", "group.id"),
        ("bootstrap.servers=x:1", "bootstrap.servers"),
        ("security.protocol=PLAINTEXT", "security.protocol"),
        ("sasl.password=x", "sasl.password"),
    ],
)
def test_a_property_set_against_relays_guarantees_is_named(query, name):
    with pytest.raises(ConfigError) as caught:
        BrokerURL.parse(f"kafka://u:{SECRET}@b:9092?{query}")
    text = str(caught.value)
    assert name in text and "\n" not in text and SECRET not in text


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("kafka://", "expected HOST:PORT"),
        ("kafka://b:9092,", "expected HOST:PORT"),
        ("kafka://b:notaport", "expected HOST:PORT"),
        ("kafka://b:70000", "bad port"),
        ("kafka://b:9092/topic", "no path"),
        ("kafkas://b:9093?ssl.ca.location=/no/such/ca.pem", "no such file"),
        (f"kafka://u:{SECRET}@b:9092?sasl.mechanism=GSSAPI", "sasl.mechanism"),
        ("kafka://b:9092?linger.ms", "invalid broker URL"),
    ],
)
def test_bad_kafka_urls(url, message):
    with pytest.raises(ConfigError, match=message) as caught:
        BrokerURL.parse(url)
    assert SECRET not in str(caught.value)


def test_passwords_are_masked_in_logs_and_reprs():
    url = f"kafka://app:{SECRET}@b1:9092,b2:9092?ssl.key.password={SECRET}&linger.ms=5"
    assert redact_url(url) == "kafka://app:***@b1:9092,b2:9092?ssl.key.password=***&linger.ms=5"
    parsed = BrokerURL.parse(url)
    assert SECRET not in repr(parsed)
    settings = DaemonSettings("postgresql://x@db/app", broker=parsed)
    assert SECRET in settings.secrets


@given(st.sampled_from(sorted(KAFKA_FIXED)), st.text(min_size=1, max_size=20))
def test_any_value_of_a_fixed_property_is_relays_own_or_refused(name, value):
    allowed = KAFKA_FIXED[name][0]
    url = f"kafka://b:9092?{name}={value.replace('&', '').replace('#', '') or 'x'}"
    try:
        got = BrokerURL.parse(url)
    except ConfigError as exc:
        assert name in str(exc)
        return
    spelled = dict(got.kafka)[name].strip().lower()
    # librdkafka reads a boolean as true/t/1 or false/f/0
    as_read = {"t": "true", "1": "true", "f": "false", "0": "false"}.get(spelled, spelled)
    assert as_read in allowed


@pytest.mark.parametrize(
    ("query", "accepted"),
    [
        ("request.required.acks=1", False),  # librdkafka's other name for acks
        ("request.required.acks=all", True),
        ("enable.idempotence=1", True),  # librdkafka reads 1 as true
        ("enable.idempotence=T", True),
        ("enable.idempotence=0", False),
        ("enable.auto.commit=1", False),
        ("enable.auto.commit=f", True),
    ],
)
def test_aliases_and_booleans_are_checked_as_librdkafka_reads_them(query, accepted):
    url = f"kafka://b:9092?{query}"
    if accepted:
        BrokerURL.parse(url)
    else:
        with pytest.raises(ConfigError, match=query.split("=")[0]):
            BrokerURL.parse(url)


def test_without_the_kafka_extra_a_kafka_url_exits_2_naming_it():
    code = (
        "import sys; sys.modules['confluent_kafka'] = None; "
        "sys.argv = ['relay', 'outbox', '--database-url', 'postgresql://x@127.0.0.1:1/x', "
        "'--broker-url', 'kafka://127.0.0.1:9092']; "
        "from relay.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "relay-outbox[kafka]" in lines[0], done.stderr


def test_the_inbox_group_defaults_to_the_first_topic_and_rabbitmq_flags_are_refused():
    from relay.config import InboxSettings

    broker = BrokerURL.parse("kafka://b:9092")
    db = "postgresql://x@db/app"
    settings = InboxSettings(db, broker=broker, queue="orders, payments")
    assert settings.consumer_name == "orders"
    named = InboxSettings(db, broker=broker, queue="orders,payments", consumer_name="billing")
    assert named.consumer_name == "billing"
    for extra in ({"binds": ("#",)}, {"queue_type": "quorum"}, {"queue_args": ("x-a=1",)}):
        with pytest.raises(ConfigError, match="RabbitMQ only"):
            InboxSettings(db, broker=broker, queue="orders", **extra)
    with pytest.raises(ConfigError, match="TOPIC,TOPIC"):
        InboxSettings(db, broker=broker, queue="orders,,payments")
