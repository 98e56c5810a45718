"""The load of a demo or drill run: threads that place orders at a rate, and how they stop.

The order placing itself differs (the demo's shop, the drill's producer that survives
connection failures); the pacing, the stop and the error a thread hands back to the main
thread are the same, and live here.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import Engine

from pipeline.tools.harness.sql import WorkflowQueries


def wait_turn(started: float, index: int, rate: float, stop: threading.Event | None = None) -> bool:
    """Sleep until item ``index`` is due at ``rate`` per second from ``started`` (monotonic);
    False when ``stop`` was set meanwhile. A rate of 0 means as fast as possible."""
    if rate > 0:
        delay = started + index / rate - time.monotonic()
        if delay > 0:
            if stop is None:
                time.sleep(delay)
            elif stop.wait(delay):
                return False
    return stop is None or not stop.is_set()


class LoadThread(threading.Thread):
    """A daemon thread that runs :meth:`work` once against the run's database; the main
    thread reads :attr:`error` (reported as one line) and sets :attr:`stop` to end it early."""

    def __init__(self, name: str, engine: Engine, queries: WorkflowQueries, rate: float) -> None:
        super().__init__(name=name, daemon=True)
        self.engine = engine
        self.queries = queries
        self.rate = rate
        self.stop = threading.Event()
        self.placed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.work()
        except Exception as exc:  # reported by the main thread as one line
            self.error = exc

    def work(self) -> None:
        raise NotImplementedError
