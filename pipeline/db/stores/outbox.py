"""The outbox table: the producer's insert, the relay's claim and settlement, the backlog.

The relay's statements run on its own autocommit psycopg connection as pre-rendered
bytes in binary mode (its hot path); the producer's run on the caller's SQLAlchemy
connection, sync or async, so for those the store hands back the statement to run.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for
from pipeline.envelope import OutboxEvent
from pipeline.testhooks import pause_before_commit

Statement = tuple[str, Any]
"""A query's text and its parameters, for the caller's SQLAlchemy ``exec_driver_sql``."""

SentRow = tuple[uuid.UUID, str, float]
"""An event marked sent: its id, type, and seconds from its creation to its publication."""


class Retry(NamedTuple):
    event_id: uuid.UUID
    delay: float  # seconds before it is due again
    error_class: str
    error: str


class DeadEvent(NamedTuple):
    event_id: uuid.UUID
    reason: str
    error_class: str
    error: str


class ExpectedDelivery(NamedTuple):
    """An ordered consumer's inbox 'pending' row for an event on its way to it."""

    consumer: str
    event_id: uuid.UUID
    event_type: str
    ordering_key: str | None
    seq: int


@dataclass
class Settlement:
    """How a claimed batch ends, recorded under its fencing token in one round trip.

    ``routes`` maps each event type of the batch to its consumers, comma-separated: the
    sent events record whom they went to (the delivery ledger's source of truth).
    ``expected`` is kept for callers that record ordered deliveries at settlement; the
    relay records them before publishing (:meth:`OutboxStore.expect`).
    """

    token: int
    sent: list[uuid.UUID] = field(default_factory=list)
    routes: Mapping[str, str] = field(default_factory=dict)
    expected: list[ExpectedDelivery] = field(default_factory=list)
    released: list[uuid.UUID] = field(default_factory=list)
    retries: list[Retry] = field(default_factory=list)
    dead: list[DeadEvent] = field(default_factory=list)


