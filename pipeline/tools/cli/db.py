"""``pipeline db``: schema management."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import settings_of


@click.group()
def db() -> None:
    """Database schema management."""


@db.command("upgrade")
@click.pass_context
def db_upgrade(ctx: click.Context) -> None:
    """Apply pending migrations (safe to run concurrently and repeatedly)."""
    from pipeline.tools.ops.schema import upgrade_schema

    settings = settings_of(ctx)
    result = upgrade_schema(settings)
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
    from pipeline.tools.ops.schema import pending_versions

    pending = pending_versions(settings_of(ctx))
    if pending:
        click.echo(f"pending migrations: {pending}")
        ctx.exit(1)
    click.echo("no pending migrations")
