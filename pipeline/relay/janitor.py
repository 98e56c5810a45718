"""The relay's janitor: a retention pass every ``PIPELINE_PRUNE_INTERVAL_SECONDS``.

It runs on a thread and a connection of its own, so a long pass (catching up on a
million rows) never holds up publishing; the pass itself is
:class:`pipeline.db.retention.Pruner` (short batches, lock timeouts, one pass at a time
across relays). The first pass starts one interval after the relay.

Inbox keys are never pruned younger than the longest retry horizon of the consumers
this relay knows: the relay refuses to start with a shorter
``PIPELINE_INBOX_RETENTION_SECONDS`` anyway, and the janitor keeps them longer should it
be built some other way.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol, runtime_checkable

import psycopg

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.retention import TABLES, Pruner, PruneResult, RetentionPolicy
from pipeline.errors import ServiceUnavailableError
from pipeline.observability import metrics
from pipeline.registry import Registry

log = logging.getLogger("pipeline.relay.janitor")


@runtime_checkable
class _RetryHorizon(Protocol):
    """A consumer definition that can tell how late a copy of its events may come."""

    def retry_horizon(self, settings: Settings) -> float: ...


def longest_retry_horizon(settings: Settings, registry: Registry) -> float:
    """Seconds: the latest a copy of an event may reach any consumer in ``registry``."""
    horizons = [
        subscription.handler.retry_horizon(settings)
        for subscription in registry.all()
        if isinstance(subscription.handler, _RetryHorizon)
    ]
    return max([settings.redelivery_horizon_seconds, *horizons])


class Janitor:
    """Prunes on a daemon thread until ``stop`` is set."""

    def __init__(self, settings: Settings, registry: Registry, stop: threading.Event) -> None:
        self.settings = settings
        self.registry = registry
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

    def policy(self) -> RetentionPolicy:
        horizon = longest_retry_horizon(self.settings, self.registry)
        if horizon > self.settings.inbox_retention_seconds:
            log.error(
                "PIPELINE_INBOX_RETENTION_SECONDS is shorter than a consumer's retry horizon; "
                "inbox keys are kept for the horizon instead",
                extra={
                    "inbox_retention_seconds": self.settings.inbox_retention_seconds,
                    "retry_horizon_seconds": round(horizon),
                },
            )
        return RetentionPolicy.from_settings(self.settings, min_inbox_seconds=horizon)

    def run_once(self) -> PruneResult:
        """One pass now (on the janitor's connection); skipped if another holds the lock."""
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings, autocommit=True)
        pruner = Pruner(self.settings.schema_name, self.policy(), on_batch=_count)
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
