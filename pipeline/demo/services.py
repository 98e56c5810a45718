"""What ``pipeline demo`` starts, and how it is all stopped again, also on Ctrl-C.

Everything the demo starts registers its own undo on a :class:`Cleanup` stack the
moment it exists, so an error or Ctrl-C at any step undoes exactly what was done.
Child processes (relay, workers) run in their own sessions: a Ctrl-C in the terminal
reaches only the demo, which then stops them in order (SIGTERM, then SIGKILL of the
whole process group after a grace period) instead of leaving them half-stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO

from pipeline.childprocess import die_with_parent
from pipeline.errors import DemoError

STOP_GRACE_SECONDS = 15.0


class Cleanup:
    """A stack of undo actions, run newest first, that a second Ctrl-C cannot cut short.

    While :meth:`close` runs, SIGINT only sets :attr:`hurry` (processes are then killed
    instead of waited for), so the demo never leaves servers or temp dirs behind.
    """

    def __init__(self, report: Callable[[str], None]) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._report = report
        self.hurry = threading.Event()

    def push(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def close(self) -> None:
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._on_interrupt)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as exc:  # keep undoing the rest; say what was left over
                    self._report(f"could not {what}: {type(exc).__name__}: {exc}")
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.hurry.is_set():
            self._report("cleaning up; Ctrl-C again is ignored, processes are now killed")
        self.hurry.set()


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def choose_port(host: str, preferred: int) -> int:
    """``preferred`` if it is free (stable for a local Prometheus), else any free port."""
    if preferred and port_is_free(host, preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class ChildProcess:
    """A ``pipeline relay`` / ``pipeline worker`` child, its log, and how to stop it."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] = field(repr=False)

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> ChildProcess:
        log = log_path.open("ab")
        # prctl in a pre-exec hook is only safe while this process has a single thread.
        single = sys.platform.startswith("linux") and threading.active_count() == 1
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent if single else None,  # noqa: PLW1509 - see above
            )
        except OSError as exc:
            log.close()
            raise DemoError(f"cannot start the {name}: {exc}") from None
        return cls(name, process, log_path, log)

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 1) -> str:
        try:
            text = self.log_path.read_text("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text[-lines:])

    def died(self) -> DemoError:
        tail = self.log_tail()
        detail = f": {tail}" if tail else ""
        return DemoError(f"the {self.name} exited with code {self.process.returncode}{detail}")

    def terminate(self) -> None:
        if self.running():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # its session's group: all children

    def wait_stopped(self, deadline: float, hurry: threading.Event) -> None:
        """Wait for a clean exit until ``deadline`` (or a hurry), then kill the group."""
        while self.running() and time.monotonic() < deadline and not hurry.is_set():
            time.sleep(0.05)
        self.kill()  # also reaps grandchildren that outlived a clean exit
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        self._log.close()


def stop_all(children: list[ChildProcess], hurry: threading.Event) -> None:
    """SIGTERM every child at once, then wait for each within one shared grace period."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for child in children:
        child.wait_stopped(deadline, hurry)


def count_in_file(path: Path, needle: str) -> int:
    try:
        return path.read_text("utf-8", "replace").count(needle)
    except OSError:
        return 0
