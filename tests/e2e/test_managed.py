"""What managed PostgreSQL and brokers do in production, on real servers:
a failover to a streaming standby, an endpoint that answers read only,
passwords that expire, TLS with certificate verification (issue 32).

Both daemons run as subprocesses under a producer's load; every check is
on the database's rows: every committed outbox row published, every
message's effect once, nothing dead, no attempt counted, both daemons up.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Self

import psycopg
import pytest

from tests.apps.handlers import EFFECTS_DDL
from tests.brokers.test_rabbit import http_get
from tests.conftest import RELAY, REPO, RelayProcess, free_port, wait_until
from tests.pgcluster import OWN_SERVER_TESTS, Certificates, Cluster, cluster, own_directory

TOPIC = "managed.e"


class Producer:
    """Inserts outbox rows of type Effect on `keys` keys, a few per
    transaction, until stopped; connects anew (to the writer of a
    multi-host URL) after any failure. Which rows committed is read from
    the database afterwards: a commit whose answer was lost may have
    landed."""

    def __init__(self, conninfo: str, keys: int = 6) -> None:
        self.conninfo = conninfo
        self.keys = keys
        self.stopping = threading.Event()
        self.failures = 0
        self.sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(30)

    def _run(self) -> None:
        n = 0
        conn: psycopg.Connection | None = None
        while not self.stopping.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.conninfo, connect_timeout=3)
                    # The shared server's read-only fault is for relay only.
                    conn.execute("SET default_transaction_read_only = off")
                    conn.commit()
                with conn.transaction():
                    for _ in range(5):
                        conn.execute(
                            "INSERT INTO outbox (topic, key, type, payload) "
                            "VALUES (%s, %s, 'Effect', jsonb_build_object('n', %s::int))",
                            (TOPIC, f"k{n % self.keys}", n),
                        )
                        n += 1
                self.sent = n
            except psycopg.Error:
                self.failures += 1
                if conn is not None:
                    with contextlib.suppress(Exception):
                        conn.close()
                conn = None
                time.sleep(0.2)
                continue
            time.sleep(0.02)
        if conn is not None:
            conn.close()


def effect_check(conninfo: str) -> dict[str, Any]:
    """Every outbox row published and handled once, in order per key, and
    nothing dead or counted as an attempt, in either table."""
    with psycopg.connect(conninfo) as conn, conn.transaction():
        # One snapshot for every count: the daemons go on meanwhile.
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        outbox = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status <> 'published'), "
            "coalesce(sum(attempts), 0) FROM outbox"
        ).fetchone()
        inbox = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE status <> 'processed'), "
            "coalesce(sum(attempts), 0) FROM inbox"
        ).fetchone()
        effects = conn.execute(
            "SELECT count(*), count(DISTINCT message_id) FROM effects"
        ).fetchone()
        missing = conn.execute(
            "SELECT count(*) FROM outbox o WHERE NOT EXISTS "
            "(SELECT 1 FROM effects e WHERE e.message_id = o.id::text)"
        ).fetchone()[0]
        disorder = conn.execute(
            "SELECT count(*) FROM (SELECT n, lag(n) OVER (PARTITION BY key ORDER BY id) AS before "
            "FROM effects) e WHERE n < before"
        ).fetchone()[0]
    assert outbox is not None and inbox is not None and effects is not None
    return {
        "rows": outbox[0],
        "unpublished": outbox[1],
        "outbox_attempts": outbox[2],
        "unprocessed": inbox[1],
        "inbox_attempts": inbox[2],
        "effects": effects[0],
        "distinct_effects": effects[1],
        "missing_effects": missing,
        "out_of_order": disorder,
    }


def all_done(conninfo: str) -> Callable[[], Any]:
    def check() -> Any:
        with contextlib.suppress(psycopg.Error):
            found = effect_check(conninfo)
            if found["rows"] and not (
                found["unpublished"] or found["unprocessed"] or found["missing_effects"]
            ):
                return found
        return None

    return check


def first_after(conninfo: str, column: str, table: str, since: float) -> float | None:
    """The earliest `column` (a timestamptz) of `table` after the epoch `since`."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            f"SELECT extract(epoch FROM min({column})) FROM {table} "  # noqa: S608 - constants
            f"WHERE {column} > to_timestamp(%s)",
            (since,),
        ).fetchone()
    return float(row[0]) if row and row[0] is not None else None


