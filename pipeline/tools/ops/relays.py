"""What operators are told about relays and workers: alive (busy or idle), stale or gone.

A live relay or worker process refreshes its heartbeat every couple of seconds, busy or
idle, so the heartbeat's age decides (:class:`pipeline.db.stores.heartbeats.ProcessInfo`).
A process on this host that no longer exists (killed with ``kill -9``, its row left
behind) is gone at once, whatever its heartbeat's age.
"""

from __future__ import annotations

import os
import socket

from pipeline.db.stores.heartbeats import ProcessInfo


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
