"""What operators are told about the relays: alive (busy or idle), stale or gone.

A live relay refreshes its heartbeat every couple of seconds, busy or idle, so the
heartbeat's age decides (:func:`pipeline.db.stores.relays.relay_state`). A relay on this
host whose process no longer exists (killed with ``kill -9``, its row left behind) is gone
at once, whatever its heartbeat's age.
"""

from __future__ import annotations

import os
import socket

from pipeline.db.stores.relays import RelayInfo


def relay_state(relay: RelayInfo) -> str:
    """``busy``, ``idle``, ``stale`` or ``gone``."""
    state = relay.state
    if state != "gone" and relay.host == socket.gethostname() and not _running(relay.pid):
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
