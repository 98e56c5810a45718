"""Run a consumer's handler effectively once per event (DESIGN I3, I4).

One Dramatiq message carries a run of events for one consumer. They are handled in
one database transaction, and one failure does not roll back its neighbours:

1. claim the inbox key (consumer, event id) — no row back means a duplicate;
2. run the handler on the same transaction (its writes, follow-up events and the
   inbox record commit together). Follow-up events are validated as they are published
   and inserted just before COMMIT, so the ordering locks their insert takes are never
   held while a handler waits: no producer waits on a slow or frozen handler;
3. on an exception, roll back the handler's work and record the failed attempt; after
   the commit, failed events are re-sent with a jittered delay, or dead-lettered when
   non-retryable or out of retries.

Unordered consumers take the fast way first: one statement claims every event of the
message and the handlers run without savepoints (one round trip per event fewer for
the SAVEPOINT and one for its release). If a handler raises, that transaction is rolled
back, the failure is recorded, and the message's other events are done again the
careful way, each in a savepoint — so a handler may run twice for one delivery when a
neighbour fails, with the same attempt number and idempotency key (its database effects
still commit once). Metrics of the fast way are recorded only once it has committed.

Ordered consumers handle a key in sequence order: an event whose predecessor was
delivered here but is not yet processed or dead-lettered is deferred (re-sent with a
short delay, no attempt counted) without holding up other keys.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from dramatiq.middleware import TimeLimitExceeded
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DataError, DBAPIError
from sqlalchemy.orm import Session

from pipeline.config import Settings
from pipeline.db.ordering import ordering_lock_bucket
from pipeline.db.stores.inbox import ConsumeDeadLetter, InboxStore, message_digest, raw_digest
from pipeline.envelope import EnvelopeError, ReceivedEvent, decode_envelope
from pipeline.errors import PermissionDeniedError, error_text
from pipeline.inbox.consumer import ConsumerDefinition
from pipeline.inbox.context import HandlerContext
from pipeline.inbox.upcasting import Upcasters, upcasters
from pipeline.observability import metrics, tracing
from pipeline.outbox import DeferredEvents, deferring_events, held_events
from pipeline.registry import Subscription
from pipeline.signing import REASONS, EnvelopeSigner, event_source

log = logging.getLogger("pipeline.inbox")
DEFER_DELAY = 0.05  # seconds before a deferred ordered event first looks at its predecessor again
OPEN_SAVEPOINTS = "pipeline.open_savepoints"  # Session.info key: savepoints not yet released
MAX_OPEN_SAVEPOINTS = 64
DEFER_DELAY_MAX = 2.0  # the wait doubles with each deferral up to this: a held key costs little
Resender = Callable[[list[dict[str, Any]], float, int], None]
"""Sends envelopes again after a delay (seconds), with the number of deferrals so far."""


@dataclass(frozen=True)
class DeliveredMessage:
    """The Dramatiq message being handled, for the dead letters recorded for it: each is
    keyed by a digest that a redelivery of the same message reproduces (its queue, id and
    content, and which of its dead letters it is), so it is recorded once."""

    queue: str
    message_id: str
    actor_name: str
    args: Any
    kwargs: Any

    @cached_property
    def _content(self) -> bytes:
        """Actor name, arguments and keywords, encoded deterministically (once: a message
        of several refused envelopes has a dead letter for each)."""
        try:
            return json.dumps(
                [self.actor_name, self.args, self.kwargs],
                sort_keys=True,
                separators=(",", ":"),
                ensure_ascii=True,
            ).encode()
        except (TypeError, ValueError, RecursionError):
            return b""  # not JSON again (too deep): the id alone tells the message

    def digest(self, part: str) -> bytes:
        """The digest of this message's dead letter ``part`` (:data:`WHOLE_MESSAGE`, or
        :func:`envelope_part` of one envelope)."""
        return message_digest(self.queue, self.message_id, self._content, part)


WHOLE_MESSAGE = "message"  # a dead letter for the message as a whole


def envelope_part(index: int) -> str:
    """The part of a dead letter for the message's envelope at ``index``."""
    return f"envelope {index}"


