"""A worker process's view of its broker being down, shared by all its consumers.

The first consumer to fail in a backoff step logs one line (the reason and the wait) and
sets when the next try is due; consumers stay off the broker until then. The first fetch
that succeeds again logs the recovery and resets the waits. Both transports use it, with
the broker's name in their lines.
"""

from __future__ import annotations

import logging
import threading
import time

from pipeline.backoff import Backoff

log = logging.getLogger("pipeline.transport.broker")


class BrokerOutage:
    """One log line per backoff step for the whole process (see the module docstring)."""

    def __init__(self, name: str, first: float = 0.5, cap: float = 10.0) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._backoff = Backoff(first, cap)
        self._next_try = 0.0

    def failed(self, exc: BaseException) -> float:
        """Record a failure; the seconds to wait before the next try."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_try:
                return self._next_try - now  # another consumer already reported this step
            delay = self._backoff.next_delay()
            self._next_try = now + delay
        log.warning(
            f"{self.name} unreachable: {type(exc).__name__}: {exc}; next try in {delay:.1f}s",
            extra={"error_class": type(exc).__name__, "retry_in": delay},
        )
        return delay

    def pause(self) -> float:
        """Seconds until the next try is due (0 when the broker is not known to be down)."""
        return max(0.0, self._next_try - time.monotonic()) if self._backoff.failures else 0.0

    def succeeded(self) -> None:
        if not self._backoff.failures:
            return
        with self._lock:
            recovered = self._backoff.reset()
            self._next_try = 0.0
        if recovered:
            log.info(f"{self.name} reachable again: consuming")
