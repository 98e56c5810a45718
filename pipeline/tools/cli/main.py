"""The ``pipeline`` command line.

Expected failures (:class:`PipelineError`) print one line on stderr and exit 1;
usage errors print one line too and exit 2 (click's convention). Tracebacks are kept
for real bugs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import click

from pipeline.config import Settings, load_settings
from pipeline.errors import PipelineError

if TYPE_CHECKING:
    from pipeline.observability.metrics import MetricsServer
    from pipeline.policy import ConsumerPolicy
    from pipeline.runtime import Runtime


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
    from pipeline.db.connect import make_engine
    from pipeline.db.migrate import upgrade
    from pipeline.driver_errors import wrap_driver_errors

    settings = _settings(ctx)
    engine = make_engine(settings)
    try:
        with wrap_driver_errors(settings), engine.begin() as connection:
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
    from pipeline.db.connect import make_engine
    from pipeline.db.migrate import pending_migrations
    from pipeline.driver_errors import wrap_driver_errors

    settings = _settings(ctx)
    engine = make_engine(settings)
    try:
        with wrap_driver_errors(settings), engine.connect() as connection:
            pending = pending_migrations(connection, settings.schema_name)
    finally:
        engine.dispose()
    if pending:
        click.echo(f"pending migrations: {pending}")
        ctx.exit(1)
    click.echo("no pending migrations")


def _check_database(settings: Settings, grants: Mapping[str, frozenset[str]], command: str) -> None:
    """Fail fast, with one clear line, on a bad URL, a down server or a missing grant."""
    from pipeline.db.connect import connect
    from pipeline.db.privileges import require_privileges

    with connect(settings) as conn:
        require_privileges(conn, settings.schema_name, grants, command)


def _with_apps(settings: Settings, apps: tuple[str, ...]) -> Settings:
    if not apps:
        return settings
    names = [*settings.app_module_names(), *apps]
    return settings.replace(app_modules=",".join(names))


@cli.command()
@click.option(
    "--mode",
    type=click.Choice(["auto", "inline", "workers"]),
    default="auto",
    show_default=True,
    help="inline: publish in the relay; workers: only dispatch publishing actors; "
    "auto: inline, plus actors when a backlog builds up.",
)
@click.option("--no-listen", is_flag=True, help="Do not LISTEN; rely on polling only.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port of the /metrics endpoint (default PIPELINE_METRICS_PORT, 9464; 0 disables).",
)
@click.option(
    "--state-metrics/--no-state-metrics",
    default=True,
    show_default=True,
    help="Serve backlog, dead-letter and queue-depth gauges (one relay per deployment is enough).",
)
@click.pass_context
def relay(
    ctx: click.Context,
    mode: str,
    no_listen: bool,
    apps: tuple[str, ...],
    metrics_port: int | None,
    state_metrics: bool,
) -> None:
    """Wake on NOTIFY (with a polling fallback) and publish due outbox events.

    Started before Postgres, Redis or `pipeline db upgrade`, it waits for them (one log
    line per try); once running, it rides out their outages the same way.
    """
    import threading

    from pipeline.db.privileges import relay_grants
    from pipeline.observability.logging import configure_logging
    from pipeline.observability.tracing import configure_tracing, shutdown_tracing
    from pipeline.readiness import wait_for_services
    from pipeline.relay.relay import Relay
    from pipeline.runtime import build_runtime

    settings = _with_apps(_settings(ctx), apps)
    settings.require_database_url()
    runtime = build_runtime(settings)  # import errors and bad settings: one line, here
    configure_logging(settings)
    stop = threading.Event()
    _stop_on_signals(stop.set)
    try:
        if not wait_for_services(settings, redis_needed=True, stop=stop, role="relay"):
            return
        grants = relay_grants(
            publishing=mode != "workers",
            canary=settings.canary_interval > 0,
            janitor=settings.prune_interval_seconds > 0,
        )
        _check_database(settings, grants, "pipeline relay")
        server = Relay(
            settings,
            runtime.registry,
            runtime.publisher,
            mode=mode,  # type: ignore[arg-type]
            listen=not no_listen,
            dispatch=runtime.dispatcher,
        )
        _stop_on_signals(server.shutdown)
        if stop.is_set():  # a signal came between the wait and the handler above
            return
        configure_tracing(settings, "pipeline-relay")
        endpoint = _relay_metrics(settings, runtime, metrics_port, state_metrics)
        try:
            server.run()
        finally:
            if endpoint is not None:
                endpoint.close()
            shutdown_tracing()
    finally:
        runtime.close()


def _stop_on_signals(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (a graceful stop, exit code 0)."""
    import signal

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop())