def message_digest_of(delivered: DeliveredMessage | None, part: str) -> bytes | None:
    return None if delivered is None else delivered.digest(part)


@dataclass
class Resend:
    """Envelopes to send again after the transaction commits, and after how long."""

    envelopes: list[dict[str, Any]]
    delay: float
    deferrals: int = 0  # deferrals so far (ordered events waiting for a predecessor)


@dataclass
class Outcome:
    processed: int = 0
    duplicates: int = 0
    retried: int = 0
    deferred: int = 0
    dead: int = 0
    resends: list[Resend] = field(default_factory=list)
    duplicate_events: list[ReceivedEvent] = field(default_factory=list)  # one at a time


@dataclass
class Committed:
    """What the fast way did, counted in metrics only once its transaction commits."""

    processed: list[tuple[ReceivedEvent, float]] = field(default_factory=list)  # and duration
    duplicates: list[ReceivedEvent] = field(default_factory=list)
    copies: list[ReceivedEvent] = field(default_factory=list)  # repeated in the same message

    def clear(self) -> None:
        """Forget the rolled-back fast way (copies stay: they are duplicates however it ends)."""
        self.processed.clear()
        self.duplicates.clear()


class InboxProcessor:
    """Handles the messages of one consumer; one instance per consumer per process."""

    def __init__(
        self,
        settings: Settings,
        subscription: Subscription,
        definition: ConsumerDefinition,
        engine: Callable[[], Engine],
        resend: Resender,
        upcaster_registry: Upcasters = upcasters,
    ) -> None:
        self.settings = settings
        self.subscription = subscription
        self.definition = definition
        self.engine = engine
        self.resend = resend
        self.upcasters = upcaster_registry
        self.store = InboxStore(settings.schema_name)
        self.policy = definition.policy(settings)
        self.signer = EnvelopeSigner.from_settings(settings, event_source(settings))

    # -- a message -------------------------------------------------------------------------
    def handle(
        self, envelopes: Any, deferrals: int = 0, delivered: DeliveredMessage | None = None
    ) -> Outcome:
        """Process one message's envelopes; re-sends and dead letters are done on return.

        ``deferrals`` counts how often these envelopes already waited for a predecessor.
        Dead letters recorded for the message (``delivered``) are recorded once however
        often it is delivered.
        """
        outcome = Outcome()
        if not isinstance(envelopes, list) or not envelopes:
            self._dead_letter_unreadable(
                envelopes,
                "message argument is not a non-empty list of CloudEvents envelopes",
                message_digest_of(delivered, WHOLE_MESSAGE),
            )
            outcome.dead += 1
            return outcome
        events: list[tuple[dict[str, Any], ReceivedEvent]] = []
        for index, envelope in enumerate(envelopes):
            refused = self.signer.verify(envelope, self.subscription.consumer)
            if refused is not None:
                self._dead_letter_unauthentic(
                    envelope, refused, message_digest_of(delivered, envelope_part(index))
                )
                outcome.dead += 1
                continue
            try:
                events.append((envelope, decode_envelope(envelope)))
            except (EnvelopeError, TypeError, ValueError) as exc:
                self._dead_letter_unreadable(
                    envelope,
                    f"invalid envelope: {exc}",
                    message_digest_of(delivered, envelope_part(index)),
                )
                outcome.dead += 1
        committed = Committed()
        if events:
            dead = outcome.dead
            try:
                self._transaction(events, outcome, committed, deferrals, defer=True)
            except _FollowUpsRefused as refused:
                # Rare (a follow-up's id already taken, a missing grant): handle the message
                # again with each handler's events inserted as it publishes them, so the
                # error fails the handler that caused it, as any of its statements would.
                log.warning(
                    "follow-up events refused at commit; handling the message again with "
                    "events inserted as they are published",
                    extra={
                        "consumer": self.subscription.consumer,
                        "error_class": type(refused.__cause__).__name__,
                    },
                )
                outcome, committed = Outcome(dead=dead), Committed()
                self._transaction(events, outcome, committed, deferrals, defer=False)
        self._count(committed, outcome)
        for resend in outcome.resends:
            self.resend(resend.envelopes, resend.delay, resend.deferrals)
        return outcome

    def _transaction(
        self,
        events: Sequence[tuple[dict[str, Any], ReceivedEvent]],
        outcome: Outcome,
        committed: Committed,
        deferrals: int,
        defer: bool,
    ) -> None:
        """The message's one transaction: claims, handlers, and their follow-up events.

        With ``defer``, follow-up events are held back and inserted just before COMMIT
        (:class:`pipeline.outbox.DeferredEvents`): the ordering locks they take are then
        held for that statement and the commit only, never while a handler waits on
        another service, so no producer ever waits on a slow or frozen handler.
        """
        # The connection comes from the session, so that the session owns (and
        # commits) the one transaction shared by the inbox records and the handlers.
        with Session(self.engine()) as session:
            session.begin()
            try:
                with deferring_events(session) if defer else nullcontext() as held:
                    if self.subscription.ordered:
                        self._handle_events(session, events, outcome, deferrals)
                    else:
                        self._handle_batch(session, events, outcome, committed)
                    self._log_duplicates(session, committed, outcome)
                    if held is not None:
                        _insert_held(held)
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def _handle_batch(
        self,
        session: Session,
        events: Sequence[tuple[dict[str, Any], ReceivedEvent]],
        outcome: Outcome,
        committed: Committed,
    ) -> None:
        """Unordered consumers: one claim for all, no savepoints until a handler fails."""
        consumer = self.subscription.consumer
        batch: dict[uuid.UUID, tuple[dict[str, Any], ReceivedEvent]] = {}
        for envelope, event in events:
            if event.id in batch:  # the same event twice in one message: one runs
                committed.copies.append(event)
                self._duplicate_span(event)
            else:
                batch[event.id] = (envelope, event)
        # Handled in the lock order of their ordering keys. Follow-up events are normally
        # held back and inserted together, in lock order, before COMMIT; when they are not
        # (a message handled again after its follow-ups were refused) they usually share
        # their cause's key, so two messages handled at once still take the insert
        # trigger's key locks in one order and cannot deadlock on them.
        runs = sorted(batch.values(), key=lambda run: _lock_order(run[1]))
        attempts = self._claim_all(session.connection(), [event for _, event in runs])
        for _, event in runs:
            attempt = attempts.get(event.id)
            if attempt is None:
                committed.duplicates.append(event)
                self._duplicate_span(event)
                continue
            started = time.perf_counter()
            with tracing.process_span(event, consumer, attempt) as span:
                try:
                    self._run_handler(session, event, attempt)
                except (Exception, TimeLimitExceeded) as exc:
                    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                        raise  # the database went away, not the handler: Dramatiq redelivers
                    session.rollback()  # its neighbours' work too: they are redone below
                    session.begin()
                    committed.clear()
                    _discard_held(0)
                    metrics.handler_duration.labels(consumer, event.type).observe(
                        time.perf_counter() - started
                    )
                    self._recover(session, runs, event, attempt, exc, outcome, span)
                    return
            committed.processed.append((event, time.perf_counter() - started))

    def _recover(
        self,
        session: Session,
        runs: Sequence[tuple[dict[str, Any], ReceivedEvent]],
        failed: ReceivedEvent,
        attempt: int,
        exc: BaseException,
        outcome: Outcome,
        span: Any,
    ) -> None:
        """After a fast-way failure (rolled back): record it, and redo the rest carefully.

        Keys are locked in event-id order, as the fast way's claim does, so a copy of the
        message on another worker cannot deadlock with this one. After a time limit the
        others are re-sent (no attempt counted) rather than run again past the limit.
        """
        others: list[dict[str, Any]] = []
        for envelope, event in sorted(runs, key=lambda run: run[1].id):
            if event is failed:
                retry = self._failed(
                    session.connection(), envelope, event, attempt, exc, outcome, span
                )
            elif isinstance(exc, TimeLimitExceeded):
                others.append(envelope)
                continue
            else:
                retry = self._handle_one(session, envelope, event, outcome, alone=False)
            if retry is not None:
                outcome.resends.append(retry)
        if others:
            outcome.resends.append(Resend(others, 0.0))

    def _claim_all(
        self, connection: Connection, events: Sequence[ReceivedEvent]
    ) -> dict[uuid.UUID, int]:
        """Claim every event in one statement: attempt numbers of those not yet done."""
        return self.store.claim_many(connection, self.subscription.consumer, events)

    def _count(self, committed: Committed, outcome: Outcome) -> None:
        """Metrics of what the fast way committed (nothing of it counts before the commit)."""
        consumer = self.subscription.consumer
        metrics.record_processed(consumer, committed.processed)
        duplicates = committed.duplicates + committed.copies
        for event in duplicates:
            metrics.inbox_duplicates.labels(consumer, event.type).inc()
        outcome.processed += len(committed.processed)
        outcome.duplicates += len(duplicates)

    def _log_duplicates(self, session: Session, committed: Committed, outcome: Outcome) -> None:
        """Record this message's duplicates in ``delivery_log``, in its transaction."""
        seen = committed.duplicates + committed.copies + outcome.duplicate_events
        if seen:
            self.store.log_duplicates(
                session.connection(), self.subscription.consumer, [e.id for e in seen]
            )

    def _count_duplicate(self, event: ReceivedEvent, outcome: Outcome) -> None:
        outcome.duplicates += 1
        outcome.duplicate_events.append(event)
        metrics.inbox_duplicates.labels(self.subscription.consumer, event.type).inc()
        self._duplicate_span(event)

    def _duplicate_span(self, event: ReceivedEvent) -> None:
        """A ``process`` span for a delivery the inbox had already seen (no handler ran)."""
        with tracing.process_span(event, self.subscription.consumer, 0) as span:
            tracing.mark_duplicate(span)

    def _run_handler(self, session: Session, event: ReceivedEvent, attempt: int) -> None:
        """Upcast and run the handler (upcasting belongs to the attempt: a failing upcaster
        fails only this event), flushing its writes so that their errors land here."""
        version, data = self.upcasters.upcast(event.type, event.version, event.data)
        current = event if version == event.version else _with_payload(event, version, data)
        context = HandlerContext(
            current, session, self.subscription.consumer, attempt, self.subscription.queue
        )
        held = held_events()
        mark = held.mark() if held is not None else 0
        try:
            self.definition.function(current, context)
            session.flush()
        except BaseException:
            _discard_held(mark)  # its follow-ups are rolled back with the rest of its work
            raise

    def _handle_events(
        self,
        session: Session,
        events: Sequence[tuple[dict[str, Any], ReceivedEvent]],
        outcome: Outcome,
        deferrals: int = 0,
    ) -> None:
        """Ordered consumers: events one by one, deferring those whose predecessor is unfinished.

        A deferred event waits twice as long each time (up to ``DEFER_DELAY_MAX``): a key
        held for long (its head retried with backoff, or owed and re-sent by the relay's
        ledger sweep) costs a message every few seconds, not a busy loop.
        """
        defer_delay = min(DEFER_DELAY * 2**deferrals, DEFER_DELAY_MAX)
        held: dict[str, Resend] = {}  # ordered keys waiting for an earlier event
        # A message's only event needs no savepoint: its transaction is one (two round
        # trips fewer per event on the common path of lightly loaded consumers).
        alone = len(events) == 1
        for envelope, event in events:
            key = event.ordering_key if self.subscription.ordered else None
            if key is not None and key in held:
                held[key].envelopes.append(envelope)
                outcome.deferred += 1
                continue
            if key is not None and self._predecessor_unfinished(session.connection(), event):
                held[key] = Resend([envelope], defer_delay, deferrals + 1)
                outcome.deferred += 1
                continue
            retry = self._handle_one(session, envelope, event, outcome, alone)
            if retry is not None:
                if key is not None:
                    held[key] = retry  # later events of the key travel with the retry
                else:
                    outcome.resends.append(retry)
        outcome.resends.extend(held.values())

    def _predecessor_unfinished(self, connection: Connection, event: ReceivedEvent) -> bool:
        return self.store.predecessor_unfinished(connection, self.subscription.consumer, event)

    # -- an event --------------------------------------------------------------------------
    def _handle_one(
        self,
        session: Session,
        envelope: dict[str, Any],
        event: ReceivedEvent,
        outcome: Outcome,
        alone: bool,
    ) -> Resend | None:
        """Claim and handle one event; rolled back alone (savepoint or its own transaction)."""
        consumer = self.subscription.consumer
        # A savepoint that is not rolled back is never released: the message's COMMIT
        # releases them all, a round trip fewer per event (the next one nests inside it).
        # Every MAX_OPEN_SAVEPOINTS they are released at once, so a message of many events
        # never nests deeper than that (SQLAlchemy commits nested savepoints recursively).
        open_savepoints: list[Any] = session.info.setdefault(OPEN_SAVEPOINTS, [])
        if len(open_savepoints) >= MAX_OPEN_SAVEPOINTS:
            open_savepoints[0].commit()  # RELEASE of the oldest releases the newer ones too
            open_savepoints.clear()
        savepoint = None if alone else session.begin_nested()
        connection = session.connection()  # emits the SAVEPOINT now: the claim must be inside
        if savepoint is not None:
            open_savepoints.append(savepoint)  # taken out again if it is rolled back
        attempt = self.store.claim(connection, consumer, event)
        if attempt is None:
            self._count_duplicate(event, outcome)
            return None
        started = time.perf_counter()
        with tracing.process_span(event, consumer, attempt) as span:
            try:
                self._run_handler(session, event, attempt)
            except (Exception, TimeLimitExceeded) as exc:
                if savepoint is not None:
                    savepoint.rollback()
                    open_savepoints.remove(savepoint)
                else:  # the message's own transaction was the savepoint: start another
                    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                        raise  # the database went away, not the handler: Dramatiq redelivers
                    session.rollback()
                    session.begin()
                metrics.handler_duration.labels(consumer, event.type).observe(
                    time.perf_counter() - started
                )
                return self._failed(
                    session.connection(), envelope, event, attempt, exc, outcome, span
                )
        metrics.record_processed(consumer, [(event, time.perf_counter() - started)])
        outcome.processed += 1
        return None

    def _failed(
        self,
        connection: Connection,
        envelope: dict[str, Any],
        event: ReceivedEvent,
        attempt: int,
        exc: BaseException,
        outcome: Outcome,
        span: Any,
    ) -> Resend | None:
        """Record the failed attempt (same number the rolled-back claim had) and decide."""
        consumer = self.subscription.consumer
        metrics.inbox_failures.labels(consumer, event.type, type(exc).__name__).inc()
        permanent = isinstance(exc, self.definition.non_retryable)
        dead = permanent or attempt > self.policy.retries
        delay = 0.0 if dead else self.policy.retry_delay(attempt)
        recorded = self.store.fail(
            connection,
            consumer,
            event,
            error=error_text(exc),
            error_class=type(exc).__name__,
            dead=dead,
            retry_in=delay,
        )
        if not recorded:
            # Rolling back to the savepoint released the claim's row lock, and a concurrent
            # copy of this event has since processed (or dead-lettered) it: a duplicate.
            outcome.duplicates += 1
            outcome.duplicate_events.append(event)
            metrics.inbox_duplicates.labels(consumer, event.type).inc()
            tracing.mark_duplicate(span)
            return None
        if dead:
            reason = (
                f"non-retryable {type(exc).__name__}"
                if permanent
                else f"gave up after {attempt} attempts"
            )
            self._dead_letter(event, envelope, reason, exc, attempt, connection)
            tracing.record_dead_letter(span, reason)
            outcome.dead += 1
            return None
        tracing.record_retry(span, exc, delay)
        metrics.inbox_retries.labels(consumer, event.type).inc()
        log.warning(
            "handler failed; will retry",
            extra={
                "consumer": consumer,
                "event_id": str(event.id),
                "attempt": attempt,
                "error_class": type(exc).__name__,
                "retry_in": round(delay, 3),
            },
        )
        outcome.retried += 1
        return Resend([envelope], delay)

    # -- dead letters ----------------------------------------------------------------------
    def _dead_letter(
        self,
        event: ReceivedEvent,
        envelope: dict[str, Any],
        reason: str,
        exc: BaseException,
        attempts: int,
        connection: Connection,
    ) -> None:
        self.store.dead_letter(
            connection,
            ConsumeDeadLetter(
                event_id=event.id,
                consumer=self.subscription.consumer,
                event_type=event.type,
                queue=self.subscription.queue,
                reason=reason,
                error_class=type(exc).__name__,
                error=error_text(exc),
                attempts=attempts,
                envelope=json.dumps(envelope),
            ),
        )
        metrics.dead_letters.labels("consume", event.type, type(exc).__name__).inc()
        log.error(
            "event dead-lettered at consume",
            extra={
                "consumer": self.subscription.consumer,
                "event_id": str(event.id),
                "reason": reason,
                "error_class": type(exc).__name__,
            },
        )

    def dead_letter_arguments(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        delivered: DeliveredMessage | None = None,
    ) -> None:
        """Dead-letter a message whose arguments this consumer's actor cannot take (none,
        several, unknown keywords) at once: retrying it could never succeed."""
        self._dead_letter_unreadable(
            {"args": list(args), "kwargs": kwargs},
            f"message arguments do not fit consumer {self.subscription.consumer!r}: expected "
            "one list of CloudEvents envelopes (non-retryable)",
            message_digest_of(delivered, WHOLE_MESSAGE),
        )

    def _dead_letter_unauthentic(
        self, envelope: Any, refused: str, digest: bytes | None = None
    ) -> None:
        """Keep a refused envelope for inspection, attributed to no event: whatever id it
        claims, it must not mark a real event dead nor count as that event's outcome."""
        metrics.unauthentic_messages.labels(self.subscription.consumer, refused).inc()
        record_unreadable(
            self.settings,
            self.engine(),
            self.subscription.queue,
            REASONS[refused],
            consumer=self.subscription.consumer,
            envelope=envelope,
            error_class="UnauthenticMessage",
            attributed=False,
            message_digest=digest,
        )

    def _dead_letter_unreadable(
        self, envelope: Any, reason: str, digest: bytes | None = None
    ) -> None:
        record_unreadable(
            self.settings,
            self.engine(),
            self.subscription.queue,
            reason,
            consumer=self.subscription.consumer,
            envelope=envelope,
            message_digest=digest,
        )


