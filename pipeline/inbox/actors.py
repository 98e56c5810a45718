"""Inbox actors on the Dramatiq broker, and the worker-side safety nets.

* one actor per consumer, on the consumer's own queue, running :class:`InboxProcessor`;
* a middleware that dead-letters (in Postgres, with the reason) messages naming an
  actor nobody registered, and messages that ran out of infrastructure retries;
* a sink that dead-letters undecodable bytes found on a queue, and one that counts message
  ids found without a body (leftover duplicates, and deliveries whose body Redis lost).

Handler exceptions never reach Dramatiq (the processor retries them with its own
bookkeeping); what does reach it is an infrastructure failure (database or broker
down, the connection killed), which Dramatiq's Retries middleware re-delivers with
capped exponential backoff — counted and logged here, and made harmless by the inbox. A
copy of an event whose claim another transaction still holds (a duplicate delivery being
handled) is given back the same way, as :class:`CopyInFlight`: one INFO line, not counted.
Should the broker lose even that retry, the relay's ledger sweep delivers the event again.

An expected outage (:func:`pipeline.driver_errors.is_outage`: Postgres refusing or
dropping connections, Redis unreachable) is logged as one line per failed message —
error class, reason, actor, message id, the wait before the next try — with the
traceback at DEBUG only: the actor raises it to Dramatiq as :class:`InfrastructureRetry`
(a ``dramatiq.Retry``, which Dramatiq retries without logging it as an error). Any
other exception is a bug and keeps Dramatiq's error line with its traceback.
"""

from __future__ import annotations

import logging
import os
import random
import threading
from collections.abc import Callable
from typing import Any

import dramatiq
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import Middleware
from sqlalchemy import Engine

from pipeline.backoff import backoff_ceiling
from pipeline.config import Settings
from pipeline.db.connect import make_engine
from pipeline.db.stores.inbox import ClaimHeld
from pipeline.driver_errors import driver_reason, is_outage
from pipeline.inbox.consumer import definitions
from pipeline.inbox.processor import (
    DeliveredMessage,
    InboxProcessor,
    envelope_id,
    record_unreadable,
)
from pipeline.observability import metrics
from pipeline.policy import require_retention
from pipeline.registry import Registry, actor_name_for
from pipeline.transport.base import Transport
from pipeline.transport.messages import current_exception

log = logging.getLogger("pipeline.inbox")
INFRASTRUCTURE_RETRIES = 1000  # at up to a minute apart: most of a day before giving up
INFRASTRUCTURE_MIN_BACKOFF_MS = 100
INFRASTRUCTURE_MAX_BACKOFF_MS = 60_000
ACTOR_PREFIX = actor_name_for("")
REJECTED = "rejected"  # the part of a rejected message's dead letter (see DeliveredMessage)


class ProcessEngine:
    """One SQLAlchemy engine per OS process, created after Dramatiq forks its workers."""

    def __init__(self, settings: Settings, pool_size: int = 8) -> None:
        self.settings = settings
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._engine: Engine | None = None
        self._pid = 0

    def __call__(self) -> Engine:
        if self._engine is None or self._pid != os.getpid():
            with self._lock:
                if self._engine is None or self._pid != os.getpid():
                    # No pre-ping (a round trip per message): a connection that died
                    # with a Postgres restart fails its message, Dramatiq retries it, and
                    # SQLAlchemy recycles every pooled connection made before the failure.
                    self._engine = make_engine(
                        self.settings, pool_size=self.pool_size, max_overflow=self.pool_size
                    )
                    self._pid = os.getpid()
        return self._engine

    def dispose(self) -> None:
        if self._engine is not None and self._pid == os.getpid():
            self._engine.dispose()
        self._engine = None


class InfrastructureRetry(dramatiq.Retry):
    """An inbox message failed because a server is out of reach; retry it after ``delay``
    ms. Dramatiq retries a ``Retry`` without logging it as an error; the cause is the
    driver's exception, logged in one line by :class:`CountInfrastructureRetries`."""

    def __init__(self, cause: BaseException, delay: int) -> None:
        driver_error = getattr(cause, "orig", None) or cause  # SQLAlchemy's wrapper: the driver's
        super().__init__(driver_reason(driver_error), delay=delay)
        self.cause = cause


class CopyInFlight(InfrastructureRetry):
    """An inbox message given back because another transaction holds the claim of a copy
    of its event (:class:`pipeline.db.stores.inbox.ClaimHeld`): a duplicate delivery still
    being handled. Retried like an outage, but neither counted nor logged as one: tried
    again, it finds the other copy's outcome (a duplicate, or a claim to take over)."""


def failure_of(exception: BaseException | None) -> BaseException | None:
    """The exception that failed a message (the outage behind an :class:`InfrastructureRetry`)."""
    return exception.cause if isinstance(exception, InfrastructureRetry) else exception