def _relay_metrics(
    settings: Settings, runtime: Runtime, port: int | None, state_metrics: bool
) -> MetricsServer | None:
    """Start the relay's /metrics endpoint; a port in use disables it (delivery matters more)."""
    import logging

    from pipeline.observability.metrics import start_metrics_server, zero_initialise_consumers
    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.tools.ops.state import StateCollector

    def queues() -> list[str]:
        return [*(s.queue for s in runtime.registry.all()), PUBLISH_QUEUE_NAME]

    def consumers() -> list[str]:
        return [s.consumer for s in runtime.registry.all()]

    from pipeline.tools.ops.table_sizes import TableSizeCollector

    collectors: list[Any] = (
        [StateCollector(settings, queues, consumers=consumers), TableSizeCollector(settings)]
        if state_metrics
        else []
    )
    zero_initialise_consumers(consumers())
    try:
        return start_metrics_server(settings, "relay", port=port, collectors=collectors)
    except OSError as exc:
        logging.getLogger("pipeline.relay").error(
            "metrics endpoint disabled: cannot listen",
            extra={"host": settings.metrics_host, "error": str(exc)},
        )
        return None


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--processes", "-p", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--threads", "-t", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--queues", "-Q", multiple=True, help="Only consume these queues.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.option(
    "--metrics-port",
    "metrics_port_option",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port of the workers' /metrics endpoint (default PIPELINE_WORKER_METRICS_PORT, 9465; "
    "0 disables and runs dramatiq in place of this process).",
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
    dramatiq_args: tuple[str, ...],
) -> None:
    """Run Dramatiq worker processes for the publishing and inbox actors.

    This process supervises dramatiq and serves the metrics of all its worker processes
    (prometheus_client multiprocess mode); stop it with SIGTERM. Extra arguments are
    passed to the dramatiq command line. Started before Postgres, Redis or `pipeline db
    upgrade`, it waits for them (one log line per try) before starting dramatiq.
    """
    import os
    import threading

    from pipeline.db.privileges import worker_grants
    from pipeline.observability.logging import configure_logging
    from pipeline.readiness import wait_for_services
    from pipeline.registry import validate_queue_name
    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.runtime import build_runtime

    settings = _with_apps(_settings(ctx), apps)
    settings.require_redis_url()
    settings.require_database_url()
    for queue in queues:
        validate_queue_name(queue)
    runtime = build_runtime(settings)  # import errors and bad settings: one line, here
    try:
        _check_queues(queues, runtime.broker.get_declared_queues())
    finally:
        runtime.close()
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
    stop = threading.Event()
    _stop_on_signals(stop.set)
    if not wait_for_services(settings, redis_needed=True, stop=stop, role="worker"):
        return
    publishing = not queues or PUBLISH_QUEUE_NAME in queues
    _check_database(settings, worker_grants(publishing=publishing), "pipeline worker")
    env = dict(os.environ)
    env["PIPELINE_APP_MODULES"] = settings.app_modules
    env["dramatiq_worker_timeout"] = str(settings.worker_timeout_ms)
    from pipeline.observability.metrics import MULTIPROC_ENV, metrics_port

    port = metrics_port(settings, "worker") if metrics_port_option is None else metrics_port_option
    if port == 0 and not env.get(MULTIPROC_ENV):
        os.execve(sys.executable, argv, env)  # noqa: S606 - replace this process with dramatiq
    from pipeline.observability.workers import run_dramatiq_with_metrics

    ctx.exit(run_dramatiq_with_metrics(argv, env, settings, port))


def _check_queues(wanted: tuple[str, ...], declared: set[str]) -> None:
    known = declared | {f"{name}.DQ" for name in declared}
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


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option(
    "--max-pending-age",
    type=click.FloatRange(min=0),
    default=300.0,
    show_default=True,
    help="Unhealthy when the oldest unsent event is older than this many seconds.",
)
@click.option(
    "--max-dead-letters",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Unhealthy when more dead letters than this are waiting.",
)
@click.option(
    "--interval",
    default="5m",
    show_default=True,
    help="Window of the per-consumer figures: 30s, 5m, 2h, 7d, or seconds.",
)
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
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
    import math

    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.runtime import import_app_modules
    from pipeline.tools.ops.activity import parse_duration
    from pipeline.tools.ops.status import Thresholds, format_status, read_status

    if math.isnan(max_pending_age):  # FloatRange lets nan through: it compares false
        raise click.BadParameter("must be a number of seconds", param_hint="'--max-pending-age'")

    try:
        window = parse_duration(interval)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="'--interval'") from None
    settings = _with_apps(_settings(ctx), apps)
    import_app_modules(settings.app_module_names())
    from pipeline.registry import registry

    queues = [*(s.queue for s in registry.all()), PUBLISH_QUEUE_NAME]
    result = read_status(
        settings,
        queues,
        Thresholds(max_pending_age, max_dead_letters),
        interval=window,
        consumers=[s.consumer for s in registry.all()],
    )
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2, sort_keys=True))
    else:
        click.echo(format_status(result))
    ctx.exit(0 if result.healthy else 1)


