"""One `relay outbox` draining several sources (databases x schemas): each
as it would alone, none waiting for another, sources added and dropped at
run time; against the real PostgreSQL and RabbitMQ."""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.config import Source, combine_sources, labelled, read_sources
from relay.errors import ConfigError
from tests.conftest import _admin, drop_database, free_port, pg_url, rows, wait_until
from tests.ops.test_operations import metric_is, scrape
from tests.sqs_server import sqs, sqs_server  # noqa: F401 - fixtures

SCHEMAS = ("t1", "t2")
# An outbox of several sources holds up to 32 connections of the shared
# server (100 at most): these tests run one at a time, on one worker.
pytestmark = pytest.mark.xdist_group("many_sources")


@contextlib.contextmanager
def tenant_databases(run_relay, schemas: Iterable[str]) -> Iterator[list[str]]:
    """Two databases, each with relay's tables in `schemas`; their URLs."""
    names = [f"relay_s_{uuid.uuid4().hex[:12]}" for _ in range(2)]
    with _admin() as conn:
        for name in names:
            conn.execute(f'CREATE DATABASE "{name}"')
    urls = [pg_url(name) for name in names]
    try:
        for url in urls:
            for schema in schemas:
                result = run_relay(
                    "schema", "apply", "--schema", schema, env={"RELAY_DATABASE_URL": url}
                )
                assert result.returncode == 0, result.stderr
        yield urls
    finally:
        for name in names:
            drop_database(name)


@pytest.fixture
def databases(template_db: str, run_relay) -> Iterator[list[str]]:
    """Two databases, each with relay's tables in schemas t1 and t2; their URLs."""
    with tenant_databases(run_relay, SCHEMAS) as urls:
        yield urls


def insert(url: str, schema: str, topic: str, n: int = 1) -> None:
    engine = sa.create_engine(url)
    try:
        rows(
            engine,
            f"INSERT INTO {schema}.outbox (topic, key, payload) "
            "SELECT :topic, 'k' || (i % 7), jsonb_build_object('i', i) "
            "FROM generate_series(1, :n) i",
            topic=topic,
            n=n,
        )
    finally:
        engine.dispose()


def pending(url: str, schema: str) -> int:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            f"SELECT count(*) FROM {schema}.outbox WHERE status = 'pending'"
        ).fetchone()
    return int(row[0]) if row else -1


def label(url: str, schema: str) -> str:
    return f"{url.rsplit('/', 1)[1]}/{schema}"


def readyz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def outbox_args(rabbit, *extra: str) -> list[str]:
    return ["outbox", "--exchange", rabbit.exchange, "--poll-interval", "30", *extra]


# -- the sources themselves (pure) -----------------------------------------------


def test_every_schema_in_every_database_once():
    found = combine_sources(
        ["postgresql://u:pw@h1/a postgresql://u@h2/b", "postgresql://u@h2/b"], ["t1", "t2"]
    )
    assert [(s.label, s.schema) for s in found] == [
        ("a/t1", "t1"),
        ("a/t2", "t2"),
        ("b/t1", "t1"),
        ("b/t2", "t2"),
    ]
    # A label names no host and no credential; the same name twice is told apart.
    two = labelled(
        [Source("postgresql+psycopg://u:pw@h1/app"), Source("postgresql+psycopg://u@h2/app")]
    )
    assert list(two) == ["app/public", "app/public~2"]


def test_a_sources_file_with_comments_and_bad_lines(tmp_path: Path):
    path = tmp_path / "sources"
    path.write_text("# tenants\n\npostgresql://u@h/a t1  # first\npostgresql://u@h/b\n")
    assert [s.label for s in read_sources(str(path))] == ["a/t1", "b/public"]
    for bad in ("postgresql://u@h/a t1 t2\n", "mysql://h/a\n", "postgresql://u@h/a 9x\n"):
        path.write_text("postgresql://u@h/ok\n" + bad)
        with pytest.raises(ConfigError, match="line 2"):
            read_sources(str(path))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.text(max_size=60),
            st.sampled_from(["postgresql://u@h/a", "postgresql://u:p@h/b t1", "# x", ""]),
        ),
        max_size=6,
    )
)
def test_any_sources_file_is_read_or_refused_with_its_line(lines):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "sources"
        path.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
        try:
            found = read_sources(str(path))
        except ConfigError as exc:
            assert "line" in str(exc) or "cannot read" in str(exc)
        else:
            assert len(found) == len(set(found))
            assert all("/" in source.label and "u:p" not in source.label for source in found)


