"""One publishing batch: claim due events, deliver them, record the outcome.

Shared by the relay (inline publishing) and the publishing actor, so both paths have
the same guarantees: a lease with a fencing token (a publisher whose lease expired
cannot overwrite a newer claim), an event marked sent only after the broker accepted
every copy, per-key order (a failed event holds back the rest of its key), and
retries with full-jitter backoff ending in a dead letter with the attempt history.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import psycopg

from pipeline.backoff import full_jitter
from pipeline.config import Settings
from pipeline.db.stores.outbox import (
    DeadEvent,
    ExpectedDelivery,
    OutboxStore,
    Retry,
    SentRow,
    Settlement,
)
from pipeline.envelope import OutboxEvent
from pipeline.errors import error_text
from pipeline.observability import metrics, tracing
from pipeline.registry import Registry, Subscription
from pipeline.transport.publisher import (
    Delivery,
    PermanentPublishError,
    Publisher,
    PublisherUnavailable,
)

log = logging.getLogger("pipeline.relay")


@dataclass
class BatchResult:
    claimed: int = 0
    sent: int = 0
    unrouted: int = 0
    retried: int = 0
    released: int = 0
    dead: int = 0
    full: bool = False  # the claim was cut by the batch size: more work is probably due


def plan_deliveries(
    events: Sequence[OutboxEvent], registry: Registry, max_events_per_message: int
) -> list[Delivery]:
    """Group events per consumer into messages; one key's run is never split across messages.

    Keeping a key's run in one message makes its delivery atomic per consumer, so no
    later event of a key can reach a consumer while an earlier one failed to. A run
    that failed before travels alone: a poison event then fails only its own key and
    never again takes unrelated events down with it.
    """
    per_consumer: dict[str, tuple[Subscription, list[OutboxEvent]]] = {}
    for event in events:
        for subscription in registry.routes_for(event.event_type):
            per_consumer.setdefault(subscription.consumer, (subscription, []))[1].append(event)
    return [
        delivery
        for subscription, routed in per_consumer.values()
        for delivery in pack_deliveries(subscription, routed, max_events_per_message)
    ]


def pack_deliveries(
    subscription: Subscription, events: Sequence[OutboxEvent], max_events_per_message: int
) -> list[Delivery]:
    """One consumer's events (in sequence order) as messages of whole key runs."""
    units: dict[object, list[OutboxEvent]] = {}
    for event in events:
        unit_key: object = event.ordering_key if event.ordering_key is not None else event.id
        units.setdefault(unit_key, []).append(event)
    deliveries: list[Delivery] = []
    current: list[OutboxEvent] = []
    for unit in units.values():
        if unit[0].attempts > 1:  # retried: isolate it
            deliveries.append(Delivery(subscription, unit))
            continue
        if current and len(current) + len(unit) > max_events_per_message:
            deliveries.append(Delivery(subscription, current))
            current = []
        current.extend(unit)
    if current:
        deliveries.append(Delivery(subscription, current))
    return deliveries


_WARNED_UNROUTED: set[str] = set()  # event types this process warned about sending to nobody