def assert_clean(found: dict[str, Any]) -> None:
    assert found["unpublished"] == found["unprocessed"] == 0, found
    assert found["outbox_attempts"] == found["inbox_attempts"] == 0, found
    assert found["effects"] == found["distinct_effects"] == found["rows"], found
    assert found["out_of_order"] == 0, found


@pytest.fixture
def daemons(rabbit: Any, tmp_path: Path) -> Iterator[Callable[..., tuple[RelayProcess, ...]]]:
    """Start `relay outbox` and `relay inbox` (the test handlers) on a database
    URL and the shared RabbitMQ, with HTTP probes; stopped after the test."""
    started: list[RelayProcess] = []
    queue = f"{rabbit.exchange}.in"
    rabbit.queues.append(queue)

    def start(database_url: str, *extra: str, env: dict[str, str] | None = None) -> Any:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_")}
        base.update(
            {
                "RELAY_DATABASE_URL": database_url,
                "RELAY_BROKER_URL": "amqp://guest:guest@127.0.0.1:5672/",
                "RELAY_EXCHANGE": rabbit.exchange,
                "RELAY_POLL_INTERVAL": "5",
                "RELAY_BACKOFF_MIN": "0.2",
                "RELAY_BACKOFF_MAX": "1",
                "PYTHONUNBUFFERED": "1",
                **(env or {}),
            }
        )
        out_port, in_port = free_port(), free_port()
        outbox = RelayProcess(
            ["outbox", "--http-port", str(out_port), *extra], base, tmp_path / "outbox.log"
        )
        inbox = RelayProcess(
            [
                "inbox",
                "--queue",
                queue,
                "--bind",
                "managed.#",
                "--handlers",
                "tests.apps.handlers:registry",
                "--http-port",
                str(in_port),
                *extra,
            ],
            base,
            tmp_path / "inbox.log",
        )
        outbox.port, inbox.port = out_port, in_port  # type: ignore[attr-defined]
        started.extend([outbox, inbox])
        outbox.wait_for_log("outbox relay started", timeout=60)
        inbox.wait_for_log("inbox started", timeout=60)
        return outbox, inbox

    yield start
    for proc in started:
        proc.stop()


def alive(*procs: RelayProcess) -> None:
    for proc in procs:
        assert proc.proc.poll() is None, f"relay {proc.args[0]} exited:\n{proc.log[-3000:]}"


def apply_schema(database_url: str, env: dict[str, str] | None = None) -> None:
    done = subprocess.run(
        [*RELAY, "schema", "apply", "--database-url", database_url],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------
# The read-only endpoint, on the shared server
# --------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_both_daemons_ride_out_a_read_only_endpoint_and_recover_on_new_sessions(
    database, engine, daemons
):
    """A managed failover's first seconds: the endpoint answers read only.
    Simulated with the database's default_transaction_read_only and relay's
    sessions ended; the setting is reset while the read-only sessions relay
    opened meanwhile are still open: relay must drop them, not retry on them."""
    from tests.conftest import rows

    rows(engine, EFFECTS_DDL)
    libpq = database.replace("postgresql+psycopg://", "postgresql://")
    dbname = libpq.rsplit("/", 1)[1]
    outbox, inbox = daemons(database)
    admin = psycopg.connect(libpq.rsplit("/", 1)[0] + "/postgres", autocommit=True)
    with Producer(libpq) as producer:
        wait_until(lambda: producer.sent > 100, timeout=30, message="rows produced")
        admin.execute(f'ALTER DATABASE "{dbname}" SET default_transaction_read_only = on')
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND application_name = 'relay'",
            (dbname,),
        )
        for proc in (outbox, inbox):
            _, body = wait_until(
                lambda p=proc: (
                    (s := http_get(p.port, "/readyz"))[0] == 503 and "read only" in s[1] and s
                ),
                timeout=30,
                message=f"{proc.args[0]} not ready, read only",
            )
            assert "read only" in body
        # relay has read-only sessions open now; the endpoint takes writes again.
        time.sleep(2)
        read_only_sessions = admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
            "AND application_name = 'relay'",
            (dbname,),
        ).fetchone()[0]
        admin.execute(f'ALTER DATABASE "{dbname}" RESET default_transaction_read_only')
        reset = time.time()
        time.sleep(1)
    found = wait_until(all_done(libpq), timeout=60, message="every row published and handled")
    published = first_after(libpq, "published_at", "outbox", reset)
    processed = first_after(libpq, "processed_at", "inbox", reset)
    assert published is not None and processed is not None
    print(
        f"\nread-only endpoint: first publish {published - reset:.1f}s and first processed "
        f"message {processed - reset:.1f}s after the endpoint took writes again",
        flush=True,
    )
    alive(outbox, inbox)
    assert_clean(found)
    assert read_only_sessions > 0
    for proc in (outbox, inbox):
        wait_until(lambda p=proc: http_get(p.port, "/readyz")[0] == 200, timeout=30)
        assert "crashed" not in proc.log and "Traceback" not in proc.log, proc.log[-3000:]
        waits = [line for line in proc.log.splitlines() if "read-only transaction" in line]
        assert waits, proc.log[-3000:]
    admin.close()


