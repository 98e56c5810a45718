"""Refresh the relay's state collectors on a thread of their own, off the scrape path.

A Prometheus scrape must never wait on Postgres or Redis: a scrape that outlasts the
scraper's timeout fails as a whole, and the relay then looks down while it is the
database that does not answer. :class:`StateRefresher` reads every collector's sources
every ``interval`` seconds; scrapes serve the values of the last refresh. A refresh
that cannot finish (a database that stopped answering) holds only this thread: the
collectors report their sources down once their values are too old to trust, and
``pipeline_state_metrics_last_success_timestamp_seconds`` stops advancing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger("pipeline.state")


class Refreshable(Protocol):
    def refresh(self) -> None: ...

    def run_in_background(self) -> None: ...


class StateRefresher(threading.Thread):
    """Calls ``refresh()`` on each collector now and then every ``interval`` seconds."""

    def __init__(self, collectors: Sequence[Refreshable], interval: float) -> None:
        super().__init__(name="pipeline-state-refresher", daemon=True)
        self.collectors = list(collectors)
        self.interval = interval
        self.stop = threading.Event()
        self.first_pass = threading.Event()  # set once every collector was refreshed once
        for collector in self.collectors:
            collector.run_in_background()

    def start_and_wait(self, timeout: float = 5.0) -> None:
        """Start, and give the first refresh up to ``timeout`` seconds, so that the first
        scrape usually finds values; a server that does not answer delays nothing longer."""
        self.start()
        self.first_pass.wait(timeout)

    def run(self) -> None:
        while not self.stop.is_set():
            for collector in self.collectors:
                if self.stop.is_set():
                    return
                try:
                    collector.refresh()
                except Exception:  # a bug in one collector must not end the others' refreshes
                    log.exception("state metrics refresh failed")
            self.first_pass.set()
            self.stop.wait(self.interval)

    def close(self, timeout: float = 5.0) -> None:
        """Stop refreshing; a refresh stuck on an unanswering server is left behind (daemon)."""
        self.stop.set()
        if self.is_alive():
            self.join(timeout)
