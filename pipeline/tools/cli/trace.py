"""``pipeline trace EVENT_ID``: an event's lineage."""

from __future__ import annotations

import click

from pipeline.tools.cli.options import json_option, settings_of
from pipeline.tools.ops.text import printable_lines


@click.command("trace")
@click.argument("event_id")
@json_option("Print the lineage as JSON.")
@click.pass_context
def trace(ctx: click.Context, event_id: str, as_json: bool) -> None:
    """Show an event's lineage: publishing, each consumer, dead letters, follow-up events."""
    import json
    import uuid

    from pipeline.tools.ops.lineage import render, trace_event

    try:
        wanted = uuid.UUID(event_id)
    except ValueError:
        raise click.BadParameter(f"{event_id!r} is not an event id (a UUID)") from None
    settings = settings_of(ctx)
    lineage = trace_event(settings, wanted)
    if as_json:
        click.echo(json.dumps(lineage.as_json(), indent=2))
    else:
        click.echo(printable_lines(render(lineage, settings.trace_ui_url)))
