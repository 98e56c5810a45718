"""How the demo and the drill undo what they did, also on Ctrl-C.

Everything a run starts registers its own undo on a :class:`Cleanup` stack the moment it
exists, so an error or Ctrl-C at any step undoes exactly what was done. Undoing may have
a time budget (the demo's is a few seconds): every step that waits (threads, relays and
workers, servers) asks :meth:`Cleanup.remaining` how long it may still wait, and then
kills instead. Should the run itself be killed, the fleet's watchdog process
(:mod:`pipeline.tools.harness.fleet`) kills what it started and deletes its files.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any


class Cleanup:
    """A stack of undo actions, run newest first, that a second Ctrl-C cannot cut short.

    While :meth:`close` runs, SIGINT and SIGTERM only set :attr:`hurry`: waiting steps
    then stop waiting and kill, so nothing is left behind. A failing action is reported
    and the rest still run.
    """

    def __init__(self, report: Callable[[str], None], budget: float | None = None) -> None:
        self._actions: list[tuple[str, Callable[[], None]]] = []
        self._report = report
        self._budget = budget
        self._deadline: float | None = None
        self.hurry = threading.Event()

    def push(self, what: str, action: Callable[[], None]) -> None:
        self._actions.append((what, action))

    def remaining(self, cap: float) -> float:
        """Seconds a step may still wait: at most ``cap``, 0 once hurried or out of budget."""
        if self.hurry.is_set():
            return 0.0
        if self._deadline is None:
            return cap
        return max(0.0, min(cap, self._deadline - time.monotonic()))

    def close(self) -> None:
        if self._budget is not None:
            self._deadline = time.monotonic() + self._budget
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, self._on_interrupt)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except Exception as exc:  # keep undoing the rest; say what was left over
                    self._report(f"could not {what}: {type(exc).__name__}: {exc}")
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.hurry.is_set():
            self._report("cleaning up; Ctrl-C again is ignored, processes are now killed")
        self.hurry.set()