def test_a_bad_sources_file_exits_2(run_relay, tmp_path: Path):
    path = tmp_path / "sources"
    path.write_text("postgresql://u@h/a bad-schema\n")
    result = run_relay("outbox", "--sources", str(path))
    assert result.returncode == 2
    assert "line 1" in result.stderr and "Traceback" not in result.stderr
    missing = run_relay("outbox", "--sources", str(tmp_path / "nope"))
    assert missing.returncode == 2, missing.stderr
    both = run_relay("outbox", "--sources", str(path), "--database-url", "postgresql://u@h/a")
    assert both.returncode == 2 and "not both" in both.stderr
    listen = run_relay(
        "outbox",
        "--database-url",
        "postgresql://u@h/a postgresql://u@h/b",
        "--listen-url",
        "postgresql://u@h/a",
    )
    assert listen.returncode == 2 and "--listen-url names one database" in listen.stderr


def test_status_of_several_sources_as_text(databases, run_relay):
    insert(databases[0], "t1", "x", 2)
    result = run_relay(
        "status",
        *[arg for url in databases for arg in ("--database-url", url)],
        "--schema",
        "t1",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("outbox: pending 2, published 0, dead 0; oldest pending ")
    assert f"source {label(databases[0], 't1')}:" in lines
    assert f"source {label(databases[1], 't1')}:" in lines
    assert "  outbox: pending 0, published 0, dead 0; none pending" in lines


# -- one process, four sources --------------------------------------------------------


async def test_two_databases_by_two_schemas_drained_by_one_process(
    databases, rabbit, start_relay, run_relay
):
    queue = await rabbit.queue("#")
    port = free_port()
    relay = start_relay(
        *outbox_args(rabbit, "--http-port", str(port)),
        *[arg for url in databases for arg in ("--database-url", url)],
        "--schema",
        "t1",
        "--schema",
        "t2",
    )
    relay.wait_for_log("outbox of 4 sources started", timeout=30)
    relay.wait_until_logged("outbox relay started", 4, timeout=30)
    time.sleep(1)  # every listener has made its first look
    for url in databases:
        for schema in SCHEMAS:
            insert(url, schema, f"to.{label(url, schema)}", 3)
    # A poll of 30 s: these arrive at once only through each source's own wake-up.
    got = await rabbit.drain(queue, 12, timeout=10)
    by_topic: dict[str, int] = {}
    for message in got:
        by_topic[message.routing_key] = by_topic.get(message.routing_key, 0) + 1
    assert by_topic == {f"to.{label(u, s)}": 3 for u in databases for s in SCHEMAS}

    # A row reaches the queue before its batch commits, and is counted after
    # the commit: wait for the counters rather than race the last commit.
    for url in databases:
        for schema in SCHEMAS:
            series = f'relay_outbox_published_total{{source="{label(url, schema)}"}}'
            wait_until(metric_is(port, series, 3.0), timeout=10, message=series)
    samples = scrape(port)
    assert not any("127.0.0.1" in name or "postgres@" in name for name in samples)

    status = run_relay(
        "status",
        "--json",
        *[arg for url in databases for arg in ("--database-url", url)],
        "--schema",
        "t1",
        "--schema",
        "t2",
    )
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report["outbox"]["published"] == 12
    assert set(report["sources"]) == {label(u, s) for u in databases for s in SCHEMAS}
    assert all(r["outbox"]["published"] == 3 for r in report["sources"].values())


async def test_a_backlog_in_one_source_does_not_hold_up_another(databases, rabbit, start_relay):
    queue = await rabbit.queue("fresh")
    busy, quiet = databases
    insert(busy, "t1", "backlog", 40_000)
    relay = start_relay(
        *outbox_args(rabbit), "--database-url", busy, "--database-url", quiet, "--schema", "t1"
    )
    relay.wait_until_logged("outbox relay started", 2, timeout=30)
    wait_until(lambda: pending(busy, "t1") < 39_000, timeout=20, message="the backlog drains")
    insert(quiet, "t1", "fresh")
    started = time.monotonic()
    await rabbit.drain(queue, 1, timeout=10)
    took = time.monotonic() - started
    left = pending(busy, "t1")
    assert left > 0, "the backlog was gone before the quiet source's row: no test"
    assert took < 2.0, took


async def test_a_source_that_is_down_delays_no_other(databases, rabbit, start_relay, tmp_path):
    queue = await rabbit.queue("#")
    missing = pg_url(f"relay_gone_{uuid.uuid4().hex[:10]}")
    path = tmp_path / "sources"
    path.write_text(f"{missing} t1\n{databases[0]} t1\n{databases[1]} t2\n")
    port = free_port()
    relay = start_relay(
        *outbox_args(rabbit, "--poll-interval", "0.5", "--http-port", str(port)),
        "--sources",
        str(path),
    )
    relay.wait_for_log("outbox of 3 sources started", timeout=30)
    insert(databases[0], "t1", "a", 2)
    insert(databases[1], "t2", "b", 2)
    got = await rabbit.drain(queue, 4, timeout=15)
    assert sorted(m.routing_key for m in got) == ["a", "a", "b", "b"]
    code, body = readyz(port)
    assert code == 503
    assert f"source {label(missing, 't1')} does not answer" in body
    # A database dropped under a running source: the others still flow.
    drop_database(databases[0].rsplit("/", 1)[1])
    insert(databases[1], "t2", "c", 2)
    got = await rabbit.drain(queue, 2, timeout=15)
    assert [m.routing_key for m in got] == ["c", "c"]
    assert relay.proc.poll() is None, relay.log


async def test_sources_added_and_dropped_at_run_time(databases, rabbit, start_relay, tmp_path):
    queue = await rabbit.queue("#")
    first, second = databases
    path = tmp_path / "sources"
    path.write_text(f"{first} t1\n")
    port = free_port()
    relay = start_relay(
        *outbox_args(rabbit, "--poll-interval", "0.5", "--http-port", str(port)),
        "--sources",
        str(path),
    )
    relay.wait_for_log("outbox of 1 sources started", timeout=30)
    insert(second, "t2", "early")
    insert(first, "t1", "one")
    assert [m.routing_key for m in await rabbit.drain(queue, 1)] == ["one"]

    # Added, then SIGHUP: the second source starts and drains what waited.
    path.write_text(f"# two now\n{first} t1\n{second} t2\n")
    relay.signal(signal.SIGHUP)
    assert [m.routing_key for m in await rabbit.drain(queue, 1, timeout=15)] == ["early"]
    relay.wait_for_log(f"added {label(second, 't2')}")

    # Dropped, no signal: the file's change alone is noticed; the first's
    # rows wait, the second's go on.
    time.sleep(0.05)
    path.write_text(f"{second} t2\n")
    wait_until(lambda: f"dropped {label(first, 't1')}" in relay.log, timeout=15)
    insert(first, "t1", "left")
    insert(second, "t2", "two")
    assert [m.routing_key for m in await rabbit.drain(queue, 1, timeout=15)] == ["two"]
    time.sleep(1.5)
    assert pending(first, "t1") == 1
    # The dropped source's series are gone; the running one's stay.
    samples = scrape(port)
    assert f'relay_outbox_published_total{{source="{label(second, "t2")}"}}' in samples
    assert not any(label(first, "t1") in name for name in samples)
    assert relay.proc.poll() is None, relay.log


def both_schemas(url: str) -> list[str]:
    return ["--database-url", url, "--schema", "t1", "--schema", "t2"]


def largest_batch(url: str, schema: str) -> int:
    """The most rows one transaction published (published_at is its now())."""
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        row = conn.execute(
            f"SELECT max(n) FROM (SELECT count(*) AS n FROM {schema}.outbox "
            "WHERE status = 'published' GROUP BY published_at) b"
        ).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


@pytest.mark.parametrize(("given", "largest"), [((), 100), (("--batch-size", "500"), 300)])
async def test_several_sources_take_batches_of_100_unless_told(
    databases, rabbit, run_relay, given, largest
):
    await rabbit.queue("#")
    url = databases[0]
    engine = sa.create_engine(url)
    try:
        rows(
            engine,
            "INSERT INTO t1.outbox (topic, key, payload) "
            "SELECT 'b', 'one-key', '{}' FROM generate_series(1, 300)",
        )
    finally:
        engine.dispose()
    result = run_relay(
        "outbox",
        "--once",
        "--exchange",
        rabbit.exchange,
        *both_schemas(url),
        *given,
    )
    assert result.returncode == 0, result.stderr
    assert pending(url, "t1") == 0
    assert largest_batch(url, "t1") == largest


async def test_a_source_whose_loop_fails_is_started_again_and_the_others_go_on(
    databases, rabbit, start_relay
):
    """A schema newer than this relay ends that source's loop (alone, the
    daemon would exit 2): the others flow, and it starts again once mended."""
    queue = await rabbit.queue("#")
    url = databases[0]
    engine = sa.create_engine(url)
    try:
        rows(engine, "INSERT INTO t1.relay_schema_version (version, name) VALUES (999, 'x')")
        relay = start_relay(
            *outbox_args(rabbit, "--poll-interval", "0.5"),
            *both_schemas(url),
        )
        relay.wait_for_log(f"source {label(url, 't1')}: its main task ended", timeout=30)
        insert(url, "t2", "fine")
        insert(url, "t1", "later")
        assert [m.routing_key for m in await rabbit.drain(queue, 1, timeout=15)] == ["fine"]
        rows(engine, "DELETE FROM t1.relay_schema_version WHERE version = 999")
        assert [m.routing_key for m in await rabbit.drain(queue, 1, timeout=30)] == ["later"]
        assert relay.log.count("its main task ended") == 1, relay.log
        assert relay.proc.poll() is None
    finally:
        engine.dispose()


async def test_several_sources_publish_to_sqs(databases, sqs, run_relay):
    """Each source has its own publisher: SQS as RabbitMQ."""
    url = databases[0]
    topics = {schema: sqs.name(f"src-{schema}") for schema in SCHEMAS}
    for schema, topic in topics.items():
        sqs.create(topic)
        insert(url, schema, topic, 2)
    result = run_relay(
        "outbox", "--once", *both_schemas(url), env={**sqs.env, "RELAY_BROKER_URL": "sqs://"}
    )
    assert result.returncode == 0, result.stderr
    for schema, topic in topics.items():
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += sqs.receive(topic)
        assert len(got) == 2, schema
        assert pending(url, schema) == 0


def test_status_reports_a_source_it_cannot_read_and_exits_1(databases, run_relay):
    insert(databases[0], "t1", "x", 3)
    missing = pg_url(f"relay_gone_{uuid.uuid4().hex[:10]}")
    result = run_relay(
        "status", "--json", "--database-url", f"{databases[0]} {missing}", "--schema", "t1"
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["outbox"]["pending"] == 3
    assert report["sources"][label(databases[0], "t1")]["outbox"]["pending"] == 3
    assert "does not exist" in report["sources"][label(missing, "t1")]["error"]
    assert f"sources not read: {label(missing, 't1')}" in result.stderr


async def test_a_delayed_row_goes_out_within_a_poll_of_falling_due(databases, rabbit, start_relay):
    """No notification comes when a row's available_at passes: each source's
    poll (one claim of every key per --poll-interval) finds it."""
    queue = await rabbit.queue("#")
    url = databases[0]
    relay = start_relay(*outbox_args(rabbit, "--poll-interval", "0.5"), *both_schemas(url))
    relay.wait_until_logged("outbox relay started", 2, timeout=30)
    engine = sa.create_engine(url)
    try:
        rows(
            engine,
            "INSERT INTO t2.outbox (topic, payload, available_at) "
            "VALUES ('later', '{}', now() + interval '2 seconds')",
        )
        due = time.monotonic() + 2
        [message] = await rabbit.drain(queue, 1, timeout=10)
        assert message.routing_key == "later"
        assert time.monotonic() - due < 1.5
    finally:
        engine.dispose()