def record_unreadable(
    settings: Settings,
    engine: Engine,
    queue: str,
    reason: str,
    *,
    consumer: str | None = None,
    envelope: Any = None,
    raw: bytes | None = None,
    event_type: str | None = None,
    event_ids: Sequence[uuid.UUID] = (),
    error_class: str = "UnprocessableMessage",
    attributed: bool = True,
    message_digest: bytes | None = None,
) -> None:
    """Dead-letter something that is not a processable event, keeping it for inspection.

    Events it carried (``event_ids``, or the envelope's own id) are marked dead for
    ``consumer``, so an ordered consumer's later events of their keys stop waiting —
    unless ``attributed`` is False (an unauthentic envelope: the ids it names are claims).
    NUL characters, which Postgres text cannot hold, are kept escaped as ``\\x00``.
    A ``raw`` message is recorded once per queue and bytes: one that comes back after it
    was recorded (the worker stopped before the broker let go of it) is not recorded again;
    nor is a dead letter with a ``message_digest`` (:meth:`DeliveredMessage.digest`)
    recorded already.
    """
    event_id = envelope_id(envelope) if attributed else None
    carried = list(event_ids) or ([event_id] if event_id is not None else [])
    try:
        envelope_json = json.dumps(_without_nul(envelope)) if envelope is not None else None
    except (TypeError, ValueError, RecursionError):
        envelope_json = None
    raw_text = _escape_nul(raw.decode("utf-8", "backslashreplace")) if raw is not None else None
    letter = ConsumeDeadLetter(
        event_id=event_id,
        consumer=consumer,
        event_type=event_type,
        queue=queue,
        reason=reason,
        error_class=error_class,
        error=reason,
        attempts=0,
        envelope=envelope_json,
        raw_message=raw_text,
        raw_digest=raw_digest(queue, raw) if raw is not None else None,
        message_digest=message_digest,
    )
    store = InboxStore(settings.schema_name)
    try:
        recorded = _store_unreadable(store, engine, letter, carried if attributed else [])
    except DataError:
        # Text jsonb refuses (a lone surrogate escape): keep it as ASCII JSON text instead.
        kept = raw_text if raw_text is not None else envelope_json
        letter = replace(letter, envelope=None, raw_message=kept)
        recorded = _store_unreadable(store, engine, letter, carried if attributed else [])
    if not recorded:
        log.warning("unprocessable message was dead-lettered already", extra={"queue": queue})
        return
    metrics.dead_letters.labels("consume", event_type or "unknown", error_class).inc()
    log.error("unprocessable message dead-lettered", extra={"queue": queue, "reason": reason})


