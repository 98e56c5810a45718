"""What operators are told about relays and workers: alive (busy or idle), stale or gone.

A live relay or worker process refreshes its heartbeat every couple of seconds, busy or
idle, so the heartbeat's age decides (:class:`pipeline.db.stores.heartbeats.ProcessInfo`).
A process on this host that no longer exists (killed with ``kill -9``, its row left
behind) is gone at once, whatever its heartbeat's age. A process whose heartbeat found
its clock more than ``CLOCK_OFFSET_LIMIT`` off the database's is named with the offset.
"""

from __future__ import annotations

import os
import socket

from pipeline.db.stores.heartbeats import ProcessInfo

CLOCK_OFFSET_LIMIT = 1.0
"""How far a process's clock may be off the database's: the delivery ledger's margin
between queue messages' times (their enqueuer's clock) and the database's."""


def clock_skew(process: ProcessInfo) -> str:
    """``"5.0s ahead of the database's"`` when its clock is off by more than the limit, else
    ``""`` (also when not measured yet)."""
    offset = process.clock_offset
    if offset is None or abs(offset) <= CLOCK_OFFSET_LIMIT:
        return ""
    return f"{abs(offset):.1f}s {'ahead of' if offset > 0 else 'behind'} the database's"


def process_state(process: ProcessInfo) -> str:
    """``busy``, ``idle``, ``stale`` or ``gone``."""
    state = process.state
    if state != "gone" and process.host == socket.gethostname() and not _running(process.pid):
        return "gone"
    return state


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True
