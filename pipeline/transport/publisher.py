"""The publisher port: how the relay hands a transport its deliveries.

The relay hands a publisher *deliveries*: one consumer and a run of events for it.
Each delivery must be all-or-nothing and keep its events in order, which is what
lets the relay keep per-key order without waiting for the broker one event at a
time. Other transports (HTTP webhooks, NATS JetStream with dedup ids, Kafka) fit
the same :class:`Publisher` protocol: deliver each delivery atomically and report
an outcome per delivery. A transport makes its publisher
(:meth:`pipeline.transport.base.Transport.publisher`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from pipeline.envelope import OutboxEvent
from pipeline.errors import PermanentPublishError, PublisherUnavailable
from pipeline.registry import Subscription

__all__ = [
    "Delivery",
    "PermanentPublishError",
    "Publisher",
    "PublisherUnavailable",
]


@dataclass(frozen=True)
class Delivery:
    """A run of events for one consumer, delivered as one unit, in order."""

    subscription: Subscription
    events: Sequence[OutboxEvent]


class Publisher(Protocol):
    """Delivers each :class:`Delivery` atomically; returns one outcome per delivery.

    ``None`` means the broker accepted it; an exception is the reason it was not
    (counted as a failed attempt of its events). Raising :class:`PublisherUnavailable`
    means the transport is down: the batch is given back without counting an attempt.
    Every failure of the transport itself (connection, timeout, a server that refuses
    writes) must raise it, never escape as another exception.
    """

    def deliver(self, deliveries: Sequence[Delivery]) -> list[BaseException | None]: ...

    def oldest_waiting(self, queue: str) -> datetime | None:
        """When the oldest delivery still in flight for ``queue`` was handed over (waiting
        in the transport, or taken by a live consumer that has not acknowledged it yet), or
        None when none is (the ledger sweep leaves younger deliveries alone)."""
        ...

    def forgot(self) -> bool:
        """Whether the transport has lost what it held since this was last asked (a broker
        restarted empty): the ledger then sends what is owed at once instead of after the
        horizon. False when the transport cannot tell; the horizon remains the backstop."""
        ...

    def close(self) -> None: ...
