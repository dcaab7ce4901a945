"""The NATS adapter in this process against nats-server: what the contract
suite (tests/brokers/test_contract.py) does not say about NATS, and its URL."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest

from relay.brokers import Incoming, Outcome, make_consumer, make_publisher
from relay.brokers.nats.publishing import build_message
from relay.config import BrokerURL, InboxSettings, redact_url
from relay.errors import BrokerUnavailable, ConfigError
from relay.outbox import WORKERS
from relay.rows import Failure, OutboxRow
from tests.conftest import free_port, wait_until
from tests.nats_server import NATS_SERVER, Nats

CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def row(topic: str, payload: object, *, key: str | None = None, headers: str = "{}") -> OutboxRow:
    return OutboxRow(
        str(uuid.uuid4()), 0, topic, key, None, orjson.dumps(payload).decode(), headers, CREATED, 0
    )


async def collect(consumer: object, seconds: float) -> list[Incoming]:
    """What the consumer hands out in `seconds`, nothing acknowledged."""
    batches = consumer.batches(100, 0.1)  # type: ignore[attr-defined]
    got: list[Incoming] = []
    try:
        async with asyncio.timeout(seconds):
            while True:
                got += await anext(batches)
    except TimeoutError:
        pass
    finally:
        await batches.aclose()
    return got


# --------------------------------------------------------------------------
# The URL
# --------------------------------------------------------------------------


def test_a_nats_url_lists_its_servers_and_keeps_its_password_out_of_sight():
    broker = BrokerURL.parse("nats://app:s3cret@a.example:4223,b.example")
    assert broker.kind == "nats"
    assert broker.nodes == ("nats://app:s3cret@a.example:4223", "nats://app:s3cret@b.example:4222")
    assert "s3cret" not in redact_url(broker.url) and "s3cret" not in repr(broker)
    assert BrokerURL.parse("natss://h:4222").nats == (("tls", "1"),)


def test_ca_and_creds_name_files_that_exist(tmp_path: Path):
    creds = tmp_path / "user.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\n")
    broker = BrokerURL.parse(f"natss://h:4222?ca={creds}&creds={creds}")
    assert dict(broker.nats) == {"ca": str(creds), "creds": str(creds), "tls": "1"}
    for url, said in [
        (f"nats://h?ca={creds}", "ca applies to natss://"),
        ("nats://h?creds=/no/such.creds", "no such file"),
        ("nats://h?user=x", "unknown parameter 'user'"),
        ("nats://h/path", "no path"),
        ("nats://h:99999", "bad port"),
    ]:
        with pytest.raises(ConfigError, match=said):
            BrokerURL.parse(url)


def test_rabbitmqs_inbox_options_are_refused_and_names_are_checked():
    broker = BrokerURL.parse("nats://127.0.0.1:4222")
    with pytest.raises(ConfigError, match="--bind"):
        InboxSettings("postgresql://x/db", broker=broker, queue="orders", binds=("a.#",))
    with pytest.raises(ConfigError, match="invalid --queue"):
        make_consumer(broker, queue="orders.v1", exchange="relay", binds=(), prefetch=10)


def test_a_nats_url_without_the_client_installed_exits_2_naming_the_extra():
    code = (
        "import sys; sys.modules['nats'] = None\n"
        "from relay.cli import main\n"
        "sys.argv = ['relay', 'outbox', '--database-url', 'postgresql://x/db',"
        " '--broker-url', 'nats://127.0.0.1:4222']\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "pip install 'relay-outbox[nats]'" in done.stderr
    assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------
# Outbox
# --------------------------------------------------------------------------


def test_headers_a_nats_header_cannot_carry_fail_the_row_for_good():
    message = build_message(row("t", {}, headers='{"Nats-Msg-Id": "theirs", "x": "y"}'))
    assert message.headers["Nats-Msg-Id"] != "theirs" and message.headers["x"] == "y"
    for headers in ('{"a b": "x"}', '{"x": "two\\nlines"}', '{"x": " padded"}'):
        with pytest.raises(Exception, match="NATS header"):
            build_message(row("t", {}, headers=headers))
    for topic in ("a..b", "a.*", "a.>", "a b"):
        with pytest.raises(Exception, match="NATS subject"):
            build_message(row(topic, {}))


async def test_a_keys_later_rows_wait_when_the_stream_refuses_its_first(nats_helper: Nats):
    subject = nats_helper.name("refusing")
    stream = await nats_helper.create(f"S-{subject}", [subject], max_msg_size=200)
    first = row(subject, {"blob": "x" * 300}, key="k")  # over the stream's max_msg_size
    batch = [first, row(subject, {"n": 2}, key="k"), row(subject, {"n": 3}, key="j")]
    publisher = make_publisher(BrokerURL.parse(nats_helper.url), exchange="relay", workers=WORKERS)
    try:
        results = await publisher.publish(batch)
    finally:
        await publisher.close()
    assert isinstance(results[0], Failure) and results[0].permanent
    assert "too large" in results[0].error and "max_msg_size" in results[0].error
    assert results[1:] == [Outcome.RELEASE, None]
    [stored] = await nats_helper.messages(stream)
    assert stored.headers["Nats-Msg-Id"] == batch[2].id


async def test_relay_connects_to_any_server_of_the_list_that_answers(nats_helper: Nats):
    subject = nats_helper.name("any")
    stream = await nats_helper.create(f"S-{subject}", [subject])
    live = nats_helper.url.removeprefix("nats://")
    for url in (f"nats://127.0.0.1:1,{live}", f"nats://{live},127.0.0.1:1"):
        publisher = make_publisher(BrokerURL.parse(url), exchange="relay", workers=1)
        try:
            assert await publisher.publish([row(subject, {"n": 1})]) == [None]
        finally:
            await publisher.close()
    assert len(await nats_helper.messages(stream)) == 2


async def test_an_unreachable_server_is_unavailable_with_its_reason(nats_helper: Nats):
    publisher = make_publisher(
        BrokerURL.parse("nats://app:s3cret@127.0.0.1:1,127.0.0.1:2"), exchange="relay", workers=1
    )
    try:
        with pytest.raises(BrokerUnavailable, match="NATS at nats://app:\\*\\*\\*@") as raised:
            await publisher.connect()
        assert "s3cret" not in str(raised.value)
    finally:
        await publisher.close()


# --------------------------------------------------------------------------
# Inbox
# --------------------------------------------------------------------------


async def test_the_consumer_holds_about_max_bytes_and_a_larger_message_comes_alone(
    nats_helper: Nats,
):
    stream, subject = await nats_helper.stream("bytes")
    for n in range(6):
        await nats_helper.publish(f"{subject}.x", b"%d" % n + b" " * 3000)
    await nats_helper.publish(f"{subject}.x", b"big" + b" " * 20_000)
    consumer = make_consumer(
        BrokerURL.parse(nats_helper.url),
        queue=stream,
        exchange="relay",
        binds=(),
        prefetch=100,
        max_bytes=8000,
    )
    try:
        first = await collect(consumer, 1.5)
        assert 1 <= len(first) <= 2, len(first)  # 3 KB each: the third is over 8 KB
        got, acked = list(first), 0
        for _ in range(10):
            await consumer.ack(got[acked:])
            acked = len(got)
            got += await collect(consumer, 1.0)
            if len(got) == 7:
                break
        assert [m.body[:3] for m in got] == [b"0  ", b"1  ", b"2  ", b"3  ", b"4  ", b"5  ", b"big"]
        await consumer.ack(got[acked:])
    finally:
        await consumer.close()
    # +ACK is fire-and-forget and the server applies it on its own time: the
    # last one may still be on its way when the connection has closed.
    for _ in range(100):
        info = await nats_helper.consumer_info(stream, stream)
        if (info.num_pending, info.num_ack_pending) == (0, 0):
            break
        await asyncio.sleep(0.05)
    assert (info.num_pending, info.num_ack_pending) == (0, 0)


async def test_a_missing_stream_is_unavailable_and_a_push_consumer_is_bad_configuration(
    nats_helper: Nats,
):
    missing = make_consumer(
        BrokerURL.parse(nats_helper.url), queue="no-such-stream", exchange="", binds=(), prefetch=1
    )
    with pytest.raises(BrokerUnavailable, match="NATS stream 'no-such-stream' does not exist"):
        await missing.connect()
    stream, _ = await nats_helper.stream("push")
    await nats_helper.add_consumer(stream, "pushed", deliver_subject="somewhere")
    consumer = make_consumer(
        BrokerURL.parse(nats_helper.url),
        queue=stream,
        exchange="",
        binds=(),
        prefetch=1,
        consumer_name="pushed",
    )
    try:
        with pytest.raises(ConfigError, match="push consumer"):
            await consumer.connect()
    finally:
        await consumer.close()


# --------------------------------------------------------------------------
# natss://
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory):
    """nats-server with TLS, its certificate signed by a CA of the test's own."""
    base = tmp_path_factory.mktemp("nats-tls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=base, check=True, capture_output=True)

    subject = ["-subj", "/CN=relay-test-ca"]
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
            "-days", "2", *subject)  # fmt: skip
    subject = ["-subj", "/CN=localhost"]
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
            *subject)  # fmt: skip
    (base / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    signed = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", "ext.cnf"]
    openssl("x509", "-req", "-in", "server.csr", "-out", "server.pem", "-days", "2", *signed)
    port = free_port()
    tls = ["--tls", "--tlscert", "server.pem", "--tlskey", "server.key"]
    store = ["-js", "-sd", str(base / "store")]
    with (base / "server.log").open("wb") as log:
        process = subprocess.Popen(
            [NATS_SERVER, *store, "-a", "127.0.0.1", "-p", str(port), *tls],
            cwd=base,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: _listening(port), timeout=30)
        yield port, base / "ca.pem"
    finally:
        process.terminate()
        process.wait(10)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
    except OSError:
        return False
    return True


async def test_natss_verifies_the_server_against_ca_and_refuses_it_without(tls_server):
    port, ca = tls_server
    trusted = make_publisher(
        BrokerURL.parse(f"natss://127.0.0.1:{port}?ca={ca}"), exchange="relay", workers=1
    )
    try:
        await trusted.connect()
        assert trusted.connected
    finally:
        await trusted.close()
    untrusted = make_publisher(BrokerURL.parse(f"natss://127.0.0.1:{port}"), exchange="", workers=1)
    try:
        with pytest.raises(ConfigError, match=r"TLS failed: .*certificate"):
            await untrusted.connect()
    finally:
        await untrusted.close()