def delivered_message(message: Any) -> DeliveredMessage:
    """What a Dramatiq message's dead letters are keyed by (:class:`DeliveredMessage`)."""
    return DeliveredMessage(
        queue=message.queue_name,
        message_id=message.message_id,
        actor_name=message.actor_name,
        args=list(message.args),
        kwargs=message.kwargs,
    )


class _CurrentMessage(threading.local):
    message: Any = None  # the message this worker thread is processing
    quiet_retry: str | None = None  # its id, once logged here: Dramatiq's line is DEBUG


_current = _CurrentMessage()


def infrastructure_delay_ms(retries: int) -> int:
    """The wait before the next try of a message that failed ``retries`` times before:
    doubling from the minimum to the maximum backoff, drawn from its upper half."""
    ceiling = backoff_ceiling(
        retries + 1, INFRASTRUCTURE_MIN_BACKOFF_MS, INFRASTRUCTURE_MAX_BACKOFF_MS
    )
    return int(random.uniform(ceiling / 2, ceiling))


def retry_outages(function: Any, *args: Any, **kwargs: Any) -> None:
    """Run the actor's work; an expected outage leaves as :class:`InfrastructureRetry`, a
    claim held by another copy's transaction as :class:`CopyInFlight`."""
    try:
        function(*args, **kwargs)
    except Exception as exc:
        message = _current.message
        held = isinstance(exc, ClaimHeld)
        if not (held or is_outage(exc)) or message is None:
            raise
        log.debug("message failed outside its handlers", exc_info=True)
        _current.quiet_retry = message.message_id
        delay = infrastructure_delay_ms(message.options.get("retries", 0))
        raise (CopyInFlight if held else InfrastructureRetry)(exc, delay) from exc


class QuietRetries(logging.Filter):
    """Dramatiq's own "Retrying message ..." line, for a message whose retry was just
    logged by :class:`CountInfrastructureRetries`, becomes DEBUG (one line per failure)."""

    def filter(self, record: logging.LogRecord) -> bool:
        quiet = _current.quiet_retry
        if quiet is None or not isinstance(record.args, tuple) or quiet not in record.args:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


RETRIES_LOGGER = "dramatiq.middleware.retries.Retries"  # Dramatiq's Retries middleware logs here


def quiet_dramatiq_retries() -> None:
    """Install :class:`QuietRetries` on Dramatiq's Retries logger (once)."""
    logger = logging.getLogger(RETRIES_LOGGER)
    if not any(isinstance(f, QuietRetries) for f in logger.filters):
        logger.addFilter(QuietRetries())


class CountInfrastructureRetries(Middleware):
    """One metric increment and one log line per inbox message that failed outside its
    handlers (Dramatiq's Retries middleware sends it again); a :class:`CopyInFlight` is
    one INFO line and no increment."""

    def before_process_message(self, broker: Any, message: Any) -> None:
        _current.message = message
        _current.quiet_retry = None

    def after_process_message(
        self, broker: Any, message: Any, *, result: Any = None, exception: Any = None
    ) -> None:
        _current.message = None  # quiet_retry stays: Dramatiq's Retries may log after this
        if exception is None or not message.actor_name.startswith(ACTOR_PREFIX):
            return
        consumer = message.actor_name.removeprefix(ACTOR_PREFIX)
        if isinstance(exception, CopyInFlight):
            log.info(
                "another copy of the message is being handled; it will be tried again",
                extra={
                    "consumer": consumer,
                    "actor": message.actor_name,
                    "message_id": message.message_id,
                    "retries": message.options.get("retries", 0),
                    "retry_in": round((exception.delay or 0) / 1000, 3),
                },
            )
            return
        failure = failure_of(exception)
        error_class = type(failure).__name__
        metrics.inbox_infrastructure_retries.labels(consumer, error_class).inc()
        fields: dict[str, Any] = {
            "consumer": consumer,
            "actor": message.actor_name,
            "message_id": message.message_id,
            "error_class": error_class,
            "retries": message.options.get("retries", 0),
        }
        if isinstance(exception, InfrastructureRetry):
            fields["reason"] = str(exception)
            fields["retry_in"] = round((exception.delay or 0) / 1000, 3)
        log.warning("message failed outside its handlers; it will be retried", extra=fields)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        _current.message = None


