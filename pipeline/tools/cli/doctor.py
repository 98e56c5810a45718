"""``pipeline doctor``: check the deployment, each problem with its fix."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import apps_option, json_option, settings_of


@click.command()
@json_option()
@apps_option()
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, apps: tuple[str, ...]) -> None:
    """Check the deployment: schema, indexes and triggers, LISTEN not behind a transaction
    pooler, notification queue, settings, Redis eviction and persistence, clock skew,
    dead letters and the canary. Each problem comes with its fix.

    Exits 0 when nothing is wrong, 1 when anything is.
    """
    import json

    from pipeline.tools.ops.doctor import check_deployment, format_report

    settings = settings_of(ctx, apps)
    settings.require_database_url()
    report = check_deployment(settings)
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(format_report(report))
    ctx.exit(0 if report.healthy else 1)
