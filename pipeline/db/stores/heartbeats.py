"""The heartbeat tables: each running relay's and worker process's row.

``relay_state`` holds the relays (producers read its busy flag: a busy relay polls, so
they skip their NOTIFY), ``worker_state`` the worker processes; operators see both in
``pipeline status`` and ``pipeline doctor``. A live process refreshes its row at least
every ``HEARTBEAT_SECONDS``, busy or idle, so a row's age tells its state: alive (busy or
idle) while younger than ``PIPELINE_HEARTBEAT_STALE_SECONDS``, then stale (stopped without
removing its row, paused, stuck, or cut off from Postgres), and gone from
``PIPELINE_HEARTBEAT_GONE_SECONDS``. A process that stops cleanly deletes its row.

Each heartbeat also measures the process's clock against the database's: the upsert
returns ``clock_timestamp()``, and the offset is the process's wall time at the midpoint
of that round trip minus it (positive: the process's clock is ahead). The next heartbeat
stores it in ``clock_offset``, so a row's offset is at most one heartbeat old; the
relays export theirs as ``pipeline_relay_clock_offset_seconds``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from pipeline.config import Settings
from pipeline.db.queries import queries_for

HEARTBEAT_SECONDS = 2.0
"""How often a live relay or worker refreshes its heartbeat at the longest (an idle one)."""
Kind = Literal["relay", "worker"]


@dataclass
class ProcessInfo:
    """One heartbeat row, with the thresholds its state is judged by."""

    process_id: str
    host: str
    pid: int
    busy: bool
    heartbeat_age_seconds: float
    stale_seconds: float
    gone_seconds: float
    clock_offset: float | None = None
    """Its clock minus the database's, in seconds (None: not measured yet)."""

    @property
    def state(self) -> str:
        """``busy`` or ``idle`` (alive), ``stale`` or ``gone``, by the heartbeat's age."""
        if self.heartbeat_age_seconds >= self.gone_seconds:
            return "gone"
        if self.heartbeat_age_seconds >= self.stale_seconds:
            return "stale"
        return "busy" if self.busy else "idle"

    @property
    def alive(self) -> bool:
        return self.state in ("busy", "idle")


class HeartbeatStore:
    """The relays' or the worker processes' rows for one schema."""

    def __init__(self, settings: Settings, kind: Kind) -> None:
        self.settings = settings
        self.kind = kind
        self._queries = queries_for(settings.schema_name)

    def heartbeat(
        self,
        conn: psycopg.Connection[Any],
        process_id: str,
        busy: bool,
        host: str,
        pid: int,
        clock_offset: float | None = None,
    ) -> float:
        """Insert or refresh this process's row (its busy flag, heartbeat time and
        ``clock_offset``, the offset the previous heartbeat measured, kept when None).

        Returns the clock offset this heartbeat measured, in seconds: the wall time at
        the midpoint of the round trip minus the database's ``clock_timestamp()``.
        """
        params = {
            "process_id": process_id,
            "busy": busy,
            "host": host,
            "pid": pid,
            "clock_offset": clock_offset,
        }
        before = time.time()
        row = conn.execute(self._queries[f"{self.kind}_heartbeat"], params).fetchone()
        after = time.time()
        assert row is not None  # an upsert with RETURNING returns its row
        return (before + after) / 2 - float(row[0])

    def forget(self, conn: psycopg.Connection[Any], process_id: str) -> None:
        conn.execute(self._queries[f"{self.kind}_forget"], {"process_id": process_id})

    def processes(self, conn: psycopg.Connection[Any]) -> list[ProcessInfo]:
        """Every row, with its heartbeat's age in seconds."""
        rows = conn.execute(self._queries[f"{self.kind}_states"]).fetchall()
        stale, gone = self.settings.heartbeat_stale_seconds, self.settings.heartbeat_gone_seconds
        return [
            ProcessInfo(
                r[0],
                r[1],
                int(r[2]),
                bool(r[3]),
                max(0.0, float(r[4])),
                stale,
                gone,
                None if r[5] is None else float(r[5]),
            )
            for r in rows
        ]
