"""Events sent to no consumer, and the event types waiting to be published.

The relay records whom each sent event went to (``outbox.consumers``); an event whose
type no consumer subscribed to when it was sent has an empty list. Nothing owes it a
delivery, so the ledger never sends it again: these queries let the relay refuse to start
when it would make more of them, ``pipeline status`` count them, and an operator send
them again once their consumers exist.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pipeline.db.queries import queries_for


@dataclass
class UnroutedEvent:
    id: uuid.UUID
    seq: int
    event_type: str
    aggregate_type: str | None
    aggregate_id: str | None
    ordering_key: str | None
    created_at: datetime
    published_at: datetime | None

    def as_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id),
            "seq": self.seq,
            "event_type": self.event_type,
            "aggregate_type": self.aggregate_type,
            "aggregate_id": self.aggregate_id,
            "ordering_key": self.ordering_key,
            "created_at": self.created_at.isoformat(),
            "published_at": self.published_at.isoformat() if self.published_at else None,
        }


class UnroutedStore:
    """The queries of ``unrouted.sql`` for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def unsent_event_types(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        """Events waiting to be published (pending or publishing), by event type."""
        rows = conn.execute(self._queries["unsent_event_types"]).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def counts(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        """Events sent to no consumer, by event type."""
        rows = conn.execute(self._queries["unrouted_counts"]).fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def events(
        self,
        conn: psycopg.Connection[Any],
        limit: int | None,
        event_types: Sequence[str] | None = None,
    ) -> list[UnroutedEvent]:
        """Events sent to no consumer, oldest first (of ``event_types`` only, if given)."""
        rows = conn.execute(
            self._queries["unrouted_list"],
            {"limit": limit, "event_types": list(event_types) if event_types else None},
        ).fetchall()
        return [UnroutedEvent(*row) for row in rows]

    def resend(self, conn: psycopg.Connection[Any], ids: Sequence[uuid.UUID]) -> list[uuid.UUID]:
        """Put these events back to pending (those still unrouted); returns their ids."""
        rows = conn.execute(self._queries["unrouted_resend"], {"ids": list(ids)}).fetchall()
        return [row[0] for row in rows]

    def count_affected(self, conn: psycopg.Connection[Any], audit_id: int, count: int) -> None:
        """Add ``count`` events sent again to an operator action's audit record."""
        conn.execute(
            self._queries["unrouted_audit_affected"], {"audit_id": audit_id, "count": count}
        )

    def wake_relays(self, conn: psycopg.Connection[Any], channel: str) -> None:
        """NOTIFY the relays' channel: events are due now."""
        conn.execute(self._queries["unrouted_wake_relay"], {"channel": channel})
