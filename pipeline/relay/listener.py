"""The relay's LISTEN connection: wake on NOTIFY, survive dropped connections.

A dedicated autocommit connection (never through a transaction-pooling PgBouncer)
waits for notifications with a timeout, runs a health query while idle, and on any
connection error reconnects with capped exponential backoff. Every (re)connect
wakes the relay with source ``reconnect``, which triggers a full catch-up sweep for
whatever was committed while nobody listened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from pipeline.backoff import Backoff
from pipeline.db.connect import describe_server, driver_reason
from pipeline.observability import metrics

log = logging.getLogger("pipeline.relay.listener")
HEALTH_CHECK_INTERVAL = 5.0


class Listener(threading.Thread):
    """Calls ``wake(source)`` on each notification and after each (re)connect."""

    def __init__(
        self,
        url: str,
        channel: str,
        wake: Callable[[str], None],
        stop: threading.Event,
        backoff_max: float = 10.0,
    ) -> None:
        super().__init__(name="pipeline-listener", daemon=True)
        self.url = url
        self.channel = channel
        self.wake = wake
        self.stop_event = stop
        self.backoff_max = backoff_max
        self.connected = threading.Event()
        self.connections = 0
        self._conn: psycopg.Connection[Any] | None = None

    def run(self) -> None:
        backoff = Backoff(0.1, self.backoff_max)
        while not self.stop_event.is_set():
            try:
                self._listen(backoff)
            except psycopg.Error as exc:
                delay = backoff.next_delay()
                self._lost(exc, delay)
                self.stop_event.wait(delay)

    def _listen(self, backoff: Backoff) -> None:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        if not conn.autocommit:  # pragma: no cover - guarded for custom connection factories
            raise RuntimeError("LISTEN needs an autocommit connection")
        self._conn = conn
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            self.connections += 1
            if self.connections > 1:
                metrics.relay_listener_reconnects.inc()
                log.warning("LISTEN connection re-established", extra={"channel": self.channel})
            self.connected.set()
            backoff.reset()
            metrics.relay_listener_connected.set(1)
            self.wake("reconnect")
            last_check = time.monotonic()
            while not self.stop_event.is_set():
                for _ in conn.notifies(timeout=0.5, stop_after=1):
                    self.wake("notify")
                if time.monotonic() - last_check > HEALTH_CHECK_INTERVAL:
                    conn.execute("SELECT 1")
                    last_check = time.monotonic()
        finally:
            self._conn = None
            self.connected.clear()
            metrics.relay_listener_connected.set(0)
            conn.close()

    def _lost(self, exc: BaseException, delay: float) -> None:
        if not self.stop_event.is_set():
            log.warning(
                f"LISTEN connection to Postgres at {describe_server(self.url)} lost: "
                f"{driver_reason(exc, self.url)}; next try in {delay:.1f}s",
                extra={"channel": self.channel, "error_class": type(exc).__name__},
            )

    def backend_pid(self) -> int | None:
        """The server process id of the LISTEN connection (tests terminate it)."""
        conn = self._conn
        return conn.info.backend_pid if conn is not None else None
