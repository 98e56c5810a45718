"""An event's lineage from the database: what ``pipeline trace EVENT_ID`` shows.

Everything the pipeline did to an event is in Postgres — the outbox row, failed attempts,
each consumer's inbox record, dead letters, and follow-up events (by causation id) — so
an operator can follow one event, or a whole workflow, without a tracing backend. The
trace id ties it to the distributed trace when one is exported.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

import psycopg

from pipeline.config import Settings
from pipeline.db.connect import connect
from pipeline.db.stores.lineage import AttemptRow, DeadLetterRow, InboxRow, LineageStore
from pipeline.driver_errors import wrap_driver_errors
from pipeline.errors import NotFoundError
from pipeline.policy import redelivery_horizon

MAX_DEPTH = 20


@dataclass
class Delivery(InboxRow):
    """One consumer's record of the event; ``owed`` once it has no outcome past the horizon."""

    owed: bool = False


@dataclass
class Lineage:
    id: uuid.UUID
    seq: int
    event_type: str
    event_version: int
    aggregate: str | None
    ordering_key: str | None
    status: str
    publish_attempts: int
    created_at: datetime
    published_at: datetime | None
    trace_id: str | None
    correlation_id: str | None
    causation_id: str | None
    failed_attempts: list[AttemptRow] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    dead_letters: list[DeadLetterRow] = field(default_factory=list)
    follow_ups: list[Lineage] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        def convert(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            if isinstance(value, list):
                return [convert(v) for v in value]
            if isinstance(value, datetime):
                return value.isoformat()
            if isinstance(value, uuid.UUID):
                return str(value)
            return value

        result: dict[str, Any] = convert(asdict(self))
        return result


def _trace_id(traceparent: str | None) -> str | None:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None


def load_lineage(
    conn: psycopg.Connection[Any],
    schema: str,
    event_id: uuid.UUID,
    depth: int = 0,
    horizon: float = 60.0,
) -> Lineage:
    """The event and, recursively, the follow-up events it caused.

    Every consumer the event was delivered to is listed, with an inbox record or without
    one yet ('delivered': no outcome so far); either is ``owed`` once it has had no
    outcome for longer than the redelivery ``horizon`` (seconds).
    """
    store = LineageStore(schema)
    row = store.event(conn, event_id)
    if row is None:
        raise NotFoundError(f"no event {event_id} in schema {schema!r}")
    aggregate = f"{row.aggregate_type}:{row.aggregate_id}" if row.aggregate_id is not None else None
    lineage = Lineage(
        id=row.id,
        seq=row.seq,
        event_type=row.event_type,
        event_version=row.event_version,
        aggregate=aggregate,
        ordering_key=row.ordering_key,
        status=row.status,
        publish_attempts=row.attempts,
        created_at=row.created_at,
        published_at=row.published_at,
        trace_id=_trace_id(row.traceparent),
        correlation_id=row.correlation_id,
        causation_id=row.causation_id,
    )
    lineage.failed_attempts = store.attempts(conn, event_id)
    lineage.deliveries = _deliveries(
        store.inbox(conn, event_id), row.consumers or [], row.published_at, row.now, horizon
    )
    lineage.dead_letters = store.dead_letters(conn, event_id)
    if depth < MAX_DEPTH:
        for child in store.children(conn, event_id):
            lineage.follow_ups.append(load_lineage(conn, schema, child, depth + 1, horizon))
    return lineage


def trace_event(settings: Settings, event_id: uuid.UUID) -> Lineage:
    """``pipeline trace``: the event's lineage read from the configured database."""
    with wrap_driver_errors(settings), connect(settings) as conn:
        return load_lineage(
            conn, settings.schema_name, event_id, horizon=redelivery_horizon(settings)
        )


def _deliveries(
    rows: Sequence[InboxRow],
    consumers: list[str],
    published_at: datetime | None,
    now: datetime,
    horizon: float,
) -> list[Delivery]:
    """Inbox records, plus the consumers the event went to that have none yet."""
    found = {row.consumer: Delivery(**vars(row)) for row in rows}
    for consumer in consumers:
        if consumer not in found:
            found[consumer] = Delivery(
                consumer,
                "delivered",
                0,
                None,
                None,
                None,
                delivered_at=published_at,
                redeliveries=0,
            )
    for delivery in found.values():
        # A row the relay recorded before publishing is owed only once the event is sent,
        # counted from the later of its publication and the row's own date.
        unfinished = delivery.status in ("delivered", "pending", "failed")
        since = delivery.delivered_at
        if since is not None and published_at is not None:
            since = max(since, published_at)
        delivery.owed = (
            unfinished
            and published_at is not None
            and since is not None
            and (now - since).total_seconds() > horizon
        )
    return [found[name] for name in sorted(found)]


def trace_url(template: str | None, trace_id: str | None) -> str | None:
    """Where a trace UI shows the trace: ``{trace_id}`` filled in, else Jaeger's path."""
    if not template or not trace_id:
        return None
    if "{trace_id}" in template:
        return template.replace("{trace_id}", trace_id)
    return f"{template.rstrip('/')}/trace/{trace_id}"


def _ms(start: datetime, end: datetime | None) -> str:
    return f"+{(end - start).total_seconds() * 1000:.1f} ms" if end is not None else "—"


def render(lineage: Lineage, trace_ui_url: str | None = None, indent: str = "") -> list[str]:
    """Human-readable lines: the event, its publishing, each consumer, then follow-ups."""
    origin = lineage.created_at
    lines = [
        f"{indent}{lineage.event_type} v{lineage.event_version}  {lineage.id}  [{lineage.status}]",
        f"{indent}  created    {origin.isoformat()}"
        + (f"  aggregate {lineage.aggregate}" if lineage.aggregate else ""),
        f"{indent}  published  {_ms(origin, lineage.published_at)}  "
        f"after {lineage.publish_attempts} attempt(s)",
    ]
    if lineage.trace_id:
        link = f"  {trace_url(trace_ui_url, lineage.trace_id)}" if trace_ui_url else ""
        lines.append(f"{indent}  trace      {lineage.trace_id}{link}")
    for attempt in lineage.failed_attempts:
        who = f" {attempt.consumer}" if attempt.consumer else ""
        lines.append(
            f"{indent}  failed     {attempt.stage}{who} attempt {attempt.attempt} "
            f"{_ms(origin, attempt.at)}: {attempt.error_class}"
        )
    for delivery in lineage.deliveries:
        notes = [f"{delivery.attempts} attempt(s)"]
        if delivery.redeliveries:
            notes.append(f"delivered again {delivery.redeliveries}x")
        if delivery.owed:
            notes.append("OWED: no outcome within the redelivery horizon")
        lines.append(
            f"{indent}  consumer   {delivery.consumer}: {delivery.status} "
            f"{_ms(origin, delivery.processed_at)} ({', '.join(notes)})"
        )
    for dead in lineage.dead_letters:
        who = f" {dead.consumer}" if dead.consumer else ""
        lines.append(
            f"{indent}  DEAD       {dead.stage}{who} #{dead.id}: {dead.reason} ({dead.error_class})"
        )
    for child in lineage.follow_ups:
        lines.append(f"{indent}  └─ caused:")
        lines.extend(render(child, trace_ui_url, indent + "     "))
    return lines
