"""``pipeline dlq unrouted`` and ``resend-unrouted``: events that were sent to no consumer.

An event is sent to nobody when no registered consumer took its type at the time (a relay
or publishing worker started without the modules that register its consumers, with
``PIPELINE_ALLOW_UNROUTED=1``, or an older version that did not check). Once the consumers
exist, ``resend-unrouted`` puts such events back to pending, due now; the relay publishes
them to the consumers that take their types now, in their keys' order. Events whose type
still has no consumer in this command's registry (``PIPELINE_APP_MODULES`` / ``--app``) are
left alone: sent again they would reach nobody again. The action is audited; a dry run
changes nothing and is not.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Settings
from pipeline.db.migrate import notify_channel
from pipeline.db.stores.unrouted import UnroutedEvent, UnroutedStore
from pipeline.driver_errors import wrap_driver_errors
from pipeline.registry import Registry
from pipeline.tools.ops.audit import begin_action
from pipeline.tools.ops.dlq.access import open_connection, require_grants

BATCH = 1000
AUDIT_LISTED = 100  # event ids kept in the audit record's parameters


@dataclass
class ResendReport:
    """What a resend would do (dry run) or did: the events with a consumer now, and those
    still without one (left alone)."""

    routable: list[UnroutedEvent]
    without_consumer: list[UnroutedEvent]
    dry_run: bool
    audit_id: int | None = None
    resent: list[uuid.UUID] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "dry_run": self.dry_run,
            "routable": [event.as_json() for event in self.routable],
            "still_without_consumer": [event.as_json() for event in self.without_consumer],
        }
        if not self.dry_run:
            data |= {"audit_id": self.audit_id, "resent": [str(i) for i in self.resent]}
        return data


def list_unrouted(
    settings: Settings, *, limit: int | None, event_types: Sequence[str] = ()
) -> list[UnroutedEvent]:
    """Events sent to no consumer, oldest first."""
    with wrap_driver_errors(settings), open_connection(settings) as conn:
        return UnroutedStore(settings.schema_name).events(conn, limit, event_types or None)


def resend_unrouted(
    settings: Settings,
    registry: Registry,
    *,
    event_types: Sequence[str] = (),
    limit: int | None = None,
    dry_run: bool = True,
    reason: str = "",
) -> ResendReport:
    """Put the unrouted events whose types have a consumer in ``registry`` back to pending."""
    store = UnroutedStore(settings.schema_name)
    with wrap_driver_errors(settings), open_connection(settings) as conn:
        events = store.events(conn, limit, event_types or None)
        routable = [e for e in events if registry.routes_for(e.event_type)]
        without = [e for e in events if not registry.routes_for(e.event_type)]
        if dry_run:
            return ResendReport(routable, without, dry_run=True)
        require_grants(conn, settings, "pipeline dlq resend-unrouted", replay=True)
        parameters = {
            "event_types": sorted({e.event_type for e in routable}),
            "events": [str(e.id) for e in routable[:AUDIT_LISTED]],
        }
        audit_id = begin_action(
            conn, settings.schema_name, "dlq.resend_unrouted", reason, parameters
        )
        resent: list[uuid.UUID] = []
        ids = [e.id for e in routable]
        for start in range(0, len(ids), BATCH):
            with conn.transaction():
                batch = store.resend(conn, ids[start : start + BATCH])
                store.count_affected(conn, audit_id, len(batch))
            resent += batch
        if resent:
            store.wake_relays(conn, notify_channel(settings.schema_name))
    return ResendReport(routable, without, dry_run=False, audit_id=audit_id, resent=resent)


def render_unrouted(events: Sequence[UnroutedEvent], limit: int | None) -> list[str]:
    if not events:
        return ["no events were sent to no consumer"]
    lines = [
        f"{e.id}  {e.event_type}  {e.aggregate_type or '-'}/{e.aggregate_id or '-'}  "
        f"created {e.created_at:%Y-%m-%d %H:%M:%S}  sent "
        + (f"{e.published_at:%Y-%m-%d %H:%M:%S}" if e.published_at else "-")
        for e in events
    ]
    more = f" (at most {limit} listed)" if limit is not None and len(events) >= limit else ""
    lines.append(f"{len(events)} event(s) sent to no consumer{more}")
    return lines


def render_resend(report: ResendReport) -> list[str]:
    lines: list[str] = []
    if report.without_consumer:
        types = sorted({e.event_type for e in report.without_consumer})
        lines.append(
            f"{len(report.without_consumer)} event(s) left alone: no registered consumer takes "
            f"{', '.join(types)} (load its modules with PIPELINE_APP_MODULES / --app)"
        )
    if report.dry_run:
        by_type: dict[str, int] = {}
        for event in report.routable:
            by_type[event.event_type] = by_type.get(event.event_type, 0) + 1
        for event_type, count in sorted(by_type.items()):
            lines.append(f"would send again: {count} {event_type}")
        lines.append(
            f"dry run: {len(report.routable)} event(s) would go back to pending and be "
            "published to their consumers; nothing changed"
        )
    else:
        lines.append(
            f"sent again: {len(report.resent)} event(s) back to pending; the relay publishes "
            f"them (audit record #{report.audit_id})"
        )
    return lines
