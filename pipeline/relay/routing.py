"""Events sent to nobody: the check a relay or publishing worker makes before it starts.

The relay marks an event sent without delivering it when no registered consumer takes its
type (``pipeline_events_unrouted_total``); nothing owes it a delivery, so it is never sent
again by itself. The usual cause is a process started without the application modules
that register the consumers (``PIPELINE_APP_MODULES``), so before publishing, a relay or
publishing worker looks at the event types waiting in the outbox and refuses to start when
some have no consumer, unless ``PIPELINE_ALLOW_UNROUTED=1`` (``--allow-unrouted``) says
events without consumers are meant. Events already sent to nobody are listed by
``pipeline dlq unrouted`` and sent again by ``pipeline dlq resend-unrouted``.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.stores.unrouted import UnroutedStore
from pipeline.errors import ConfigurationError
from pipeline.registry import Registry

log = logging.getLogger("pipeline.relay")


def unrouted_waiting(
    conn: psycopg.Connection[Any], settings: Settings, registry: Registry
) -> dict[str, int]:
    """Events waiting to be published whose type no consumer in ``registry`` takes, by type."""
    waiting = UnroutedStore(settings.schema_name).unsent_event_types(conn)
    return {
        event_type: n for event_type, n in waiting.items() if not registry.routes_for(event_type)
    }


def check_routes(
    conn: psycopg.Connection[Any], settings: Settings, registry: Registry, command: str
) -> dict[str, int]:
    """Raise :class:`ConfigurationError` (one line) if waiting events have no consumer.

    With ``settings.allow_unrouted`` it logs a warning instead and returns them.
    """
    missing = unrouted_waiting(conn, settings, registry)
    if not missing:
        return missing
    listed = ", ".join(f"{t} ({n})" for t, n in sorted(missing.items()))
    if settings.allow_unrouted:
        log.warning(
            f"events waiting for types no consumer takes will be sent to nobody: {listed}",
            extra={"event_types": sorted(missing)},
        )
        return missing
    modules = settings.app_modules or "(none)"
    raise ConfigurationError(
        f"{command}: events are waiting whose type no registered consumer takes: {listed}; "
        f"they would be sent to nobody. Load the modules that register their consumers "
        f"(PIPELINE_APP_MODULES / --app, now {modules}), or set PIPELINE_ALLOW_UNROUTED=1 "
        "(--allow-unrouted) if no consumer is meant"
    )
