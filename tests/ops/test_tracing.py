"""OpenTelemetry: spans continue the producer's trace through the outbox and the inbox.

The daemons run with OTEL_TRACES_EXPORTER=console, which prints each span as
JSON on stdout (the test's log file, with stderr): the spans are read from
there, as an operator would see them.
"""

from __future__ import annotations

import json
import re

from tests.conftest import rows, wait_until

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACING = {
    "OTEL_TRACES_EXPORTER": "console",
    "OTEL_BSP_SCHEDULE_DELAY": "100",
    "OTEL_SERVICE_NAME": "relay-under-test",
}


def spans(log: str) -> list[dict]:
    """The console exporter's spans in a log: JSON objects that start a line."""
    found, decoder = [], json.JSONDecoder()
    for match in re.finditer(r"^\{", log, re.MULTILINE):
        try:
            value, _ = decoder.raw_decode(log, match.start())
        except ValueError:
            continue
        if isinstance(value, dict) and "context" in value:
            found.append(value)
    return found


async def test_inbox_span_continues_the_message_trace_and_the_handler_runs_in_it(
    effects, rabbit, inbox
):
    daemon = inbox(env=TRACING)
    await rabbit.publish(
        "orders.placed",
        b'{"n": 1}',
        message_id="traced-1",
        type="TraceEffect",
        headers={"traceparent": TRACEPARENT},
    )
    await rabbit.publish("orders.placed", b'{"n": 2}', message_id="untraced-1", type="TraceEffect")
    wait_until(lambda: len(rows(effects, "SELECT 1 FROM effects")) == 2)
    seen = dict(rows(effects, "SELECT message_id, traceparent FROM effects"))
    trace_id, span_id = seen["traced-1"].split("-")
    assert trace_id == TRACE_ID and span_id != PARENT_ID
    assert seen["untraced-1"].split("-")[0] != TRACE_ID  # a trace of its own
    daemon.stop()
    [span] = [s for s in spans(daemon.log) if s["context"]["span_id"] == "0x" + span_id]
    assert span["name"] == "process orders.placed"
    assert span["kind"] == "SpanKind.CONSUMER"
    assert span["parent_id"] == "0x" + PARENT_ID
    assert span["context"]["trace_id"] == "0x" + TRACE_ID
    assert span["attributes"]["messaging.system"] == "rabbitmq"
    assert span["attributes"]["messaging.message.id"] == "traced-1"
    assert span["attributes"]["messaging.operation.type"] == "process"
    assert span["resource"]["attributes"]["service.name"] == "relay-under-test"


async def test_failed_handler_marks_its_span_failed(effects, rabbit, inbox):
    daemon = inbox("--max-attempts", "1", env=TRACING)
    await rabbit.publish(
        "t", b"{}", message_id="fails-1", type="AlwaysFails", headers={"traceparent": TRACEPARENT}
    )
    wait_until(
        lambda: (
            rows(effects, "SELECT status FROM inbox WHERE message_id = 'fails-1'") == [("dead",)]
        )
    )
    daemon.stop()
    [span] = [
        s for s in spans(daemon.log) if s["attributes"].get("messaging.message.id") == "fails-1"
    ]
    assert span["status"]["status_code"] == "ERROR"
    assert "this handler always fails" in span["status"]["description"]


async def test_without_otel_variables_no_span_is_printed(effects, rabbit, inbox):
    daemon = inbox()
    await rabbit.publish(
        "t", b"{}", message_id="plain-1", type="Effect", headers={"traceparent": TRACEPARENT}
    )
    wait_until(lambda: rows(effects, "SELECT message_id FROM effects") == [("plain-1",)])
    daemon.stop()
    assert spans(daemon.log) == []
    assert "tracing:" not in daemon.log


async def test_outbox_span_continues_the_row_trace(engine, rabbit, run_relay):
    queue = await rabbit.queue("orders.#")
    rows(
        engine,
        "INSERT INTO outbox (topic, key, type, payload, headers) VALUES "
        "('orders.placed', 'order-7', 'OrderPlaced', '{}', CAST(:h AS jsonb)), "
        "('orders.placed', NULL, 'OrderPlaced', '{}', '{}')",
        h=json.dumps({"traceparent": TRACEPARENT}),
    )
    result = run_relay("outbox", "--once", "--exchange", rabbit.exchange, env=TRACING)
    assert result.returncode == 0, result.stderr
    await rabbit.drain(queue, 2)
    traced_id = rows(engine, "SELECT id::text FROM outbox WHERE key = 'order-7'")[0][0]
    found = {s["attributes"]["messaging.message.id"]: s for s in spans(result.stdout)}
    assert len(found) == 2, result.stdout
    span = found[traced_id]
    assert span["name"] == "send orders.placed"
    assert span["kind"] == "SpanKind.PRODUCER"
    assert span["parent_id"] == "0x" + PARENT_ID
    assert span["context"]["trace_id"] == "0x" + TRACE_ID
    assert span["attributes"]["messaging.destination.name"] == rabbit.exchange
    assert span["attributes"]["messaging.rabbitmq.destination.routing_key"] == "orders.placed"
    assert span["status"]["status_code"] == "UNSET"
    others = [s for i, s in found.items() if i != traced_id]
    assert others[0]["parent_id"] is None


