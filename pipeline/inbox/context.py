"""What a handler gets besides the event: its transaction, keys, and follow-up publishing.

A context may be a *sandbox* (``pipeline dlq replay --to-sandbox``): the handler runs in
a transaction that is always rolled back, and :func:`pipeline.inbox.http.idempotent_post`
records the calls it would make instead of making them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from pipeline.envelope import ReceivedEvent
from pipeline.inbox.idempotency import idempotency_key
from pipeline.outbox import add_event


@dataclass(frozen=True)
class ExternalCall:
    """A call the idempotency helper did not make in a sandbox (no body: it may hold data)."""

    method: str
    url: str
    idempotency_key: str


@dataclass
class SandboxLog:
    """What a handler did in a sandbox: the events it published, the calls it would make."""

    published: list[tuple[str, uuid.UUID]] = field(default_factory=list)
    external_calls: list[ExternalCall] = field(default_factory=list)


@dataclass
class HandlerContext:
    """The handler's view of one attempt at one event.

    ``session`` is in the same transaction as the inbox record: everything the handler
    writes commits together with "processed", or not at all. ``idempotency_key`` is
    the same on every attempt of this (consumer, event); use :meth:`step_key` when a
    handler makes several external calls.
    """

    event: ReceivedEvent
    session: Session
    consumer: str
    attempt: int
    queue: str
    published: list[uuid.UUID] = field(default_factory=list)
    sandbox: SandboxLog | None = None
    """Set in a sandbox run: external calls are recorded here, never made."""

    @property
    def idempotency_key(self) -> str:
        return idempotency_key(self.consumer, self.event.id)

    def step_key(self, step: str) -> str:
        """A key per external call of this handler ("charge", "email", ...)."""
        return idempotency_key(self.consumer, self.event.id, step)

    def publish(self, event_type: str, payload: Any, **fields: Any) -> uuid.UUID:
        """Add a follow-up event in this transaction, caused by (and correlated with) this one."""
        fields.setdefault("causation_id", self.event.id)
        correlation = self.event.correlation_id
        if correlation is not None:
            fields.setdefault("correlation_id", uuid.UUID(correlation))
        event_id = add_event(self.session, event_type, payload, **fields)
        self.published.append(event_id)
        if self.sandbox is not None:
            self.sandbox.published.append((event_type, event_id))
        return event_id
