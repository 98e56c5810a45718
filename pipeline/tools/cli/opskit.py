"""``pipeline opskit`` (also ``python -m pipeline.tools.opskit``): render the alert rules,
dashboards and runbooks for a deployment; ``pipeline opskit export DIR`` writes them
where a deployment picks them up (what a ``pip install`` user needs: no checkout).

Without options it renders the repository's committed files (``alerts/``,
``dashboards/``, ``runbooks/``); ``--check`` only compares and exits 1 when they differ.
The renderer loads on first use (registering the command keeps ``pipeline --help``
fast), so an option left out takes :class:`~pipeline.tools.opskit.KitOptions`' default.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from pipeline.tools.cli.entry import OneLineErrors, OneLineErrorsGroup

# The thresholds' flags and help (pipeline.tools.opskit.options.THRESHOLDS is the source;
# repeated here so that `pipeline --help` does not import the renderer).
THRESHOLD_FLAGS = {
    "backlog_threshold": "Unsent outbox events above which a growing backlog alerts (1000).",
    "oldest_pending_seconds": "Age in seconds of the oldest unsent event that alerts (600).",
    "publish_failure_ratio": "Share of failed publish attempts that alerts (0.05).",
    "consumer_failure_ratio": "Share of a consumer's failed handler attempts that alerts (0.25).",
    "queue_depth_threshold": "Messages on a consumer queue above which growth alerts (100).",
    "redeliveries_per_second": "Re-deliveries per second to one consumer that alert (0.05).",
    "duplicate_ratio": "Share of a consumer's deliveries that are duplicates that alerts (0.25).",
    "canary_stale_seconds": "Seconds without a canary crossing the pipeline that alert (120).",
    "state_metrics_stale_seconds": "Age in seconds of the relay's state metrics that alerts (120).",
}


def kit_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The rendering options, shared by ``pipeline opskit`` and ``pipeline opskit export``."""
    options = [
        click.option("--relay-job", default=None, help="Job label of relays (pipeline-relay)."),
        click.option("--worker-job", default=None, help="Job label of workers (pipeline-worker)."),
        click.option(
            "--group-label",
            "group_labels",
            multiple=True,
            help="Label every aggregation keeps and every dashboard filters on, e.g. "
            "namespace (repeatable).",
        ),
        click.option(
            "--runbook-base-url",
            default=None,
            help="Absolute URL where the rendered runbooks/ pages are published; links are "
            "<base>/<name>.md (default: http://localhost:8088, docker-compose's runbooks "
            "service).",
        ),
        click.option(
            "--runbook-url",
            default=None,
            help="Absolute runbook URL template with {name}, for other layouts than "
            "<base>/<name>.md.",
        ),
        click.option(
            "--grafana-url", default=None, help="Grafana base URL (http://localhost:3000)."
        ),
        click.option(
            "--trace-ui-url", default=None, help="Trace UI base URL (http://localhost:16686)."
        ),
        click.option(
            "--latency-slo-seconds",
            type=float,
            default=None,
            help="Latency SLO: end-to-end seconds, a histogram bucket boundary (5).",
        ),
        click.option(
            "--latency-slo-target",
            type=float,
            default=None,
            help="Latency SLO: share of events within it over 30 days (0.99).",
        ),
        click.option(
            "--no-canary",
            "canary",
            flag_value=False,
            default=None,
            help="Relays run without the canary (PIPELINE_CANARY_INTERVAL=0): no canary "
            "alert or panels.",
        ),
        click.option(
            "--no-listen",
            "listen",
            flag_value=False,
            default=None,
            help="Relays run with --no-listen: no alerts about their LISTEN connection.",
        ),
        click.option(
            "--allowed-unrouted-type",
            "allowed_unrouted_types",
            multiple=True,
            help="An event type sent to no consumer on purpose (relays run with "
            "--allow-unrouted): the unrouted-events alert ignores it (repeatable).",
        ),
        *(
            click.option("--" + name.replace("_", "-"), name, type=float, default=None, help=text)
            for name, text in THRESHOLD_FLAGS.items()
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def build_options(ctx: click.Context, values: dict[str, Any]) -> Any:
    """KitOptions from the flags given (those left out take the defaults)."""
    from pipeline.tools.opskit import KitOptions
    from pipeline.tools.opskit.options import runbook_url_for_base

    given = {k: v for k, v in values.items() if v is not None and v != ()}
    base = given.pop("runbook_base_url", None)
    if base is not None:
        if "runbook_url" in given:
            raise click.UsageError("give --runbook-base-url or --runbook-url, not both", ctx)
        given["runbook_url"] = runbook_url_for_base(base)
    for name in ("group_labels", "allowed_unrouted_types"):
        if name in given:
            given[name] = tuple(given[name])
    try:
        return KitOptions(**given)
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx) from None


@click.group(
    cls=OneLineErrorsGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path(),
    help="Directory to write into (default: the current one).",
)
@click.option("--check", is_flag=True, help="Compare only; exit 1 on a difference.")
@kit_options
@click.pass_context
def opskit(ctx: click.Context, /, out: Path, check: bool, **values: Any) -> None:
    """Render the pipeline's Prometheus rules, Grafana dashboards and runbooks."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = values  # `export` takes these as defaults of its own flags
        return
    from pipeline.tools.opskit import render_kit
    from pipeline.tools.opskit.render import stale_files, write_files

    files = render_kit(build_options(ctx, values))
    if check:
        stale = stale_files(files, out)
        for relative in stale:
            click.echo(f"differs from the code: {relative}", err=True)
        ctx.exit(1 if stale else 0)
    for path in write_files(files, out):
        click.echo(str(path))


@opskit.command(cls=OneLineErrors)
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@kit_options
@click.pass_context
def export(ctx: click.Context, /, directory: Path, **values: Any) -> None:
    """Write the ops kit for a deployment into DIRECTORY: alerts/ (Prometheus rule files),
    dashboards/ (Grafana JSON) and runbooks/ (Markdown), rendered with the options given.

    Works from an installed package: the templates ship with it."""
    from pipeline.tools.opskit import render_kit
    from pipeline.tools.opskit.options import DEFAULT_RUNBOOK_BASE_URL
    from pipeline.tools.opskit.render import write_files

    inherited = {k: v for k, v in (ctx.obj or {}).items() if v is not None and v != ()}
    given = {k: v for k, v in values.items() if v is not None and v != ()}
    options = build_options(ctx, {**inherited, **given})
    written = write_files(render_kit(options), directory)
    for path in written:
        click.echo(str(path))
    click.echo(
        f"wrote {len(written)} files: load {directory / 'alerts'}/*.yaml as Prometheus "
        f"rule_files, import {directory / 'dashboards'}/*.json into Grafana, and publish "
        f"{directory / 'runbooks'}/ where the alerts link: {options.runbook('README')}",
        err=True,
    )
    if options.runbook_url.startswith(DEFAULT_RUNBOOK_BASE_URL + "/"):
        click.echo(
            f"note: runbook links point at {DEFAULT_RUNBOOK_BASE_URL} (docker-compose's "
            "runbooks service); pass --runbook-base-url with where you publish them",
            err=True,
        )