# --------------------------------------------------------------------------
# The whole trace, in this process, with the SDK's in-memory exporter
# --------------------------------------------------------------------------


async def test_one_trace_runs_from_the_producers_request_to_the_handlers_sql(
    effects, rabbit, monkeypatch
):
    """enqueue inside the app's span, then the outbox and inbox daemons (run
    here, on this event loop, so that their spans reach the exporter): every
    span is of the request's trace, and the handler's work is a child of
    the inbox's CONSUMER span."""
    import asyncio

    import sqlalchemy as sa
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    import relay
    from relay import tracing
    from relay.config import BrokerURL, InboxSettings, OutboxSettings
    from relay.lifecycle import EXIT_OK, Daemon
    from relay.wiring import inbox_service, outbox_service
    from tests.conftest import AMQP_URL

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # What tracing.setup() does from OTEL_*, with this provider instead.
    monkeypatch.setattr(tracing, "enabled", True)
    monkeypatch.setattr(tracing, "_tracer", provider.get_tracer("relay"))
    app = provider.get_tracer("app")

    registry = relay.HandlerRegistry()

    @registry.handler("Traced")
    def traced(message: relay.Message, conn: sa.Connection) -> None:
        with app.start_as_current_span("handler sql"):
            conn.execute(sa.text("INSERT INTO effects (message_id) VALUES (:m)"), {"m": message.id})

    with (
        app.start_as_current_span("POST /orders", kind=SpanKind.SERVER) as request,
        effects.begin() as conn,
    ):
        message_id = relay.enqueue(conn, "traced.order", {"n": 1}, type="Traced")
    [(headers,)] = rows(effects, "SELECT headers FROM outbox")
    request_context = request.get_span_context()
    assert headers["traceparent"].startswith(
        f"00-{request_context.trace_id:032x}-{request_context.span_id:016x}-"
    )

    broker = BrokerURL.parse(AMQP_URL)
    database = str(effects.url.render_as_string(hide_password=False))
    inbox = Daemon(
        "inbox",
        [
            inbox_service(
                InboxSettings(
                    database_url=database,
                    broker=broker,
                    exchange=rabbit.exchange,
                    queue=f"{rabbit.exchange}.traced",
                    binds=("traced.#",),
                    poll_interval=0.2,
                ),
                registry,
            )
        ],
        shutdown_timeout=5,
    )
    rabbit.queues.append(f"{rabbit.exchange}.traced")
    running = asyncio.ensure_future(inbox.run())
    try:
        await asyncio.wait_for(inbox.started_event.wait(), 30)
        outbox = Daemon(
            "outbox",
            [
                outbox_service(
                    OutboxSettings(database_url=database, broker=broker, exchange=rabbit.exchange),
                    once=True,
                )
            ],
            shutdown_timeout=5,
        )
        assert await asyncio.wait_for(outbox.run(), 30) == EXIT_OK
        for _ in range(300):
            if rows(effects, "SELECT message_id FROM effects"):
                break
            await asyncio.sleep(0.05)
    finally:
        inbox.request_stop("test over")
        await asyncio.wait_for(running, 30)
    assert rows(effects, "SELECT message_id FROM effects") == [(str(message_id),)]

    spans = {span.name: span for span in exporter.get_finished_spans()}
    send, process, work = (
        spans["send traced.order"],
        spans["process traced.order"],
        spans["handler sql"],
    )
    assert send.kind == SpanKind.PRODUCER and process.kind == SpanKind.CONSUMER
    for span in (send, process, work):
        assert span.context.trace_id == request_context.trace_id
    assert send.parent.span_id == request_context.span_id
    assert process.parent.span_id == request_context.span_id  # the wire's traceparent
    assert work.parent.span_id == process.context.span_id


def test_enqueue_adds_the_current_context_only_inside_a_span_and_never_over_the_apps_own():
    from opentelemetry.sdk.trace import TracerProvider

    from relay import tracing

    headers: dict[str, str] = {}
    tracing.add_current_context(headers)
    assert headers == {}  # no span: nothing to continue
    with TracerProvider().get_tracer("app").start_as_current_span("request") as span:
        given = {"traceparent": TRACEPARENT}
        tracing.add_current_context(given)
        assert given == {"traceparent": TRACEPARENT}
        tracing.add_current_context(headers)
    context = span.get_span_context()
    assert headers["traceparent"].startswith(f"00-{context.trace_id:032x}-{context.span_id:016x}-")
