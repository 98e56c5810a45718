"""Replay dead letters: a plan first (what ``--dry-run`` prints), then its execution.

* A publish-stage dead letter: its outbox row goes back to ``pending`` (no attempts, due
  now, no lease) and the relay is woken; the relay publishes the event to its
  subscribers as it does any event, in its ordering key's sequence order.
* A consume-stage dead letter: the consumer's inbox row goes back to ``pending`` (no
  attempts, delivered now) and one message goes to that consumer's queue alone. No other
  consumer sees the event again; should the message be lost, the relay's ledger sweep
  delivers it again, as it does any owed delivery.

Events keep their ids, so an inbox that already processed one drops the copy. Dead
letters are replayed in their events' sequence order (per ordering key, the original
order), one transaction each: the dead letter is locked (two operators never replay one
twice), changed, marked replayed (``replayed_at``, ``replay_count``) and counted in the
audit record together. A replayed event that fails again becomes a new dead letter.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg

from pipeline.db.migrate import notify_channel
from pipeline.db.stores.dead_letters import DeadLetterStore
from pipeline.envelope import OutboxEvent
from pipeline.errors import ConfigurationError, ServiceUnavailableError
from pipeline.registry import Registry, Subscription, actor_name_for
from pipeline.tools.ops.audit import count_affected
from pipeline.tools.ops.dlq.events import load_events
from pipeline.tools.ops.dlq.rate import TokenBucket
from pipeline.tools.ops.dlq.records import DeadLetter
from pipeline.transport.publisher import Delivery, Publisher, PublisherUnavailable

StepKind = Literal["requeue", "deliver", "skip", "unroutable"]


@dataclass
class ReplayStep:
    """What replaying one dead letter does (``requeue``, ``deliver``), or why it does not
    (``skip``: nothing to do; ``unroutable``: no queue is known for its consumer)."""

    letter: DeadLetter
    kind: StepKind
    detail: str
    subscription: Subscription | None = None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.letter.id,
            "stage": self.letter.stage,
            "consumer": self.letter.consumer,
            "event_type": self.letter.event_type,
            "event_ids": [str(i) for i in self.letter.event_ids],
            "action": self.kind,
            "queue": self.subscription.queue if self.subscription else None,
            "detail": self.detail,
        }


@dataclass
class StepResult:
    """What happened: ``replayed``, ``skipped`` (nothing to do) or ``failed`` (rolled back)."""

    step: ReplayStep
    outcome: Literal["replayed", "skipped", "failed"]
    detail: str
    event_ids: list[uuid.UUID] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        data = self.step.as_json()
        data.update(
            outcome=self.outcome,
            detail=self.detail,
            replayed_event_ids=[str(i) for i in self.event_ids],
        )
        return data


def consumer_route(letter: DeadLetter, registry: Registry) -> Subscription | None:
    """The consumer's subscription; else a route to the queue the dead letter names."""
    if letter.consumer is None:
        return None
    for subscription in registry.all():
        if subscription.consumer == letter.consumer:
            return subscription
    if letter.queue is None:
        return None
    return Subscription(
        consumer=letter.consumer,
        event_types=frozenset(),
        queue=letter.queue,
        actor_name=actor_name_for(letter.consumer),
    )


def plan_replay(letters: Sequence[DeadLetter], registry: Registry) -> list[ReplayStep]:
    """One step per dead letter, from the state of its event and inbox record now."""
    steps = []
    seen: dict[tuple[str | None, uuid.UUID], int] = {}
    for letter in letters:
        step = (
            _plan_publish(letter, registry)
            if letter.stage == "publish"
            else _plan_consume(letter, registry)
        )
        if step.kind in ("requeue", "deliver"):
            repeated = [
                seen[(letter.consumer, e)] for e in letter.event_ids if (letter.consumer, e) in seen
            ]
            if repeated:
                step = ReplayStep(
                    letter, "skip", f"the same event is replayed by dead letter #{repeated[0]}"
                )
            for event_id in letter.event_ids:
                seen.setdefault((letter.consumer, event_id), letter.id)
        steps.append(step)
    return steps


def _plan_publish(letter: DeadLetter, registry: Registry) -> ReplayStep:
    if letter.event_id is None or letter.outbox_status is None:
        return ReplayStep(letter, "skip", "the event is no longer in the outbox")
    if letter.outbox_status != "dead":
        return ReplayStep(
            letter, "skip", f"the event is {letter.outbox_status}, not dead: nothing to replay"
        )
    subscribers = [s.consumer for s in registry.routes_for(letter.event_type or "")]
    to = f" ({', '.join(subscribers)})" if subscribers else ""
    return ReplayStep(
        letter,
        "requeue",
        f"outbox row back to pending; the relay publishes it to its subscribers{to}",
    )