class DeadLetterUnknownActors(Middleware):
    """Dead-letter, with a clear reason, what no actor of this process can handle."""

    def __init__(self, settings: Settings, engine: ProcessEngine) -> None:
        self.settings = settings
        self.engine = engine

    def before_nack(self, broker: Any, message: Any) -> None:
        """Every message Dramatiq rejects passes here: unknown actors and exhausted retries."""
        exception = current_exception(message)
        if not isinstance(exception, ActorNotFound) and not message.actor_name.startswith(
            ACTOR_PREFIX
        ):
            # Another of the pipeline's actors (the publishing actor, which never retries:
            # its leases expire and its events are claimed again) carries no delivery.
            return
        if isinstance(exception, ActorNotFound):
            reason = (
                f"message names actor {message.actor_name!r}, which no consumer in this worker "
                "registered (unknown consumer)"
            )
        else:
            reason = f"gave up after infrastructure retries: {type(failure_of(exception)).__name__}"
        envelopes = message.args[0] if message.args and isinstance(message.args[0], list) else []
        carried = [i for i in (envelope_id(e) for e in envelopes) if i is not None]
        consumer = message.actor_name.removeprefix(ACTOR_PREFIX)
        try:
            record_unreadable(
                self.settings,
                self.engine(),
                message.queue_name,
                reason,
                consumer=consumer if message.actor_name.startswith(ACTOR_PREFIX) else None,
                envelope={"actor_name": message.actor_name, "args": list(message.args)},
                event_ids=carried,
                message_digest=delivered_message(message).digest(REJECTED),
            )
        except Exception:  # the message itself stays in Dramatiq's dead-letter queue
            log.exception("could not record a dead letter", extra={"queue": message.queue_name})


def message_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """The envelopes and deferral count an inbox message carries: one positional argument
    and at most a ``deferrals`` count. (None, 0) for arguments no inbox actor can take."""
    deferrals = kwargs.get("deferrals", 0)
    if (
        len(args) != 1
        or set(kwargs) - {"deferrals"}
        or not isinstance(deferrals, int)
        or isinstance(deferrals, bool)
        or not 0 <= deferrals <= 1_000_000
    ):
        return None, 0
    return args[0], deferrals


def inbox_function(processor: InboxProcessor) -> Callable[..., None]:
    """The function of a consumer's actor: takes whatever arguments a message carries (a
    message is data, not a call the broker vouches for) and dead-letters those that do
    not fit at once, instead of failing like an infrastructure error and being retried."""

    def run(*args: Any, **kwargs: Any) -> None:
        message = _current.message  # the message this thread runs: dead letters are keyed by it
        delivered = None if message is None else delivered_message(message)
        envelopes, deferrals = message_arguments(args, kwargs)
        if envelopes is None:
            retry_outages(processor.dead_letter_arguments, args, kwargs, delivered)
            return
        retry_outages(processor.handle, envelopes, deferrals, delivered)

    return run


def count_missing_bodies(queue: str, duplicates: int, lost: int) -> None:
    """Message ids fetched without a body: counted and dropped, never dead-lettered.

    A duplicate's message already finished; a lost delivery is sent again by the relay's
    delivery ledger once its redelivery horizon passes.
    """
    if duplicates:
        metrics.inbox_duplicates_dropped.labels(queue).inc(duplicates)
    if lost:
        metrics.deliveries_lost.labels(queue).inc(lost)
    log.log(
        logging.WARNING if lost else logging.INFO,
        "dropped message ids without a body"
        + (f"; {lost} lost, the relay's ledger sends them again" if lost else ""),
        extra={"queue": queue, "duplicates": duplicates, "lost": lost},
    )


def declare_inbox_actors(
    transport: Transport, settings: Settings, consumers: Registry, engine: ProcessEngine
) -> dict[str, dramatiq.Actor[Any, Any]]:
    """Bind an inbox actor for every consumer with a handler in this process."""
    require_retention(settings, consumers.policies(settings))  # before anything is declared
    broker = transport.broker
    broker.add_middleware(DeadLetterUnknownActors(settings, engine))
    broker.add_middleware(CountInfrastructureRetries())
    quiet_dramatiq_retries()
    transport.on_undecodable(
        lambda queue, data, reason: record_unreadable(settings, engine(), queue, reason, raw=data)
    )
    transport.on_missing_body(count_missing_bodies)
    actors: dict[str, dramatiq.Actor[Any, Any]] = {}
    for subscription, definition in definitions(consumers):
        actor_ref: list[dramatiq.Actor[Any, Any]] = []

        def resend(
            envelopes: list[dict[str, Any]],
            delay: float,
            deferrals: int,
            ref: list[Any] = actor_ref,
        ) -> None:
            kwargs = {"deferrals": deferrals} if deferrals else None
            ref[0].send_with_options(args=(envelopes,), kwargs=kwargs, delay=int(delay * 1000))

        processor = InboxProcessor(settings, subscription, definition, engine, resend)
        options: dict[str, Any] = {
            "max_retries": INFRASTRUCTURE_RETRIES,
            "min_backoff": INFRASTRUCTURE_MIN_BACKOFF_MS,
            "max_backoff": INFRASTRUCTURE_MAX_BACKOFF_MS,
        }
        if processor.policy.time_limit_ms is not None:
            options["time_limit"] = processor.policy.time_limit_ms

        actor: dramatiq.Actor[Any, Any] = dramatiq.Actor(
            inbox_function(processor),
            broker=broker,
            actor_name=subscription.actor_name,
            queue_name=subscription.queue,
            priority=0,
            options=options,
        )
        actor_ref.append(actor)
        actors[subscription.consumer] = actor
    return actors