class Drainer:
    """Claims and publishes batches over one dedicated database connection."""

    def __init__(
        self,
        settings: Settings,
        publisher: Publisher,
        registry: Registry,
        owner: str,
        connection: psycopg.Connection[Any],
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.publisher = publisher
        self.registry = registry
        self.owner = owner
        self.conn = connection
        self.store = OutboxStore(settings.schema_name)
        self.rng = rng or random.Random()
        # What a batch waits on the broker, named by transport.
        self._broker_publish = metrics.broker_publish.labels(settings.transport_name)

    def claim(self, limit: int | None = None) -> tuple[int, list[OutboxEvent]]:
        """Lease up to ``limit`` due events; returns the fencing token and the events in order."""
        token = secrets.randbits(62)
        events = self.store.claim(
            self.conn,
            token=token,
            owner=self.owner,
            batch_size=limit or self.settings.batch_size,
            max_run=self.settings.max_events_per_message,
            lease_seconds=self.settings.lease_seconds,
        )
        events.sort(key=lambda e: e.seq)
        return token, events

    def run_batch(self, limit: int | None = None) -> BatchResult:
        """Claim, deliver and settle one batch."""
        token, events = self.claim(limit)
        result = BatchResult(
            claimed=len(events), full=len(events) >= (limit or self.settings.batch_size)
        )
        if not events:
            return result
        metrics.publish_batch_size.observe(len(events))
        deliveries = plan_deliveries(events, self.registry, self.settings.max_events_per_message)
        try:
            # Ordered consumers' inbox rows are committed before any copy can be consumed:
            # the relay and a worker never contend on one inbox row.
            self.store.expect(self.conn, self._expected_deliveries(events))
        except BaseException:
            self._release_quietly(events, token)
            raise
        try:
            failures = self._deliver(deliveries)
        except PublisherUnavailable as exc:
            with self.conn.transaction():
                self.store.release(self.conn, [e.id for e in events], token)
            for event in events:
                metrics.publish_failures.labels(event.event_type, type(exc).__name__).inc()
            raise
        self._settle(token, events, failures, result)
        return result

    def _deliver(self, deliveries: list[Delivery]) -> dict[uuid.UUID, BaseException]:
        failures: dict[uuid.UUID, BaseException] = {}
        with ExitStack() as spans:  # one send span per delivery, around the pipelined call
            sends = [
                spans.enter_context(tracing.send_span(d.subscription.queue, d.events))
                for d in deliveries
            ]
            started = time.perf_counter()
            outcomes = self.publisher.deliver(deliveries)
            self._broker_publish.observe(time.perf_counter() - started)
            for span, outcome in zip(sends, outcomes, strict=True):
                tracing.record_send_outcome(span, outcome)
        attempts: Counter[str] = Counter()
        for delivery, outcome in zip(deliveries, outcomes, strict=True):
            for event in delivery.events:
                attempts[event.event_type] += 1
                if outcome is not None:
                    failures.setdefault(event.id, outcome)
        for event_type, count in attempts.items():  # one metric update per type, not per event
            metrics.publish_attempts.labels(event_type).inc(count)
        return failures

    def _settle(
        self,
        token: int,
        events: list[OutboxEvent],
        failures: dict[uuid.UUID, BaseException],
        result: BatchResult,
    ) -> None:
        settlement = Settlement(token)
        sent, released = settlement.sent, settlement.released
        retry: list[tuple[OutboxEvent, BaseException]] = []
        dead: list[tuple[OutboxEvent, BaseException, str]] = []
        blocked_keys: set[str] = set()
        for event in events:
            if event.ordering_key is not None and event.ordering_key in blocked_keys:
                released.append(event.id)
                continue
            error = failures.get(event.id)
            if error is None:
                sent.append(event.id)
                continue
            if event.ordering_key is not None:
                blocked_keys.add(event.ordering_key)
            metrics.publish_failures.labels(event.event_type, type(error).__name__).inc()
            if isinstance(error, PermanentPublishError):
                dead.append((event, error, "permanent error"))
            elif event.attempts >= self.settings.publish_max_attempts:
                dead.append((event, error, f"gave up after {event.attempts} attempts"))
            else:
                retry.append((event, error))
        if sent:
            settlement.routes = self._routes(events)
        settlement.retries = [
            Retry(
                event.id,
                full_jitter(
                    event.attempts,
                    self.settings.publish_backoff_base,
                    self.settings.publish_backoff_max,
                    self.rng,
                ),
                type(error).__name__,
                error_text(error),
            )
            for event, error in retry
        ]
        settlement.dead = [
            DeadEvent(event.id, reason, type(error).__name__, error_text(error))
            for event, error, reason in dead
        ]
        marked = self.store.settle(self.conn, settlement)
        if marked:
            self._count_sent(marked, result)
        for event, error, reason in dead:
            metrics.dead_letters.labels("publish", event.event_type, type(error).__name__).inc()
            log.error(
                "event dead-lettered at publish",
                extra={
                    "event_id": str(event.id),
                    "event_type": event.event_type,
                    "reason": reason,
                    "error_class": type(error).__name__,
                },
            )
        result.released, result.retried, result.dead = len(released), len(retry), len(dead)

    def _routes(self, events: list[OutboxEvent]) -> dict[str, str]:
        """Each event type of the batch and its consumers (comma-separated): what a sent
        event records as the deliveries it owes."""
        return {
            event_type: ",".join(s.consumer for s in self.registry.routes_for(event_type))
            for event_type in sorted({event.event_type for event in events})
        }

    def _release_quietly(self, events: list[OutboxEvent], token: int) -> None:
        """Give a batch back after a failure before publishing (best effort: otherwise its
        lease expires and another claim takes it)."""
        try:
            self.store.release(self.conn, [e.id for e in events], token)
        except psycopg.Error:
            log.debug("could not release a claimed batch", exc_info=True)

    def _expected_deliveries(self, events: list[OutboxEvent]) -> list[ExpectedDelivery]:
        """Ordered consumers' inbox 'pending' rows for the events of a key on their way.

        Recorded for every claimed event before publishing, and committed: no later event
        of the key can be claimed before the event is marked sent, so a worker that takes
        a later event always finds the earlier one's row. A row of an event that then
        fails is harmless: only sent events' rows are owed (the ledger), and an event
        dead-lettered at publish removes its rows in the same transaction.
        """
        return [
            ExpectedDelivery(
                subscription.consumer, event.id, event.event_type, event.ordering_key, event.seq
            )
            for event in events
            if event.ordering_key is not None
            for subscription in self.registry.routes_for(event.event_type)
            if subscription.ordered
        ]

    def _count_sent(self, rows: list[SentRow], result: BatchResult) -> None:
        result.sent = len(rows)
        sent_by_type: Counter[str] = Counter()
        lags: dict[str, list[float]] = {}
        for _, event_type, lag in rows:
            sent_by_type[event_type] += 1
            lags.setdefault(event_type, []).append(lag)
        for event_type, count in sent_by_type.items():
            routed = bool(self.registry.routes_for(event_type))
            counter = metrics.events_published if routed else metrics.events_unrouted
            counter.labels(event_type).inc(count)
            result.unrouted += 0 if routed else count
            if not routed and event_type not in _WARNED_UNROUTED:
                _WARNED_UNROUTED.add(event_type)  # once per type and process: no flood
                log.warning(
                    "events sent to no consumer: no registered consumer takes their type; "
                    "`pipeline dlq unrouted` lists them, `pipeline dlq resend-unrouted` sends "
                    "them again once their consumers run",
                    extra={"event_type": event_type},
                )
            metrics.observe_many(
                metrics.publish_lag.labels(event_type), [max(0.0, lag) for lag in lags[event_type]]
            )

    def drain(self, max_batches: int = 1_000_000, time_budget: float = float("inf")) -> int:
        """Run batches until no work is due, ``max_batches`` ran, or the time budget is spent."""
        deadline = time.monotonic() + time_budget
        total = 0
        for _ in range(max_batches):
            result = self.run_batch()
            total += result.claimed
            if not result.full or time.monotonic() >= deadline:
                break
        return total