# --------------------------------------------------------------------------
# Configuration that cannot work exits 2 at start
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("sslmode=bogus", "unknown sslmode 'bogus'"),
        ("sslmode=verify-full&sslrootcert=/nonexistent/ca.crt", "sslrootcert"),
        ("sslmode=require&sslcert=/nonexistent/c.crt", "sslcert"),
        ("target_session_attrs=writer", "target_session_attrs"),
    ],
)
def test_a_tls_setting_that_cannot_work_exits_2_with_one_line(database, run_relay, query, said):
    for command in (["outbox"], ["inbox", "--queue", "q"], ["status"]):
        done = run_relay(*command, env={"RELAY_DATABASE_URL": f"{database}?{query}"}, timeout=30)
        assert done.returncode == 2, (command, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], done.stderr


def test_a_multi_host_url_reaches_the_host_that_takes_writes(database, run_relay):
    dead = free_port()
    url = database.replace("127.0.0.1:5432", f"127.0.0.1:{dead},127.0.0.1:5432")
    done = run_relay("status", "--json", env={"RELAY_DATABASE_URL": url})
    assert done.returncode == 0, done.stderr
    assert '"outbox"' in done.stdout


def test_a_password_command_that_fails_is_waited_out_like_an_unreachable_database(
    database, start_relay, tmp_path
):
    flag = tmp_path / "ready"
    command = f"test -e {flag} && echo unused"
    proc = start_relay("outbox", "--database-password-command", command)
    proc.wait_for_log("--database-password-command exited 1", timeout=30)
    assert proc.proc.poll() is None
    flag.touch()  # trust authentication: any password is taken
    proc.wait_for_log("outbox relay started", timeout=30)


# --------------------------------------------------------------------------
# A server of our own: passwords, TLS
# --------------------------------------------------------------------------


class Secured:
    """A server with TLS on (a CA of the test's own, a certificate for
    localhost) and a role `app` that logs in with a password."""

    def __init__(self, server: Cluster, certs: Certificates) -> None:
        self.server = server
        self.certs = certs
        self.password = "first-password"
        self.password_file = server.base / "password"
        self.set_password(self.password)

    def set_password(self, password: str) -> None:
        self.password = password
        self.password_file.write_text(password + "\n")
        with contextlib.suppress(psycopg.Error):
            self.server.execute(f"ALTER ROLE app PASSWORD '{password}'")

    def database(self) -> str:
        """A new database owned by `app`, with relay's schema and the effects table."""
        name = f"managed_{uuid.uuid4().hex[:10]}"
        self.server.execute(f'CREATE DATABASE "{name}" OWNER app')
        url = self.url(name, password=True)
        apply_schema(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(EFFECTS_DDL)
        return name

    def url(
        self, dbname: str, *, password: bool = False, host: str = "127.0.0.1", **params: str
    ) -> str:
        user = f"app:{self.password}" if password else "app"
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{user}@{host}:{self.server.port}/{dbname}" + (
            f"?{query}" if query else ""
        )

    def tls_url(self, dbname: str, *, host: str = "localhost", ca: Path | None = None) -> str:
        """The URL with the password, verifying the server's certificate."""
        return self.url(
            dbname,
            password=True,
            host=host,
            sslmode="verify-full",
            sslrootcert=str(ca or self.certs.ca),
        )


