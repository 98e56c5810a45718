"""The relay's janitor: a retention pass every ``PIPELINE_PRUNE_INTERVAL_SECONDS``.

It runs on a thread and a connection of its own, so a long pass (catching up on a
million rows) never holds up publishing; the pass itself is
:class:`pipeline.db.retention.Pruner` (short batches, lock timeouts, one pass at a time
across relays). The first pass starts one interval after the relay.

A janitor is never built for an inbox retention shorter than the longest retry horizon
of the consumers this relay knows (:mod:`pipeline.policy`): it refuses, as workers and
``pipeline prune`` do, however the relay around it was put together.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.retention import TABLES, Pruner, PruneResult, RetentionPolicy
from pipeline.errors import ServiceUnavailableError
from pipeline.observability import metrics
from pipeline.policy import require_retention
from pipeline.registry import Registry

log = logging.getLogger("pipeline.relay.janitor")


class Janitor:
    """Prunes on a daemon thread until ``stop`` is set."""

    def __init__(self, settings: Settings, registry: Registry, stop: threading.Event) -> None:
        require_retention(settings, registry.policies(settings))
        self.settings = settings
        self.stop = stop
        self.passes = 0
        self.last: PruneResult | None = None
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        for table in TABLES:  # the series exist from the first scrape
            metrics.pruned_rows.labels(table)

    @property
    def enabled(self) -> bool:
        return self.settings.prune_interval_seconds > 0

    def start(self) -> None:
        if not self.enabled:
            return
        self._thread = threading.Thread(target=self._loop, name="pipeline-janitor", daemon=True)
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        interval = self.settings.prune_interval_seconds
        try:
            while not self.stop.wait(interval):
                try:
                    self.run_once()
                except (psycopg.Error, ServiceUnavailableError) as exc:
                    self._close()
                    log.warning(
                        "prune pass failed; retrying next interval",
                        extra={
                            "error_class": type(exc).__name__,
                            "error": str(exc).splitlines()[0] if str(exc) else "",
                        },
                    )
        finally:
            self._close()

    def run_once(self) -> PruneResult:
        """One pass now (on the janitor's connection); skipped if another holds the lock."""
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings, autocommit=True)
        policy = RetentionPolicy.from_settings(self.settings)
        pruner = Pruner(self.settings.schema_name, policy, on_batch=_count)
        result = pruner.run(self._conn, stop=self.stop)
        self.passes += 1
        self.last = result
        if result.deleted:
            log.info(
                "pruned rows past their retention",
                extra={t.table: t.deleted for t in result.tables if t.deleted},
            )
        return result

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _count(table: str, deleted: int) -> None:
    metrics.pruned_rows.labels(table).inc(deleted)
