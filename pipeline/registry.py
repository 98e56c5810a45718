"""Which consumers subscribe to which event types.

The relay routes each event to the queues of its subscribers, and workers run the
consumers' handlers, so both processes import the same application modules (the
``--app`` option or ``PIPELINE_APP_MODULES``) and thereby fill the same registry. A
subscription may come without a handler (a route to a consumer another process serves);
its policy is then the settings' defaults (:meth:`Subscription.policy`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Settings, validate_identifier
from pipeline.envelope import ReceivedEvent
from pipeline.errors import ConfigurationError, UnknownConsumerError
from pipeline.policy import ConsumerPolicy

WILDCARD = "*"
RESERVED_PREFIX = "pipeline."  # the pipeline's own events (the canary), unseen by "*"
CANARY_EVENT_TYPE = "pipeline.canary"
"""The end-to-end canary's event type: committed by the relay, handled by the inbox."""
CANARY_CONSUMER = "pipeline_canary"
"""The built-in consumer that records the canary's arrival."""


Handler = Callable[[ReceivedEvent, Any], None]
"""A consumer's handler: the event and its ``pipeline.inbox.HandlerContext``. The context
belongs to the inbox, a layer above; the ``@consumer`` decorator types it exactly."""


@dataclass(frozen=True)
class ConsumerDefinition:
    """A handler and what its consumer declared (None: the settings' default)."""

    name: str
    function: Handler
    max_retries: int | None = None
    min_backoff: float | None = None
    max_backoff: float | None = None
    non_retryable: tuple[type[BaseException], ...] = ()
    time_limit: float | None = None

    def policy(self, settings: Settings) -> ConsumerPolicy:
        return ConsumerPolicy.resolve(
            settings,
            self.name,
            max_retries=self.max_retries,
            min_backoff=self.min_backoff,
            max_backoff=self.max_backoff,
            time_limit=self.time_limit,
        )


@dataclass(frozen=True)
class Subscription:
    """A consumer's name, the event types it takes, and the Dramatiq queue it listens on."""

    consumer: str
    event_types: frozenset[str]
    queue: str
    actor_name: str
    ordered: bool = False
    handler: ConsumerDefinition | None = field(default=None, compare=False, hash=False)
    """The consumer's definition; None for a route to a consumer served elsewhere."""

    def policy(self, settings: Settings) -> ConsumerPolicy:
        """The declared policy, or the settings' defaults when the handler is not here."""
        if self.handler is None:
            return ConsumerPolicy.resolve(settings, self.consumer, declared=False)
        return self.handler.policy(settings)

    def accepts(self, event_type: str) -> bool:
        """Exact types, or ``"*"`` for every type except the reserved ``pipeline.*`` ones."""
        if event_type in self.event_types:
            return True
        return WILDCARD in self.event_types and not event_type.startswith(RESERVED_PREFIX)


_QUEUE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,99}$")
EVENT_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,199}$")
"""What an event type may be: the producer refuses others, so no consumer could get them."""


def validate_event_types(consumer: str, event_types: Iterable[str]) -> frozenset[str]:
    if isinstance(event_types, str | bytes) or not isinstance(event_types, Iterable):
        raise ConfigurationError(
            f"consumer {consumer!r}: event types must be a list such as [{event_types!r}], "
            f"not a {type(event_types).__name__} (a string would subscribe to its letters)"
        )
    types = frozenset(event_types)
    for event_type in sorted(types, key=repr):
        if event_type != WILDCARD and not (
            isinstance(event_type, str) and EVENT_TYPE.fullmatch(event_type)
        ):
            raise ConfigurationError(
                f"consumer {consumer!r}: invalid event type {event_type!r}: use 1-200 "
                'characters of letters, digits and _.:/- (or "*" for every type)'
            )
    return types


def validate_queue_name(queue: str) -> str:
    if not _QUEUE.fullmatch(queue):
        raise ConfigurationError(f"invalid queue name {queue!r}: use letters, digits and _.-")
    return queue


def queue_name_for(consumer: str) -> str:
    return f"pipeline.{consumer}"


def actor_name_for(consumer: str) -> str:
    return f"pipeline_inbox_{consumer}"


class Registry:
    """A thread-safe map of consumer name to :class:`Subscription`, with a route cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subscriptions: dict[str, Subscription] = {}
        self._routes: dict[str, tuple[Subscription, ...]] = {}

    def add(self, subscription: Subscription) -> None:
        validate_identifier(subscription.consumer, "consumer name")
        with self._lock:
            existing = self._subscriptions.get(subscription.consumer)
            if existing is not None and (
                existing != subscription or existing.handler is not subscription.handler
            ):
                raise ConfigurationError(
                    f"consumer {subscription.consumer!r} is registered twice with different "
                    "event types, queues or handlers"
                )
            self._subscriptions[subscription.consumer] = subscription
            self._routes.clear()

    def subscribe(
        self,
        consumer: str,
        event_types: Iterable[str],
        queue: str | None = None,
        *,
        ordered: bool = False,
        handler: ConsumerDefinition | None = None,
    ) -> Subscription:
        """Register a route; ``handler`` is None for a consumer served by another process."""
        validate_identifier(consumer, "consumer name")  # before it names a queue and an actor
        subscription = Subscription(
            consumer=consumer,
            event_types=validate_event_types(consumer, event_types),
            queue=validate_queue_name(queue_name_for(consumer) if queue is None else queue),
            actor_name=actor_name_for(consumer),
            ordered=ordered,
            handler=handler,
        )
        self.add(subscription)
        return subscription

    def remove(self, consumer: str) -> None:
        with self._lock:
            self._subscriptions.pop(consumer, None)
            self._routes.clear()

    def get(self, consumer: str) -> Subscription:
        try:
            return self._subscriptions[consumer]
        except KeyError:
            raise UnknownConsumerError(f"no consumer named {consumer!r} is registered") from None

    def routes_for(self, event_type: str) -> tuple[Subscription, ...]:
        """The subscriptions that receive ``event_type``, in a stable order."""
        routes = self._routes.get(event_type)
        if routes is None:
            with self._lock:
                routes = tuple(
                    s for _, s in sorted(self._subscriptions.items()) if s.accepts(event_type)
                )
                self._routes[event_type] = routes
        return routes

    def all(self) -> list[Subscription]:
        with self._lock:
            return [s for _, s in sorted(self._subscriptions.items())]

    def event_types(self) -> list[str]:
        """The event types some consumer subscribes to by name (``"*"`` left out), sorted."""
        return sorted({t for s in self.all() for t in s.event_types if t != WILDCARD})

    def policies(self, settings: Settings) -> list[ConsumerPolicy]:
        """Every subscribed consumer's policy (what the retention rule is judged on)."""
        return [s.policy(settings) for s in self.all()]

    def clear(self) -> None:
        with self._lock:
            self._subscriptions.clear()
            self._routes.clear()


registry = Registry()
"""The process-wide registry that the ``@consumer`` decorator fills."""
