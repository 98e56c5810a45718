"""The relay process: wake on NOTIFY (or poll), then publish what is due.

Loop states:

* **idle** — blocks until a notification, a reconnect, or the adaptive poll timer
  (fast after it found work, doubling up to ``poll_interval_max`` when idle);
* **busy** — while events arrive at ``busy_poll_rate`` a second or more (or claims are
  still full after a second of draining; :class:`BusyRule`) it polls every
  ``poll_interval_busy`` instead and advertises itself as busy in ``relay_state``, so
  producers skip NOTIFY and its database-wide commit lock; at lower rates a NOTIFY wakes
  it sooner than a poll would, for less work;
* **hand-off** — when the rate stays under half of ``busy_poll_rate`` for five windows
  in a row it clears the flag, then keeps polling until every transaction that could
  have seen the flag set has ended
  (snapshot ``xmin`` passes the ``xmax`` taken after the flip), so no event committed
  during the switch waits for a poll; a NOTIFY cuts each of those polls' waits short.

Publishing is done inline (the fewest hops on the idle path) and, when a batch comes
back full, also by up to ``publishers_in_flight`` Dramatiq publishing actors that
drain the backlog in the worker processes (``mode="auto"``). ``mode="workers"``
only dispatches actors; ``mode="inline"`` never does.

An idle relay refreshes its heartbeat in ``relay_state`` every
``IDLE_HEARTBEAT_INTERVAL`` seconds (a busy one every second), so ``pipeline status``
tells a live idle relay from a stale or gone one; each heartbeat also measures this
host's clock against the database's (``pipeline_relay_clock_offset_seconds``). Between
cycles the loop also commits the canary, runs the delivery ledger's sweep
(``ledger.py``; at once after an outage, so a broker that came back empty is noticed
without waiting for the next sweep) and counts the backlog against its warning threshold
(``backlog.py``);
the janitor (``janitor.py``) prunes on a thread of its own.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

import psycopg

from pipeline.backoff import Backoff
from pipeline.config import Settings
from pipeline.db.connect import (
    SCHEMA_MISSING,
    connect,
    describe_server,
    driver_reason,
    schema_missing_message,
)
from pipeline.db.migrate import notify_channel
from pipeline.db.stores.heartbeats import HEARTBEAT_SECONDS, HeartbeatStore
from pipeline.db.stores.outbox import OutboxStore
from pipeline.errors import ServiceUnavailableError
from pipeline.observability import metrics
from pipeline.registry import Registry
from pipeline.relay.backlog import BacklogMonitor
from pipeline.relay.canary import emit_canary
from pipeline.relay.drain import Drainer
from pipeline.relay.janitor import Janitor
from pipeline.relay.ledger import DeliveryLedger
from pipeline.relay.listener import Listener
from pipeline.transport.publisher import Publisher, PublisherUnavailable

log = logging.getLogger("pipeline.relay")
Mode = Literal["auto", "inline", "workers"]
HEARTBEAT_INTERVAL = 1.0  # a busy relay's heartbeat (producers skip NOTIFY while it is fresh)
IDLE_HEARTBEAT_INTERVAL = HEARTBEAT_SECONDS  # an idle relay's: it is alive, with no work
HANDOFF_LIMIT = 2.0
FIRST_RETRY = 0.1
# A statement that gave up waiting (``lock_timeout``, ``statement_timeout``): another
# session held what it needed too long (a stopped process). Retried on the same connection.
WAIT_TIMEOUTS = (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)
# Failures the relay waits out (logging each backoff step) instead of exiting: Postgres or
# the broker down, restarting, failing over, or the schema not installed yet.
OUTAGES = (
    psycopg.OperationalError,
    psycopg.errors.ReadOnlySqlTransaction,
    *SCHEMA_MISSING,
    ServiceUnavailableError,
    PublisherUnavailable,
)


class Waker:
    """A wake-up signal that remembers why it was raised (notify, reconnect)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._source: str | None = None

    def __call__(self, source: str) -> None:
        with self._cond:
            if self._source != "reconnect":  # a reconnect's catch-up sweep wins
                self._source = source
            self._cond.notify_all()

    def wait(self, timeout: float) -> str:
        return self.wait_for(timeout) or "poll"

    def wait_for(self, timeout: float) -> str | None:
        """The source of the wake-up, or None if ``timeout`` passed without one."""
        with self._cond:
            if self._source is None:
                self._cond.wait(timeout)
            source, self._source = self._source, None
        return source


