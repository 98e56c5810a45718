"""The operator audit log: who did what to which scope, when, and how many rows it affected."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from pipeline.db.queries import queries_for


@dataclass
class AuditRecord:
    id: int
    at: datetime
    actor: str
    action: str
    parameters: dict[str, Any]
    affected: int

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "at": self.at.isoformat(),
            "actor": self.actor,
            "action": self.action,
            "parameters": self.parameters,
            "affected": self.affected,
        }


class AuditStore:
    """The audit log's queries for one schema (``parameters`` are stored as JSON)."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def insert(
        self, conn: psycopg.Connection[Any], actor: str, action: str, parameters: str
    ) -> int:
        """Record an action with nothing affected yet; returns its id."""
        row = conn.execute(
            self._queries["audit_insert"],
            {"actor": actor, "action": action, "parameters": parameters},
        ).fetchone()
        assert row is not None  # INSERT ... RETURNING
        return int(row[0])

    def count_affected(
        self,
        conn: psycopg.Connection[Any],
        audit_id: int,
        dead_letter_ids: Sequence[int],
        max_listed: int,
    ) -> None:
        """Add dead letters to a record's count, listing the first ``max_listed`` ids."""
        conn.execute(
            self._queries["audit_affected"],
            {"audit_id": audit_id, "ids": list(dead_letter_ids), "max_listed": max_listed},
        )

    def add_affected(self, conn: psycopg.Connection[Any], audit_id: int, count: int) -> None:
        """Add ``count`` rows (not dead letters) to a record's count."""
        conn.execute(self._queries["audit_add_affected"], {"audit_id": audit_id, "count": count})

    def record_prune(
        self, conn: psycopg.Connection[Any], actor: str, parameters: str, affected: int
    ) -> None:
        """Record a finished prune (its count known)."""
        conn.execute(
            self._queries["prune_audit"],
            {"actor": actor, "parameters": parameters, "affected": affected},
        )

    def latest(self, conn: psycopg.Connection[Any], limit: int) -> list[AuditRecord]:
        """The latest records first."""
        rows = conn.execute(self._queries["audit_list"], {"limit": limit}).fetchall()
        return [AuditRecord(r[0], r[1], r[2], r[3], json.loads(r[4]), r[5]) for r in rows]
