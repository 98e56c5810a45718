"""The delivery ledger's sweep: send again what a consumer is owed past the horizon.

The broker carries deliveries; Postgres is their source of truth. Each event marked sent
records the consumers it went to (``outbox.consumers``), and each consumer's inbox row
holds the outcome, so for every (event, consumer) Postgres can tell whether it was
processed, dead-lettered, or is still owed. A broker that forgets (a Redis restart without
persistence, the AOF's last second, eviction, failover to an empty replica) or a worker
that dropped a message therefore delays an event but cannot lose it:

1. sent events that reached the horizon (``PIPELINE_REDELIVERY_HORIZON_SECONDS``) with
   no inbox row for one of their consumers get a 'pending' row dated at publication (a
   worker's claim still uncommitted stops this step there for the sweep, never the relay:
   see :meth:`LedgerStore.account`);
2. unfinished rows ('pending', 'failed') whose last delivery (or due retry) is older
   than the horizon are delivered again, oldest first, through the same publisher the
   relay uses, and their ``delivered_at`` and ``redeliveries`` are updated.

A delivery is sent again only when it is overdue and not in flight. A delivery
younger than the oldest message still waiting on its consumer's queue, or held by a live
worker (fetched and not yet acknowledged), may be that message, so it is not owed yet: a
consumer that is merely behind is never sent copies of its backlog. Rows a worker holds
(it is processing them) are skipped, a row recorded for an event not sent yet is not
owed, and ordered consumers' later events wait behind a predecessor that is still on its
way. What is sent again is counted by consumer and reason
(``pipeline_ledger_redeliveries_total``).
The inbox absorbs any copy that was not needed after all. One relay sweeps at a time
(an advisory lock), every ``PIPELINE_RECONCILE_INTERVAL_SECONDS``.

When the transport says it lost what it held (:meth:`Publisher.forgot`: a Redis that
restarted empty), the next sweep does not wait for the horizon: every unfinished delivery
handed over before the loss was noticed is owed at once (a worker that holds one still
skips it). What was handed over after the notice went to the broker that holds it, even
when the sweep comes later (another relay held the sweep): not owed. The queues are not
consulted then: a message waiting on them may have been carried over from a worker's
memory (an ordered event deferred, or a retry, before the loss), with a timestamp from
before the loss, and would hold back deliveries the broker forgot until the horizon. What
was sent between the loss and its notice is sent a second time; a copy too many is
absorbed by the inbox, where one too few would wait for the horizon.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.stores.ledger import LedgerStore
from pipeline.envelope import OutboxEvent
from pipeline.observability import metrics
from pipeline.policy import redelivery_horizon
from pipeline.registry import Registry, Subscription
from pipeline.relay.drain import pack_deliveries
from pipeline.transport.publisher import Delivery, Publisher

log = logging.getLogger("pipeline.relay.ledger")

SWEEP_OVERLAP = timedelta(seconds=5)
"""How far each sweep looks back before the previous one's end: a sent mark is committed
in the round trip that makes it, so a few seconds covers any late commit."""

CLOCK_MARGIN = timedelta(seconds=1)
"""Queue messages carry their enqueuer's clock, the ledger the database's."""

SWEEP_LIMIT = 2000
"""Owed deliveries sent again per sweep at most (bounded work; the next sweep goes on)."""


@dataclass
class SweepResult:
    """What one sweep did; ``skipped`` when another relay holds the sweep."""

    skipped: bool = False
    accounted: int = 0  # sent events' deliveries newly recorded as owed
    redelivered: Counter[str] = field(default_factory=Counter)  # by consumer
    reasons: Counter[tuple[str, str]] = field(default_factory=Counter)  # (consumer, reason)
    vanished: int = 0


class DeliveryLedger:
    """Runs the sweep on the relay's connection; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        publisher: Publisher,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.publisher = publisher
        self.store = LedgerStore(settings.schema_name)

    def sweep(
        self, conn: psycopg.Connection[Any], *, forgotten_at: datetime | None = None
    ) -> SweepResult:
        """One sweep in one transaction; raises if Postgres or the broker fails (nothing lost).

        ``forgotten_at``: when the transport was found to have lost its messages (database
        time). What was handed over before then is owed now, not after the horizon; what
        was handed over since went to the broker that holds it (a sweep that another relay's
        held up comes later, and must not send those again).
        """
        forgotten = forgotten_at is not None
        result = SweepResult()
        with conn.transaction():
            if not self.store.lock(conn):
                result.skipped = True
                return result
            horizon = 0.0 if forgotten else redelivery_horizon(self.settings)
            swept_to, until = self.store.window(conn, horizon)
            if forgotten_at is not None:
                until = min(until, forgotten_at)
            if until > swept_to:
                result.accounted, held = self.store.account(conn, swept_to - SWEEP_OVERLAP, until)
                # Held up by a worker's open claim: the next sweep looks from there again.
                self.store.advance(conn, until if held is None else max(swept_to, held))
            self._redeliver(conn, until, result, forgotten)
        return result

    def _redeliver(
        self,
        conn: psycopg.Connection[Any],
        horizon_cutoff: datetime,
        result: SweepResult,
        forgotten: bool,
    ) -> None:
        subscriptions = {s.consumer: s for s in self.registry.all()}
        if not subscriptions:
            return
        names = sorted(subscriptions)
        cutoffs = []
        for name in names:
            if forgotten:  # what waits on the queues says nothing of what was lost
                cutoffs.append(horizon_cutoff)
                continue
            waiting = self.publisher.oldest_waiting(subscriptions[name].queue)
            if waiting is not None:  # enqueued on another clock: a margin
                waiting -= CLOCK_MARGIN
            cutoffs.append(horizon_cutoff if waiting is None else min(horizon_cutoff, waiting))
        rows = self.store.owed(
            conn,
            names,
            cutoffs,
            [subscriptions[name].ordered for name in names],
            SWEEP_LIMIT,
        )
        if not rows:
            return
        owed: dict[str, list[OutboxEvent]] = {}
        vanished: list[tuple[str, uuid.UUID]] = []
        reasons: dict[tuple[str, uuid.UUID], str] = {}
        for row in rows:
            if row.event is None:  # the event row is gone
                vanished.append((row.consumer, row.event_id))
            else:
                owed.setdefault(row.consumer, []).append(row.event)
                reasons[(row.consumer, row.event_id)] = row.reason
        if vanished:
            self._record_vanished(conn, vanished, result)
        deliveries: list[Delivery] = []
        for consumer, events in owed.items():
            events.sort(key=lambda event: event.seq)
            deliveries.extend(
                pack_deliveries(
                    subscriptions[consumer], events, self.settings.max_events_per_message
                )
            )
        outcomes = self.publisher.deliver(deliveries)
        sent = [
            (delivery.subscription, event)
            for delivery, outcome in zip(deliveries, outcomes, strict=True)
            if outcome is None
            for event in delivery.events
        ]
        if sent:
            self.store.redelivered(
                conn, [(subscription.consumer, event.id) for subscription, event in sent]
            )
        for subscription, event in sent:
            consumer = subscription.consumer
            reason = "broker_lost" if forgotten else reasons.get((consumer, event.id), "no_outcome")
            result.reasons[(consumer, reason)] += 1
        self._count(sent, result, forgotten)

    def _record_vanished(
        self,
        conn: psycopg.Connection[Any],
        vanished: list[tuple[str, uuid.UUID]],
        result: SweepResult,
    ) -> None:
        self.store.vanished(conn, vanished)
        result.vanished = len(vanished)
        log.error(
            "owed deliveries whose events are no longer in the outbox were dead-lettered",
            extra={"count": len(vanished)},
        )

    def _count(
        self, sent: list[tuple[Subscription, OutboxEvent]], result: SweepResult, forgotten: bool
    ) -> None:
        for subscription, _ in sent:
            result.redelivered[subscription.consumer] += 1
        for (consumer, reason), count in result.reasons.items():
            metrics.redelivery_reasons.labels(consumer, reason).inc(count)
        why = "the broker lost them" if forgotten else "no outcome within the redelivery horizon"
        for consumer, count in result.redelivered.items():
            metrics.redeliveries.labels(consumer).inc(count)
            log.warning(
                f"delivered events again: {why}",
                extra={
                    "consumer": consumer,
                    "count": count,
                    "reasons": {
                        reason: n
                        for (name, reason), n in result.reasons.items()
                        if name == consumer
                    },
                    "horizon_seconds": redelivery_horizon(self.settings),
                },
            )