class BusyRule:
    """When polling beats NOTIFY: events arriving at ``busy_rate`` a second or more.

    NOTIFY makes each producer's commit take a database-wide lock and hold it through the
    commit's flush, so at high rates it serialises producers' commits; and on NOTIFY the
    relay publishes each transaction's events as they come, a Dramatiq message or two
    apiece, while a busy relay's poll every ``poll_interval_busy`` gathers several events
    per message, which is what keeps workers ahead at 1,000 events/s. Polling costs a claim
    per interval and adds up to an interval to every event's latency. The cut-over is
    therefore a rate: the rule counts the events its cycles found over windows of
    ``WINDOW`` seconds, makes the relay busy after ``HOT_WINDOWS`` windows in a row at
    ``busy_rate`` or more (so a sustained stream is taken up within a tenth of a second,
    while one large transaction, which NOTIFYs once, is not), and lets it go back to
    NOTIFY after ``CALM_WINDOWS`` windows in a row under half of that (hysteresis: a rate
    near the threshold, or one window's lull, does not flip it back and forth). A backlog
    (claims still full after a second of draining) makes it busy at once. Each relay
    counts only what it claimed itself. The rule is unit-agnostic: ``now`` and
    ``WINDOW`` in one unit, ``busy_rate`` in events per that unit.
    """

    WINDOW = 0.05
    HOT_WINDOWS = 2
    CALM_WINDOWS = 5

    def __init__(self, busy_rate: float, now: float) -> None:
        self.busy_rate = busy_rate
        self._window_start = now
        self._window_found = 0
        self._hot = 0  # consecutive windows at the rate or more
        self._calm = 0  # consecutive windows under half the rate
        self.rate = 0.0  # events per unit of time found over the last complete window

    def busy_after(self, now: float, found: int, backlog: bool, busy: bool) -> bool:
        """Whether the relay should be (or stay) busy after a cycle that found ``found``."""
        self._window_found += found
        elapsed = now - self._window_start
        if elapsed >= self.WINDOW:
            self.rate = self._window_found / elapsed
            self._window_start, self._window_found = now, 0
            self._hot = self._hot + 1 if self.rate >= self.busy_rate else 0
            self._calm = self._calm + 1 if self.rate < self.busy_rate / 2 else 0
        if backlog:
            self._calm = 0
            return True
        if self._hot >= self.HOT_WINDOWS:
            return True
        return busy and self._calm < self.CALM_WINDOWS


