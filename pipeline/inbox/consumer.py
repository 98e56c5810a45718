"""The ``@consumer`` decorator: register a handler for a set of event types.

::

    @consumer("billing", ["order.placed"], max_retries=5, non_retryable=[CardDeclined])
    def charge(event: ReceivedEvent, ctx: HandlerContext) -> None:
        ...

Each consumer gets its own Dramatiq queue and inbox actor (declared by the worker
runtime), and the relay routes its event types to that queue.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from pipeline.config import MAX_COUNT, MAX_INTERVAL
from pipeline.envelope import ReceivedEvent
from pipeline.errors import ConfigurationError
from pipeline.inbox.context import HandlerContext
from pipeline.registry import (
    ConsumerDefinition,
    Registry,
    Subscription,
    registry,
    validate_event_types,
)

__all__ = ["ConsumerDefinition", "Handler", "consumer", "definitions"]

Handler = Callable[[ReceivedEvent, HandlerContext], None]


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
    """Register ``function`` as consumer ``name`` of ``event_types`` (``"*"`` for all).

    Every option is checked here, where the mistake is made: ``event_types`` must be a
    list (a string would subscribe to its letters), the numbers finite and in range.
    """
    types = validate_event_types(name, event_types)
    if not types:
        raise ConfigurationError(f"consumer {name!r} subscribes to no event types")
    if max_retries is not None and (
        isinstance(max_retries, bool)
        or not isinstance(max_retries, int)
        or not 0 <= max_retries <= MAX_COUNT
    ):
        raise ConfigurationError(
            f"consumer {name!r}: max_retries must be a whole number from 0 to {MAX_COUNT}"
        )
    for option, value in (
        ("min_backoff", min_backoff),
        ("max_backoff", max_backoff),
        ("time_limit", time_limit),
    ):
        _check_seconds(name, option, value)

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


def _check_seconds(name: str, option: str, value: object) -> None:
    """A number of seconds: finite, above 0, at most a week (``None``: the default)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_INTERVAL
    ):
        raise ConfigurationError(
            f"consumer {name!r}: {option} must be a number of seconds above 0 and at most "
            f"{MAX_INTERVAL:g} (a week), not {value!r}"
        )


def definitions(consumers: Registry) -> list[tuple[Subscription, ConsumerDefinition]]:
    """The registered consumers that have a handler in this process."""
    return [(s, s.handler) for s in consumers.all() if s.handler is not None]
