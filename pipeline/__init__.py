"""pipeline: transactional outbox and idempotent inbox on Postgres and Dramatiq/Redis.

The public API is importable from here; names load on first use (PEP 562), so the CLI
and ``import pipeline`` stay fast and do not pull in SQLAlchemy or OpenTelemetry until
something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.config import Settings, configure, get_settings, load_settings
    from pipeline.envelope import ReceivedEvent
    from pipeline.errors import (
        BacklogFull,
        ConfigurationError,
        EventValidationError,
        MigrationError,
        NotFoundError,
        PermissionDeniedError,
        PipelineError,
        ServiceUnavailableError,
        UnknownConsumerError,
    )
    from pipeline.inbox.consumer import consumer
    from pipeline.inbox.context import HandlerContext
    from pipeline.inbox.http import idempotent_post
    from pipeline.inbox.upcasting import upcaster
    from pipeline.outbox import (
        NewEvent,
        add_event,
        add_event_async,
        add_events,
        add_events_async,
    )

_EXPORTS = {
    "Settings": "pipeline.config",
    "configure": "pipeline.config",
    "get_settings": "pipeline.config",
    "load_settings": "pipeline.config",
    "ReceivedEvent": "pipeline.envelope",
    "BacklogFull": "pipeline.errors",
    "ConfigurationError": "pipeline.errors",
    "EventValidationError": "pipeline.errors",
    "MigrationError": "pipeline.errors",
    "NotFoundError": "pipeline.errors",
    "PermissionDeniedError": "pipeline.errors",
    "PipelineError": "pipeline.errors",
    "ServiceUnavailableError": "pipeline.errors",
    "UnknownConsumerError": "pipeline.errors",
    "consumer": "pipeline.inbox.consumer",
    "HandlerContext": "pipeline.inbox.context",
    "idempotent_post": "pipeline.inbox.http",
    "upcaster": "pipeline.inbox.upcasting",
    "NewEvent": "pipeline.outbox",
    "add_event": "pipeline.outbox",
    "add_event_async": "pipeline.outbox",
    "add_events": "pipeline.outbox",
    "add_events_async": "pipeline.outbox",
}

__all__ = [
    "BacklogFull",
    "ConfigurationError",
    "EventValidationError",
    "HandlerContext",
    "MigrationError",
    "NewEvent",
    "NotFoundError",
    "PermissionDeniedError",
    "PipelineError",
    "ReceivedEvent",
    "ServiceUnavailableError",
    "Settings",
    "UnknownConsumerError",
    "add_event",
    "add_event_async",
    "add_events",
    "add_events_async",
    "configure",
    "consumer",
    "get_settings",
    "idempotent_post",
    "load_settings",
    "upcaster",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
