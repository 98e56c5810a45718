"""A watchdog process: what a process started dies with it, SIGKILL of that process included.

The owner's own cleanup cannot run when it is SIGKILLed, and ``PR_SET_PDEATHSIG`` on a
child is not enough (it is unsafe in a threaded parent, Postgres' backends would not
get it, and it would leave the data directory behind). So before it starts a server or
a child process, the owner starts ``python -m pipeline.tools.harness.watchdog`` in a session
of its own and keeps the write end of the watchdog's stdin. It writes one JSON line each
time what it owns changes: the pids of the process trees to kill and the paths to
delete should it die (``{"kill": [pid, ...], "remove": [path, ...]}``; each line replaces
the last). When the owner is gone, however it went, the kernel closes that pipe; the
watchdog reads end-of-file (or sees its parent change, in case a forked child kept the
pipe open), SIGKILLs the trees that still run, deletes the paths, and exits. After a
clean shutdown the owner has already reported nothing left, and the watchdog just exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pipeline.tools.harness.processes import kill_tree, start_time

PARENT_CHECK_SECONDS = 0.5


class Watchdog:
    """The owner's side: starts the watchdog process and tells it what the owner owns."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> None:
        """Start the watchdog (once); it guards nothing until :meth:`guard`."""
        if self._process is not None and self._process.poll() is None:
            return
        command = [sys.executable, "-m", "pipeline.tools.harness.watchdog"]
        self._process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C aimed at the owner's terminal spares it
        )

    def guard(self, kill: Sequence[int] = (), remove: Sequence[Path] = ()) -> None:
        """Should the owner die now, kill these process trees and delete these paths."""
        line = json.dumps({"kill": list(kill), "remove": [str(path) for path in remove]})
        self._send(line + "\n")

    def close(self) -> None:
        """The owner is done: the watchdog does what it was last told, then exits.

        Call :meth:`guard` with nothing first when everything was already undone.
        """
        process = self._process
        if process is None:
            return
        self._process = None
        assert process.stdin is not None
        with contextlib.suppress(OSError):
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def _send(self, line: str) -> None:
        process = self._process
        if process is None or process.stdin is None:
            return
        stdin: IO[bytes] = process.stdin
        with contextlib.suppress(OSError):  # a dead watchdog cannot be told; nothing to undo
            stdin.write(line.encode())
            stdin.flush()


def _watch() -> None:
    """Block until the owner is gone, then kill and delete what it last reported."""
    owner = os.getppid()
    trees: dict[int, int | None] = {}  # pid -> its start time, to skip a reused pid
    remove: list[str] = []
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], PARENT_CHECK_SECONDS)
        if not ready:
            if os.getppid() != owner:
                break
            continue
        chunk = os.read(0, 4096)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                state = json.loads(line)
                trees = {int(pid): start_time(int(pid)) for pid in state["kill"]}
                remove = [str(path) for path in state["remove"]]
    for pid, started in trees.items():
        if start_time(pid) == started:  # still the process we were told about
            kill_tree(pid)
    for path in remove:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the owner's end ends the watch
    _watch()


if __name__ == "__main__":
    main()
