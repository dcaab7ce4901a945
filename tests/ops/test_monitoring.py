"""monitoring/: the alert rules, their promtool unit tests, the runbook, the
Grafana dashboard and the Kubernetes PrometheusRule made from the rules; and
a live Prometheus (Debian's `prometheus` package) scraping a running
`relay outbox` (two sources) and `relay inbox`, whose alerts go pending on a
dead row, a cut broker, a source whose database is gone and a stopped daemon,
and which answers every panel query of the dashboard.

promtool and prometheus may be missing on a laptop: those tests skip there,
and fail under CI (CI=true; .ci/run installs them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.brokers.test_rabbit import OWN_NODE_TESTS, OwnNode, own_node  # noqa: F401 - fixture
from tests.conftest import REPO, free_port, inbox_args, pg_url, rows, wait_until
from tests.kafka_server import Kafka, kafka, kafka_server  # noqa: F401 - fixtures
from tests.proxy import Proxy, amqp_proxy, pg_proxy  # noqa: F401 - fixtures

yaml = pytest.importorskip("yaml")

MONITORING = REPO / "monitoring"
RULES = MONITORING / "alerts.yml"
UNIT_TESTS = MONITORING / "alerts_test.yml"
DASHBOARD = MONITORING / "dashboard.json"
RUNBOOK = REPO / "docs" / "runbook.md"
K8S = REPO / "examples" / "kubernetes" / "monitoring.yaml"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        message = f"{name} is not installed (Debian: apt-get install prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must provide it)")
        pytest.skip(message)
    return path


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


# --------------------------------------------------------------------------
# The rules, offline
# --------------------------------------------------------------------------


def test_promtool_checks_the_rules_and_passes_their_unit_tests():
    promtool = _tool("promtool")
    checked = subprocess.run(
        [promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run(
        [promtool, "test", "rules", str(UNIT_TESTS)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=MONITORING,
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_every_alert_has_a_firing_and_a_silent_unit_test():
    firing: set[str] = set()
    silent: set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    names = {rule["alert"] for rule in _rules()}
    assert names - firing == set(), "alerts with no firing test"
    assert names - silent == set(), "alerts with no silent test"


def test_every_alert_has_a_severity_a_summary_a_for_and_a_runbook_entry():
    anchors = {
        _anchor(line.lstrip("#"))
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("#")
    }
    names = []
    for rule in _rules():
        names.append(rule["alert"])
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert re.fullmatch(r"\d+m", rule["for"]), rule["alert"]
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/runbook.md#{rule['alert'].lower()}", url
        assert url.split("#")[1] in anchors, f"docs/runbook.md has no heading for {url}"
    assert len(names) == len(set(names))
    # Each entry says what to look at and what fixes it.
    text = RUNBOOK.read_text()
    for name in names:
        entry = text.split(f"## {name}\n", 1)[1].split("\n## ", 1)[0]
        for part in ("**Means.**", "**Look first.**", "**Fix.**"):
            assert part in entry, f"{name}: no {part}"


def test_the_kubernetes_prometheusrule_is_made_from_the_rule_file():
    # The committed file is the generator's output (no second copy to drift)…
    result = subprocess.run(
        [sys.executable, str(MONITORING / "kubernetes.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    documents = [d for d in yaml.safe_load_all(K8S.read_text()) if d]
    kinds = {d["kind"]: d for d in documents}
    # …and the PrometheusRule's spec is the rule file.
    assert kinds["PrometheusRule"]["spec"] == yaml.safe_load(RULES.read_text())
    assert kinds["PrometheusRule"]["apiVersion"] == "monitoring.coreos.com/v1"
    # The ServiceMonitor scrapes the Services, whose names match RelayDown's
    # job selector and which select the pods' relay ports.
    monitor = kinds["ServiceMonitor"]
    services = [d for d in documents if d["kind"] == "Service"]
    deployments = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]: d
        for d in yaml.safe_load_all((K8S.parent / "deployment.yaml").read_text())
        if d and d["kind"] == "Deployment"
    }
    [endpoint] = monitor["spec"]["endpoints"]
    for service in services:
        labels = service["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert re.search("relay", service["metadata"]["name"])
        assert service["spec"]["publishNotReadyAddresses"] is True
        pod = deployments[service["spec"]["selector"]["app.kubernetes.io/name"]]
        [port] = service["spec"]["ports"]
        assert port["name"] == endpoint["port"]
        container_ports = {
            p["name"]: p["containerPort"]
            for c in pod["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        assert container_ports[port["targetPort"]] == port["port"]
    assert len(services) == 2


def _panel_targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query of every panel, rows included."""
    found = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                found.append((panel["title"], target["expr"]))

    walk(dashboard["panels"])
    return found


