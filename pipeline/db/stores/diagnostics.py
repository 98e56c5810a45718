"""Health and catalog reads for the operator tools: ``doctor``, ``status`` and grants.

Nothing here is on a delivery path; each read is one statement, most on the catalog.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for


class Trigger(NamedTuple):
    table: str
    enabled: bool


class ServerClock(NamedTuple):
    now: float  # the database's clock, seconds since the epoch
    notify_queue_usage: float  # pg_notification_queue_usage(), 0..1
    backend_pid: int


class ActivityCount(NamedTuple):
    consumer: str
    kind: str  # processed, failures, duplicate, redelivery, dead_letters
    total: int


class MissingGrant(NamedTuple):
    role: str
    table: str | None  # None: USAGE on the schema itself
    privilege: str


class DiagnosticsStore:
    """The diagnostic reads for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def migrations(self, conn: psycopg.Connection[Any]) -> dict[int, str]:
        """Recorded migration versions and their checksums (UndefinedTable: no schema)."""
        return {int(v): c for v, c in conn.execute(self._queries["doctor_migrations"]).fetchall()}

    def indexes(self, conn: psycopg.Connection[Any]) -> dict[str, bool]:
        """The schema's indexes by name, and whether each is valid."""
        rows = conn.execute(self._queries["doctor_indexes"], {"schema_name": self.schema})
        return {str(name): bool(valid) for name, valid in rows.fetchall()}

    def triggers(self, conn: psycopg.Connection[Any]) -> dict[str, Trigger]:
        rows = conn.execute(self._queries["doctor_triggers"], {"schema_name": self.schema})
        return {str(name): Trigger(table, bool(on)) for name, table, on in rows.fetchall()}

    def functions(self, conn: psycopg.Connection[Any]) -> set[str]:
        rows = conn.execute(self._queries["doctor_functions"], {"schema_name": self.schema})
        return {str(row[0]) for row in rows.fetchall()}

    def server(self, conn: psycopg.Connection[Any]) -> ServerClock:
        row = conn.execute(self._queries["doctor_server"]).fetchone()
        assert row is not None
        return ServerClock(float(row[0]), float(row[1]), int(row[2]))

    def dead_letters_waiting(self, conn: psycopg.Connection[Any]) -> dict[str, int]:
        """Dead letters not yet replayed, by stage (stages with none are left out)."""
        rows = conn.execute(self._queries["doctor_dead_letters"]).fetchall()
        return {str(stage): int(count) for stage, count in rows}

    def last_processed_age(self, conn: psycopg.Connection[Any], consumer: str) -> float | None:
        """Seconds since ``consumer`` last processed an event (None: never)."""
        row = conn.execute(self._queries["doctor_canary"], {"consumer": consumer}).fetchone()
        return None if row is None or row[0] is None else float(row[0])

    def activity(self, conn: psycopg.Connection[Any], interval: float) -> list[ActivityCount]:
        """Per consumer and kind, what happened in the last ``interval`` seconds."""
        rows = conn.execute(self._queries["consumer_activity"], {"interval": interval})
        return [ActivityCount(str(c), str(k), int(n)) for c, k, n in rows.fetchall()]

    def missing_grants(
        self, conn: psycopg.Connection[Any], grants: Sequence[tuple[str, str]]
    ) -> list[MissingGrant]:
        """Which (table, privilege) pairs the current role lacks; tables not installed are
        skipped, and a missing USAGE on the schema is one row with no table."""
        rows = conn.execute(
            self._queries["missing_privileges"],
            {
                "schema_name": self.schema,
                "tables": [table for table, _ in grants],
                "privileges": [privilege for _, privilege in grants],
            },
        ).fetchall()
        return [MissingGrant(str(r[0]), r[1], str(r[2])) for r in rows]
