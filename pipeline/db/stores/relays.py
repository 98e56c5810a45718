"""The ``relay_state`` table: each running relay's heartbeat and busy flag.

Producers read the busy flag (a busy relay polls, so they skip their NOTIFY); operators
see the relays in ``pipeline status``. A row whose heartbeat stopped expires by age.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from pipeline.db.queries import queries_for


@dataclass
class RelayInfo:
    relay_id: str
    host: str
    pid: int
    busy: bool
    heartbeat_age_seconds: float


class RelayStore:
    """The relays' rows for one schema."""

    def __init__(self, schema: str) -> None:
        self.schema = schema
        self._queries = queries_for(schema)

    def heartbeat(
        self, conn: psycopg.Connection[Any], relay_id: str, busy: bool, host: str, pid: int
    ) -> None:
        """Insert or refresh this relay's row (its busy flag and heartbeat time)."""
        conn.execute(
            self._queries["relay_heartbeat"],
            {"relay_id": relay_id, "busy": busy, "host": host, "pid": pid},
        )

    def forget(self, conn: psycopg.Connection[Any], relay_id: str) -> None:
        conn.execute(self._queries["relay_forget"], {"relay_id": relay_id})

    def relays(self, conn: psycopg.Connection[Any]) -> list[RelayInfo]:
        """Every relay row, with its heartbeat's age in seconds."""
        rows = conn.execute(self._queries["relay_states"]).fetchall()
        return [RelayInfo(r[0], r[1], int(r[2]), bool(r[3]), max(0.0, float(r[4]))) for r in rows]
