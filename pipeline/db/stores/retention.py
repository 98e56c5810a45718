"""The prune passes' statements: their lock and one batch of a table.

Used by :mod:`pipeline.db.retention` (the janitor and ``pipeline prune``), on an
autocommit connection: each batch commits on its own.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for


class PruneBatch(NamedTuple):
    eligible: int  # rows past their retention among those scanned
    deleted: int
    scanned: int
    last: Any  # where the next batch starts (the table's key after the last row scanned)


class RetentionStore:
    """The prune statements for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def lock(self, conn: psycopg.Connection[Any]) -> bool:
        """Take the prune lock (session-scoped); False when another pass holds it."""
        row = conn.execute(self._queries["prune_lock"], {"schema_name": self.schema}).fetchone()
        return bool(row and row[0])

    def unlock(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(self._queries["prune_unlock"], {"schema_name": self.schema})

    def prune_batch(
        self,
        conn: psycopg.Connection[Any],
        table: str,
        *,
        cutoff: datetime,
        after: Any,
        limit: int,
        dry_run: bool,
    ) -> PruneBatch:
        """Delete (or, in a dry run, count) one batch of ``table``'s rows older than ``cutoff``,
        scanning at most ``limit`` rows from ``after`` on."""
        row = conn.execute(
            self._queries[f"prune_{table}"],
            {"cutoff": cutoff, "after": after, "limit": limit, "dry_run": dry_run},
        ).fetchone()
        assert row is not None  # an aggregate always returns its row
        return PruneBatch(int(row[0]), int(row[1]), int(row[2]), row[3])
