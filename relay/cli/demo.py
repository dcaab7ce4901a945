"""`relay demo`: a producer, both daemons and a sample handler in one process."""

from __future__ import annotations

import sys
from typing import Any

import click

from relay import config
from relay.cli.base import SCHEMA_OPTION, build, option, run_coro, setup_logs


@click.command()
@option("--database-url", required=True, help="postgresql://user:pass@host:port/db")
@SCHEMA_OPTION
@option(
    "--broker-url",
    default=None,
    help="amqp://user:pass@host:port/vhost or sqs://… (not needed with --producer-only)",
)
@option(
    "--rate",
    type=click.FloatRange(min=0, min_open=True),
    default=200.0,
    show_default=True,
    help="messages per second the producer offers",
)
@option(
    "--duration",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="seconds to run, then stop and exit 0 (0: until Ctrl-C)",
)
@option("--exchange", default="relay", show_default=True, help="RabbitMQ topic exchange")
@option(
    "--queue",
    default="relay-demo",
    show_default=True,
    help="the demo inbox's queue, bound to demo.#",
)
@option(
    "--http-port",
    type=click.IntRange(0, 65535),
    default=0,
    show_default=True,
    help="port for /healthz, /readyz and /metrics (0: none)",
)
@option(
    "--producer-only",
    is_flag=True,
    help="only produce and report; the daemons run elsewhere "
    "(relay inbox --handlers relay.demo:registry)",
)
@option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@option("--log-format", default="text", show_default=True, type=click.Choice(["text", "json"]))
def demo(producer_only: bool, **kwargs: Any) -> None:
    """Apply the schema, then run a producer, both daemons and a sample handler
    in one process, printing live rates (use a scratch database and vhost)."""
    setup_logs(kwargs)
    from relay.demo import DemoSettings, run_demo

    broker_url = kwargs.pop("broker_url")
    broker = None
    if broker_url or not producer_only:
        broker = build(config.BrokerURL.parse, url=broker_url)
    settings = build(DemoSettings, broker=broker, producer_only=producer_only, **kwargs)
    sys.exit(run_coro(run_demo(settings)))