cli.add_command(__import__("pipeline.tools.demo.cli", fromlist=["demo"]).demo)  # cheap: click only
cli.add_command(__import__("pipeline.tools.cli.dlq", fromlist=["dlq"]).dlq)  # cheap: click only
cli.add_command(
    __import__("pipeline.tools.drill.cli", fromlist=["drill"]).drill
)  # cheap: click only


@cli.command("trace")
@click.argument("event_id")
@click.option("--json", "as_json", is_flag=True, help="Print the lineage as JSON.")
@click.pass_context
def trace_command(ctx: click.Context, event_id: str, as_json: bool) -> None:
    """Show an event's lineage: publishing, each consumer, dead letters, follow-up events."""
    import json
    import uuid

    from pipeline.db.connect import connect
    from pipeline.driver_errors import wrap_driver_errors
    from pipeline.policy import redelivery_horizon
    from pipeline.tools.ops.lineage import load_lineage, render

    try:
        wanted = uuid.UUID(event_id)
    except ValueError:
        raise click.BadParameter(f"{event_id!r} is not an event id (a UUID)") from None
    settings = _settings(ctx)
    with wrap_driver_errors(settings), connect(settings) as conn:
        lineage = load_lineage(
            conn, settings.schema_name, wanted, horizon=redelivery_horizon(settings)
        )
    if as_json:
        click.echo(json.dumps(lineage.as_json(), indent=2))
    else:
        click.echo("\n".join(render(lineage, settings.trace_ui_url)))


def _consumer_policies(settings: Settings) -> list[ConsumerPolicy]:
    """Every registered consumer's policy, after importing the app modules."""
    from pipeline.inbox.canary import register_canary
    from pipeline.registry import registry
    from pipeline.runtime import import_app_modules

    import_app_modules(settings.app_module_names())
    register_canary(registry)
    return registry.policies(settings)


@cli.command()
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; delete nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.pass_context
def prune(ctx: click.Context, dry_run: bool, as_json: bool, apps: tuple[str, ...]) -> None:
    """Delete rows past their retention now (what the relay's janitor does periodically).

    Sent events, processed inbox keys, attempt history and audit records older than
    their PIPELINE_*_RETENTION_SECONDS; never anything still owed, pending or
    dead-lettered. Exits 1 if a janitor or another prune is running.
    """
    import json

    from pipeline.tools.ops.prune import format_prune, run_prune

    settings = _with_apps(_settings(ctx), apps)
    result = run_prune(settings, _consumer_policies(settings), dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(result.as_json(), indent=2))
    else:
        click.echo(format_prune(result))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.pass_context
def doctor(ctx: click.Context, as_json: bool, apps: tuple[str, ...]) -> None:
    """Check the deployment: schema, indexes and triggers, LISTEN not behind a transaction
    pooler, notification queue, settings, Redis eviction and persistence, clock skew,
    dead letters and the canary. Each problem comes with its fix.

    Exits 0 when nothing is wrong, 1 when anything is.
    """
    import json

    from pipeline.tools.ops.doctor import format_report, run_doctor

    settings = _with_apps(_settings(ctx), apps)
    settings.require_database_url()
    report = run_doctor(settings, _consumer_policies(settings))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(format_report(report))
    ctx.exit(0 if report.healthy else 1)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: one clear line for expected errors, never a traceback."""
    try:
        result: Any = cli.main(args=argv, prog_name="pipeline", standalone_mode=False)
        sys.exit(result if isinstance(result, int) else 0)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.UsageError as exc:  # one line, and where to read more
        path = exc.ctx.command_path if exc.ctx is not None else "pipeline"
        click.echo(f"pipeline: error: {exc.format_message()} (see '{path} --help')", err=True)
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
    except Exception as exc:
        from pipeline.driver_errors import permission_denied

        denied = permission_denied(exc)  # a grant revoked while running, or a read refused
        if denied is None:
            raise
        click.echo(f"pipeline: error: {denied}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