@pytest.fixture(scope="module")
def secured() -> Iterator[Secured]:
    base = own_directory("relay-certs-")
    certs = Certificates(base)
    cert, key = certs.issue("server", dns="localhost")
    with cluster("relay-secured-", password_encryption="'scram-sha-256'") as server:
        for source, name in ((cert, "server.crt"), (key, "server.key"), (certs.ca, "root.crt")):
            target = server.data / name
            shutil.copy(source, target)
            shutil.chown(target, "postgres", "postgres")
            target.chmod(0o600)
        server.configure(
            {"ssl": "on", "ssl_cert_file": "'server.crt'", "ssl_key_file": "'server.key'"}
        )
        server.execute("SELECT pg_reload_conf()")
        server.execute("CREATE ROLE app LOGIN")
        yield Secured(server, certs)
    shutil.rmtree(base, ignore_errors=True)


@OWN_SERVER_TESTS
@pytest.mark.timeout(240)
async def test_rotating_passwords_lose_nothing(secured, daemons, tmp_path):
    """The role's password changes every 2 s and relay's sessions are ended:
    relay runs the password command again after the refusal, and goes on."""
    name = secured.database()
    command = f"cat {secured.password_file}"
    outbox, inbox = daemons(secured.url(name), "--database-password-command", command)
    rotations = 0
    # The producer logs in as postgres (trust): only relay's credentials rotate.
    with Producer(secured.server.url(name), keys=4) as producer:
        wait_until(lambda: producer.sent > 50, timeout=30, message="rows produced")
        for _ in range(5):
            time.sleep(2)
            secured.set_password(f"password-{uuid.uuid4().hex[:8]}")
            rotations += 1
            secured.server.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'app'"
            )
    found = wait_until(
        all_done(secured.server.url(name)), timeout=90, message="every row published and handled"
    )
    alive(outbox, inbox)
    assert_clean(found)
    assert rotations == 5
    assert (
        "password authentication failed" in outbox.log + inbox.log
    )  # it was refused, and recovered


@OWN_SERVER_TESTS
@pytest.mark.timeout(180)
async def test_both_daemons_work_over_verified_tls_listen_included(secured, daemons):
    name = secured.database()
    url = secured.tls_url(name)
    # A long poll: a row published within a few seconds came by LISTEN's wake-up.
    outbox, inbox = daemons(url, env={"RELAY_POLL_INTERVAL": "60"})
    time.sleep(2)
    started = time.monotonic()
    with psycopg.connect(secured.server.url(name), autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox (topic, key, type, payload) "
            "SELECT %s, 'k' || (i %% 3), 'Effect', jsonb_build_object('n', i) "
            "FROM generate_series(1, 20) i",
            (TOPIC,),
        )
    found = wait_until(all_done(secured.server.url(name)), timeout=30, message="handled")
    assert time.monotonic() - started < 15
    assert_clean(found)
    sessions = secured.server.execute(
        "SELECT a.backend_type, s.ssl, a.query "
        "FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) "
        f"WHERE a.datname = '{name}' AND a.application_name = 'relay'"
    )
    assert sessions and all(ssl for _, ssl, _ in sessions), sessions
    assert any(query.startswith("LISTEN") for _, _, query in sessions), sessions
    alive(outbox, inbox)


@OWN_SERVER_TESTS
@pytest.mark.parametrize("fault", ["wrong CA", "wrong host name"])
def test_a_certificate_that_does_not_verify_exits_2_at_start(secured, run_relay, tmp_path, fault):
    name = secured.database()
    if fault == "wrong CA":
        url = secured.tls_url(name, ca=Certificates(tmp_path, "other-ca").ca)
    else:  # the certificate names localhost, not 127.0.0.1
        url = secured.tls_url(name, host="127.0.0.1")
    for command in (["outbox"], ["inbox", "--queue", f"q{uuid.uuid4().hex[:6]}"]):
        started = time.monotonic()
        done = run_relay(*command, env={"RELAY_DATABASE_URL": url}, timeout=60)
        assert done.returncode == 2, (command, done.stderr)
        assert time.monotonic() - started < 30
        last = done.stderr.strip().splitlines()[-1]
        assert "TLS failed" in last and "certificate" in last, done.stderr
        assert "Traceback" not in done.stderr


# --------------------------------------------------------------------------
# A real failover: a primary, a synchronous standby, the primary stopped hard
# --------------------------------------------------------------------------


