"""Run a consumer's handler on an event without keeping anything it does.

``pipeline dlq replay --to-sandbox`` shows an operator what a replay would do before
doing it. The handler runs as a replay would run it: the envelope is encoded from the
event exactly as the relay encodes it, upcasters apply, the attempt is 1 (a replay
starts the count again) and the idempotency keys are the real ones — but in a
transaction that is always rolled back. The handler's session joins that transaction
through a savepoint, so even a handler that commits its session commits nothing. Calls
made through the idempotency helper are recorded, never sent (see ``inbox/http.py``).

What a sandbox cannot hold back: effects outside the session and the helper (another
HTTP client, files, e-mail), and sequence numbers that rolled-back inserts consumed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from pipeline.envelope import OutboxEvent, decode_envelope, encode_envelope
from pipeline.errors import ConfigurationError, error_text
from pipeline.inbox.consumer import ConsumerDefinition
from pipeline.inbox.context import ExternalCall, HandlerContext, SandboxLog
from pipeline.inbox.upcasting import Upcasters, upcasters
from pipeline.redaction import redact_url
from pipeline.registry import Subscription


@dataclass
class SandboxOutcome:
    """What the handler did with one event: it returned (``ok``) or raised."""

    consumer: str
    event_id: uuid.UUID
    event_type: str
    ok: bool
    error_class: str | None = None
    error: str | None = None
    retryable: bool | None = None
    """For an error: whether the inbox would retry it (else it dead-letters at once)."""
    published: list[tuple[str, uuid.UUID]] = field(default_factory=list)
    external_calls: list[ExternalCall] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "event_id": str(self.event_id),
            "event_type": self.event_type,
            "outcome": "ok" if self.ok else "error",
            "error_class": self.error_class,
            "error": self.error,
            "retryable": self.retryable,
            "published": [{"type": t, "id": str(i)} for t, i in self.published],
            "external_calls": [
                {"method": c.method, "url": redact_url(c.url), "idempotency_key": c.idempotency_key}
                for c in self.external_calls
            ],
        }


def handler_of(subscription: Subscription) -> ConsumerDefinition:
    """The consumer's handler, or a clear error when this process did not import it."""
    if not isinstance(subscription.handler, ConsumerDefinition):
        raise ConfigurationError(
            f"consumer {subscription.consumer!r} has no handler in this process: name the "
            "module that registers it in PIPELINE_APP_MODULES (or --app)"
        )
    return subscription.handler


def run_in_sandbox(
    engine: Engine,
    subscription: Subscription,
    event: OutboxEvent,
    source: str,
    upcaster_registry: Upcasters = upcasters,
) -> SandboxOutcome:
    """Run the handler on ``event`` in a transaction that is rolled back, whatever happens."""
    definition = handler_of(subscription)
    received = decode_envelope(json.loads(encode_envelope(event, source)))
    log = SandboxLog()
    outcome = SandboxOutcome(subscription.consumer, received.id, received.type, ok=True)
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            with Session(bind=connection, join_transaction_mode="create_savepoint") as session:
                try:
                    version, data = upcaster_registry.upcast(
                        received.type, received.version, received.data
                    )
                    current = (
                        received
                        if version == received.version
                        else replace(received, version=version, data=data)
                    )
                    context = HandlerContext(
                        current,
                        session,
                        subscription.consumer,
                        1,
                        subscription.queue,
                        sandbox=log,
                    )
                    definition.function(current, context)
                    session.flush()
                except Exception as exc:
                    outcome.ok = False
                    outcome.error_class = type(exc).__name__
                    outcome.error = error_text(exc)
                    outcome.retryable = not isinstance(exc, definition.non_retryable)
        finally:
            transaction.rollback()
    outcome.published = list(log.published)
    outcome.external_calls = list(log.external_calls)
    return outcome
