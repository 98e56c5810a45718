"""Inbox actors on the Dramatiq broker, and the worker-side safety nets.

* one actor per consumer, on the consumer's own queue, running :class:`InboxProcessor`;
* a middleware that dead-letters (in Postgres, with the reason) messages naming an
  actor nobody registered, and messages that ran out of infrastructure retries;
* a sink that dead-letters undecodable bytes found on a queue.

Handler exceptions never reach Dramatiq (the processor retries them with its own
bookkeeping); what does reach it is an infrastructure failure (database or Redis
down), which Dramatiq's Retries middleware re-delivers with backoff — the inbox
makes the re-delivery harmless.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import dramatiq
from dramatiq.errors import ActorNotFound
from dramatiq.middleware import Middleware
from sqlalchemy import Engine

from pipeline.config import Settings
from pipeline.db.connect import make_engine
from pipeline.inbox.consumer import check_retention, definitions
from pipeline.inbox.processor import InboxProcessor, envelope_id, record_unreadable
from pipeline.registry import Registry, actor_name_for

log = logging.getLogger("pipeline.inbox")
INFRASTRUCTURE_RETRIES = 1000
ACTOR_PREFIX = actor_name_for("")


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


class DeadLetterUnknownActors(Middleware):
    """Dead-letter, with a clear reason, what no actor of this process can handle."""

    def __init__(self, settings: Settings, engine: ProcessEngine) -> None:
        self.settings = settings
        self.engine = engine

    def before_nack(self, broker: Any, message: Any) -> None:
        """Every message Dramatiq rejects passes here: unknown actors and exhausted retries."""
        exception = getattr(message, "_exception", None)
        if isinstance(exception, ActorNotFound):
            reason = (
                f"message names actor {message.actor_name!r}, which no consumer in this worker "
                "registered (unknown consumer)"
            )
        else:
            reason = f"gave up after infrastructure retries: {type(exception).__name__}"
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
            )
        except Exception:  # the message itself stays in Dramatiq's dead-letter queue
            log.exception("could not record a dead letter", extra={"queue": message.queue_name})


def declare_inbox_actors(
    broker: Any, settings: Settings, consumers: Registry, engine: ProcessEngine
) -> dict[str, dramatiq.Actor[Any, Any]]:
    """Bind an inbox actor for every consumer with a handler in this process."""
    check_retention(settings, consumers)
    broker.add_middleware(DeadLetterUnknownActors(settings, engine))
    broker.undecodable_sink = lambda queue, data, reason: record_unreadable(
        settings, engine(), queue, reason, raw=data
    )
    actors: dict[str, dramatiq.Actor[Any, Any]] = {}
    for subscription, definition in definitions(consumers):
        actor_ref: list[dramatiq.Actor[Any, Any]] = []

        def resend(
            envelopes: list[dict[str, Any]], delay: float, ref: list[Any] = actor_ref
        ) -> None:
            ref[0].send_with_options(args=(envelopes,), delay=int(delay * 1000))

        processor = InboxProcessor(settings, subscription, definition, engine, resend)
        options: dict[str, Any] = {
            "max_retries": INFRASTRUCTURE_RETRIES,
            "min_backoff": 100,
            "max_backoff": 60_000,
        }
        if definition.time_limit is not None:
            options["time_limit"] = int(definition.time_limit * 1000)

        def run(envelopes: Any, processor: InboxProcessor = processor) -> None:
            processor.handle(envelopes)

        actor: dramatiq.Actor[Any, Any] = dramatiq.Actor(
            run,
            broker=broker,
            actor_name=subscription.actor_name,
            queue_name=subscription.queue,
            priority=0,
            options=options,
        )
        actor_ref.append(actor)
        actors[subscription.consumer] = actor
    return actors
