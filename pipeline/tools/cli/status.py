"""``pipeline status``: is the deployment healthy, and what did each consumer do lately."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import (
    apps_option,
    count_option,
    json_option,
    seconds_option,
    settings_of,
)


@click.command()
@json_option()
@seconds_option(
    "--max-pending-age",
    300.0,
    "Unhealthy when the oldest unsent event is older than this many seconds.",
    minimum=0,
)
@count_option("--max-dead-letters", 0, "Unhealthy when more dead letters than this are waiting.")
@click.option(
    "--interval",
    default="5m",
    show_default=True,
    help="Window of the per-consumer figures: 30s, 5m, 2h, 7d, or seconds.",
)
@apps_option()
@click.pass_context
def status(
    ctx: click.Context,
    as_json: bool,
    max_pending_age: float,
    max_dead_letters: int,
    interval: str,
    apps: tuple[str, ...],
) -> None:
    """Backlog, oldest unsent event, dead letters, relays, queue depths, and per consumer
    the events processed, failures, duplicates, re-deliveries and dead letters of the
    last --interval.

    Exits 0 when healthy, 1 when not (dead letters, or the oldest unsent event older
    than --max-pending-age) or when Postgres or Redis cannot be read.
    """
    import json

    from pipeline.tools.ops.activity import parse_duration
    from pipeline.tools.ops.status import Thresholds, deployment_status, format_status

    try:
        window = parse_duration(interval)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--interval'") from None
    result = deployment_status(
        settings_of(ctx, apps), Thresholds(max_pending_age, max_dead_letters), interval=window
    )
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2, sort_keys=True))
    else:
        click.echo(format_status(result))
    ctx.exit(0 if result.healthy else 1)
