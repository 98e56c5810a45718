"""``pipeline relay``: publish the outbox, with its metrics endpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from pipeline.config import Settings
from pipeline.tools.cli.options import apps_option, metrics_port_option, settings_of
from pipeline.tools.cli.services import routes_check, stop_on_signals, warn_unknown_variables

if TYPE_CHECKING:
    from pipeline.observability.metrics import MetricsServer
    from pipeline.runtime import Runtime


@click.command()
@click.option(
    "--mode",
    type=click.Choice(["auto", "inline", "workers"]),
    default="auto",
    show_default=True,
    help="inline: publish in the relay; workers: only dispatch publishing actors; "
    "auto: inline, plus actors when a backlog builds up.",
)
@click.option("--no-listen", is_flag=True, help="Do not LISTEN; rely on polling only.")
@apps_option()
@metrics_port_option(
    "metrics_port",
    "Port of the /metrics endpoint (default PIPELINE_METRICS_PORT, 9464; 0 disables).",
)
@click.option(
    "--state-metrics/--no-state-metrics",
    default=True,
    show_default=True,
    help="Serve backlog, dead-letter and queue-depth gauges (one relay per deployment is enough).",
)
@click.option(
    "--allow-unrouted",
    is_flag=True,
    help="Start even when events wait whose type no registered consumer takes (they are "
    "sent to nobody; default PIPELINE_ALLOW_UNROUTED).",
)
@click.pass_context
def relay(
    ctx: click.Context,
    mode: str,
    no_listen: bool,
    apps: tuple[str, ...],
    metrics_port: int | None,
    state_metrics: bool,
    allow_unrouted: bool,
) -> None:
    """Wake on NOTIFY (with a polling fallback) and publish due outbox events.

    Started before Postgres, Redis or `pipeline db upgrade`, it waits for them (one log
    line per try); once running, it rides out their outages the same way.
    """
    settings = settings_of(ctx, apps)  # a bad setting: one line before any heavy import
    settings.require_database_url()

    import threading

    from pipeline.db.privileges import relay_grants
    from pipeline.observability.logging import configure_logging
    from pipeline.observability.tracing import configure_tracing, shutdown_tracing
    from pipeline.readiness import wait_for_services
    from pipeline.relay.relay import Relay
    from pipeline.runtime import build_runtime
    from pipeline.signing import warn_if_unauthenticated

    if allow_unrouted:
        settings = settings.replace(allow_unrouted=True)
    runtime = build_runtime(settings)  # import errors and bad settings: one line, here
    configure_logging(settings)
    warn_if_unauthenticated(settings)
    warn_unknown_variables("relay")
    stop = threading.Event()
    stop_on_signals(stop.set)
    try:
        grants = relay_grants(
            publishing=mode != "workers",
            canary=settings.canary_interval > 0,
            janitor=settings.prune_interval_seconds > 0,
        )
        unrouted: dict[str, int] = {}
        routes = routes_check(settings, runtime.registry, "pipeline relay", unrouted)
        if not wait_for_services(
            settings, redis_needed=True, stop=stop, role="relay", grants=grants, checks=[routes]
        ):
            return
        server = Relay(
            settings,
            runtime.registry,
            runtime.publisher,
            mode=mode,  # type: ignore[arg-type]
            listen=not no_listen,
            dispatch=runtime.dispatcher,
        )
        stop_on_signals(server.shutdown)
        if stop.is_set():  # a signal came between the wait and the handler above
            return
        configure_tracing(settings, "pipeline-relay")
        endpoint = _relay_metrics(settings, runtime, metrics_port, state_metrics, unrouted)
        try:
            server.run()
        finally:
            if endpoint is not None:
                endpoint.close()
            shutdown_tracing()
    finally:
        runtime.close()


def _relay_metrics(
    settings: Settings,
    runtime: Runtime,
    port: int | None,
    state_metrics: bool,
    unrouted: dict[str, int],
) -> MetricsServer | None:
    """Start the relay's /metrics endpoint; a port in use disables it (delivery matters more)."""
    import logging

    from pipeline.observability.metrics import (
        metrics_port,
        start_metrics_server,
        zero_initialise_consumers,
        zero_initialise_publishing,
    )
    from pipeline.relay.actors import PUBLISH_QUEUE_NAME
    from pipeline.relay.refresher import StateRefresher
    from pipeline.relay.state import StateCollector
    from pipeline.relay.table_sizes import TableSizeCollector

    def queues() -> list[str]:
        return [*(s.queue for s in runtime.registry.all()), PUBLISH_QUEUE_NAME]

    def consumers() -> list[str]:
        return [s.consumer for s in runtime.registry.all()]

    collectors: list[Any] = (
        [StateCollector(settings, queues, consumers=consumers), TableSizeCollector(settings)]
        if state_metrics
        else []
    )
    zero_initialise_consumers(consumers())
    zero_initialise_publishing(
        sorted({*runtime.registry.event_types(), *unrouted}), settings.transport_name
    )
    serving = metrics_port(settings, "relay") if port is None else port
    refresher = None
    if collectors and serving:
        refresher = StateRefresher(collectors, settings.state_metrics_interval)
        refresher.start_and_wait()  # refreshed off the scrape path from now on
    try:
        server = start_metrics_server(settings, "relay", port=port, collectors=collectors)
    except OSError as exc:
        if refresher is not None:
            refresher.close()
        logging.getLogger("pipeline.relay").error(
            "metrics endpoint disabled: cannot listen",
            extra={"host": settings.metrics_host, "error": str(exc)},
        )
        return None
    if refresher is not None:
        if server is None:
            refresher.close()
        else:
            server.add_closer(refresher.close)
    return server
