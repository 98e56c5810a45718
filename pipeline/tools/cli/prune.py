"""``pipeline prune``: one retention pass now (what the relay's janitor does periodically)."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import apps_option, dry_run_option, json_option, settings_of


@click.command()
@dry_run_option("Count what would be deleted; delete nothing.")
@json_option()
@apps_option()
@click.pass_context
def prune(ctx: click.Context, dry_run: bool, as_json: bool, apps: tuple[str, ...]) -> None:
    """Delete rows past their retention now (what the relay's janitor does periodically).

    Sent events, processed inbox keys, attempt history and audit records older than
    their PIPELINE_*_RETENTION_SECONDS; never anything still owed, pending or
    dead-lettered. Exits 1 if a janitor or another prune is running.
    """
    import json

    from pipeline.tools.ops.prune import format_prune, prune_now

    result = prune_now(settings_of(ctx, apps), dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2))
    else:
        click.echo(format_prune(result))
