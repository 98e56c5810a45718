"""One event's record across the tables, for ``pipeline trace``: its outbox row, failed
attempts, each consumer's inbox record, dead letters and follow-up events.

Error texts are read through :func:`~pipeline.redaction.redact_text`, as the dead-letter
store reads them: writers mask them too, but a row may predate that or come from elsewhere."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for
from pipeline.redaction import redact_text


class EventRow(NamedTuple):
    """The outbox row, with whom it was sent to and the database's clock."""

    id: uuid.UUID
    seq: int
    event_type: str
    event_version: int
    aggregate_type: str | None
    aggregate_id: str | None
    ordering_key: str | None
    status: str
    attempts: int
    created_at: datetime
    published_at: datetime | None
    last_error_class: str | None
    last_error: str | None
    traceparent: str | None
    correlation_id: str | None
    causation_id: str | None
    consumers: list[str] | None  # whom it was sent to
    now: datetime  # the database's clock when read


# The rows below are dataclasses rather than tuples: ``pipeline trace`` shows them as they
# are, in its text and its JSON (``dataclasses.asdict``).


@dataclass
class AttemptRow:
    stage: str
    consumer: str | None
    attempt: int
    error_class: str
    error: str
    at: datetime

    def __post_init__(self) -> None:
        self.error = redact_text(self.error)


@dataclass
class InboxRow:
    consumer: str
    status: str
    attempts: int
    received_at: datetime | None
    processed_at: datetime | None
    last_error_class: str | None
    delivered_at: datetime | None
    redeliveries: int


@dataclass
class DeadLetterRow:
    id: int
    stage: str
    consumer: str | None
    reason: str
    error_class: str
    at: datetime

    def __post_init__(self) -> None:
        self.reason = redact_text(self.reason)


class LineageStore:
    """The lineage reads for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def _rows(self, conn: psycopg.Connection[Any], name: str, event_id: uuid.UUID) -> list[Any]:
        return conn.execute(self._queries[name], {"event_id": event_id}).fetchall()

    def event(self, conn: psycopg.Connection[Any], event_id: uuid.UUID) -> EventRow | None:
        rows = self._rows(conn, "lineage_event", event_id)
        if not rows:
            return None
        row = EventRow(*rows[0])
        return row._replace(last_error=redact_text(row.last_error)) if row.last_error else row

    def attempts(self, conn: psycopg.Connection[Any], event_id: uuid.UUID) -> list[AttemptRow]:
        return [AttemptRow(*r) for r in self._rows(conn, "lineage_attempts", event_id)]

    def inbox(self, conn: psycopg.Connection[Any], event_id: uuid.UUID) -> list[InboxRow]:
        return [InboxRow(*r) for r in self._rows(conn, "lineage_inbox", event_id)]

    def dead_letters(
        self, conn: psycopg.Connection[Any], event_id: uuid.UUID
    ) -> list[DeadLetterRow]:
        return [DeadLetterRow(*r) for r in self._rows(conn, "lineage_dead_letters", event_id)]

    def children(self, conn: psycopg.Connection[Any], event_id: uuid.UUID) -> list[uuid.UUID]:
        """The events it caused (``causation_id``), in sequence order."""
        return [r[0] for r in self._rows(conn, "lineage_children", event_id)]
