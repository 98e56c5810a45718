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
@click.pass_context
def relay(ctx: click.Context, mode: str, no_listen: bool, apps: tuple[str, ...]) -> None:
    """Wake on NOTIFY (with a polling fallback) and publish due outbox events."""
    import signal

    from pipeline.db.connect import connect
    from pipeline.relay.relay import Relay
    from pipeline.runtime import build_runtime

    settings = _with_apps(_settings(ctx), apps)
    connect(settings).close()  # fail fast, with one clear line, on a bad URL or a down server
    runtime = build_runtime(settings)
    server = Relay(
        settings,
        runtime.registry,
        runtime.publisher,
        mode=mode,  # type: ignore[arg-type]
        listen=not no_listen,
        dispatch=runtime.dispatcher,
    )
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: server.shutdown())
    from pipeline.observability.logging import configure_logging

    configure_logging(settings)
    try:
        server.run()
    finally:
        runtime.close()


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--processes", "-p", type=int, default=2, show_default=True)
@click.option("--threads", "-t", type=int, default=8, show_default=True)
@click.option("--queues", "-Q", multiple=True, help="Only consume these queues.")
@click.option("--app", "apps", multiple=True, help="Module that registers consumers (repeatable).")
@click.argument("dramatiq_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def worker(
    ctx: click.Context,
    processes: int,
    threads: int,
    queues: tuple[str, ...],
    apps: tuple[str, ...],
    dramatiq_args: tuple[str, ...],
) -> None:
    """Run Dramatiq worker processes for the publishing and inbox actors.

    Extra arguments are passed to the dramatiq command line.
    """
    import os

    from pipeline.db.connect import connect
    from pipeline.runtime import build_runtime

    settings = _with_apps(_settings(ctx), apps)
    settings.require_redis_url()
    connect(settings).close()
    build_runtime(settings).close()  # import errors and bad settings: one line, here
    env = dict(os.environ)
    env["PIPELINE_APP_MODULES"] = settings.app_modules
    env["dramatiq_worker_timeout"] = str(settings.worker_timeout_ms)
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
    argv += list(dramatiq_args)
    os.execve(sys.executable, argv, env)  # noqa: S606 - replace this process with dramatiq


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


if __name__ == "__main__":
    main()