def test_the_dashboard_is_grafana_json_with_a_source_selector():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert "label_values(relay_outbox_pending, source)" in json.dumps(variables["source"]["query"])
    assert variables["source"]["includeAll"] and variables["source"]["allValue"] == ".*"
    targets = _panel_targets(dashboard)
    assert len(targets) >= 10
    for title, expr in targets:
        if "relay_outbox" in expr or "relay_table" in expr:
            assert 'source=~"$source"' in expr, (title, expr)
    titles = " ".join(title for title, _ in targets).lower()
    for what in ("published", "pending", "oldest", "dead", "latency", "dead row versions"):
        assert what in titles, what


# --------------------------------------------------------------------------
# A live Prometheus
# --------------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus on a free port with a data directory of its own,
    scraping `targets` ({job: ["host:port"]}) every second and evaluating
    monitoring/alerts.yml every second."""

    def __init__(self, directory: Path, targets: dict[str, list[str]]) -> None:
        self.port = free_port()
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(RULES)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": hosts}]}
                for job, hosts in targets.items()
            ],
        }
        path = directory / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.log_path = directory / "prometheus.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                _tool("prometheus"),
                f"--config.file={path}",
                f"--storage.tsdb.path={directory / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        wait_until(self._ready, timeout=60, message="prometheus ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=5):
                return True
        except (OSError, urllib.error.URLError):
            return False

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]  # type: ignore[no-any-return]

    def value(self, expr: str) -> float | None:
        """The value of a query of one series, or None when it has none."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if len(result) == 1 else None

    def alerts(self) -> list[dict[str, Any]]:
        """The pending and firing alerts."""
        return self.api("alerts")["alerts"]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _active(prometheus: Prometheus) -> set[tuple[str, str, str]]:
    """(alertname, job, source) of the pending and firing alerts."""
    return {
        (a["labels"]["alertname"], a["labels"].get("job", ""), a["labels"].get("source", ""))
        for a in prometheus.alerts()
    }


def _wait_active(
    prometheus: Prometheus, expected: set[tuple[str, str, str]], what: str
) -> set[tuple[str, str, str]]:
    """Until every alert of `expected` is pending or firing; the active set."""
    return wait_until(  # type: ignore[no-any-return]
        lambda: (active := _active(prometheus)) >= expected and active,
        timeout=90,
        interval=0.5,
        message=f"alerts {sorted(expected)} pending ({what})",
    )


def _substitute(expr: str, source: str = ".*") -> str:
    """A panel's query as Grafana sends it: variables replaced."""
    return (
        expr.replace("$__rate_interval", "5m")
        .replace("$__range", "5m")
        .replace("${job}", ".*")
        .replace("$job", ".*")
        .replace("${source}", source)
        .replace("$source", source)
    )


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[[dict[str, list[str]]], Prometheus]]:
    started: list[Prometheus] = []

    def start(targets: dict[str, list[str]]) -> Prometheus:
        directory = tmp_path / f"prometheus{len(started)}"
        directory.mkdir()
        started.append(Prometheus(directory, targets))
        return started[-1]

    yield start
    for prometheus in started:
        prometheus.stop()


def _outbox_rows(engine: sa.Engine, schema: str, sql_values: str, count: int = 1) -> None:
    rows(
        engine,
        f"INSERT INTO {schema}.outbox (topic, key, type, payload, headers, created_at) "
        f"SELECT {sql_values} FROM generate_series(1, {count}) AS i",
    )


