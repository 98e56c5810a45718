"""``pipeline worker``: Dramatiq worker processes for the publishing and inbox actors."""

from __future__ import annotations

import sys

import click

from pipeline.tools.cli.options import (
    apps_option,
    metrics_port_option,
    processes_option,
    settings_of,
    threads_option,
)
from pipeline.tools.cli.services import routes_check, stop_on_signals, warn_unknown_variables


@click.command(context_settings={"ignore_unknown_options": True})
@processes_option(2, short=("-p",))
@threads_option(8, short=("-t",))
@click.option("--queues", "-Q", multiple=True, help="Only consume these queues.")
@apps_option()
@metrics_port_option(
    "metrics_port_option",
    "Port of the workers' /metrics endpoint (default PIPELINE_WORKER_METRICS_PORT, 9465; "
    "0 disables and runs dramatiq in place of this process).",
)
@click.option(
    "--allow-unrouted",
    is_flag=True,
    help="Publish even when events wait whose type no registered consumer takes (they are "
    "sent to nobody; default PIPELINE_ALLOW_UNROUTED).",
)
@click.argument("dramatiq_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def worker(
    ctx: click.Context,
    processes: int,
    threads: int,
    queues: tuple[str, ...],
    apps: tuple[str, ...],
    metrics_port_option: int | None,
    allow_unrouted: bool,
    dramatiq_args: tuple[str, ...],
) -> None:
    """Run Dramatiq worker processes for the publishing and inbox actors.

    This process supervises dramatiq and serves the metrics of all its worker processes
    (prometheus_client multiprocess mode); stop it with SIGTERM. Extra arguments are
    passed to the dramatiq command line. Started before Postgres, Redis or `pipeline db
    upgrade`, it waits for them (one log line per try) before starting dramatiq.
    """
    settings = settings_of(ctx, apps)  # a bad setting: one line before any heavy import
    settings.require_redis_url()
    settings.require_database_url()

    import os
    import threading

    from pipeline.db.privileges import worker_grants
    from pipeline.observability.logging import configure_logging
    from pipeline.readiness import wait_for_services
    from pipeline.registry import validate_queue_name
    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.runtime import build_runtime
    from pipeline.signing import warn_if_unauthenticated

    if allow_unrouted:
        settings = settings.replace(allow_unrouted=True)
    for queue in queues:
        validate_queue_name(queue)
    runtime = build_runtime(settings)  # import errors and bad settings: one line, here
    try:
        broker = runtime.broker
        _check_queues(queues, broker.get_declared_queues(), broker.get_declared_delay_queues())
    finally:
        runtime.close()
    registry = runtime.registry
    argv = [
        sys.executable,
        "-m",
        "dramatiq",
        "pipeline.worker",
        "--processes",
        str(processes),
        "--threads",
        str(threads),
    ]
    for queue in queues:
        argv += ["--queues", queue]
    argv += _checked_dramatiq_args(dramatiq_args)
    configure_logging(settings)
    warn_if_unauthenticated(settings)
    warn_unknown_variables("worker")
    stop = threading.Event()
    stop_on_signals(stop.set)
    publishing = not queues or PUBLISH_QUEUE_NAME in queues
    grants = worker_grants(publishing=publishing)
    checks = [routes_check(settings, registry, "pipeline worker", {})] if publishing else []
    if not wait_for_services(
        settings, redis_needed=True, stop=stop, role="worker", grants=grants, checks=checks
    ):
        return
    env = dict(os.environ)
    if settings.allow_unrouted:
        env["PIPELINE_ALLOW_UNROUTED"] = "1"
    env["PIPELINE_APP_MODULES"] = settings.app_modules
    env["dramatiq_worker_timeout"] = str(settings.worker_timeout_ms)
    from pipeline.observability.metrics import MULTIPROC_ENV, metrics_port

    port = metrics_port(settings, "worker") if metrics_port_option is None else metrics_port_option
    if port == 0 and not env.get(MULTIPROC_ENV):
        os.execve(sys.executable, argv, env)  # noqa: S606 - replace this process with dramatiq
    from pipeline.observability.workers import run_dramatiq_with_metrics

    ctx.exit(run_dramatiq_with_metrics(argv, env, settings, port))


def _check_queues(wanted: tuple[str, ...], declared: set[str], delayed: set[str]) -> None:
    """Every queue in ``wanted`` is one of the worker's queues, or a queue of their delayed
    messages (which Dramatiq's worker consumes under its own name)."""
    known = declared | delayed
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(map(repr, unknown))} is not a queue of this worker; "
            f"expected one of {', '.join(sorted(declared))}",
            param_hint="'--queues' / '-Q'",
        )


def _checked_dramatiq_args(args: tuple[str, ...]) -> list[str]:
    """The extra arguments, checked with dramatiq's own parser before anything starts."""
    import argparse
    import importlib.util

    from dramatiq.cli import make_argument_parser

    parser = make_argument_parser()  # type: ignore[no-untyped-call]
    parser.exit_on_error = False
    try:
        parsed, unknown = parser.parse_known_args(["pipeline.worker", *args])
    except (argparse.ArgumentError, SystemExit) as exc:
        raise click.UsageError(f"bad dramatiq argument: {exc}") from None
    if unknown:
        raise click.UsageError(
            f"no such option: {' '.join(unknown)} (not a pipeline worker or dramatiq option; "
            "see `dramatiq --help`)"
        )
    for module in parsed.modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise click.UsageError(f"extra argument {module!r} is not an importable module")
    return list(args)