class Relay:
    """Runs until ``stop`` is set; see the module docstring for the loop."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        publisher: Publisher,
        *,
        mode: Mode = "auto",
        listen: bool = True,
        dispatch: Callable[[], int] | None = None,
        relay_id: str | None = None,
    ) -> None:
        if mode != "inline" and dispatch is None:
            raise ValueError(f"mode {mode!r} needs a dispatch function for publishing actors")
        self.settings = settings
        self.registry = registry
        self.publisher = publisher
        self.mode = mode
        self.listen = listen
        self.dispatch = dispatch
        self.relay_id = relay_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.outbox = OutboxStore(settings.schema_name)
        self.relays = HeartbeatStore(settings, "relay")
        self.waker = Waker()
        self.stop = threading.Event()
        self.listener: Listener | None = None
        self.busy = False
        self.busy_spells = 0  # times the relay went busy
        self._last_heartbeat = 0.0
        self.clock_offset: float | None = None  # this host's clock minus the database's
        self._conn: psycopg.Connection[Any] | None = None
        self.cycles = 0
        self._next_canary = 0.0  # the first canary goes out at start-up
        self.ledger = DeliveryLedger(settings, registry, publisher)
        self._next_sweep = 0.0
        # When this relay noticed that the broker lost its messages (database time); the
        # next sweep it runs owes what was handed over before then, ignoring the horizon.
        self._forgotten_at: datetime | None = None
        self._backoff = Backoff(FIRST_RETRY, settings.reconnect_backoff_max)
        self.janitor = Janitor(settings, registry, self.stop)  # prunes on its own thread
        self.backlog = BacklogMonitor(settings)

    # -- lifecycle -------------------------------------------------------------------------
    def run(self) -> None:
        """Serve until :meth:`shutdown`; outages of Postgres or the broker are waited out.

        Each failed try logs one line with the reason and the wait before the next; the
        waits double up to ``reconnect_backoff_max`` and start again small once a cycle
        succeeds.
        """
        if self.listen:
            self.listener = Listener(
                self.settings.require_database_url(),
                notify_channel(self.settings.schema_name),
                self.waker,
                self.stop,
                self.settings.reconnect_backoff_max,
            )
            self.listener.start()
        self.janitor.start()
        log.info("relay started", extra={"relay_id": self.relay_id, "mode": self.mode})
        try:
            while not self.stop.is_set():
                try:
                    self._serve()
                except WAIT_TIMEOUTS as exc:
                    delay = self._backoff.next_delay()
                    log.warning(
                        f"relay waiting: a statement gave up waiting ({self._timed_out(exc)}); "
                        f"retrying in {delay:.1f}s",
                        extra={"error_class": type(exc).__name__, "retry_in": delay},
                    )
                    self.stop.wait(delay)
                except OUTAGES as exc:
                    if not isinstance(exc, PublisherUnavailable):
                        self._close_connection()
                    delay = self._backoff.next_delay()
                    log.warning(
                        f"relay waiting: {self._outage(exc)}; next try in {delay:.1f}s",
                        extra={"error_class": type(exc).__name__, "retry_in": delay},
                    )
                    self.stop.wait(delay)
        finally:
            # A fatal error (a revoked grant) leaves without shutdown(): stop the listener
            # and janitor too, or each join below waits its full timeout.
            self.stop.set()
            self._forget()
            self._close_connection()
            if self.listener is not None:
                self.listener.join(timeout=5)
            self.janitor.join(timeout=5)
            log.info("relay stopped", extra={"relay_id": self.relay_id})

    @staticmethod
    def _timed_out(exc: BaseException) -> str:
        """Which bound a statement hit, in words (``lock_timeout`` or ``statement_timeout``)."""
        if isinstance(exc, psycopg.errors.LockNotAvailable):
            return "a lock held by another session past PIPELINE_LOCK_TIMEOUT_MS"
        return "canceled, e.g. past PIPELINE_STATEMENT_TIMEOUT_MS"

    def _outage(self, exc: BaseException) -> str:
        """Why the relay cannot work, in one line without secrets."""
        if isinstance(exc, PublisherUnavailable | ServiceUnavailableError):
            return str(exc)
        if isinstance(exc, SCHEMA_MISSING):
            return schema_missing_message(self.settings.schema_name)
        url = self.settings.require_database_url()
        return f"lost Postgres at {describe_server(url)}: {driver_reason(exc, url)}"

    def shutdown(self) -> None:
        self.stop.set()
        self.waker("shutdown")

    # -- the loop --------------------------------------------------------------------------
    def _serve(self) -> None:
        conn = self._connection()
        drainer = Drainer(self.settings, self.publisher, self.registry, self.relay_id, conn)
        interval = self.settings.poll_interval_min
        rule = BusyRule(self.settings.busy_poll_rate, time.monotonic())
        self._set_busy(conn, False, force=True)
        while not self.stop.is_set():
            timeout = self.settings.poll_interval_busy if self.busy else interval
            source = self._wait(conn, timeout)
            if self.stop.is_set():
                break
            if self.settings.canary_interval and time.monotonic() >= self._next_canary:
                emit_canary(conn, self.settings.schema_name)
                self._next_canary = time.monotonic() + self.settings.canary_interval
            if time.monotonic() >= self._next_sweep:
                self._sweep_ledger(conn)
            self.backlog.maybe_check(conn)
            metrics.relay_wakeups.labels(source).inc()
            self.cycles += 1
            found, backlog = self._cycle(drainer)
            if self._backoff.reset():
                log.info("relay recovered: publishing again", extra={"relay_id": self.relay_id})
                # A broker that came back may have come back empty: ask now, not at the
                # next sweep, so what it forgot is sent again without waiting.
                self._next_sweep = 0.0
            if rule.busy_after(time.monotonic(), found, backlog, self.busy):
                self._set_busy(conn, True)  # also refreshes a busy relay's heartbeat
            elif self.busy:
                self._hand_off(conn, drainer)
            else:
                self._heartbeat(conn)
            if found:
                interval = self.settings.poll_interval_min
                if backlog and self.mode != "inline" and self.dispatch is not None:
                    self.dispatch()
                continue
            if self.busy:
                continue  # the rate still calls for polling: poll again
            if self.outbox.has_due_work(conn):
                interval = self.settings.poll_interval_min  # due but held back: look again soon
            else:
                interval = min(interval * 2, self.settings.poll_interval_max)

    def _sweep_ledger(self, conn: psycopg.Connection[Any]) -> None:
        """Send again what consumers are owed past the horizon (``ledger.py``).

        Postgres and broker outages propagate (the loop retries them); any other database
        error is logged and the sweep tried again next interval, never stopping publishing.
        """
        self._next_sweep = time.monotonic() + self.settings.reconcile_interval_seconds
        noticed = self.ledger.store.clock(conn)  # before the marker is set again
        if self.publisher.forgot():
            self._forgotten_at = noticed
            if self.cycles:
                metrics.broker_memory_lost.inc()
                log.warning(
                    "the broker lost its messages (its memory marker is gone): sending what "
                    "consumers are owed now, not after the redelivery horizon",
                    extra={"relay_id": self.relay_id},
                )
            else:  # at start: a new broker, or one that lost its messages while no relay ran
                log.info(
                    "the broker had no memory marker yet: sending what consumers are owed now",
                    extra={"relay_id": self.relay_id},
                )
        try:
            result = self.ledger.sweep(conn, forgotten_at=self._forgotten_at)
            if not result.skipped:
                self._forgotten_at = None  # another relay's sweep would not have known
        except psycopg.OperationalError:
            raise
        except psycopg.Error as exc:
            log.error(
                "ledger sweep failed; retrying next interval",
                extra={"error_class": type(exc).__name__, "error": str(exc).splitlines()[0]},
            )

    def _cycle(self, drainer: Drainer) -> tuple[int, bool]:
        """Publish what is due; returns (events found, whether a backlog remains)."""
        if self.mode == "workers":
            due = self.outbox.has_due_work(self._connection())
            if due and self.dispatch is not None:
                self.dispatch()
            return 0, False
        found = 0
        deadline = time.monotonic() + 1.0
        while not self.stop.is_set():
            result = drainer.run_batch()
            found += result.claimed
            if not result.full or time.monotonic() > deadline:
                return found, result.full
            if self.dispatch is not None and self.mode == "auto":
                self.dispatch()
        return found, False

    def _hand_off(self, conn: psycopg.Connection[Any], drainer: Drainer) -> None:
        """Clear the busy flag, then cover transactions that saw it set (module docstring)."""
        self._set_busy(conn, False)
        xmax = self.outbox.snapshot_xmax(conn)
        deadline = time.monotonic() + HANDOFF_LIMIT
        reconnected = False
        try:
            while not self.stop.is_set() and time.monotonic() < deadline:
                if self.outbox.horizon_passed(conn, xmax):
                    break
                drainer.run_batch()
                # Producers NOTIFY again already: one that does ends this wait at once.
                source = self.waker.wait(self.settings.poll_interval_busy)
                if self.stop.is_set():
                    break
                metrics.relay_wakeups.labels(source).inc()
                reconnected |= source == "reconnect"
            if drainer.run_batch().full:  # more is due: the loop's next cycle takes it now
                self.waker("poll")
        finally:
            if reconnected:  # the LISTEN connection came back: its catch-up is still due
                self.waker("reconnect")

    def _wait(self, conn: psycopg.Connection[Any], timeout: float) -> str:
        """Wait up to ``timeout`` for a wake-up, refreshing the heartbeat while idle.

        The wait is cut into slices of ``IDLE_HEARTBEAT_INTERVAL``: a live relay that
        has nothing to do still says so every few seconds, so a stale heartbeat means a
        relay that stopped (or cannot reach Postgres), never an idle one.
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            source = self.waker.wait_for(max(0.0, min(remaining, IDLE_HEARTBEAT_INTERVAL)))
            if source is not None or self.stop.is_set() or remaining <= IDLE_HEARTBEAT_INTERVAL:
                return source or "poll"
            self._heartbeat(conn)

    # -- state -----------------------------------------------------------------------------
    def _heartbeat(self, conn: psycopg.Connection[Any]) -> None:
        """Refresh the heartbeat if it is ``IDLE_HEARTBEAT_INTERVAL`` old (flag unchanged)."""
        if time.monotonic() - self._last_heartbeat >= IDLE_HEARTBEAT_INTERVAL:
            self._set_busy(conn, self.busy, force=True)

    def _set_busy(self, conn: psycopg.Connection[Any], busy: bool, force: bool = False) -> None:
        now = time.monotonic()
        if not force and busy == self.busy and now - self._last_heartbeat < HEARTBEAT_INTERVAL:
            return
        self.clock_offset = self.relays.heartbeat(
            conn, self.relay_id, busy, socket.gethostname(), os.getpid(), self.clock_offset
        )
        metrics.relay_clock_offset.set(self.clock_offset)
        self.busy_spells += busy and not self.busy
        self.busy = busy
        metrics.relay_busy.set(1 if busy else 0)
        self._last_heartbeat = now

    def _forget(self) -> None:
        try:
            with connect(self.settings, autocommit=True) as conn:
                self.relays.forget(conn, self.relay_id)
        except Exception:  # best effort: a stale row expires after 5 s anyway
            log.debug("could not remove relay_state row", exc_info=True)

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.settings, autocommit=True)
        return self._conn

    def _close_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