@pytest.mark.timeout(600)
async def test_a_live_prometheus_raises_the_right_alerts_and_answers_every_panel(
    effects: sa.Engine,
    database: str,
    rabbit: Any,
    inbox: Callable[..., Any],
    start_relay: Callable[..., Any],
    run_relay: Callable[..., subprocess.CompletedProcess[str]],
    amqp_proxy: Proxy,
    pg_proxy: Proxy,
    prometheus_factory: Callable[[dict[str, list[str]]], Prometheus],
    tmp_path: Path,
) -> None:
    _tool("prometheus")
    engine = effects
    # Two sources in one database: `public` directly, `quiet` through a
    # proxy to PostgreSQL that the test cuts; both daemons reach RabbitMQ
    # through a proxy that the test cuts (the shared server stays up).
    applied = run_relay("schema", "apply", "--schema", "quiet")
    assert applied.returncode == 0, applied.stderr
    dbname = database.rsplit("/", 1)[1]
    quiet_url = pg_url(dbname).replace(":5432/", f":{pg_proxy.port}/")
    assert str(pg_proxy.port) in quiet_url
    sources = tmp_path / "sources"
    sources.write_text(f"{database} public\n{quiet_url} quiet\n")
    public, quiet = f"{dbname}/public", f"{dbname}/quiet"
    broker = f"amqp://guest:guest@127.0.0.1:{amqp_proxy.port}/"
    outbox_port, inbox_port = free_port(), free_port()
    outbox = start_relay(
        "outbox",
        "--sources",
        str(sources),
        "--exchange",
        rabbit.exchange,
        "--http-port",
        str(outbox_port),
        env={"RELAY_BROKER_URL": broker},
    )
    outbox.wait_for_log("outbox of 2 sources started", timeout=30)
    inbox(
        "--http-port",
        str(inbox_port),
        "--max-attempts",
        "5",
        env={"RELAY_BROKER_URL": broker},
    )
    prometheus = prometheus_factory(
        {
            "relay-outbox": [f"127.0.0.1:{outbox_port}"],
            "relay-inbox": [f"127.0.0.1:{inbox_port}"],
        }
    )
    started = time.monotonic()

    # Prometheus has the counters at 0 before the flow: their rates see it all.
    wait_until(
        lambda: (
            prometheus.value(f'relay_outbox_published_total{{source="{public}"}}') == 0
            and prometheus.value('relay_inbox_processed_total{job="relay-inbox"}') == 0
        ),
        timeout=60,
        message="Prometheus scrapes both daemons",
    )

    # 1. A healthy flow: rows published, received and handled; nothing fires.
    _outbox_rows(
        engine,
        "public",
        "'m.flow', 'k' || (i % 4), 'Effect', jsonb_build_object('n', i), '{}', now()",
        count=40,
    )
    wait_until(lambda: rows(engine, "SELECT count(*) FROM effects")[0][0] == 40, timeout=60)
    wait_until(
        lambda: (
            prometheus.value('relay_inbox_processed_total{job="relay-inbox"}') == 40
            and prometheus.value(f'relay_outbox_published_total{{source="{public}"}}') == 40
            and prometheus.value('sum(relay_ready{job=~"relay-.*"})') == 2
            and prometheus.value(f'relay_source_ready{{source="{quiet}"}}') == 1
        ),
        timeout=60,
        message="Prometheus sees the flow",
    )
    # The tables as production has them: vacuumed once at least (the panel
    # of the time since the last vacuum has no line for a table never vacuumed).
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(
            sa.text("VACUUM public.outbox, public.inbox, quiet.outbox")
        )
    # A few seconds of evaluations (one a second): none pending, none firing.
    for _ in range(10):
        assert prometheus.alerts() == [], "an alert on a healthy flow"
        time.sleep(1)

    # 2. Dead rows and failures: outbox rows no broker can carry (a header
    # that is not a string: a failed attempt, dead at once; 20 against the
    # flow's 40 published), a message of a type with no handler (dead in the
    # inbox), messages whose handler always raises.
    _outbox_rows(engine, "public", "'m.dead', null, 'Effect', '{}', '{\"n\": 1}', now()", count=20)
    _outbox_rows(engine, "public", "'m.dead', null, 'NoSuchHandler', '{}', '{}', now()")
    _outbox_rows(engine, "public", "'m.fail', null, 'AlwaysFails', '{}', '{}', now()", count=3)
    dead_and_failing = {
        ("RelayOutboxDeadRows", "relay-outbox", public),
        ("RelayOutboxPublishFailing", "relay-outbox", public),
        ("RelayInboxDeadRows", "relay-inbox", ""),
        ("RelayInboxHandlersFailing", "relay-inbox", ""),
    }
    active = _wait_active(prometheus, dead_and_failing, "dead rows")
    assert active == dead_and_failing, "only the alerts of dead rows and failures"

    # Every panel of the dashboard answers with at least one series, with
    # every source, and with one source chosen in the selector.
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["text"] for v in _variable_values(prometheus, dashboard, "source")} == {
        public,
        quiet,
    }
    assert {v["text"] for v in _variable_values(prometheus, dashboard, "job")} == {
        "relay-outbox",
        "relay-inbox",
    }
    empty = [
        (title, expr)
        for title, expr in _panel_targets(dashboard)
        for source in (".*", public)
        if not _is_kafka(expr) and not prometheus.query(_substitute(expr, source))
    ]
    assert empty == [], "panel queries without data"

    # 3. The broker is gone: both daemons are not ready, and the quiet
    # source's row written an hour ago ages while nothing is published.
    amqp_proxy.stop()
    _outbox_rows(engine, "quiet", "'m.late', null, 'Effect', '{}', '{}', now() - interval '1 hour'")
    _wait_active(
        prometheus,
        {
            ("RelayNotReady", "relay-outbox", ""),
            ("RelayNotReady", "relay-inbox", ""),
            ("RelayOutboxStalled", "relay-outbox", quiet),
        },
        "broker cut",
    )
    # Every source was down with the broker: a cause in common, not a source.
    assert not any(name == "RelaySourceDown" for name, _, _ in _active(prometheus))
    amqp_proxy.start()
    wait_until(
        lambda: prometheus.value('sum(relay_ready{job=~"relay-.*"})') == 2,
        timeout=90,
        message="ready again",
    )
    wait_until(lambda: rows(engine, "SELECT count(*) FROM effects")[0][0] >= 41, timeout=60)

    # 4. One source's database is gone: that source is down, not the other.
    pg_proxy.stop()
    active = _wait_active(
        prometheus, {("RelaySourceDown", "relay-outbox", quiet)}, "a source's database cut"
    )
    assert ("RelaySourceDown", "relay-outbox", public) not in active
    pg_proxy.start()
    wait_until(
        lambda: prometheus.value(f'relay_source_ready{{source="{quiet}"}}') == 1,
        timeout=90,
        message="the source answers again",
    )

    # 5. A stopped daemon (SIGSTOP: it neither exits nor answers): down.
    outbox.signal(signal.SIGSTOP)
    try:
        _wait_active(prometheus, {("RelayDown", "relay-outbox", "")}, "outbox stopped")
    finally:
        outbox.signal(signal.SIGCONT)
    print(f"live alert test: {time.monotonic() - started:.0f}s after Prometheus started")