class OutboxStore:
    """The outbox's queries for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)
        self._pause_before_commit = pause_before_commit()  # test-only (pipeline.testhooks)

    # -- the producer --------------------------------------------------------------------
    def insert(self, rows: list[dict[str, Any]], columns: Mapping[str, str]) -> Statement:
        """The INSERT of ``rows`` (already in lock order): one row as scalars, more as arrays.

        ``columns`` maps each array parameter to the row's column it takes.
        """
        if len(rows) == 1:
            return self._queries.text("outbox_insert_one"), rows[0]
        return self._queries.text("outbox_insert"), {
            parameter: [row[column] for row in rows] for parameter, column in columns.items()
        }

    def backlog_count(self, limit: int) -> Statement:
        """Count unsent events, no further than ``limit`` (a bounded index scan)."""
        return self._queries.text("backlog_count"), {"limit": limit}

    def count_backlog(self, conn: psycopg.Connection[Any], limit: int) -> int:
        row = conn.execute(self._queries["backlog_count"], {"limit": limit}).fetchone()
        return int(row[0]) if row else 0

    def insert_canary(
        self,
        conn: psycopg.Connection[Any],
        event_id: uuid.UUID,
        event_type: str,
        payload: str,
        headers: str,
    ) -> None:
        conn.execute(
            self._queries["canary_insert"],
            {"id": event_id, "event_type": event_type, "payload": payload, "headers": headers},
        )

    # -- the relay ------------------------------------------------------------------------
    def claim(
        self,
        conn: psycopg.Connection[Any],
        *,
        token: int,
        owner: str,
        batch_size: int,
        max_run: int,
        lease_seconds: float,
    ) -> list[OutboxEvent]:
        """Lease up to ``batch_size`` due events (one statement: lock, claim and commit in
        one round trip on an autocommit connection; ``claim_outbox`` in functions.sql)."""
        params = {
            "schema_name": self.schema,
            "scan_limit": batch_size * 2,
            "max_run": max_run,
            "batch_size": batch_size,
            "token": token,
            "owner": owner,
            "lease_seconds": lease_seconds,
        }
        rows = conn.execute(self._queries["claim"], params, binary=True).fetchall()
        return [OutboxEvent.from_row(row) for row in rows]

    def expect(self, conn: psycopg.Connection[Any], expected: list[ExpectedDelivery]) -> None:
        """Record ordered consumers' inbox rows for events about to be published, committed
        before the broker gets them (one autocommit statement; ``inbox_expect``)."""
        if expected:
            conn.execute(self._queries["inbox_expect"], _expect_params(expected), binary=True)

    def release(self, conn: psycopg.Connection[Any], ids: list[uuid.UUID], token: int) -> None:
        """Give leased events back unpublished (no attempt counted)."""
        conn.execute(self._queries["release"], {"ids": ids, "token": token})

    def settle(self, conn: psycopg.Connection[Any], settlement: Settlement) -> list[SentRow]:
        """Record a batch's outcome in one round trip; returns the events marked sent.

        The common outcome, every event sent to unordered consumers, is one statement on
        the autocommit connection; anything more is one transaction sent as a pipeline.
        An event whose lease was taken over meanwhile is left alone (the token fences it).
        """
        statements = self._statements(settlement)
        if not statements:
            return []
        cursors: dict[str, Any] = {}
        pause = self._pause_before_commit
        marked: list[SentRow] | None = None
        if len(statements) == 1 and pause is None:
            name, params = statements[0]
            cursors[name] = conn.execute(self._queries[name], params, binary=True)
        else:
            with conn.pipeline(), conn.transaction():
                for name, params in statements:
                    cursors[name] = conn.execute(self._queries[name], params, binary=True)
                    if name == "mark_sent" and pause is not None:
                        marked = cursors[name].fetchall()  # it ran: its rows are locked
                        pause()
        if marked is not None:
            return marked
        cursor = cursors.get("mark_sent")
        return [] if cursor is None else cursor.fetchall()

    @staticmethod
    def _statements(s: Settlement) -> list[tuple[str, dict[str, Any]]]:
        statements: list[tuple[str, dict[str, Any]]] = []
        if s.sent:
            statements.append(
                (
                    "mark_sent",
                    {
                        "ids": s.sent,
                        "token": s.token,
                        "route_types": list(s.routes),
                        "route_consumers": list(s.routes.values()),
                    },
                )
            )
            if s.expected:
                statements.append(("inbox_expect", _expect_params(s.expected)))
        if s.released:
            statements.append(("release", {"ids": s.released, "token": s.token}))
        if s.retries:
            statements.append(
                (
                    "schedule_retry",
                    {
                        "token": s.token,
                        "ids": [r.event_id for r in s.retries],
                        "delays": [r.delay for r in s.retries],
                        "error_classes": [r.error_class for r in s.retries],
                        "errors": [r.error for r in s.retries],
                    },
                )
            )
        if s.dead:
            statements.append(
                (
                    "dead_letter",
                    {
                        "token": s.token,
                        "ids": [d.event_id for d in s.dead],
                        "reasons": [d.reason for d in s.dead],
                        "error_classes": [d.error_class for d in s.dead],
                        "errors": [d.error for d in s.dead],
                    },
                )
            )
            statements.append(("inbox_unexpect", {"ids": [d.event_id for d in s.dead]}))
        return statements

    def has_due_work(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether an event is due now (pending and due, or its lease expired)."""
        return conn.execute(self._queries["has_due_work"]).fetchone() == (True,)

    def snapshot_xmax(self, conn: psycopg.Connection[Any]) -> str:
        """The first transaction id not yet visible to a snapshot taken now."""
        row = conn.execute(self._queries["snapshot_xmax"]).fetchone()
        return str(row[0]) if row else "0"

    def horizon_passed(self, conn: psycopg.Connection[Any], xmax: str) -> bool:
        """Whether every transaction older than ``xmax`` has ended."""
        return conn.execute(self._queries["horizon_passed"], {"xmax": xmax}).fetchone() == (True,)


def _expect_params(expected: list[ExpectedDelivery]) -> dict[str, Any]:
    return {
        "consumers": [e.consumer for e in expected],
        "event_ids": [e.event_id for e in expected],
        "event_types": [e.event_type for e in expected],
        "ordering_keys": [e.ordering_key for e in expected],
        "seqs": [e.seq for e in expected],
        "statuses": ["pending"] * len(expected),
    }
