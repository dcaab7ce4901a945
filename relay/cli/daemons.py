"""`relay outbox` and `relay inbox`: the two daemons and every option they take
(the options both share first, then each one's own).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from relay import config
from relay.cli.base import (
    Duration,
    F,
    build,
    claim_check_option,
    fail_config,
    given_sources,
    option,
    run_coro,
    setup_logs,
    with_common,
)
from relay.errors import ConfigError
from relay.runtime import tune_gc


def daemon_options(f: F, *, several: bool = False) -> F:
    for decorator in reversed(
        [
            option(
                "--broker-url",
                required=True,
                help="amqp://user:pass@host:port/vhost (several RabbitMQ nodes: comma-separated) "
                "sqs://[?region=..&endpoint_url=..] "
                "kafka://[USER:PASSWORD@]HOST:PORT[,HOST:PORT..][?PROPERTY=VALUE&..] "
                "or redis://[[USER]:PASSWORD@]HOST:PORT[/DB]",
            ),
            option(
                "--batch-size",
                type=click.IntRange(min=1),
                default=500,
                show_default=True,
                help="rows claimed per batch",
            ),
            option(
                "--batch-bytes",
                default="16MiB",
                show_default=True,
                metavar="SIZE",
                help="bytes of payloads the daemon holds at once, its batches together "
                "(a larger row is taken alone; 16MiB, 1GiB or bytes)",
            ),
            option(
                "--poll-interval",
                type=click.FloatRange(min=0, min_open=True),
                default=1.0,
                show_default=True,
                help="seconds between polls when no notification arrives",
            ),
            option(
                "--max-attempts",
                type=click.IntRange(min=1),
                default=10,
                show_default=True,
                help="a row whose attempts reach this is dead",
            ),
            option(
                "--backoff-min",
                type=click.FloatRange(min=0),
                default=1.0,
                show_default=True,
                help="seconds: shortest retry delay",
            ),
            option(
                "--backoff-max",
                type=click.FloatRange(min=0),
                default=300.0,
                show_default=True,
                help="seconds: longest retry delay",
            ),
            option(
                "--exchange",
                default="relay",
                show_default=True,
                help="RabbitMQ topic exchange (declared durable if missing)",
            ),
            option(
                "--http-port",
                type=click.IntRange(0, 65535),
                default=0,
                show_default=True,
                help="port for /healthz, /readyz and /metrics (0: none)",
            ),
            option(
                "--shutdown-timeout",
                type=click.FloatRange(min=0, min_open=True),
                default=30.0,
                show_default=True,
                help="seconds to finish the batch in hand on SIGTERM",
            ),
            option(
                "--retention",
                type=Duration(),
                default=None,
                help="keep finished rows this long: 90s, 30m, 24h, 7d or seconds "
                "[default: outbox 1d, inbox 7d]",
            ),
            option(
                "--on-dead",
                type=click.Choice(["skip", "block"]),
                default="skip",
                show_default=True,
                help="skip: later rows of a dead row's key go on; "
                "block: the key waits until the row is retried",
            ),
            option(
                "--listen-url",
                default=None,
                help="direct postgresql:// URL for LISTEN, when --database-url goes "
                "through a pooler such as PgBouncer [default: --database-url]",
            ),
            claim_check_option,
            option(
                "--claim-check-over",
                default="256KiB",
                show_default=True,
                metavar="SIZE",
                help="with --claim-check: bodies larger than this go to S3 (256KiB, 1MiB or bytes)",
            ),
        ]
    ):
        f = decorator(f)
    return with_common(f, several=several)


def outbox_options(f: F) -> F:
    return daemon_options(f, several=True)


def daemon_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    broker_url = kwargs.pop("broker_url")
    try:
        kwargs["broker"] = config.BrokerURL.parse(broker_url)
    except ConfigError as exc:
        fail_config(exc)
    if kwargs.get("retention") is None:
        kwargs.pop("retention", None)
    return kwargs


@click.command()
@outbox_options
@option("--once", is_flag=True, help="publish every row due now, then exit 0")
# Checked by the settings (one line on stderr), not by click (a usage block).
@option(
    "--on-unroutable",
    metavar="publish|fail",
    default="publish",
    show_default=True,
    help="RabbitMQ: a message no queue is bound for is published (and counted) or a failed attempt",
)
@option(
    "--cloudevents-source",
    default=None,
    metavar="URI",
    help="send every message as a CloudEvent 1.0 with this source (a URI-reference): "
    "binary mode on RabbitMQ and Kafka, structured on SQS and Redis",
)
@option(
    "--stream-maxlen",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Redis Streams: trim each stream to about N entries as relay adds to it (MAXLEN ~ N)",
)
@option(
    "--capture",
    metavar="poll|wal",
    default="poll",
    show_default=True,
    help="how committed rows are learnt of: the claim woken by notifications (poll), or a "
    "logical replication slot (wal: wal_level = logical and a role with REPLICATION)",
)
@option(
    "--slot",
    default=None,
    metavar="NAME",
    help="--capture wal: the replication slot's and publication's name "
    "[default: relay_outbox, with _SCHEMA added for a --schema]",
)
def outbox(once: bool, **kwargs: Any) -> None:
    """The outbox relay: publish committed outbox rows to the broker (of one
    source, or of several: every --schema in every --database-url, or --sources)."""
    setup_logs(kwargs)
    from relay.wiring import serve_outbox

    sources, path = given_sources(kwargs)
    first = sources[0]
    settings = build(
        config.OutboxSettings,
        database_url=first.database_url,
        schema=first.schema,
        **daemon_settings(kwargs),
    )
    tune_gc()
    if len(sources) == 1 and path is None:
        sys.exit(run_coro(serve_outbox(settings, once=once)))
    if settings.capture == "wal":
        fail_config(
            ConfigError(
                "--capture wal reads one source's slot: give one --database-url and --schema"
            )
        )
    if settings.listen_url and len({s.database_url for s in sources}) > 1:
        fail_config(
            ConfigError(
                "--listen-url names one database: give it only when every source is a "
                "schema of that one --database-url"
            )
        )
    from relay.sources import SOURCE_BATCH, serve_sources

    ctx = click.get_current_context()
    if ctx.get_parameter_source("batch_size") == click.core.ParameterSource.DEFAULT:
        settings = build(settings.replace, batch_size=SOURCE_BATCH)
    sys.exit(run_coro(serve_sources(settings, config.labelled(sources), path=path, once=once)))


@click.command()
@daemon_options
@option(
    "--queue",
    required=True,
    help="queue to consume (RabbitMQ: declared durable if missing; SQS: its name; "
    "Kafka: TOPIC[,TOPIC..]; Redis: STREAM[,STREAM..])",
)
@option(
    "--bind",
    "binds",
    multiple=True,
    help="bind the queue to the exchange with this pattern (repeatable; RabbitMQ only)",
)
@option(
    "--handlers",
    multiple=True,
    help="module:attribute or module (its `registry`), repeatable "
    "[default: the relay.handlers entry points]",
)
@option("--consumer-name", default=None, help="dedup scope [default: the queue name]")
@option(
    "--prefetch",
    type=click.IntRange(min=1),
    default=None,
    help="unacknowledged messages the broker may send ahead [default: 6 x --batch-size]",
)
@option(
    "--handler-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=60.0,
    show_default=True,
    help="seconds; a handler running longer fails that attempt",
)
@option(
    "--queue-type",
    metavar="classic|quorum",
    default=None,
    help="RabbitMQ queue type when relay declares the queue [default: classic]",
)
@option(
    "--queue-arg",
    "queue_args",
    multiple=True,
    metavar="NAME=VALUE",
    help="RabbitMQ queue argument when relay declares the queue (repeatable; "
    "an integer value is sent as one), e.g. x-max-length=100000",
)
@option(
    "--claim-idle",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Redis Streams: seconds an entry stays unacknowledged by another consumer of the "
    "group (one that died) before this one claims it",
)
@option(
    "--dispatch",
    type=click.Choice(["received", "stored"]),
    default="received",
    show_default=True,
    help="received: a message's handler runs in the transaction that stores it, "
    "when its key has nothing waiting; stored: messages are stored first and "
    "handled by the dispatchers in transactions of their own",
)
def inbox(**kwargs: Any) -> None:
    """The inbox daemon: consume a queue into the inbox table and dispatch rows to handlers."""
    setup_logs(kwargs)
    from relay.handlers import load
    from relay.wiring import serve_inbox

    kwargs["binds"] = tuple(kwargs["binds"])
    kwargs["queue_args"] = tuple(kwargs["queue_args"])
    kwargs["consumer_name"] = kwargs["consumer_name"] or ""
    kwargs["prefetch"] = kwargs["prefetch"] or 0  # 0: 6 x --batch-size
    specs = tuple(kwargs.pop("handlers"))
    settings = build(config.InboxSettings, **daemon_settings(kwargs))
    registry = build(load, specs=specs)
    tune_gc()
    sys.exit(run_coro(serve_inbox(settings, registry)))