def _is_kafka(expr: str) -> bool:
    """A query of the Kafka panels: answered in the Kafka test only."""
    return "relay_inbox_kafka" in expr


@pytest.mark.timeout(300)
def test_a_live_prometheus_sees_the_kafka_lag_grow_behind_hung_handlers(
    effects: sa.Engine,
    kafka: Kafka,
    start_relay: Callable[..., Any],
    prometheus_factory: Callable[[dict[str, list[str]]], Prometheus],
) -> None:
    _tool("prometheus")
    topic = kafka.topic("lag", 2)
    port = free_port()
    # Batches of 10: the receiver stores at most a few batches per
    # dispatcher ahead of them (relay.pacing), so once every dispatcher
    # hangs the rest stays in Kafka, uncommitted.
    inbox = start_relay(
        *inbox_args(topic, "--batch-size", "10", "--http-port", str(port)),
        env={"RELAY_BROKER_URL": kafka.url()},
    )
    inbox.wait_for_log("assigned", timeout=60)
    prometheus = prometheus_factory({"relay-inbox": [f"127.0.0.1:{port}"]})
    lag = f'relay_inbox_kafka_lag{{job="relay-inbox",topic="{topic}",partition="%d"}}'

    # 1. A healthy flow on both partitions: handled, committed, no lag.
    for n in range(6):
        kafka.produce(
            topic,
            b'{"n": %d}' % n,
            headers=[("id", b"ok-%d" % n), ("type", b"Effect")],
            partition=n % 2,
        )
    wait_until(lambda: rows(effects, "SELECT count(*) FROM effects")[0][0] == 6, timeout=60)
    wait_until(
        lambda: prometheus.value(lag % 0) == 0 and prometheus.value(lag % 1) == 0,
        timeout=60,
        message="Prometheus sees both partitions at no lag",
    )
    assert prometheus.alerts() == [], "an alert on a healthy flow"

    # 2. Every dispatcher hangs on a handler; a backlog of 1,200 records
    # arrives on partition 0. They are sent in batches and then one alone:
    # Tansu's end of a partition is its last batch's first offset + 1, so
    # the lone last record makes it the true end.
    backlog = 1200
    for n in range(backlog - 1):
        kafka.produce(
            topic,
            b"{}",
            headers=[("id", b"hang-%d" % n), ("type", b"SyncHang")],
            partition=0,
            flush=False,
        )
    kafka.flush()
    kafka.produce(topic, b"{}", headers=[("id", b"hang-last"), ("type", b"SyncHang")], partition=0)
    end = 3 + backlog  # partition 0's end offset

    def lagging() -> list[dict[str, Any]]:
        return [
            a
            for a in prometheus.alerts()
            if a["labels"]["alertname"] == "RelayInboxKafkaLagGrowing"
        ]

    [alert] = wait_until(
        lagging, timeout=90, interval=0.5, message="RelayInboxKafkaLagGrowing pending"
    )
    assert alert["state"] == "pending"
    assert {k: alert["labels"][k] for k in ("job", "topic", "partition")} == {
        "job": "relay-inbox",
        "topic": topic,
        "partition": "0",
    }
    assert float(alert["value"]) > 1000
    # The lag is what the contract says: the partition's end minus the
    # group's committed offset (the receiver stored a few batches at most).
    committed = wait_until(
        lambda: (
            (offset := kafka.committed(topic, topic)[0]) + (prometheus.value(lag % 0) or 0) == end
            and offset
        ),
        timeout=60,
        message="the lag is the end minus the committed offset",
    )
    assert 3 <= committed < end - 1000
    assert prometheus.value(lag % 1) == 0
    assert [a["labels"]["partition"] for a in lagging()] == ["0"]

    # 3. The dashboard's Kafka panel answers: every partition, every topic.
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [expr for _, expr in _panel_targets(dashboard) if _is_kafka(expr)]
    assert queries, "no Kafka panel"
    for expr in queries:
        found = prometheus.query(_substitute(expr))
        assert found, expr
        if any("partition" in r["metric"] for r in found):
            assert {r["metric"]["partition"] for r in found} == {"0", "1"}, expr
        else:
            assert [r["metric"]["topic"] for r in found] == [topic], expr
    inbox.signal(signal.SIGKILL)  # its handlers hang for an hour (its receiver dies with it)


