"""The ``@consumer`` decorator: register a handler for a set of event types.

::

    @consumer("billing", ["order.placed"], max_retries=5, non_retryable=[CardDeclined])
    def charge(event: ReceivedEvent, ctx: HandlerContext) -> None:
        ...

Each consumer gets its own Dramatiq queue and inbox actor (declared by the worker
runtime), and the relay routes its event types to that queue.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pipeline.config import Settings
from pipeline.envelope import ReceivedEvent
from pipeline.errors import ConfigurationError
from pipeline.inbox.context import HandlerContext
from pipeline.registry import Registry, Subscription, registry

Handler = Callable[[ReceivedEvent, HandlerContext], None]


@dataclass(frozen=True)
class ConsumerDefinition:
    """A handler and its retry, ordering and time-limit options (None: the settings' default)."""

    name: str
    function: Handler
    max_retries: int | None = None
    min_backoff: float | None = None
    max_backoff: float | None = None
    non_retryable: tuple[type[BaseException], ...] = ()
    time_limit: float | None = None

    def retries(self, settings: Settings) -> int:
        return self.max_retries if self.max_retries is not None else settings.consumer_max_retries

    def backoff_bounds(self, settings: Settings) -> tuple[float, float]:
        low = self.min_backoff if self.min_backoff is not None else settings.consumer_backoff_min
        high = self.max_backoff if self.max_backoff is not None else settings.consumer_backoff_max
        return low, max(low, high)

    def retry_horizon(self, settings: Settings) -> float:
        """The longest a copy of one event can come after its first attempt (seconds): every
        retry at its longest backoff, then the ledger's redelivery horizon."""
        retries = self.retries(settings) * self.backoff_bounds(settings)[1]
        return retries + settings.redelivery_horizon_seconds


def consumer(
    name: str,
    event_types: Iterable[str],
    *,
    ordered: bool = False,
    queue: str | None = None,
    max_retries: int | None = None,
    min_backoff: float | None = None,
    max_backoff: float | None = None,
    non_retryable: Iterable[type[BaseException]] = (),
    time_limit: float | None = None,
    registry: Registry = registry,
) -> Callable[[Handler], Handler]:
    """Register ``function`` as consumer ``name`` of ``event_types`` (``"*"`` for all)."""
    types = frozenset(event_types)
    if not types:
        raise ConfigurationError(f"consumer {name!r} subscribes to no event types")
    if max_retries is not None and max_retries < 0:
        raise ConfigurationError(f"consumer {name!r}: max_retries must be >= 0")

    def decorate(function: Handler) -> Handler:
        definition = ConsumerDefinition(
            name=name,
            function=function,
            max_retries=max_retries,
            min_backoff=min_backoff,
            max_backoff=max_backoff,
            non_retryable=tuple(non_retryable),
            time_limit=time_limit,
        )
        registry.subscribe(name, types, queue, ordered=ordered, handler=definition)
        return function

    return decorate


def definitions(consumers: Registry) -> list[tuple[Subscription, ConsumerDefinition]]:
    """The registered consumers that have a handler in this process."""
    return [(s, s.handler) for s in consumers.all() if isinstance(s.handler, ConsumerDefinition)]


def check_retention(settings: Settings, consumers: Registry) -> None:
    """Refuse an inbox retention shorter than the longest retry horizon.

    A retry that arrives after its inbox row was pruned would run the handler again,
    so pruning must never outpace retries.
    """
    for subscription, definition in definitions(consumers):
        horizon = definition.retry_horizon(settings)
        if settings.inbox_retention_seconds < horizon:
            raise ConfigurationError(
                f"PIPELINE_INBOX_RETENTION_SECONDS={settings.inbox_retention_seconds} is shorter "
                f"than consumer {subscription.consumer!r}'s retry horizon of {horizon:.0f} s "
                "(max_retries x max_backoff + PIPELINE_REDELIVERY_HORIZON_SECONDS); a late copy "
                "could be processed twice"
            )
