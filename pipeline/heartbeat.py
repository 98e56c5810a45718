"""A worker process's heartbeat in Postgres, refreshed while it is idle.

The broker's own liveness marks cannot tell workers apart (on Redis, Dramatiq's
heartbeats are written by every broker client, the relay's publisher included; RabbitMQ
has none an operator can read), so each worker process keeps a row of its own in
``worker_state``, the way a relay keeps its row in ``relay_state``
(:mod:`pipeline.db.stores.heartbeats`): refreshed every ``HEARTBEAT_SECONDS`` by a
thread, busy while a message is in hand, removed when the process stops cleanly. A
paused or stuck process stops refreshing (stale), a killed one leaves its row (gone).
Each beat also measures the host's clock against the database's (``clock_offset``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any

import psycopg
from dramatiq.middleware import Middleware

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.stores.heartbeats import HEARTBEAT_SECONDS, HeartbeatStore
from pipeline.errors import PipelineError

log = logging.getLogger("pipeline.worker")


class WorkerHeartbeat(Middleware):
    """Dramatiq middleware: this worker process's row in ``worker_state``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = HeartbeatStore(settings, "worker")
        self.worker_id = ""  # named in the worker process, after Dramatiq forked it
        self._in_hand = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._failing = False
        self.clock_offset: float | None = None  # this host's clock minus the database's

    # -- Dramatiq hooks ---------------------------------------------------------------------
    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)
        self._thread.start()

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_SECONDS + 5)
        try:
            self._forget()
        finally:
            self._close()

    def before_process_message(self, broker: Any, message: Any) -> None:
        with self._lock:
            self._in_hand += 1

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        with self._lock:
            self._in_hand = max(0, self._in_hand - 1)

    after_skip_message = after_process_message

    # -- the thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._beat()
            self._stop.wait(HEARTBEAT_SECONDS)

    def _beat(self) -> None:
        """One refresh; a failure is logged once per outage and retried on the next beat."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.settings, autocommit=True, connect_timeout=5)
            with self._lock:
                busy = self._in_hand > 0
            self.clock_offset = self.store.heartbeat(
                self._conn,
                self.worker_id,
                busy,
                socket.gethostname(),
                os.getpid(),
                self.clock_offset,
            )
        except (psycopg.Error, PipelineError) as exc:
            self._close()
            if not self._failing:
                log.warning(
                    "worker heartbeat not written; retrying every few seconds",
                    extra={"error_class": type(exc).__name__},
                )
            self._failing = True
            return
        if self._failing:
            log.info("worker heartbeat written again")
        self._failing = False

    def _forget(self) -> None:
        try:
            if self._conn is None or self._conn.closed:
                self._conn = connect(self.settings, autocommit=True, connect_timeout=5)
            self.store.forget(self._conn, self.worker_id)
        except (psycopg.Error, PipelineError):  # best effort: the row turns stale, then gone
            log.debug("could not remove worker_state row", exc_info=True)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
