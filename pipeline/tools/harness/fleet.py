"""The child processes of the demo, the drill and tests, and the one way they die with their owner.

Every child the harness starts (relays, workers, the payment API, proxies, producers) runs
in a session of its own, so a Ctrl-C in the terminal reaches only the owner, which then
stops them itself (:meth:`Fleet.stop`: SIGTERM, a bounded wait, SIGKILL of each process
group). Should the owner die without stopping them, however it dies, SIGKILL included,
one watchdog process (:mod:`pipeline.tools.harness.watchdog`) that the fleet keeps
informed SIGKILLs every child's process tree and deletes the fleet's files.

Why the watchdog and not ``PR_SET_PDEATHSIG`` (a ``preexec_fn``, or an exec wrapper that
sets it): the signal goes to the direct child only, so a worker's Dramatiq processes
(grandchildren) would survive it; it fires when the *thread* that forked the child ends,
not the process, so a child started from a producer thread would be killed early;
``preexec_fn`` is unsafe once the owner has threads, and a wrapper costs an interpreter
start per child. The watchdog learns of the owner's end from the kernel (its stdin pipe
closes), which happens on every kind of death, and it kills by process group and by
parentage in ``/proc``, which reaches grandchildren. The embedded servers use the same
watchdog (one each, since they are also used alone). What it cannot cover is a child
started in the microseconds between ``Popen`` and the report to the watchdog.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pipeline.tools.harness.processes import child_pids
from pipeline.tools.harness.watchdog import Watchdog

KILL_REAP_SECONDS = 10.0


@dataclass
class Child:
    """One child process of a fleet, its log, and how to stop it."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 1, width: int | None = None) -> str:
        """The last lines of the child's log, joined with `` | ``."""
        if self.log_path is None:
            return ""
        try:
            text = self.log_path.read_text("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip()[:width] for line in text[-lines:])

    def count_in_log(self, needle: str) -> int:
        if self.log_path is None:
            return 0
        try:
            return self.log_path.read_text("utf-8", "replace").count(needle)
        except OSError:
            return 0

    def activity(self) -> tuple[int, int]:
        """(CPU ticks of the process and its children, log size): both grow while it works."""
        ticks = 0
        for pid in (self.pid, *child_pids(self.pid)):
            ticks += cpu_ticks(pid)
        size = 0
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                size = self.log_path.stat().st_size
        return ticks, size

    def terminate(self) -> None:
        """SIGTERM the process (it stops its own children)."""
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (its session: all its children)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL the child's process group (its session: all its children) and reap it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=KILL_REAP_SECONDS)

    def pause(self) -> None:
        """SIGSTOP the child's process group: it stops without dying (``resume`` continues it)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the child's process group."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGCONT)

    def wait_stopped(self, seconds: Callable[[], float]) -> None:
        """Wait for a clean exit while ``seconds()`` allows, then kill the whole group."""
        while self.running() and seconds() > 0:
            time.sleep(0.05)
        self.kill()  # also reaps grandchildren that outlived a clean exit
        self.close_log()

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def cpu_ticks(pid: int) -> int:
    """CPU time pid used, its reaped children's included (clock ticks; 0 when gone)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    return 0


class Fleet:
    """The children of one owner (a demo or drill run, a test), all watched by one watchdog."""

    def __init__(self) -> None:
        self._watchdog = Watchdog()
        self._children: list[Child] = []
        self._remove: list[Path] = []
        self._lock = threading.Lock()

    @property
    def children(self) -> list[Child]:
        with self._lock:
            return list(self._children)

    @property
    def watchdog_pid(self) -> int | None:
        return self._watchdog.pid

    def open(self) -> None:
        """Start the watchdog (once); do it before anything it should undo exists."""
        self._watchdog.start()

    def remove_on_death(self, path: Path) -> None:
        """Should the owner die, delete ``path`` too."""
        with self._lock:
            self._remove.append(path)
        self._report()

    def keep(self, path: Path) -> None:
        """No longer delete ``path`` should the owner die."""
        with self._lock:
            self._remove = [p for p in self._remove if p != path]
        self._report()

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        stdin: int | None = subprocess.DEVNULL,
        stdout: int | None = None,
        stderr: int | IO[bytes] | None = None,
    ) -> Child:
        """Start ``argv`` in a session of its own, guarded by the watchdog from then on.

        Output goes to ``log_path`` (appended) unless ``stdout``/``stderr`` say otherwise
        (``subprocess.PIPE`` for children driven through pipes). Raises ``OSError`` when
        the command cannot be started.
        """
        self.open()
        log = log_path.open("ab") if log_path is not None else None
        try:
            process = subprocess.Popen(
                list(argv),
                env=env,
                stdin=stdin,
                stdout=stdout if stdout is not None else log,
                stderr=stderr if stderr is not None else (subprocess.STDOUT if log else None),
                start_new_session=True,
            )
        except BaseException:
            if log is not None:
                log.close()
            raise
        child = Child(name, process, log_path, log)
        with self._lock:
            self._children.append(child)
        self._report()
        return child

    def forget(self, child: Child) -> None:
        """The child is gone and reaped: the watchdog need not kill it any more."""
        with self._lock:
            self._children = [c for c in self._children if c is not child]
        self._report()

    def stop(
        self,
        children: Sequence[Child] | None = None,
        grace: float = 5.0,
        remaining: Callable[[float], float] | None = None,
    ) -> None:
        """SIGTERM the children (default: all) at once, then wait for each within one grace
        period; what still runs then is killed with its process group.

        ``remaining(cap)`` is a cleanup's budget: the wait ends at the grace period, the
        budget's end or a second Ctrl-C, whichever comes first.
        """
        targets = self.children if children is None else list(children)
        for child in targets:
            child.terminate()
        deadline = time.monotonic() + grace

        def seconds() -> float:
            left = deadline - time.monotonic()
            return remaining(left) if remaining is not None else left

        for child in targets:
            child.wait_stopped(seconds)
            self.forget(child)

    def close(self) -> None:
        """Stop every child still running (no grace), then release the watchdog."""
        for child in self.children:
            child.kill()
            child.close_log()
        with self._lock:
            self._children = []
            self._remove = []
        self._watchdog.guard()  # nothing left to undo
        self._watchdog.close()

    def _report(self) -> None:
        with self._lock:  # one line at a time: children start from several threads
            kill = [c.pid for c in self._children if c.returncode is None]
            self._watchdog.guard(kill=kill, remove=self._remove)
