"""Gauges of the pipeline tables' size, so retention can be watched working.

Read from the catalog (``pg_class.reltuples``, ``pg_total_relation_size``): no table is
scanned, and the figures are cached for ``PIPELINE_STATE_METRICS_INTERVAL`` seconds
however often they are scraped. The relay serves them with its state gauges, refreshed on
the same background thread (:mod:`.refresher`); figures older than ``3 * interval + 15``
seconds (a refresh stuck on a server that stopped answering) are left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import psycopg
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.retention import TABLES
from pipeline.db.stores.state import StateStore, TableSize
from pipeline.errors import ServiceUnavailableError

log = logging.getLogger("pipeline.state")


class TableSizeCollector(Collector):
    """``pipeline_table_rows_estimate`` and ``pipeline_table_size_bytes`` by table."""

    def __init__(self, settings: Settings, interval: float | None = None) -> None:
        self.settings = settings
        self.store = StateStore(settings.schema_name)
        self.interval = settings.state_metrics_interval if interval is None else interval
        self.stale_after = 3 * self.interval + 15
        self._io = threading.RLock()  # one read at a time; owns the connection
        self._lock = threading.Lock()  # the figures served; never held across I/O
        self._background = False
        self._conn: psycopg.Connection[Any] | None = None
        self._read_at: float | None = None
        self._sizes: list[TableSize] | None = None

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families(None))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        if not self._background:
            with self._io:
                if self._read_at is None or time.monotonic() - self._read_at >= self.interval:
                    self.refresh()
        with self._lock:
            fresh = (
                self._read_at is not None and time.monotonic() - self._read_at <= self.stale_after
            )
            return list(self._families(self._sizes if fresh else None))

    def run_in_background(self) -> None:
        """From now on only :meth:`refresh` reads the catalog; scrapes serve its figures."""
        self._background = True

    def refresh(self) -> None:
        with self._io:
            sizes = self._read()
            with self._lock:
                self._sizes, self._read_at = sizes, time.monotonic()

    def close(self) -> None:
        if not self._io.acquire(timeout=5):  # a read is stuck on a server: leave it
            return
        try:
            self._close()
        finally:
            self._io.release()

    def _read(self) -> list[TableSize] | None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.settings, autocommit=True, connect_timeout=5)
                self._conn.execute("SET statement_timeout = '5s'")
            return self.store.table_sizes(self._conn, TABLES)
        except (psycopg.Error, ServiceUnavailableError) as exc:
            log.warning(
                "table size metrics: Postgres unreadable", extra={"error_class": _name(exc)}
            )
            self._close()
            return None

    def _close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.close()
            finally:
                self._conn = None

    @staticmethod
    def _families(sizes: list[TableSize] | None) -> Iterator[GaugeMetricFamily]:
        rows = GaugeMetricFamily(
            "pipeline_table_rows_estimate",
            "Rows in a pipeline table, as the planner estimates them (pg_class.reltuples).",
            labels=["table"],
        )
        size = GaugeMetricFamily(
            "pipeline_table_size_bytes",
            "Disk space of a pipeline table with its indexes and TOAST.",
            labels=["table"],
        )
        for name, estimate, total in sizes or ():
            rows.add_metric([name], estimate)
            size.add_metric([name], total)
        yield from (rows, size)


def _name(exc: BaseException) -> str:
    return type(exc).__name__
