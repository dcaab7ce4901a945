"""`relay`: a thin layer that parses options, builds settings and calls the library.

Every option is a flag and a RELAY_<FLAG> variable (a flag beats the
variable). Bad configuration exits 2 with one line on stderr; see
relay.lifecycle for the other exit codes.

One module per command group, as Celery's celery/bin/ (what they share is
relay.cli.base); this one only assembles them. Each command imports the
library it calls inside its body, so `relay --help` and `relay schema sql`
load no database or broker code.
"""

from __future__ import annotations

import click

from relay import __version__
from relay.cli import audit, console, daemons, dead, demo, replay, schema, status


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
# The version relay carries (relay.__version__), not a distribution's metadata
# looked up by name: the distribution is not named `relay` on the index.
@click.version_option(version=__version__, prog_name="relay")
def cli() -> None:
    """relay: transactional outbox and inbox daemons for PostgreSQL, RabbitMQ, SQS and Kafka."""


for command in (
    schema.schema,
    daemons.outbox,
    daemons.inbox,
    demo.demo,
    status.status,
    dead.retry,
    dead.dead,
    replay.replay,
    audit.audit,
    console.console,
):
    cli.add_command(command)


def main() -> None:
    cli(prog_name="relay")
