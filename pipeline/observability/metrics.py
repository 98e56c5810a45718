"""Prometheus metrics of the observability contract (docs/metrics.md lists each one).

Names use the ``pipeline_`` prefix, base units and ``_total`` counters; labels are
low-cardinality (event type, consumer, stage, error class, source), never ids.
Metric objects are module-level so every process shares one set; in Dramatiq's
multi-process workers ``prometheus_client``'s multiprocess mode aggregates them
(``PROMETHEUS_MULTIPROC_DIR``, prepared by ``pipeline worker``, whose parent process
serves the aggregate). Gauges therefore declare how processes combine.

State read from Postgres and Redis (backlog, oldest pending age, dead letters, queue
depths) is not here: :class:`pipeline.relay.state.StateCollector` serves it,
cached, from the relay process only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from pipeline.config import Settings
from pipeline.errors import ConfigurationError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from pipeline.envelope import ReceivedEvent

log = logging.getLogger("pipeline.metrics")
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
Role = Literal["relay", "worker"]
WAKEUP_SOURCES = ("notify", "poll", "reconnect")

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
)

events_published = Counter(
    "pipeline_events_published_total",
    "Events whose every copy the broker accepted (marked sent).",
    ["event_type"],
)
events_unrouted = Counter(
    "pipeline_events_unrouted_total",
    "Events marked sent without any subscribed consumer.",
    ["event_type"],
)
publish_attempts = Counter(
    "pipeline_publish_attempts_total",
    "Delivery attempts of events by the publisher, successful or not.",
    ["event_type"],
)
publish_failures = Counter(
    "pipeline_publish_failures_total",
    "Failed delivery attempts, by error class.",
    ["event_type", "error_class"],
)
publish_batch_size = Histogram(
    "pipeline_publish_batch_events",
    "Events claimed per publishing batch.",
    buckets=(1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500),
)
broker_publish = Histogram(
    "pipeline_broker_publish_seconds",
    "Time the broker took to accept a publishing batch, by transport: Redis's pipelined "
    "write, or RabbitMQ's publish and its one publisher-confirm round.",
    ["transport"],
    buckets=LATENCY_BUCKETS,
)
publish_lag = Histogram(
    "pipeline_publish_lag_seconds",
    "Time from the outbox insert to the broker accepting the event.",
    ["event_type"],
    buckets=LATENCY_BUCKETS,
)
dead_letters = Counter(
    "pipeline_dead_letters_total",
    "Events dead-lettered, by stage (publish or consume).",
    ["stage", "event_type", "error_class"],
)
unauthentic_messages = Counter(
    "pipeline_unauthentic_messages_total",
    "Envelopes a worker refused and dead-lettered because their signature is missing or wrong.",
    ["consumer", "reason"],
)
redeliveries = Counter(
    "pipeline_redeliveries_total",
    "Deliveries the relay's ledger sweep sent again: no outcome within the redelivery horizon.",
    ["consumer"],
)
broker_memory_lost = Counter(
    "pipeline_broker_memory_lost_total",
    "Times a relay found that the broker had lost its messages (a Redis restarted empty); "
    "what was owed was sent again at once.",
)
REDELIVERY_REASONS = ("no_outcome", "retry_overdue", "resend_unanswered", "broker_lost")
"""Why the ledger sent a delivery again: it was delivered (or recorded as owed) and no
outcome came; a failed attempt's retry came due and no outcome came; an earlier re-send
got no outcome either; the broker lost its messages (owed at once, not after the horizon)."""
redelivery_reasons = Counter(
    "pipeline_ledger_redeliveries_total",
    "Deliveries the relay's ledger sweep sent again, by why: overdue and not in flight.",
    ["consumer", "reason"],
)
inbox_infrastructure_retries = Counter(
    "pipeline_inbox_infrastructure_retries_total",
    "Messages a worker failed on an infrastructure error (database, broker, crash) and retries.",
    ["consumer", "error_class"],
)
relay_wakeups = Counter(
    "pipeline_relay_wakeups_total",
    "Relay wake-ups by source: notify, poll or reconnect.",
    ["source"],
)
relay_listener_connected = Gauge(
    "pipeline_relay_listener_connected",
    "1 while the relay's LISTEN connection is up.",
    multiprocess_mode="max",
)
relay_busy = Gauge(
    "pipeline_relay_busy",
    "1 while the relay polls busily (producers skip NOTIFY while a relay is busy).",
    multiprocess_mode="max",
)
relay_clock_offset = Gauge(
    "pipeline_relay_clock_offset_seconds",
    "The relay host's clock minus the database's, measured at each heartbeat (positive: "
    "the host is ahead); 0 until the first heartbeat.",
    multiprocess_mode="mostrecent",
)
relay_listener_reconnects = Counter(
    "pipeline_relay_listener_reconnects_total",
    "Times the relay re-established its LISTEN connection.",
)

pruned_rows = Counter(
    "pipeline_pruned_rows_total",
    "Rows the relay's janitor deleted past their retention, by table.",
    ["table"],
)
backlog_over_warning = Gauge(
    "pipeline_backlog_over_warning",
    "1 while more events are unsent than PIPELINE_BACKLOG_WARN (checked by the relay).",
    multiprocess_mode="max",
)

# -- inbox (consumer side) -------------------------------------------------------------------
inbox_processed = Counter(
    "pipeline_inbox_processed_total",
    "Events whose handler committed.",
    ["consumer", "event_type"],
)
inbox_duplicates = Counter(
    "pipeline_inbox_duplicates_total",
    "Deliveries of already processed or dead-lettered events, acknowledged without running.",
    ["consumer", "event_type"],
)
inbox_failures = Counter(
    "pipeline_inbox_failures_total",
    "Handler attempts that raised, by error class.",
    ["consumer", "event_type", "error_class"],
)
inbox_retries = Counter(
    "pipeline_inbox_retries_total",
    "Failed handler attempts scheduled for another try.",
    ["consumer", "event_type"],
)
inbox_duplicates_dropped = Counter(
    "pipeline_inbox_duplicates_dropped_total",
    "Message ids a worker fetched after their message was already acknowledged (a leftover "
    "duplicate on the queue), dropped without running anything.",
    ["queue"],
)
deliveries_lost = Counter(
    "pipeline_deliveries_lost_total",
    "Message ids a worker fetched whose body was gone before any consumer ran it (evicted "
    "by Redis); dropped, the relay's delivery ledger sends the delivery again.",
    ["queue"],
)
handler_duration = Histogram(
    "pipeline_handler_duration_seconds",
    "Time spent in a handler attempt, successful or not.",
    ["consumer", "event_type"],
    buckets=LATENCY_BUCKETS,
)
end_to_end_latency = Histogram(
    "pipeline_end_to_end_latency_seconds",
    "Time from the outbox insert to the handler's commit.",
    ["consumer", "event_type"],
    buckets=LATENCY_BUCKETS,
)


def record_processed(consumer: str, done: Sequence[tuple[ReceivedEvent, float]]) -> None:
    """Count committed handler runs (event, handler seconds): processed, duration, latency.

    A message's events are counted together, per event type: one counter increment for
    them all (each increment is a locked write to a memory-mapped file in Dramatiq's
    multi-process workers).
    End-to-end latency is created → now (an event's CloudEvents ``time`` is its insert
    time); an unparsable time is left out of that histogram only.
    """
    now = time.time()
    by_type: dict[str, tuple[list[float], list[float]]] = {}
    for event, duration in done:
        durations, latencies = by_type.setdefault(event.type, ([], []))
        durations.append(duration)
        try:
            latencies.append(max(0.0, now - datetime.fromisoformat(event.time).timestamp()))
        except ValueError:
            continue
    for event_type, (durations, latencies) in by_type.items():
        inbox_processed.labels(consumer, event_type).inc(len(durations))
        observe_many(handler_duration.labels(consumer, event_type), durations)
        observe_many(end_to_end_latency.labels(consumer, event_type), latencies)


def observe_many(histogram: Histogram, amounts: Sequence[float]) -> None:
    """``histogram.observe`` for each amount (a message's or a batch's values at once)."""
    for amount in amounts:
        histogram.observe(amount)


# -- end-to-end canary -----------------------------------------------------------------------
canary_last_success = Gauge(
    "pipeline_canary_last_success_timestamp_seconds",
    "Unix time at which a canary event last completed the whole path (0: never).",
    multiprocess_mode="max",
)
canary_latency = Histogram(
    "pipeline_canary_latency_seconds",
    "Created-to-processed latency of canary events that completed the whole path.",
    buckets=LATENCY_BUCKETS,
)


def record_canary_success(latency_seconds: float, at: float | None = None) -> None:
    """A canary (heartbeat) event made it from the outbox through a handler."""
    canary_last_success.set(time.time() if at is None else at)
    canary_latency.observe(max(0.0, latency_seconds))


def zero_initialise(role: Role) -> None:
    """Create the labelled series whose label values are known, so they read 0, not absent.

    ``rate()`` and ``increase()`` need a series to exist before its first increment.
    """
    if role == "relay":
        for source in WAKEUP_SOURCES:
            relay_wakeups.labels(source)


def zero_initialise_consumers(consumers: Iterable[str]) -> None:
    """The relay's per-consumer counters read 0 from the start: a burst of re-deliveries
    after a Redis restart is then visible to ``rate()`` from its first increment."""
    for consumer in consumers:
        redeliveries.labels(consumer)
        for reason in REDELIVERY_REASONS:
            redelivery_reasons.labels(consumer, reason)


PUBLISH_ERROR_CLASSES = ("PublisherUnavailable", "PermanentPublishError")
"""What a failed delivery attempt is counted as: the broker down (or refusing writes), or a
message it can never take. Other classes still count; these exist at 0 from the start."""
INFRASTRUCTURE_ERROR_CLASSES = ("OperationalError", "InterfaceError", "ConnectionError")
"""The usual failures of a message outside its handlers: Postgres (SQLAlchemy's wrapper
classes) or Redis gone. Other classes still count; these exist at 0 from the start."""


def zero_initialise_publishing(event_types: Iterable[str], transport: str) -> None:
    """A publishing process's labelled series at 0 for the event types it knows.

    ``event_types``: the types its consumers subscribe to, and any it found waiting to be
    published; their failure and unrouted series then exist before the first failure.
    ``transport``: its broker's name, the label of the broker publish time.
    """
    broker_publish.labels(transport)
    for event_type in event_types:
        events_unrouted.labels(event_type)
        for error_class in PUBLISH_ERROR_CLASSES:
            publish_failures.labels(event_type, error_class)


def zero_initialise_inbox(
    consumers: Iterable[str], queues: Iterable[str], refusals: Iterable[str] = ()
) -> None:
    """A worker's labelled inbox counters at 0 for its consumers and their queues, and
    ``refusals`` (the reasons an envelope is refused as unauthentic) per consumer."""
    refused = tuple(refusals)
    for consumer in consumers:
        for error_class in INFRASTRUCTURE_ERROR_CLASSES:
            inbox_infrastructure_retries.labels(consumer, error_class)
        for reason in refused:
            unauthentic_messages.labels(consumer, reason)
    for queue in queues:
        inbox_duplicates_dropped.labels(queue)
        deliveries_lost.labels(queue)


# -- exposition ------------------------------------------------------------------------------


def multiprocess_dir() -> str | None:
    """The multiprocess directory this process writes to, if it runs in multiprocess mode."""
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir(settings: Settings) -> Path:
    """Create (or empty of stale ``*.db`` files) the directory Dramatiq's processes share.

    Uses ``PIPELINE_METRICS_MULTIPROC_DIR``, else an inherited ``PROMETHEUS_MULTIPROC_DIR``,
    else a fresh temporary directory; sets ``PROMETHEUS_MULTIPROC_DIR`` in this process's
    environment so that child processes started from now on inherit it. Only ``*.db``
    files are removed, so pointing it at a shared directory by mistake deletes nothing
    else. Call before any worker process starts: files left by a previous run would
    otherwise be added to the new run's counters.
    """
    given = settings.metrics_multiproc_dir or os.environ.get(MULTIPROC_ENV)
    try:
        path = Path(given) if given else Path(tempfile.mkdtemp(prefix="pipeline-metrics-"))
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink(missing_ok=True)
    except OSError as exc:
        raise ConfigurationError(
            f"PIPELINE_METRICS_MULTIPROC_DIR / {MULTIPROC_ENV}: cannot use {given or 'a temp dir'}"
            f" as the workers' metrics directory: {exc.strerror or exc}"
        ) from None
    os.environ[MULTIPROC_ENV] = str(path)
    return path


def remove_multiprocess_dir(path: Path) -> None:
    """Remove a directory :func:`prepare_multiprocess_dir` created under the temp dir."""
    if path.parent == Path(tempfile.gettempdir()) and path.name.startswith("pipeline-metrics-"):
        shutil.rmtree(path, ignore_errors=True)


@dataclass
class MetricsServer:
    """A running ``/metrics`` endpoint; :meth:`close` stops it and closes its collectors."""

    host: str
    port: int
    registry: CollectorRegistry
    _server: WSGIServer
    _collectors: list[Collector] = field(default_factory=list)
    _closers: list[Callable[[], None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def add_closer(self, close: Callable[[], None]) -> None:
        """Call ``close`` first when the endpoint closes (e.g. stop a collectors' refresher)."""
        self._closers.append(close)

    def close(self) -> None:
        for closer in self._closers:
            closer()
        self._closers.clear()
        self._server.shutdown()
        self._server.server_close()
        for collector in self._collectors:
            with contextlib.suppress(KeyError):
                self.registry.unregister(collector)
            close = getattr(collector, "close", None)
            if callable(close):
                close()  # e.g. the StateCollector's connections
        self._collectors.clear()


def metrics_port(settings: Settings, role: Role) -> int:
    """The configured port of ``role``'s endpoint (0: disabled)."""
    return settings.metrics_port if role == "relay" else settings.worker_metrics_port


def start_metrics_server(
    settings: Settings,
    role: Role,
    *,
    port: int | None = None,
    collectors: Iterable[Collector] = (),
    multiprocess_path: str | os.PathLike[str] | None = None,
) -> MetricsServer | None:
    """Serve ``/metrics`` on ``settings.metrics_host`` (127.0.0.1 unless told otherwise).

    ``port`` overrides the role's setting (``PIPELINE_METRICS_PORT`` for the relay,
    ``PIPELINE_WORKER_METRICS_PORT`` for workers); 0 disables the endpoint and returns
    ``None``. In multiprocess mode (``multiprocess_path``, else ``PROMETHEUS_MULTIPROC_DIR``)
    the endpoint serves the aggregate of every process's files; otherwise this
    process's default registry. ``collectors`` (e.g. the relay's ``StateCollector``) are
    added to the served registry. A port already in use raises ``OSError``.
    """
    chosen = metrics_port(settings, role) if port is None else port
    if chosen == 0:
        return None
    zero_initialise(role)
    disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: noise, never used
    path = multiprocess_path or multiprocess_dir()
    registry: CollectorRegistry
    if path:
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(path))  # type: ignore[no-untyped-call]
    else:
        registry = REGISTRY
    added: list[Collector] = []
    try:
        for collector in collectors:
            registry.register(collector)
            added.append(collector)
        server, _thread = start_http_server(chosen, addr=settings.metrics_host, registry=registry)
    except BaseException:
        for collector in added:
            registry.unregister(collector)
        raise
    host, bound = server.server_address[:2]
    log.info("metrics endpoint listening", extra={"role": role, "host": host, "port": bound})
    return MetricsServer(str(host), int(bound), registry, server, added)
