"""The pipeline's stored state in a few cheap reads: backlog, dead letters, owed, sizes.

What the relay exports as gauges (:mod:`pipeline.relay.state`) and ``pipeline status``
prints: one statement for the backlog and the dead letters waiting, one for the
deliveries owed past the redelivery horizon, one catalog read for the tables' sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg

from pipeline.db.queries import queries_for
from pipeline.errors import MigrationError

BACKLOG_STATUSES = ("pending", "publishing")
STAGES = ("publish", "consume")


@dataclass
class DatabaseState:
    backlog: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BACKLOG_STATUSES, 0))
    oldest_pending_age_seconds: float = 0.0
    dead_letters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STAGES, 0))
    owed: dict[str, int] = field(default_factory=dict)
    """Per consumer: deliveries with no outcome past the redelivery horizon."""
    keys_held: dict[str, int] = field(default_factory=dict)
    """Per consumer: ordering keys whose later events wait behind such a delivery."""


class TableSize(NamedTuple):
    table: str
    rows_estimate: float  # the planner's (pg_class.reltuples): no scan
    size_bytes: float  # with indexes and TOAST


class StateStore:
    """The state reads for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def snapshot(self, conn: psycopg.Connection[Any], horizon: float) -> DatabaseState:
        """The ``state_snapshot`` and ``ledger_state`` queries' answers (``horizon``: the
        redelivery horizon in seconds). Raises :class:`MigrationError` when the schema is
        missing."""
        state = DatabaseState()
        try:
            rows = conn.execute(self._queries["state_snapshot"]).fetchall()
            ledger = conn.execute(self._queries["ledger_state"], {"horizon": horizon}).fetchall()
        except psycopg.errors.UndefinedTable:
            raise MigrationError(
                f"the pipeline schema {self.schema!r} is not installed: run `pipeline db upgrade`"
            ) from None
        for kind, label, value in rows:
            if kind == "backlog":
                state.backlog[label] = int(value)
            elif kind == "oldest_pending_age":
                state.oldest_pending_age_seconds = max(0.0, float(value))
            elif kind == "dead_letters":
                state.dead_letters[label] = int(value)
        for consumer, owed, keys in ledger:
            state.owed[consumer] = int(owed)
            state.keys_held[consumer] = int(keys)
        return state

    def table_sizes(self, conn: psycopg.Connection[Any], tables: Sequence[str]) -> list[TableSize]:
        """Catalog figures of the schema's ``tables`` that exist, by name."""
        rows = conn.execute(
            self._queries["table_sizes"], {"schema_name": self.schema, "tables": list(tables)}
        ).fetchall()
        return [TableSize(str(name), float(count), float(size)) for name, count, size in rows]
