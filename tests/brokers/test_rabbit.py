"""RabbitMQ as users run it: unroutable messages, quorum queues and queue
arguments, several nodes to fail over between, and a broker that blocks
publishing (a resource alarm).

The shared broker is never reconfigured: failover goes through two TCP
proxies (tests/proxy.py) to it, and the memory alarm is raised on a RabbitMQ
node of this module's own (`own_node`), started on free ports under a
temporary directory and stopped at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
import pytest

import relay
from relay.config import BrokerURL, InboxSettings, parse_queue_arg, redact_url
from relay.errors import ConfigError
from tests.conftest import AMQP_URL, HANDLERS, free_port, rows, wait_until
from tests.proxy import Proxy

# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def http_get(port: int, path: str) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None, ""


def metrics(port: int) -> str:
    return http_get(port, "/metrics")[1]


def statuses(engine: Any) -> list[tuple[str, int]]:
    return [tuple(r) for r in rows(engine, "SELECT status, attempts FROM outbox ORDER BY seq")]


def node_url(port: int, password: str = "guest") -> str:
    return f"amqp://guest:{password}@127.0.0.1:{port}/"


# --------------------------------------------------------------------------
# A RabbitMQ node of our own, to raise a memory alarm on
# --------------------------------------------------------------------------


class OwnNode:
    """A RabbitMQ node started by this module: its own name, ports, data and
    log directories, no plugins, and the Debian wrapper's user (rabbitmq)."""

    def __init__(self) -> None:
        self.name = f"relay-{os.getpid()}@localhost"
        self.port = free_port()
        self.base = Path(tempfile.mkdtemp(prefix="relay-rabbit-"))
        self.url = node_url(self.port)
        for name in ("rabbitmq.conf", "plugins", "env.conf"):
            (self.base / name).write_text("")  # not the shared node's settings
        shutil.chown(self.base, "rabbitmq", "rabbitmq")
        for path in self.base.iterdir():
            shutil.chown(path, "rabbitmq", "rabbitmq")
        self.env = {
            **os.environ,
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_PID_FILE": str(self.base / "pid"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "env.conf"),
        }

    def start(self) -> None:
        subprocess.run(
            ["rabbitmq-server", "-detached"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=60,
        )

        def answers() -> bool:
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            return False

        wait_until(answers, timeout=90, interval=0.2, message=f"RabbitMQ node {self.name}")

    def ctl(self, *args: str) -> str:
        done = subprocess.run(
            ["rabbitmqctl", "-n", self.name, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    def memory_alarm(self, on: bool) -> None:
        self.ctl("set_vm_memory_high_watermark", "0" if on else "0.4")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            subprocess.run(
                ["rabbitmqctl", "-n", self.name, "stop"],
                capture_output=True,
                timeout=60,
                check=False,
            )
        shutil.rmtree(self.base, ignore_errors=True)


# The tests on the node of our own run on one worker under pytest-xdist, so
# that the node starts once (a module's fixture is made once per worker).
OWN_NODE_TESTS = pytest.mark.xdist_group("own_rabbitmq_node")


@pytest.fixture(scope="module")
def own_node() -> Iterator[OwnNode]:
    if shutil.which("rabbitmq-server") is None or os.geteuid() != 0:
        message = "a RabbitMQ node of the tests' own needs rabbitmq-server and root"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    node = OwnNode()
    try:
        node.start()
        yield node
    finally:
        node.stop()


# --------------------------------------------------------------------------
# Unroutable messages
# --------------------------------------------------------------------------


async def test_unroutable_rows_are_published_counted_by_topic_and_logged_once_per_topic(
    engine, rabbit, start_relay
):
    queue = await rabbit.queue("bound")
    with engine.begin() as conn:
        routed = relay.enqueue(conn, "bound", {"n": 0})
        for n in range(3):
            relay.enqueue(conn, "nobody.listens", {"n": n})
        relay.enqueue(conn, "nobody.either", {"n": 9})
    port = free_port()
    daemon = start_relay("outbox", "--exchange", rabbit.exchange, "--http-port", str(port))
    wait_until(lambda: statuses(engine) == [("published", 0)] * 5, message="all published")
    [message] = await rabbit.drain(queue, 1)
    assert message.message_id == str(routed)
    text = metrics(port)
    assert 'relay_outbox_unroutable_total{topic="nobody.listens"} 3.0' in text
    assert 'relay_outbox_unroutable_total{topic="nobody.either"} 1.0' in text
    assert "relay_outbox_failed_total 0.0" in text
    # One line per topic, not one per message.
    lines = [line for line in daemon.log.splitlines() if "unroutable" in line]
    assert sum("'nobody.listens'" in line for line in lines) == 1, daemon.log
    assert sum("'nobody.either'" in line for line in lines) == 1, daemon.log


def run_once_failing_unroutable(run_relay, exchange):
    """`relay outbox --once` with --on-unroutable fail, retries far off."""
    result = run_relay(
        "outbox",
        "--once",
        "--exchange",
        exchange,
        "--backoff-min",
        "30",
        "--backoff-max",
        "60",
        env={"RELAY_ON_UNROUTABLE": "fail"},
    )
    assert result.returncode == 0, result.stderr


async def test_on_unroutable_fail_keeps_the_old_behaviour_a_failed_attempt(
    engine, rabbit, run_relay
):
    with engine.begin() as conn:
        relay.enqueue(conn, "nobody.listens", {})
    run_once_failing_unroutable(run_relay, rabbit.exchange)
    [(status, attempts, error)] = rows(engine, "SELECT status, attempts, last_error FROM outbox")
    assert (status, attempts) == ("pending", 1)
    assert "unroutable" in error and "'nobody.listens'" in error


async def test_returns_in_a_mixed_batch_fail_only_their_own_rows(engine, rabbit, run_relay):
    """Routed and unroutable rows interleaved in one batch, headers and
    bodies of several frames among them: relay reads each basic.return
    itself (relay.brokers.amqp.publishing._Returns) and matches it to its publish, so exactly the
    unroutable rows fail and every routed one is published and delivered."""
    queue = await rabbit.queue("bound")
    big = {"blob": "x" * 300_000}  # over the connection's frame size: several body frames
    with engine.begin() as conn:
        routed, returned = [], []
        for n in range(12):
            payload = big if n % 4 == 0 else {"n": n}
            headers = {"traceparent": f"00-{n:032x}-{n:016x}-01", "h": "v" * n}
            if n % 3 == 0:
                returned.append(relay.enqueue(conn, "nobody.listens", payload, headers=headers))
            else:
                routed.append(relay.enqueue(conn, "bound", payload, key=f"k{n}", headers=headers))
    run_once_failing_unroutable(run_relay, rabbit.exchange)
    found = dict(rows(engine, "SELECT id, status || ':' || attempts FROM outbox"))
    assert {found[i] for i in routed} == {"published:0"}
    assert {found[i] for i in returned} == {"pending:1"}
    delivered = await rabbit.drain(queue, len(routed))
    assert sorted(m.message_id for m in delivered) == sorted(map(str, routed))


def test_a_bad_on_unroutable_exits_2_with_one_line(run_relay):
    result = run_relay("outbox", "--once", env={"RELAY_ON_UNROUTABLE": "drop"})
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "invalid --on-unroutable 'drop': use publish or fail" in result.stderr


# --------------------------------------------------------------------------
# Queue type and arguments
# --------------------------------------------------------------------------


def test_queue_args_parse_integers_as_integers_and_refuse_what_is_not_name_value():
    assert parse_queue_arg("x-max-length=10000") == ("x-max-length", 10000)
    assert parse_queue_arg("x-dead-letter-exchange=dlx") == ("x-dead-letter-exchange", "dlx")
    assert parse_queue_arg("x-overflow=reject-publish") == ("x-overflow", "reject-publish")
    assert parse_queue_arg("x-message-ttl=-1") == ("x-message-ttl", -1)
    assert parse_queue_arg("x-note=a=b") == ("x-note", "a=b")
    for bad in ("x-max-length", "=5", "x-max-length=99999999999999999999"):
        with pytest.raises(ConfigError, match="--queue-arg"):
            parse_queue_arg(bad)


def test_queue_type_and_args_are_rabbitmq_only_and_must_agree(database):
    sqs = BrokerURL.parse("sqs://")
    with pytest.raises(ConfigError, match="RabbitMQ only"):
        InboxSettings(database_url=database, broker=sqs, queue="q", queue_type="quorum")
    with pytest.raises(ConfigError, match="RabbitMQ only"):
        InboxSettings(
            database_url=database, broker=sqs, queue="q", queue_args=(("x-max-length", 5),)
        )
    with pytest.raises(ConfigError, match="contradicts"):
        InboxSettings(
            database_url=database,
            broker=BrokerURL.parse(AMQP_URL),
            queue="q",
            queue_type="quorum",
            queue_args=(("x-queue-type", "classic"),),
        )


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--queue-arg", "x-max-length"], "invalid --queue-arg 'x-max-length': use NAME=VALUE"),
        (["--queue-type", "stream"], "invalid --queue-type 'stream': use classic or quorum"),
        (["--queue-type", "quorum", "--broker-url", "sqs://"], "apply to RabbitMQ only"),
    ],
)
def test_bad_queue_options_exit_2_with_one_line(run_relay, args, error):
    result = run_relay("inbox", "--queue", "q", *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert error in result.stderr


async def redeclare(name: str, arguments: dict[str, Any]) -> str | None:
    """Declare the queue again with these arguments: None if RabbitMQ finds
    them equivalent to the queue's own, else its PRECONDITION_FAILED text."""
    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel()
        await channel.declare_queue(name, durable=True, arguments=arguments)
        return None
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        return str(exc)
    finally:
        await connection.close()


async def test_inbox_declares_a_quorum_queue_with_its_arguments_and_consumes_it(
    effects, rabbit, inbox, run_relay
):
    # A repeatable option's variable takes its values separated by spaces.
    daemon = inbox(
        "--queue-type",
        "quorum",
        bind="quorum.#",
        env={"RELAY_QUEUE_ARG": "x-delivery-limit=5 x-max-length=100000"},
    )
    queue = daemon.queue  # type: ignore[attr-defined]
    # What RabbitMQ holds: the same arguments are equivalent, others are not.
    declared = {"x-queue-type": "quorum", "x-delivery-limit": 5, "x-max-length": 100000}
    assert await redeclare(queue, declared) is None
    assert "x-queue-type" in (await redeclare(queue, {**declared, "x-queue-type": "classic"}) or "")
    assert "x-max-length" in (await redeclare(queue, {**declared, "x-max-length": 7}) or "")
    with effects.begin() as conn:
        ids = [relay.enqueue(conn, "quorum.x", {"n": n}, type="Effect") for n in range(20)]
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(
        lambda: rows(effects, "SELECT count(*) FROM inbox WHERE status = 'processed'") == [(20,)],
        message="20 processed",
    )
    assert {r[0] for r in rows(effects, "SELECT message_id FROM inbox")} == {str(i) for i in ids}


async def test_a_queue_that_exists_with_other_arguments_exits_2_with_a_clear_line(
    rabbit, start_relay
):
    queue = await rabbit.queue(name=f"{rabbit.exchange}.classic")  # classic, no arguments
    daemon = start_relay(
        "inbox",
        "--queue",
        queue.name,
        "--exchange",
        rabbit.exchange,
        "--handlers",
        HANDLERS,
        "--queue-type",
        "quorum",
    )
    assert daemon.wait(timeout=60) == 2, daemon.log
    [line] = [line for line in daemon.log.splitlines() if "error" in line]
    assert "exists with other arguments" in line and "x-queue-type" in line, daemon.log
    assert "Traceback" not in daemon.log


async def test_without_queue_options_a_queue_declared_otherwise_is_used_as_it_is(
    effects, rabbit, start_relay, run_relay
):
    channel = await rabbit.connection.channel()
    name = f"{rabbit.exchange}.owned"
    await channel.declare_queue(name, durable=True, arguments={"x-queue-type": "quorum"})
    rabbit.queues.append(name)
    daemon = start_relay(
        "inbox",
        "--queue",
        name,
        "--exchange",
        rabbit.exchange,
        "--bind",
        "owned.#",
        "--handlers",
        HANDLERS,
    )
    daemon.wait_for_log("inbox started", timeout=30)
    with effects.begin() as conn:
        relay.enqueue(conn, "owned.x", {"n": 1}, type="Effect")
    assert run_relay("outbox", "--once", "--exchange", rabbit.exchange).returncode == 0
    wait_until(lambda: rows(effects, "SELECT status FROM inbox") == [("processed",)])


# --------------------------------------------------------------------------
# Several nodes
# --------------------------------------------------------------------------


def test_every_node_password_is_redacted():
    url = "amqp://u:first-secret@a:5672/,amqp://v:second-secret@b:5672/vh"
    assert redact_url(url) == "amqp://u:***@a:5672/,amqp://v:***@b:5672/vh"
    broker = BrokerURL.parse(url)
    assert broker.nodes == ("amqp://u:first-secret@a:5672/", "amqp://v:second-secret@b:5672/vh")
    assert "secret" not in repr(broker)
    # A PostgreSQL multi-host URL (commas inside one URL) is masked as before.
    assert (
        redact_url("postgresql://u:pw@h1:5432,h2:5432/db")
        == "postgresql://u:***@h1:5432,h2:5432/db"
    )
    with pytest.raises(ConfigError) as refused:
        BrokerURL.parse("amqp://u:first-secret@a:5672/,sqs://")
    assert "secret" not in str(refused.value) and "only amqp://" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        BrokerURL.parse("amqp://u:first-secret@a:5672/,amqp://v:second-secret@b:x/")
    assert "secret" not in str(refused.value)


def test_no_node_answering_is_retried_and_logs_no_password(start_relay):
    url = ",".join(node_url(free_port(), f"pw{n}-secret") for n in range(2))
    daemon = start_relay("outbox", env={"RELAY_BROKER_URL": url})
    daemon.wait_for_log("no RabbitMQ node answered", timeout=30)
    daemon.stop()
    assert "secret" not in daemon.log and daemon.log.count("***@127.0.0.1") >= 2, daemon.log


@pytest.fixture
def two_nodes() -> Iterator[tuple[Proxy, Proxy]]:
    """Two addresses of the shared broker, each through a TCP proxy of its own."""
    first, second = Proxy(5672), Proxy(5672)
    first.start()
    second.start()
    try:
        yield first, second
    finally:
        first.close()
        second.close()


async def test_losing_a_node_moves_both_daemons_to_the_next_losing_nothing_counting_nothing(
    effects, rabbit, start_relay, two_nodes
):
    first, second = two_nodes
    url = f"{node_url(first.port)},{node_url(second.port)}"
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)
    inbox = start_relay(
        "inbox",
        "--queue",
        queue,
        "--exchange",
        rabbit.exchange,
        "--bind",
        "nodes.#",
        "--handlers",
        HANDLERS,
        env={"RELAY_BROKER_URL": url},
    )
    inbox.wait_for_log("inbox started", timeout=30)
    outbox = start_relay(
        "outbox", "--exchange", rabbit.exchange, "--batch-size", "50", env={"RELAY_BROKER_URL": url}
    )
    outbox.wait_for_log("outbox relay started")
    total = 3000
    with effects.begin() as conn:
        for n in range(total // 2):
            relay.enqueue(conn, "nodes.x", {"n": n}, type="Effect", key=f"k{n % 7}")

    def published() -> int:
        return rows(effects, "SELECT count(*) FROM outbox WHERE status = 'published'")[0][0]

    wait_until(lambda: published() > 0, message="a first row published")
    first.stop()  # node 1 is gone, mid-stream: every connection to it is cut
    with effects.begin() as conn:
        for n in range(total // 2, total):
            relay.enqueue(conn, "nodes.x", {"n": n}, type="Effect", key=f"k{n % 7}")
    wait_until(lambda: published() == total, timeout=60, message="all published")
    assert rows(effects, "SELECT count(*) FROM outbox WHERE attempts > 0") == [(0,)]
    wait_until(
        lambda: (
            rows(effects, "SELECT count(*) FROM inbox WHERE status = 'processed'") == [(total,)]
        ),
        timeout=60,
        message="all processed",
    )
    assert rows(effects, "SELECT count(*) FROM inbox WHERE attempts > 0") == [(0,)]
    for daemon in (outbox, inbox):
        # (the password, "guest", is masked wherever it appears: the user name too)
        assert f"now on node 2 of 2 (amqp://***:***@127.0.0.1:{second.port}/)" in daemon.log


# --------------------------------------------------------------------------
# A blocked broker (resource alarm), on a node of our own
# --------------------------------------------------------------------------


@OWN_NODE_TESTS
async def test_a_memory_alarm_pauses_publishing_uncounted_says_why_and_resumes(
    engine, own_node, start_relay
):
    port = free_port()
    daemon = start_relay("outbox", "--http-port", str(port), env={"RELAY_BROKER_URL": own_node.url})
    daemon.wait_for_log("outbox relay started")
    with engine.begin() as conn:
        relay.enqueue(conn, "alarm.before", {})  # unroutable: published, counted
    wait_until(lambda: statuses(engine) == [("published", 0)])
    assert http_get(port, "/readyz")[0] == 200
    own_node.memory_alarm(True)
    try:
        with engine.begin() as conn:
            relay.enqueue(conn, "alarm.during", {})
        wait_until(
            lambda: http_get(port, "/readyz")[0] == 503,
            timeout=30,
            message="/readyz 503 while blocked",
        )
        _, body = http_get(port, "/readyz")
        assert "blocks publishing" in body and "memory" in body.lower(), body
        assert "RabbitMQ blocked the connection" in daemon.log
        samples = metrics(port)  # what monitoring/alerts.yml's RelayBrokerBlocked sees
        assert "relay_outbox_broker_blocked 1.0" in samples and "relay_ready 0.0" in samples
        assert statuses(engine) == [("published", 0), ("pending", 0)]
    finally:
        own_node.memory_alarm(False)
    wait_until(
        lambda: statuses(engine) == [("published", 0)] * 2,
        timeout=30,
        message="published once unblocked",
    )
    wait_until(lambda: http_get(port, "/readyz")[0] == 200)
    assert "publishing resumes" in daemon.log
    assert "relay_outbox_failed_total 0.0" in metrics(port)


@OWN_NODE_TESTS
async def test_the_alternate_exchange_recipe_keeps_unroutable_messages(
    engine, own_node, start_relay
):
    # README's recipe, on the node of our own (no policies on the shared one).
    exchange, kept = "relay-ae-test", "relay-ae-test.unrouted"
    own_node.ctl(
        "set_policy",
        "relay-ae-test",
        f"^{exchange}$",
        f'{{"alternate-exchange":"{kept}"}}',
        "--apply-to",
        "exchanges",
    )
    connection = await aio_pika.connect(own_node.url)
    try:
        channel = await connection.channel()
        fanout = await channel.declare_exchange(kept, "fanout", durable=True)
        queue = await channel.declare_queue(kept, durable=True)
        await queue.bind(fanout)
        with engine.begin() as conn:
            message_id = relay.enqueue(conn, "nobody.listens", {"n": 1})
        port = free_port()
        start_relay(
            "outbox",
            "--exchange",
            exchange,
            "--http-port",
            str(port),
            env={"RELAY_BROKER_URL": own_node.url},
        )
        wait_until(lambda: statuses(engine) == [("published", 0)])
        message = await queue.get(timeout=10)
        assert message.message_id == str(message_id)
        assert message.routing_key == "nobody.listens"
        assert "relay_outbox_unroutable_total{" not in metrics(port)  # routed: not returned
    finally:
        own_node.ctl("clear_policy", "relay-ae-test")
        await connection.close()


async def test_the_receiver_reads_deliveries_from_the_connections_frames(rabbit):
    """relay's own frame reader takes the consumer's deliveries (not aiormq's
    reader and pamqp): messages of no body, of one body frame and of many
    (past RabbitMQ's frame_max of 128 KiB) arrive whole and in order, and the
    connection's other traffic (the acks' channel, heartbeats) goes on."""
    from relay.brokers import make_consumer

    queue = f"{rabbit.exchange}.frames"
    consumer = make_consumer(
        BrokerURL.parse(AMQP_URL), queue=queue, exchange=rabbit.exchange, binds=["f.#"], prefetch=50
    )
    try:
        await consumer.connect()
        rabbit.queues.append(queue)
        assert consumer.frames_read_by_relay  # type: ignore[attr-defined]
        bodies = [b"", b'{"n": 1}', os.urandom(300_000), b"x" * 131_064, b'{"n": 4}']
        for n, body in enumerate(bodies * 20):
            await rabbit.publish(f"f.{n % 3}", body, message_id=f"m-{n}", type="T")
        got = []
        batches = consumer.batches(100, 0.2)
        async with asyncio.timeout(30):
            while len(got) < len(bodies) * 20:
                batch = await anext(batches)
                await consumer.ack(batch)
                got += batch
        await batches.aclose()
    finally:
        await consumer.close()
    assert [m.message_id for m in got] == [f"m-{n}" for n in range(len(bodies) * 20)]
    assert [m.body for m in got] == bodies * 20
    assert {m.type for m in got} == {"T"}
    assert [m.topic for m in got] == [f"f.{n % 3}" for n in range(len(bodies) * 20)]