def _store_unreadable(
    store: InboxStore, engine: Engine, letter: ConsumeDeadLetter, carried: Sequence[uuid.UUID]
) -> bool:
    """Record the dead letter: False when one with its digest is recorded already."""
    with engine.begin() as connection:
        if not store.dead_letter(connection, letter):
            return False
        if letter.consumer is not None and carried:
            store.give_up(connection, letter.consumer, carried, letter.reason)
    return True


def _escape_nul(text: str) -> str:
    return text.replace("\x00", "\\x00") if "\x00" in text else text


def _without_nul(value: Any) -> Any:
    """``value`` with NUL characters in its strings (and keys) escaped: jsonb refuses them."""
    if isinstance(value, str):
        return _escape_nul(value)
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nul(item) for item in value]
    return value


def envelope_id(envelope: Any) -> uuid.UUID | None:
    """The event id of something that looks like an envelope, else None."""
    if not isinstance(envelope, dict):
        return None
    try:
        return uuid.UUID(str(envelope.get("id")))
    except ValueError:
        return None


class _FollowUpsRefused(Exception):
    """The held follow-up events could not be inserted (the cause says why)."""


def _insert_held(held: DeferredEvents) -> None:
    """Insert the held follow-up events; a refusal other than a lost connection is raised
    as :class:`_FollowUpsRefused` (the message is then handled again, events inserted as
    they are published)."""
    try:
        held.insert()
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise
        raise _FollowUpsRefused() from exc
    except PermissionDeniedError as exc:
        raise _FollowUpsRefused() from exc


def _discard_held(mark: int) -> None:
    held = held_events()
    if held is not None:
        held.discard_after(mark)


def _lock_order(event: ReceivedEvent) -> int:
    return -1 if event.ordering_key is None else ordering_lock_bucket(event.ordering_key)


def _with_payload(event: ReceivedEvent, version: int, data: Any) -> ReceivedEvent:
    return replace(event, version=version, data=data)
