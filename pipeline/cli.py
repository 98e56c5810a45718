"""The ``pipeline`` command line.

Expected failures (:class:`PipelineError`) print one line on stderr and exit 1;
usage errors exit 2 (click's convention). Tracebacks are kept for real bugs.
"""

from __future__ import annotations

import sys
from typing import Any

import click

from pipeline.config import Settings, load_settings
from pipeline.errors import PipelineError


def _settings(ctx: click.Context) -> Settings:
    settings: Settings = ctx.ensure_object(dict).setdefault("settings", load_settings())
    return settings


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-pipeline")
def cli() -> None:
    """Transactional outbox and idempotent inbox on Postgres and Dramatiq/Redis.

    Configuration comes from PIPELINE_* environment variables (see README).
    """


@cli.group()
def db() -> None:
    """Database schema management."""


@db.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Apply pending migrations (safe to run concurrently and repeatedly)."""
    from pipeline.db.connect import make_engine, readable_database_errors
    from pipeline.db.migrate import upgrade

    settings = _settings(ctx)
    engine = make_engine(settings)
    try:
        with readable_database_errors(settings), engine.begin() as connection:
            result = upgrade(connection, settings.schema_name)
    finally:
        engine.dispose()
    if result.applied:
        click.echo(f"schema {settings.schema_name!r}: applied migrations {result.applied}")
    elif result.functions_refreshed:
        click.echo(f"schema {settings.schema_name!r}: refreshed functions and triggers")
    else:
        click.echo(f"schema {settings.schema_name!r}: already up to date")


@db.command("pending")
@click.pass_context
def db_pending(ctx: click.Context) -> None:
    """List migrations not yet applied; exits 1 when any are pending."""
    from pipeline.db.connect import make_engine, readable_database_errors
    from pipeline.db.migrate import pending_migrations

    settings = _settings(ctx)
    engine = make_engine(settings)
    try:
        with readable_database_errors(settings), engine.connect() as connection:
            pending = pending_migrations(connection, settings.schema_name)
    finally:
        engine.dispose()
    if pending:
        click.echo(f"pending migrations: {pending}")
        ctx.exit(1)
    click.echo("no pending migrations")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line for expected errors, never a traceback."""
    try:
        result: Any = cli.main(args=argv, prog_name="pipeline", standalone_mode=False)
        sys.exit(result if isinstance(result, int) else 0)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except PipelineError as exc:
        click.echo(f"pipeline: error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
