"""The pipeline's state as Postgres and the broker hold it: backlog, dead letters, queue depths.

One snapshot is two cheap SQL statements (:class:`pipeline.db.stores.state.StateStore`)
plus the broker's queue depths (one pipelined round trip on Redis, a passive declaration
per queue on RabbitMQ). The broker's ``pipeline_state_up`` series keeps the label
``source="redis"`` whichever the transport, so alerts on it stay as they are; every series
of it carries ``transport`` (``redis`` or ``rabbitmq``), so alerts can name the broker.
:class:`StateCollector` serves it as Prometheus gauges, refreshed at most every
``PIPELINE_STATE_METRICS_INTERVAL`` seconds however often it is scraped; ``pipeline
status`` reads it once. The state is the same whichever process reads it, so one
collector per deployment is enough: ``pipeline relay`` registers one (with several
relays, aggregate with ``max``, not ``sum``).

``pipeline relay`` refreshes it on a thread of its own (:mod:`.refresher`), so a scrape
only serves the last values and never waits on Postgres or Redis; used alone (tests,
scripts), a scrape refreshes it when its values are older than the interval.

A source that cannot be read is reported by ``pipeline_state_up{source}`` = 0 and its
gauges are left out of that scrape (never stale values that look healthy); so are values
older than ``3 * interval + 15`` seconds, which a refresh stuck on a server that stopped
answering leaves behind. ``pipeline_state_metrics_last_success_timestamp_seconds`` is the
Unix time of the last refresh that read every source (0: none yet).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.stores.state import DatabaseState, StateStore
from pipeline.errors import MigrationError, ServiceUnavailableError
from pipeline.policy import redelivery_horizon
from pipeline.transport.base import QueueDepth, Transport, delay_queue_name
from pipeline.transport.factory import open_transport

log = logging.getLogger("pipeline.state")


class StateCollector(Collector):
    """Prometheus gauges of the pipeline's stored state, cached for ``interval`` seconds.

    ``queues`` returns the Dramatiq queue names to measure (the relay passes its
    subscriptions' queues and the publishing queue); their series exist at 0 from the
    first scrape, as do the ledger's series of the ``consumers`` it names. Thread-safe:
    concurrent scrapes share one refresh.
    """

    def __init__(
        self,
        settings: Settings,
        queues: Callable[[], Iterable[str]],
        interval: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        consumers: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self.settings = settings
        self.store = StateStore(settings.schema_name)
        self.queues = queues
        self.consumers = consumers
        self.interval = settings.state_metrics_interval if interval is None else interval
        self.stale_after = 3 * self.interval + 15
        self.clock = clock
        self.refreshes = 0
        self._io = threading.RLock()  # one refresh at a time; owns the connections
        self._lock = threading.Lock()  # the values served; never held across I/O
        self._background = False
        self._refreshed_at: float | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._transport: Transport | None = None
        self._database: DatabaseState | None = None
        self._queues: dict[str, QueueDepth] | None = None
        self._duration = 0.0
        self._last_success = 0.0

    # -- prometheus_client protocol ------------------------------------------------------------
    def describe(self) -> Iterable[GaugeMetricFamily]:
        """Names only, so registering does not query anything."""
        return list(self._families())

    def collect(self) -> Iterable[GaugeMetricFamily]:
        if not self._background:
            with self._io:
                now = self.clock()
                if self._refreshed_at is None or now - self._refreshed_at >= self.interval:
                    self.refresh()
        with self._lock:
            return list(self._families(filled=True))

    def close(self) -> None:
        if not self._io.acquire(timeout=5):  # a refresh is stuck on a server: leave it
            return
        try:
            self._close_database()
            if self._transport is not None:
                self._transport.close()
                self._transport = None
        finally:
            self._io.release()

    # -- refresh -------------------------------------------------------------------------------
    def run_in_background(self) -> None:
        """From now on only :meth:`refresh` (a :class:`~.refresher.StateRefresher`) reads the
        sources; scrapes serve the values of the last refresh."""
        self._background = True

    def refresh(self) -> None:
        """Read both sources now, then swap in the new values."""
        with self._io:
            started = time.perf_counter()
            database = self._read_database()
            queues = self._read_queues()
            duration = time.perf_counter() - started
            with self._lock:
                self.refreshes += 1
                self._database, self._queues, self._duration = database, queues, duration
                self._refreshed_at = self.clock()
                if database is not None and queues is not None:
                    self._last_success = time.time()

    def _read_database(self) -> DatabaseState | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.settings, autocommit=True, connect_timeout=5)
                self._conn.execute("SET statement_timeout = '5s'")
            return self.store.snapshot(self._conn, redelivery_horizon(self.settings))
        except (psycopg.Error, ServiceUnavailableError, MigrationError) as exc:
            log.warning("state metrics: Postgres unreadable", extra={"error_class": _name(exc)})
            self._close_database()
            return None

    def _read_queues(self) -> dict[str, QueueDepth] | None:
        try:
            if self._transport is None:
                self._transport = open_transport(self.settings, middleware=[], timeout=2.0)
            return self._transport.queue_depths(self.queues())
        except ServiceUnavailableError as exc:
            cause = exc.__cause__ or exc
            log.warning("state metrics: broker unreadable", extra={"error_class": _name(cause)})
            return None

    def _close_database(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    # -- families ------------------------------------------------------------------------------
    def _families(self, filled: bool = False) -> Iterator[GaugeMetricFamily]:
        refreshed = filled and self._refreshed_at is not None
        fresh = refreshed and self.clock() - (self._refreshed_at or 0.0) <= self.stale_after
        database = self._database if fresh else None
        queues = self._queues if fresh else None
        success = GaugeMetricFamily(
            "pipeline_state_metrics_last_success_timestamp_seconds",
            "Unix time of the last state refresh that read every source (0: none yet).",
        )
        up = GaugeMetricFamily(
            "pipeline_state_up",
            "1 if the last state refresh could read the source (postgres; redis: the message "
            "broker, Redis or RabbitMQ, which the transport label names).",
            labels=["source", "transport"],
        )
        duration = GaugeMetricFamily(
            "pipeline_state_refresh_duration_seconds",
            "Time the last state refresh took (one SQL statement, one broker round trip).",
        )
        backlog = GaugeMetricFamily(
            "pipeline_outbox_backlog",
            "Outbox events not yet sent, by status (pending, publishing).",
            labels=["status"],
        )
        oldest = GaugeMetricFamily(
            "pipeline_outbox_oldest_pending_age_seconds",
            "Age of the oldest outbox event not yet sent (0 when none).",
        )
        dead = GaugeMetricFamily(
            "pipeline_dead_letters_waiting",
            "Dead letters not yet replayed, by stage (publish, consume).",
            labels=["stage"],
        )
        depth = GaugeMetricFamily(
            "pipeline_queue_depth",
            "Dramatiq messages waiting on a queue (each carries a run of events).",
            labels=["queue"],
        )
        dlq = GaugeMetricFamily(
            "pipeline_dead_letter_queue_depth",
            "Messages in Dramatiq's dead-letter set of a queue.",
            labels=["queue"],
        )
        owed = GaugeMetricFamily(
            "pipeline_deliveries_owed",
            "Deliveries to a consumer with no outcome past the redelivery horizon "
            "(the relay's ledger sweep sends them again).",
            labels=["consumer"],
        )
        held = GaugeMetricFamily(
            "pipeline_ordered_keys_held",
            "Ordering keys whose later events wait behind a delivery owed to the consumer.",
            labels=["consumer"],
        )
        if filled:
            success.add_metric([], self._last_success)
        if refreshed:
            transport = self.settings.transport_name
            up.add_metric(["postgres", transport], 1.0 if database is not None else 0.0)
            up.add_metric(["redis", transport], 1.0 if queues is not None else 0.0)
            duration.add_metric([], self._duration)
        if database is not None:
            for status, count in database.backlog.items():
                backlog.add_metric([status], count)
            oldest.add_metric([], database.oldest_pending_age_seconds)
            for stage, count in database.dead_letters.items():
                dead.add_metric([stage], count)
            for consumer in sorted({*self.consumers(), *database.owed}):
                owed.add_metric([consumer], database.owed.get(consumer, 0))
                held.add_metric([consumer], database.keys_held.get(consumer, 0))
        if queues is not None:
            for name, value in queues.items():
                depth.add_metric([name], value.ready)
                depth.add_metric([delay_queue_name(name)], value.delayed)
                dlq.add_metric([name], value.dead)
        yield from (up, success, duration, backlog, oldest, dead, depth, dlq, owed, held)


def _name(exc: BaseException) -> str:
    return type(exc).__name__
