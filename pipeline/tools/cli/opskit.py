"""``pipeline opskit`` (also ``python -m pipeline.tools.opskit``): render the alert rules
and dashboards for a deployment.

Without options it renders the repository's committed files (``alerts/``,
``dashboards/``); ``--check`` only compares and exits 1 when they differ. The renderer
loads on first use (registering the command keeps ``pipeline --help`` fast), so an
option left out takes :class:`~pipeline.tools.opskit.KitOptions`' default.
"""

from __future__ import annotations

from pathlib import Path

import click

from pipeline.tools.cli.entry import OneLineErrors


@click.command(cls=OneLineErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(),
    help="Directory to write into (default: the current one).",
)
@click.option("--check", is_flag=True, help="Compare only; exit 1 on a difference.")
@click.option("--relay-job", default=None, help="Job label of relays (default: pipeline-relay).")
@click.option("--worker-job", default=None, help="Job label of workers (default: pipeline-worker).")
@click.option(
    "--group-label",
    "group_labels",
    multiple=True,
    help="Label every aggregation keeps, e.g. namespace (repeatable).",
)
@click.option(
    "--runbook-url",
    default=None,
    help="Runbook URL template with {name} (default: runbooks/{name}.md, relative to the "
    "repository).",
)
@click.option(
    "--grafana-url", default=None, help="Grafana base URL (default: http://localhost:3000)."
)
@click.option(
    "--trace-ui-url", default=None, help="Trace UI base URL (default: http://localhost:16686)."
)
@click.pass_context
def opskit(
    ctx: click.Context,
    /,
    out: Path,
    check: bool,
    group_labels: tuple[str, ...],
    **urls_and_jobs: str | None,
) -> None:
    """Render the pipeline's Prometheus rules and Grafana dashboards."""
    from pipeline.tools.opskit import KitOptions, render_kit
    from pipeline.tools.opskit.render import stale_files, write_files

    given = {name: value for name, value in urls_and_jobs.items() if value is not None}
    try:
        options = KitOptions(group_labels=group_labels, **given)  # type: ignore[arg-type]
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx) from None
    files = render_kit(options)
    if check:
        stale = stale_files(files, out)
        for relative in stale:
            click.echo(f"differs from the code: {relative}", err=True)
        ctx.exit(1 if stale else 0)
    for path in write_files(files, out):
        click.echo(str(path))
