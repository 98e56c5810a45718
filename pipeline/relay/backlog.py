"""The relay's backlog warning: a gauge and a log line while too much is unsent.

Every few seconds the relay counts unsent events (pending or publishing) no further
than ``PIPELINE_BACKLOG_WARN`` + 1 (a bounded scan of the unsent rows' index). Above
the threshold ``pipeline_backlog_over_warning`` is 1 and a warning is logged at most
once a minute; producers pay nothing for it. The hard limit
(``PIPELINE_BACKLOG_LIMIT``) is enforced by the producer itself (:mod:`pipeline.outbox`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.stores.outbox import OutboxStore
from pipeline.observability import metrics

log = logging.getLogger("pipeline.relay")

CHECK_INTERVAL = 5.0
"""Seconds between counts."""

LOG_INTERVAL = 60.0
"""Seconds between two warnings while the backlog stays above the threshold."""


class BacklogMonitor:
    """Call :meth:`maybe_check` from the relay's loop; it counts when one is due."""

    def __init__(self, settings: Settings, check_interval: float = CHECK_INTERVAL) -> None:
        self.threshold = settings.backlog_warn
        self.check_interval = check_interval
        self.store = OutboxStore(settings.schema_name)
        self.over = False
        self._next_check = 0.0
        self._last_log = float("-inf")

    def maybe_check(self, conn: psycopg.Connection[Any]) -> None:
        if not self.threshold or time.monotonic() < self._next_check:
            return
        self._next_check = time.monotonic() + self.check_interval
        self.record(self.store.count_backlog(conn, self.threshold + 1))

    def record(self, unsent: int) -> None:
        """Set the gauge and log for a count (at most ``threshold + 1``)."""
        over = unsent > self.threshold
        metrics.backlog_over_warning.set(1 if over else 0)
        now = time.monotonic()
        if over and now - self._last_log >= LOG_INTERVAL:
            self._last_log = now
            log.warning(
                "outbox backlog above PIPELINE_BACKLOG_WARN: events are produced faster than "
                "they are published",
                extra={"backlog_warn": self.threshold},
            )
        elif self.over and not over:
            self._last_log = float("-inf")
            log.info("outbox backlog back under PIPELINE_BACKLOG_WARN")
        self.over = over
