"""The ``relay_state`` table: each running relay's heartbeat and busy flag.

Producers read the busy flag (a busy relay polls, so they skip their NOTIFY); operators
see the relays in ``pipeline status``. A live relay refreshes its heartbeat at least every
``RELAY_HEARTBEAT_SECONDS``, busy or idle, so a row's age tells its state: alive (busy or
idle) while younger than ``RELAY_STALE_SECONDS``, then stale (stopped without removing
its row, stuck, or cut off from Postgres), and gone after ``RELAY_GONE_SECONDS``. A relay
that stops cleanly deletes its row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from pipeline.db.queries import queries_for

RELAY_HEARTBEAT_SECONDS = 2.0
"""How often a live relay refreshes its heartbeat at the longest (an idle one)."""
RELAY_STALE_SECONDS = 10.0
"""Heartbeat age from which a relay counts as not alive: several refreshes missed."""
RELAY_GONE_SECONDS = 60.0
"""Heartbeat age from which a relay counts as gone (its row outlived the process)."""


def relay_state(busy: bool, heartbeat_age_seconds: float) -> str:
    """``busy`` or ``idle`` (alive), ``stale`` or ``gone``, by the heartbeat's age."""
    if heartbeat_age_seconds >= RELAY_GONE_SECONDS:
        return "gone"
    if heartbeat_age_seconds >= RELAY_STALE_SECONDS:
        return "stale"
    return "busy" if busy else "idle"


@dataclass
class RelayInfo:
    relay_id: str
    host: str
    pid: int
    busy: bool
    heartbeat_age_seconds: float

    @property
    def state(self) -> str:
        """``busy``, ``idle``, ``stale`` or ``gone`` (:func:`relay_state`)."""
        return relay_state(self.busy, self.heartbeat_age_seconds)

    @property
    def alive(self) -> bool:
        return self.state in ("busy", "idle")


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
