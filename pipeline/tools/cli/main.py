"""The ``pipeline`` command: one click group over a module per command group.

Each module imports click and the settings only; the work (and its heavy imports) loads
inside the command that runs, so ``pipeline --help`` and start-up stay fast. How a run
ends (exit codes, one-line errors) is :mod:`pipeline.tools.cli.entry`.
"""

from __future__ import annotations

import click

from pipeline.tools.cli.db import db
from pipeline.tools.cli.demo import demo
from pipeline.tools.cli.dlq import dlq
from pipeline.tools.cli.doctor import doctor
from pipeline.tools.cli.drill import drill
from pipeline.tools.cli.entry import OneLineErrorsGroup
from pipeline.tools.cli.opskit import opskit
from pipeline.tools.cli.prune import prune
from pipeline.tools.cli.relay import relay
from pipeline.tools.cli.status import status
from pipeline.tools.cli.trace import trace
from pipeline.tools.cli.worker import worker


@click.group(
    "pipeline", cls=OneLineErrorsGroup, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(package_name="outbox-pipeline")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Transactional outbox and idempotent inbox on Postgres and Dramatiq/Redis.

    Configuration comes from PIPELINE_* environment variables (see README).
    """
    from pipeline.config import unknown_variables_warning

    # The long-running commands log it instead, in their log format, once logging is set up.
    warning = unknown_variables_warning()
    if warning is not None and ctx.invoked_subcommand not in LOGGING_COMMANDS:
        click.echo(f"pipeline: warning: {warning}", err=True)


LOGGING_COMMANDS = frozenset({"relay", "worker"})


for command in (db, relay, worker, status, demo, dlq, drill, trace, prune, doctor, opskit):
    cli.add_command(command)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: runs ``argv`` (default: the process's) and exits with its code."""
    cli.main(args=argv, prog_name="pipeline")
