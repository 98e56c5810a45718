"""Finding and killing a server's whole process tree, from its parent or from a watchdog.

Postgres backends call ``setsid()``, so killing the postmaster's process group misses
them: they are found by parentage in ``/proc`` (``pgrep -P`` where there is no /proc).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

KILL_WAIT_SECONDS = 10.0


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc, or None where /proc is missing or pid is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[1]), int(fields[19])


def start_time(pid: int) -> int | None:
    """When pid started (clock ticks since boot), to tell it from a later process of that pid."""
    stat = proc_stat(pid)
    return stat[2] if stat is not None else None


def child_pids(pid: int) -> list[int]:
    """Direct children of pid."""
    if Path("/proc/self/stat").exists():
        children = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                stat = proc_stat(int(entry.name))
                if stat is not None and stat[1] == pid:
                    children.append(int(entry.name))
        return children
    pgrep = shutil.which("pgrep")
    if pgrep is None:
        return []
    out = subprocess.run([pgrep, "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(line) for line in out.stdout.split()]


def pid_alive(pid: int) -> bool:
    """True while pid is a live process. Zombies count as dead: orphans may never be reaped
    in containers whose init does not reap, yet they no longer hold ports or shared memory."""
    if Path("/proc/self/stat").exists():
        stat = proc_stat(pid)
        return stat is not None and stat[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sigkill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError:  # not a group leader we can signal: kill just the process
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pgid, signal.SIGKILL)


def kill_tree(pid: int, reap: Callable[[], object] | None = None) -> None:
    """SIGKILL a server started in its own session, its children and their groups.

    The server is frozen first so it cannot fork a replacement child while we look.
    ``reap`` waits for the server itself (its parent passes ``Popen.wait``); then this
    waits, up to 10 s, until every child is gone too.
    """
    victims = [pid]
    if pid_alive(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGSTOP)
        victims += child_pids(pid)
    for victim in victims:  # start_new_session: the server's pgid is its pid
        sigkill_group(victim)
    if reap is not None:
        reap()
    deadline = time.monotonic() + KILL_WAIT_SECONDS
    while any(pid_alive(victim) for victim in victims) and time.monotonic() < deadline:
        time.sleep(0.01)
