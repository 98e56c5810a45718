"""pipeline: transactional outbox and idempotent inbox on Postgres and Dramatiq/Redis."""

from pipeline.config import Settings, configure, get_settings, load_settings
from pipeline.errors import (
    ConfigurationError,
    EventValidationError,
    MigrationError,
    NotFoundError,
    PipelineError,
    ServiceUnavailableError,
    UnknownConsumerError,
)
from pipeline.outbox import NewEvent, add_event, add_event_async, add_events, add_events_async

__all__ = [
    "ConfigurationError",
    "EventValidationError",
    "MigrationError",
    "NewEvent",
    "NotFoundError",
    "PipelineError",
    "ServiceUnavailableError",
    "Settings",
    "UnknownConsumerError",
    "add_event",
    "add_event_async",
    "add_events",
    "add_events_async",
    "configure",
    "get_settings",
    "load_settings",
]