@OWN_NODE_TESTS
@pytest.mark.timeout(300)
def test_a_live_prometheus_raises_broker_blocked_during_a_memory_alarm(
    engine: sa.Engine,
    own_node: OwnNode,
    start_relay: Callable[..., Any],
    prometheus_factory: Callable[[dict[str, list[str]]], Prometheus],
) -> None:
    # On a RabbitMQ node of the tests' own: the shared node's alarm would
    # block every other test's publishers.
    _tool("prometheus")
    port = free_port()
    outbox = start_relay("outbox", "--http-port", str(port), env={"RELAY_BROKER_URL": own_node.url})
    outbox.wait_for_log("outbox relay started")
    prometheus = prometheus_factory({"relay-outbox": [f"127.0.0.1:{port}"]})
    wait_until(
        lambda: (
            prometheus.value("relay_outbox_broker_blocked") == 0
            and prometheus.value("relay_ready") == 1
        ),
        timeout=60,
        message="Prometheus scrapes the outbox",
    )
    own_node.memory_alarm(True)
    try:
        _outbox_rows(engine, "public", "'alarm', null, null, '{}', '{}', now()")
        _wait_active(
            prometheus,
            {("RelayBrokerBlocked", "relay-outbox", ""), ("RelayNotReady", "relay-outbox", "")},
            "a memory alarm",
        )
    finally:
        own_node.memory_alarm(False)
    wait_until(
        lambda: rows(engine, "SELECT status FROM outbox") == [("published",)],
        timeout=60,
        message="published once the alarm clears",
    )
    wait_until(
        lambda: prometheus.value("relay_outbox_broker_blocked") == 0,
        timeout=60,
        message="the gauge back at 0",
    )


def _variable_values(
    prometheus: Prometheus, dashboard: dict[str, Any], name: str
) -> list[dict[str, str]]:
    """A `label_values(METRIC, LABEL)` template variable's values, as Grafana
    asks Prometheus for them."""
    [variable] = [v for v in dashboard["templating"]["list"] if v["name"] == name]
    query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
    match = re.fullmatch(r"label_values\((\w+)(\{.*\})?, *(\w+)\)", query)
    assert match, query
    metric, selector, label = match.groups()
    values = prometheus.api(f"label/{label}/values", **{"match[]": metric + (selector or "")})
    return [{"text": v} for v in values]