@pytest.fixture
def primary_and_standby() -> Iterator[tuple[Cluster, Cluster]]:
    """A primary with a streaming standby that it waits for at each commit
    (synchronous_commit on): nothing committed is lost when it fails over."""
    with cluster(
        "relay-failover-",
        synchronous_standby_names="'standby'",
        wal_keep_size="'256MB'",
    ) as primary:
        standby = primary.standby("standby")
        try:
            wait_until(
                lambda: primary.execute(
                    "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                )[0][0],
                timeout=60,
                message="the standby streaming synchronously",
            )
            yield primary, standby
        finally:
            standby.stop("immediate")


@OWN_SERVER_TESTS
@pytest.mark.timeout(300)
async def test_a_failover_to_the_standby_loses_nothing_and_both_daemons_stay_up(
    primary_and_standby, daemons
):
    primary, standby = primary_and_standby
    name = f"failover_{uuid.uuid4().hex[:8]}"
    primary.execute(f'CREATE DATABASE "{name}"')
    apply_schema(primary.url(name))
    primary.execute(EFFECTS_DDL, name)
    hosts = f"127.0.0.1:{primary.port},127.0.0.1:{standby.port}"
    url = f"postgresql://postgres@{hosts}/{name}?target_session_attrs=read-write"
    outbox, inbox = daemons(url)
    with Producer(url) as producer:
        wait_until(lambda: producer.sent > 300, timeout=60, message="rows produced")
        fault = time.time()
        primary.stop("immediate")  # the writer is gone, as a host failure takes it
        time.sleep(1)  # the managed service notices, then promotes
        standby.promote()
        standby.wait_writable()
        promoted = time.time()
        sent_at_promotion = producer.sent
        wait_until(
            lambda: producer.sent > sent_at_promotion + 200, timeout=60, message="rows produced"
        )
    writer = standby.url(name)
    found = wait_until(all_done(writer), timeout=90, message="every row published and handled")
    alive(outbox, inbox)
    assert_clean(found)
    # The times are the new primary's now(): when each batch's transaction began.
    published = first_after(writer, "published_at", "outbox", promoted)
    processed = first_after(writer, "processed_at", "inbox", promoted)
    assert published is not None and processed is not None
    print(
        f"\nfailover: promoted {promoted - fault:.1f}s after the fault; the first batch "
        f"published {published - fault:.1f}s and the first processed {processed - fault:.1f}s "
        f"after the fault; {found['rows']} rows, producer failures {producer.failures}",
        flush=True,
    )
    # LISTEN follows the writer: a row on the new primary wakes the outbox
    # well before its 5 s poll (and the inbox's, the same).
    time.sleep(1)
    with psycopg.connect(writer, autocommit=True) as conn:
        started = time.monotonic()
        conn.execute(
            "INSERT INTO outbox (topic, key, type, payload) "
            "VALUES (%s, 'after', 'Effect', '{\"n\": 0}')",
            (TOPIC,),
        )
    wait_until(all_done(writer), timeout=30, message="the row after the failover")
    woke = time.monotonic() - started
    assert woke < 4, f"{woke:.1f}s: not woken by LISTEN on the new primary"
    for proc in (outbox, inbox):
        assert "crashed" not in proc.log and "Traceback" not in proc.log, proc.log[-3000:]


# --------------------------------------------------------------------------
# RabbitMQ over TLS: a node of our own with a TLS listener
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_node() -> Iterator[Any]:
    """A RabbitMQ node whose TLS listener has a certificate for localhost
    from a CA of the test's own, and asks clients for a certificate of that CA."""
    from tests.brokers.test_rabbit import OwnNode

    if shutil.which("rabbitmq-server") is None or os.geteuid() != 0:
        pytest.fail("a RabbitMQ node of the tests' own needs rabbitmq-server and root")
    node = OwnNode()
    certs = Certificates(node.base)
    server_cert, server_key = certs.issue("server", dns="localhost")
    client_cert, client_key = certs.issue("client", dns="relay-client")
    node.tls_port = free_port()  # type: ignore[attr-defined]
    (node.base / "rabbitmq.conf").write_text(
        f"listeners.ssl.default = {node.tls_port}\n"  # type: ignore[attr-defined]
        f"ssl_options.cacertfile = {certs.ca}\n"
        f"ssl_options.certfile = {server_cert}\n"
        f"ssl_options.keyfile = {server_key}\n"
        "ssl_options.verify = verify_peer\n"
        "ssl_options.fail_if_no_peer_cert = true\n"
    )
    for path in node.base.iterdir():
        shutil.chown(path, "rabbitmq", "rabbitmq")
    node.certs, node.client = certs, (client_cert, client_key)  # type: ignore[attr-defined]
    try:
        node.start()
        wait_until(
            lambda: _answers(node.tls_port),  # type: ignore[attr-defined]
            timeout=60,
            message="the TLS listener",
        )
        yield node
    finally:
        node.stop()


def _answers(port: int) -> bool:
    import socket

    with contextlib.suppress(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    return False


def amqps_url(node: Any, *, host: str = "localhost", ca: Path | None = None) -> str:
    cert, key = node.client
    return (
        f"amqps://guest:guest@{host}:{node.tls_port}/?cafile={ca or node.certs.ca}"
        f"&certfile={cert}&keyfile={key}"
    )


@OWN_SERVER_TESTS
@pytest.mark.timeout(180)
async def test_both_daemons_work_over_amqps_with_verification_and_a_client_certificate(
    tls_node, database, engine, daemons
):
    from tests.conftest import rows

    rows(engine, EFFECTS_DDL)
    outbox, inbox = daemons(database, env={"RELAY_BROKER_URL": amqps_url(tls_node)})
    rows(
        engine,
        "INSERT INTO outbox (topic, key, type, payload) "
        "SELECT :t, 'k' || (i % 3), 'Effect', jsonb_build_object('n', i) "
        "FROM generate_series(1, 50) i",
        t=TOPIC,
    )
    libpq = database.replace("postgresql+psycopg://", "postgresql://")
    found = wait_until(all_done(libpq), timeout=60, message="handled over amqps")
    assert_clean(found)
    alive(outbox, inbox)
    assert "amqps://" in outbox.log  # it says where it connected, without the password
    assert "guest:guest" not in outbox.log + inbox.log


@OWN_SERVER_TESTS
@pytest.mark.parametrize("fault", ["wrong CA", "wrong host name"])
def test_an_amqps_certificate_that_does_not_verify_exits_2_at_start(
    tls_node, database, run_relay, tmp_path, fault
):
    if fault == "wrong CA":
        url = amqps_url(tls_node, ca=Certificates(tmp_path, "other-ca").ca)
    else:  # the node's certificate names localhost, not 127.0.0.1
        url = amqps_url(tls_node, host="127.0.0.1")
    for command in (["outbox"], ["inbox", "--queue", f"q{uuid.uuid4().hex[:6]}"]):
        done = run_relay(*command, env={"RELAY_BROKER_URL": url}, timeout=60)
        assert done.returncode == 2, (command, done.stderr[-2000:])
        last = done.stderr.strip().splitlines()[-1]
        assert "TLS failed" in last and "certificate" in last.lower(), done.stderr[-2000:]
        assert "Traceback" not in done.stderr


def test_an_amqps_url_whose_files_are_missing_exits_2(run_relay):
    done = run_relay(
        "outbox", env={"RELAY_BROKER_URL": "amqps://u:p@localhost:5671/?cafile=/nonexistent/ca"}
    )
    assert done.returncode == 2
    assert "cafile '/nonexistent/ca': no such file" in done.stderr
    assert ":p@" not in done.stderr


def test_the_dead_message_commands_say_a_read_only_database_is_unavailable(
    database, engine, run_relay
):
    from tests.conftest import rows

    name = engine.url.database
    rows(engine, "INSERT INTO outbox (topic, payload, status) VALUES ('t', '{}', 'dead')")
    rows(engine, f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
    try:
        for command in (
            ["dead", "retry", "--all"],
            ["dead", "discard", "--all"],
            ["retry", "outbox", "--all-dead"],
        ):
            done = run_relay(*command)
            assert done.returncode == 1, (command, done.stderr)
            [line] = done.stderr.strip().splitlines()
            assert line.startswith("relay: error: database unavailable") and "read-only" in line
    finally:
        rows(engine, f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
    assert rows(engine, "SELECT status FROM outbox") == [("dead",)]
    assert run_relay("dead", "retry", "--all").returncode == 0
    assert rows(engine, "SELECT status FROM outbox") == [("pending",)]