def _plan_consume(letter: DeadLetter, registry: Registry) -> ReplayStep:
    if letter.consumer is None:
        return ReplayStep(
            letter, "skip", "names no consumer: inspect it with `pipeline dlq show`, then purge it"
        )
    if not letter.event_ids:
        return ReplayStep(
            letter, "skip", "names no readable event: inspect it with `pipeline dlq show`"
        )
    if letter.event_id is not None and letter.inbox_status == "processed":
        return ReplayStep(
            letter,
            "skip",
            f"{letter.consumer} has processed the event since: nothing is owed (purge this one)",
        )
    if letter.event_id is not None and letter.outbox_status is None and not letter.has_envelope:
        return ReplayStep(
            letter, "skip", "the event is no longer in the outbox and no envelope was kept"
        )
    subscription = consumer_route(letter, registry)
    if subscription is None:
        return ReplayStep(
            letter,
            "unroutable",
            f"no queue known for consumer {letter.consumer!r}: name its module in "
            "PIPELINE_APP_MODULES (or --app)",
        )
    if letter.carried and letter.carried_processed >= len(letter.carried):
        return ReplayStep(
            letter,
            "skip",
            f"{letter.consumer} has processed its events since: nothing is owed (purge this one)",
        )
    count = len(letter.event_ids) - letter.carried_processed
    events = "the event" if count == 1 else f"{count} events"
    return ReplayStep(
        letter,
        "deliver",
        f"inbox row of {letter.consumer} back to pending; one message with {events} to queue "
        f"{subscription.queue}, for {letter.consumer} only",
        subscription,
    )


def unroutable(steps: Sequence[ReplayStep]) -> list[ReplayStep]:
    """Consume-stage steps that cannot run because no queue is known for their consumer."""
    return [s for s in steps if s.kind == "unroutable"]


def require_routes(steps: Sequence[ReplayStep]) -> None:
    """Refuse a replay that would leave dead letters behind for want of configuration."""
    missing = unroutable(steps)
    if missing:
        consumers = sorted({s.letter.consumer or "" for s in missing})
        raise ConfigurationError(
            f"cannot replay {len(missing)} dead letter(s): no queue known for consumer(s) "
            f"{', '.join(consumers)} (not registered by PIPELINE_APP_MODULES or --app, and the "
            "dead letters name no queue)"
        )


class Replayer:
    """Executes a plan on an autocommit connection, one transaction per dead letter."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        schema: str,
        publisher: Publisher | None,
        audit_id: int,
        bucket: TokenBucket | None = None,
    ) -> None:
        self.conn = conn
        self.schema = schema
        self.store = DeadLetterStore(schema)
        self.publisher = publisher
        self.audit_id = audit_id
        self.bucket = bucket or TokenBucket(None)

    def run(
        self, steps: Sequence[ReplayStep], report: Callable[[StepResult], None] = lambda _: None
    ) -> list[StepResult]:
        """Replay each step in order; a broker that is down stops the run (nothing lost)."""
        results: list[StepResult] = []
        for step in steps:
            if step.kind in ("skip", "unroutable"):
                result = StepResult(step, "skipped", step.detail)
            else:
                self.bucket.acquire(max(1, len(step.letter.event_ids)))
                try:
                    result = self._replay(step)
                except PublisherUnavailable as exc:
                    done = sum(r.outcome == "replayed" for r in results)
                    raise ServiceUnavailableError(
                        f"replay stopped at dead letter #{step.letter.id}: {exc}; {done} "
                        f"replayed before it (audit record #{self.audit_id}); run the command "
                        "again to replay the rest"
                    ) from None
            results.append(result)
            report(result)
        return results

    def _replay(self, step: ReplayStep) -> StepResult:
        letter = step.letter
        failure: StepResult | None = None
        with self.conn.transaction():
            if not self.store.lock(self.conn, letter.id):
                return StepResult(step, "skipped", "replayed or purged meanwhile")
            result = self._requeue(step) if step.kind == "requeue" else self._deliver(step)
            if result.outcome == "replayed":
                self.store.mark_replayed(self.conn, letter.id)
                count_affected(self.conn, self.schema, self.audit_id, [letter.id])
                return result
            failure = result
            raise psycopg.Rollback()  # nothing half-done stays behind
        assert failure is not None
        return failure

    def _requeue(self, step: ReplayStep) -> StepResult:
        assert step.letter.event_id is not None  # planned "requeue": a publish-stage event
        requeued = self.store.requeue_outbox(self.conn, step.letter.event_id)
        if requeued is None:
            return StepResult(step, "skipped", "the event is no longer dead: nothing to replay")
        self.store.wake_relay(self.conn, notify_channel(self.schema))
        return StepResult(step, "replayed", step.detail, [requeued])

    def _deliver(self, step: ReplayStep) -> StepResult:
        letter, subscription = step.letter, step.subscription
        assert subscription is not None and letter.consumer is not None  # planned "deliver"
        if self.publisher is None:
            raise ConfigurationError("a consume-stage replay needs PIPELINE_BROKER_URL")
        events = load_events(self.conn, self.schema, letter)
        if not events:
            return StepResult(step, "skipped", "its events are gone from the outbox")
        owed = self._requeue_inbox(letter.consumer, events)
        events = [event for event in events if event.id in owed]
        if not events:
            return StepResult(
                step, "skipped", f"{letter.consumer} has processed the event since: nothing owed"
            )
        (outcome,) = self.publisher.deliver([Delivery(subscription, events)])
        if outcome is not None:
            return StepResult(step, "failed", f"not delivered: {type(outcome).__name__}: {outcome}")
        return StepResult(step, "replayed", step.detail, [event.id for event in events])

    def _requeue_inbox(self, consumer: str, events: Sequence[OutboxEvent]) -> set[uuid.UUID]:
        return self.store.requeue_inbox(self.conn, consumer, events)
